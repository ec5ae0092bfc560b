"""python -m transfer COMMAND [options]: the transfer stages, each reading a pretraining run's backbone export
(RUN_DIR/backbone.pth, the file `python -m eval` reads).

Each command is one module of this package, named in COMMANDS, that provides `add_arguments(parser)` and
`run(args) -> int` (the exit status: 0 done, 2 bad input with a one-line message); the first line of its
docstring is its help.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from pretrain.runtime.argument_types import CommandLineParser
from pretrain.runtime.memory_reuse import reuse_freed_memory

COMMANDS: dict[str, str] = {
    "finetune": "transfer.finetune",
    "digit-scenes": "transfer.digit_scenes",
    "detection": "transfer.detection",
    "detectron2": "transfer.detectron2",
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m transfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or name).strip().splitlines()[0]
        command = commands.add_parser(name, help=summary, description=module.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reuse_freed_memory()           # as `python -m pretrain` does (pretrain/runtime/memory_reuse.py)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
