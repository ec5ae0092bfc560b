"""Command line of the evaluation stage: `python -m eval knn|linear|retrieval --run RUN_DIR`, `python -m eval plot`.

Each command reads only the backbone export (RUN_DIR/backbone.pth or --checkpoint FILE) and the run
config saved inside it, encodes the train and val .beton files with the frozen backbone (features are
cached in RUN_DIR/eval/features_step{step}.pt), runs its protocol and writes
RUN_DIR/eval/{protocol}_step{step}.json plus TensorBoard scalars `eval/...` on RUN_DIR/tb at the export's
step. User errors (missing or mismatched checkpoint, missing .beton, an option out of range, a results folder that
cannot be written or a full disk) print one message and exit with 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from eval.features import EvaluationInputError
from eval.table import TableInputError
from pretrain.data import DatasetError
from pretrain.runtime.argument_types import CommandLineParser, add_command
from pretrain.runtime.exit_status import UNWRITABLE, one_line

# Each command is a module providing HELP, add_arguments(parser) and run(args) (pretrain/runtime/argument_types.py's
# add_command); a protocol's command ends the module of its math (eval/knn.py, eval/linear.py, eval/retrieval.py).
COMMANDS: dict[str, str] = {
    "knn": "eval.knn",
    "linear": "eval.linear",
    "retrieval": "eval.retrieval",
    "watch": "eval.watch",
    "baselines": "eval.baselines",
    "plot": "eval.plot",
    "table": "eval.table",
}


def build_parser() -> argparse.ArgumentParser:
    """`python -m eval {knn,linear,retrieval,watch,baselines,plot,table} [options]`."""
    parser = CommandLineParser(prog="python -m eval", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, module in COMMANDS.items():
        add_command(commands, name, importlib.import_module(module))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (EvaluationInputError, DatasetError, TableInputError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)     # a loader worker's error: its own message
        return 2
    except OSError as error:        # results, a plot, the watcher's lock where they cannot be written
        if error.errno not in UNWRITABLE:          # e.g. ENOTDIR: a file on the path (--run notes.txt/run)
            raise
        print(f"error: cannot write {error.filename or 'the results'}: {error.strerror}; write to a folder on a "
              "writable filesystem with space left (--run, --out or --out-dir), or free some space", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
