"""argparse types shared by the command lines (`type=positive_int`): a bad value is refused by argparse in one
line naming the option, before anything runs."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value
