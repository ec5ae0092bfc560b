"""The error of the detection command's inputs (its own module, so that every part of the command can raise it)."""


class DetectionInputError(Exception):
    """A user-facing problem with the inputs of the detection command; printed in one line, exit status 2."""
