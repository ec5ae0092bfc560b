"""Detectron2, the field's detection protocol: convert a backbone export, then fine-tune MoCo's R50-C4 on it.

    python -m transfer detectron2 convert --run RUN_DIR [--out FILE.pkl]
    python -m transfer detectron2 train --config configs/transfer/detectron2/X.yaml --weights FILE.pkl
                                        [--num-gpus N] [--resume] [--eval-only] [KEY VALUE ...]

`convert` needs no Detectron2: it writes the weight pickle Detectron2's checkpointer reads. `train` runs
Detectron2's own `launch` and a `DefaultTrainer` with an evaluator per test set (COCOEvaluator for COCO-format
sets, PascalVOCDetectionEvaluator for VOC), see `transfer/detectron2/train.py`. Detectron2 is not on the package
registries; where it cannot be imported, `train` exits with status 2 and the install steps.

The converter is `transfer/detectron2/weights.py` (weight names, what is refused, the pickle's content).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.features import EvaluationInputError, resolve_checkpoint_path
from pretrain.runtime.argument_types import positive_int
from transfer.detectron2.weights import Detectron2InputError, convert_export, write_detectron2_weights

# How a user installs Detectron2 (checked on this project's machines, /work/shared/ENVIRONMENT.md).
INSTALL_STEPS = (
    "Detectron2 is not on the package registries; build it from its public source against the installed torch "
    "(about 5 minutes on 2 CPU cores): git clone https://github.com/facebookresearch/detectron2 && "
    "pip install wheel setuptools && cd detectron2 && pip --isolated install --no-build-isolation . "
    "(build isolation off: its setup.py imports torch). Check with: python -c 'from detectron2 import _C'")


# ============ the command ============


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    convert = actions.add_parser(
        "convert", help="write the Detectron2 weight pickle of a backbone export (needs no Detectron2)",
        description="Convert RUN_DIR/backbone.pth (ResNet-50/101/152, model.stem=imagenet) to the .pkl that "
                    "Detectron2's DetectionCheckpointer reads, with the export's input statistics.")
    convert.add_argument("--run", dest="run_dir", metavar="RUN_DIR",   # not `run`: __main__ sets args.run
                         help="pretraining run: converts RUN_DIR/backbone.pth")
    convert.add_argument("--checkpoint", metavar="FILE", help="convert this backbone export instead")
    convert.add_argument("--out", metavar="FILE.pkl",
                         help="where to write the pickle (default: detectron2/backbone.pkl next to the export, "
                              "i.e. RUN_DIR/detectron2/backbone.pkl)")

    train = actions.add_parser(
        "train", help="fine-tune and evaluate a Detectron2 detector (needs Detectron2)",
        description="Run Detectron2's training and evaluation on a config of configs/transfer/detectron2/ "
                    "(Detectron2's launch + DefaultTrainer; COCOEvaluator for COCO-format test sets, "
                    "PascalVOCDetectionEvaluator for VOC). Writes OUTPUT_DIR/eval_results.json.")
    train.add_argument("--config", required=True, metavar="FILE", help="a Detectron2 YAML config")
    train.add_argument("--weights", metavar="FILE",
                       help="the .pkl written by `convert` (a *_random_init config takes none); with --eval-only "
                            "also a Detectron2 checkpoint such as OUTPUT_DIR/model_final.pth")
    train.add_argument("--digit-scenes", default="data/digit_scenes", metavar="DIR",
                       help="the digit scenes (`python -m transfer digit-scenes --out-dir DIR`), registered as "
                            "digit_scenes_train / digit_scenes_val (default: %(default)s)")
    train.add_argument("--output-dir", metavar="DIR",
                       help="Detectron2's OUTPUT_DIR (default: WEIGHTS_FOLDER/CONFIG_NAME next to --weights, "
                            "runs/detectron2/CONFIG_NAME without)")
    train.add_argument("--resume", action="store_true",
                       help="continue from OUTPUT_DIR's last checkpoint (Detectron2's resume_or_load)")
    train.add_argument("--eval-only", action="store_true", help="evaluate --weights without training")
    train.add_argument("--num-gpus", type=positive_int, default=1, help="processes per machine, one per GPU")
    train.add_argument("--num-machines", type=positive_int, default=1)
    train.add_argument("--machine-rank", type=int, default=0, help="rank of this machine (0 .. num-machines - 1)")
    train.add_argument("--dist-url", default="auto",
                       help="torch.distributed init URL of machine 0, e.g. tcp://HOST:PORT (default: %(default)s, "
                            "a free local port; one machine only)")
    train.add_argument("opts", nargs=argparse.REMAINDER, metavar="KEY VALUE",
                       help="Detectron2 config overrides, e.g. SOLVER.MAX_ITER 1000 (may start with the word opts)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "convert":
            return run_convert(args)
        return run_train(args)
    except Detectron2InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run_convert(args: argparse.Namespace) -> int:
    try:
        export_path = resolve_checkpoint_path(args.run_dir, args.checkpoint)
    except EvaluationInputError as error:
        raise Detectron2InputError(str(error)) from None
    out = Path(args.out) if args.out else export_path.parent / "detectron2" / f"{export_path.stem}.pkl"
    if out.suffix != ".pkl":
        raise Detectron2InputError(
            f"--out {out}: Detectron2's checkpointer reads converted weights only from a file ending in .pkl; "
            f"use e.g. --out {out.with_suffix('.pkl')}")
    converted = convert_export(export_path)
    write_detectron2_weights(converted, out)
    info = converted["hardview"]
    mean = ", ".join(f"{v:.3f}" for v in info["pixel_mean"])
    std = ", ".join(f"{v:.3f}" for v in info["pixel_std"])
    print(f"wrote {out}: {len(converted['model'])} tensors of {info['arch']} (ResNet-{info['depth']}, step "
          f"{info['step']}) from {export_path}; input {info['input_format']}, PIXEL_MEAN [{mean}], "
          f"PIXEL_STD [{std}]")
    print(f"  next: python -m transfer detectron2 train --config configs/transfer/detectron2/voc_R_50_C4_24k.yaml "
          f"--weights {out}")
    return 0


def import_detectron2() -> None:
    """Raise `Detectron2InputError` with the install steps where Detectron2 (and its compiled ops) cannot load."""
    try:
        from detectron2 import _C  # noqa: F401  (the compiled part: fails when built against another torch)
        import detectron2.engine  # noqa: F401  (pulls its runtime dependencies: fvcore, iopath, pycocotools)
    except (ImportError, OSError) as error:
        raise Detectron2InputError(f"cannot import Detectron2 ({type(error).__name__}: {error}). "
                                   + INSTALL_STEPS) from None


def run_train(args: argparse.Namespace) -> int:
    import_detectron2()
    from transfer.detectron2.train import train      # imports Detectron2
    return train(args)
