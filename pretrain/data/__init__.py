"""Data: .beton writing, the embedded digits, the N-view loaders (FFCV and torchvision) and batched augmentation."""


class DatasetError(ValueError):
    """A dataset path or file that cannot be used as it is (missing, not a .beton, incomplete, images too
    large to decode in memory, ...). The message names the path and says what to do; the command lines print
    it as one line and exit with status 2."""
