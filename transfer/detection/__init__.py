"""Detection on the digit scenes: a torchvision Faster R-CNN on the exported ResNet, scored with COCO mAP.

    python -m transfer detection --run RUN_DIR [--config FILE] [key=value ...] [--from export|random]

The detector (transfer/detector.py) is torchvision's Faster R-CNN in the R50-C4 layout that MoCo's detection
protocol uses, built on the pretraining run's backbone export (RUN_DIR/backbone.pth, loaded as `python -m eval`
loads it):
- backbone: the ResNet's stem and layer1-layer3 (stride 8 with the small_stride2 stem, 16 with the ImageNet
  stem), one feature map, on which the RPN proposes boxes from `model.anchor_sizes` x `model.aspect_ratios`;
- box head: RoIAlign of each proposal to `model.roi_output_size` px on that map, then the ResNet's layer4 and
  global average pooling (the C4 head), then a linear classifier over the 10 digits + background and a box
  regressor.
Every weight of the export is used (layer4 lives in the box head); only the RPN and the two linear outputs
start from scratch. `--from random` builds the same detector on the same architecture at random
initialisation (seeded, as pretraining starts) and trains it with the same recipe: the baseline a transfer
table needs. Only ResNets are supported (timm `resnet*`, any stem of pretrain/models.py); a ViT or another
architecture is refused.

Data: the digit scenes of `transfer.digit_scenes` under `data.root`, written there on first use
(`data.generate=false` refuses a missing set instead). Images are read into memory once, scaled to [0, 1]
and normalised inside the detector with the export's `data.mean` / `data.std`, at their own size (no
resizing). No augmentation: a flipped digit is not a digit.

Training runs through the training loop of every stage (pretrain/runtime/loop.py), on the CPU or one GPU per process
(`--device auto` takes CUDA when there is one): SGD with momentum, linear warm-up then cosine decay of the
learning rate, fixed-size batches in a seeded random order, fp32. The detector's run directory,
RUN_DIR/detection/detection_{export|random}_stepNNNNNNN/, holds its checkpoints (one, at the last epoch end),
config.yaml, metrics.jsonl and TensorBoard curves: a killed or stopped run (SIGINT / SIGTERM / SIGUSR1 / SIGUSR2 save a
checkpoint, exit 128 + N) resumes by rerunning the same command; a finished one is evaluated again without
training. Evaluation runs the detector on the val scenes and scores its detections with
pycocotools' COCOeval (bbox): mAP is the COCO AP averaged over IoU thresholds 0.50:0.05:0.95 with the
101-point interpolated precision, AP50 the same at IoU 0.5 alone.

Results: RUN_DIR/eval/detection_{export|random}_stepNNNNNNN.json (NNNNNNN: the step of the export; mAP,
AP50, every COCOeval statistic, the resolved config, timings) with the detections in COCO's results format
next to it (..._detections.json), and TensorBoard scalars on RUN_DIR/tb at the export's step:
`eval/detection_map`, `eval/detection_ap50` (`--from export`) and `eval/detection_random_map`,
`eval/detection_random_ap50` (`--from random`).

Config: a YAML file (default configs/transfer/detection_digit_scenes.yaml) and `key=value` overrides of any key
(values are YAML: `optim.epochs=2`, `model.anchor_sizes=[16,32]`); an unknown key is refused with the closest
valid one. The keys, their defaults and their meanings: transfer/detection/config.py.

The parts: config.py (the keys), scenes.py (the data), task.py (the detector as the loop's task), stage.py (its
run and result), predict.py and coco_metrics.py (its evaluation); this module is the command.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig

from eval.features import EvaluationInputError, load_backbone_export, resolve_checkpoint_path, resolve_device
from pretrain.runtime.checkpoint import CheckpointError
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.exit_status import exit_status_of
from pretrain.runtime.loop import run_training
from pretrain.runtime.monitor import MetricsFileError
from pretrain.runtime.run_lock import RunDirectoryInUse
from transfer.detection.config import DEFAULT_CONFIG, default_config_path, load_detection_config
from transfer.detection.input_error import DetectionInputError
from transfer.detection.scenes import load_split, prepare_scenes
from transfer.detection.stage import DetectionInputs, DetectionTraining
from transfer.detection.task import detection_backbone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", dest="run_dir", required=True, metavar="RUN_DIR",   # not `run`: __main__ sets args.run
                        help="pretraining run directory: reads RUN_DIR/backbone.pth, trains in "
                             "RUN_DIR/detection/detection_{export|random}_stepNNNNNNN (checkpoints: rerun to resume), "
                             "writes RUN_DIR/eval and RUN_DIR/tb")
    parser.add_argument("--config", metavar="FILE",
                        help=f"detection config YAML (default: {DEFAULT_CONFIG}; keys in transfer/detection/config.py)")
    parser.add_argument("--from", dest="init", choices=("export", "random"), default="export",
                        help="initialise the detector's ResNet from the export, or at random with the same "
                             "architecture (the baseline) (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto (CUDA when available), cpu or cuda; under a launcher each process takes the GPU "
                             "of its LOCAL_RANK (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. optim.epochs=2 data.root=/tmp/scenes model.norm=frozen")


def resolve_detection_inputs(args: argparse.Namespace, cfg: DictConfig) -> DetectionInputs:
    """The export, the normalisation and the scenes (written first when absent); raises DetectionInputError,
    EvaluationInputError or ConfigError (one line, what to do) for inputs that cannot work."""
    run_dir = Path(args.run_dir)
    checkpoint = resolve_checkpoint_path(run_dir, None)
    resolve_device(args.device)                                  # refuses cuda without a GPU
    export = load_backbone_export(checkpoint)
    data = export.config.get("data", {})
    mean, std = data.get("mean"), data.get("std")
    if mean is None or std is None:
        raise DetectionInputError(f"the config in {checkpoint} has no data.mean / data.std to normalise images with; "
                                  "re-export the backbone from a run with a complete config")
    detection_backbone(export, "export", cfg.seed)               # refuses a backbone that is not a ResNet
    paths = prepare_scenes(cfg)
    train, val = (load_split(paths[f"{split}_json"], paths[f"{split}_images"]) for split in ("train", "val"))
    return DetectionInputs(export=export, run_dir=run_dir, init=args.init,
                           device="cpu" if args.device == "cpu" else "auto", mean=list(mean), std=list(std),
                           paths=paths, train=train, val=val)


def run_detection(args: argparse.Namespace) -> Path:
    """Train (or resume) and evaluate the detector as `args` say; returns the result JSON written."""
    cfg = load_detection_config(args.config or default_config_path(), args.overrides)
    inputs = resolve_detection_inputs(args, cfg)
    print(f"detection on digit scenes: Faster R-CNN (C4) on {inputs.export.arch} (stem {inputs.export.stem}) from "
          f"{'the export of step ' + str(inputs.export.step) if args.init == 'export' else 'random initialisation'}, "
          f"{len(inputs.train.image_ids)} train / {len(inputs.val.image_ids)} val scenes of "
          f"{int(inputs.train.images.shape[-1])} px; training in {inputs.training_dir}", flush=True)
    return run_training(DetectionTraining(cfg, inputs))


def run(args: argparse.Namespace) -> int:
    """The exit status: 0 done, 1 diverged, 2 bad input (one line), 128 + N stopped by signal N (rerun to resume)."""
    return exit_status_of(lambda: run_detection(args),
                          (EvaluationInputError, DetectionInputError, ConfigError, CheckpointError, RunDirectoryInUse,
                           MetricsFileError), "detection")
