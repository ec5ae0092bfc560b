"""argparse types shared by every command line (`type=positive_int`, `type=number(float, above=0, at_most=1)`):
a bad value is refused by argparse in one line naming the option and the range, before anything runs.

    parser.add_argument("--lr", type=number(float, above=0, at_most=1e3))
    parser.add_argument("--budgets", type=number_list(int, at_least=1))       # "3,5,10" -> [3, 5, 10]

Every number is finite: `nan`, `inf` and `1e400` are refused, whatever the range.

`add_command` adds a sub-command run by a command module (`python -m eval knn`: eval/knn.py).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, NoReturn


class CommandLineParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (`PROG: error: argument --x: ...; see PROG --help`, exit status
    2) instead of the usage block and the error: what every command prints for every other bad input. Sub-commands
    added with `add_subparsers()` get the same class."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def add_command(commands: argparse._SubParsersAction, name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The sub-command `name`, run by `module`, a command module: HELP (its line in the list of commands),
    `add_arguments(parser)` and `run(args) -> int` (the exit status, called as `args.handler(args)`). Its --help
    shows its DESCRIPTION, a paragraph wrapped to the terminal's width, else its docstring as written; an EPILOG
    (examples) is shown as written, and so is a DESCRIPTION beside one."""
    description = getattr(module, "DESCRIPTION", None)
    epilog = getattr(module, "EPILOG", None)
    as_written = description is None or epilog is not None
    parser = commands.add_parser(name, help=module.HELP, description=description or module.__doc__, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter if as_written
                                 else argparse.HelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)
    return parser


def describe_range(at_least=None, above=None, at_most=None, below=None) -> str:
    """'a number > 0 and <= 1', 'an integer >= 1', ... (without the noun)."""
    parts = [f">= {at_least}" if at_least is not None else None, f"> {above}" if above is not None else None,
             f"<= {at_most}" if at_most is not None else None, f"< {below}" if below is not None else None]
    return " and ".join(part for part in parts if part)


def describe_wanted(kind: type, at_least=None, above=None, at_most=None, below=None) -> str:
    """'a positive integer', 'a number > 0 and <= 1', 'an integer >= 0', ..."""
    if (kind is int and at_least == 1 or above == 0) and at_most is None and below is None and \
            (at_least is None or above is None):
        return f"a positive {'integer' if kind is int else 'number'}"
    noun = "an integer" if kind is int else "a number"
    return f"{noun} {describe_range(at_least, above, at_most, below)}".strip()


def parse_number(text: str, kind: type = float, *, at_least=None, above=None, at_most=None, below=None):
    """`text` as a finite `kind` (int or float) in the range; ValueError naming the value and the range."""
    wanted = describe_wanted(kind, at_least, above, at_most, below)
    try:
        value = int(text) if kind is int else float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not {wanted}") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not finite; give {wanted}")
    if ((at_least is not None and value < at_least) or (above is not None and not value > above)
            or (at_most is not None and value > at_most) or (below is not None and not value < below)):
        raise ValueError(f"{text} is not {wanted}")
    return value


def number(kind: type = float, *, at_least=None, above=None, at_most=None, below=None) -> Callable[[str], float]:
    """An argparse type: a finite int or float in the given range."""
    def parse(text: str):
        try:
            return parse_number(text, kind, at_least=at_least, above=above, at_most=at_most, below=below)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = f"{kind.__name__} {describe_range(at_least, above, at_most, below)}".strip()
    return parse


def number_list(kind: type = float, *, at_least=None, above=None, at_most=None, below=None,
                minimum_length: int = 1) -> Callable[[str], list]:
    """An argparse type: comma-separated finite numbers, each in the range ('3,5,10' -> [3, 5, 10])."""
    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if len(parts) < minimum_length:
            raise argparse.ArgumentTypeError(f"{text!r} must hold at least {minimum_length} comma-separated value(s)")
        try:
            return [parse_number(part, kind, at_least=at_least, above=above, at_most=at_most, below=below)
                    for part in parts]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None

    parse.__name__ = f"comma-separated {kind.__name__}s"
    return parse


positive_int = number(int, at_least=1)
non_negative_int = number(int, at_least=0)
positive_float = number(float, above=0)
non_negative_float = number(float, at_least=0)


def output_folder(text: str) -> str:
    """A folder to write into (--out-dir): it may not exist yet, but it may not be a file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; the outputs are written into a folder: pass a folder "
                                         "(it is created when missing)")
    return text
