"""Data: .beton writing, the embedded digits, the N-view loaders (FFCV and torchvision) and batched augmentation."""
