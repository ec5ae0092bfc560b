"""The part of `python -m transfer detectron2 train` that runs inside Detectron2 (imported only where it is installed).

- `Res5ROIHeadsNormAfterRes5`: R50-C4's box head with one more norm layer after res5, as MoCo's protocol has it.
- `build_config`: the YAML config, then the converted pickle's input statistics and depth, the output folder and
  the command line's KEY VALUE pairs (last, so they win); datasets, device and GPU count are checked here, in
  the launching process, so a bad input stops before any worker starts.
- `train`: Detectron2's `launch` (one process per GPU) of `train_worker`, a `DefaultTrainer` whose evaluator
  follows each test set's type: COCOEvaluator (pycocotools' COCOeval, 101-point AP over IoU 0.50:0.95) for
  COCO-format sets, the digit scenes included, and PascalVOCDetectionEvaluator (11-point AP for VOC2007, whose
  AP50 is the VOC metric) for VOC. The final results go to OUTPUT_DIR/eval_results.json with the metric named.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.config import CfgNode, get_cfg
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets import register_coco_instances
from detectron2.engine import DefaultTrainer, default_setup, launch
from detectron2.evaluation import COCOEvaluator, PascalVOCDetectionEvaluator
from detectron2.layers import get_norm
from detectron2.modeling import ROI_HEADS_REGISTRY
from detectron2.modeling.roi_heads import Res5ROIHeads
from detectron2.utils import comm

from transfer.detectron2.weights import Detectron2InputError, read_detectron2_weights

DIGIT_SCENES_SPLITS = {"digit_scenes_train": "train", "digit_scenes_val": "val"}

METRICS = {
    "coco": "COCOEvaluator (pycocotools COCOeval): AP = mean over IoU 0.50:0.95 of the 101-point interpolated AP; "
            "AP50 / AP75 at one IoU; APs / APm / APl by object size",
    "pascal_voc": "PascalVOCDetectionEvaluator: VOC2007 11-point interpolated AP (VOC2012 sets: all-point); AP50 is "
                  "the VOC metric; AP = mean over IoU 0.50:0.95 of the same AP",
}


@ROI_HEADS_REGISTRY.register()
class Res5ROIHeadsNormAfterRes5(Res5ROIHeads):
    """Res5ROIHeads whose res5 stage ends with a MODEL.RESNETS.NORM layer, as in MoCo's detection protocol.

    MoCo (He et al., CVPR 2020, Sec. 4.2, PASCAL VOC set-up) fine-tunes R50-C4 with "the box prediction head
    [consisting] of conv5 (including global pooling) followed by a BN layer": with every layer normalised by
    trained, synchronised BN, features whose scale differs from supervised ImageNet features can be fine-tuned
    with the supervised recipe's hyper-parameters. The layer is new (random init); a converted backbone has
    no weights for it, so a load reports `roi_heads.res5.norm.*` as missing, and only that.
    """

    @classmethod
    def from_config(cls, cfg: CfgNode, input_shape: Any) -> dict[str, Any]:
        arguments = super().from_config(cfg, input_shape)
        res5 = arguments["res5"]                 # nn.Sequential of BottleneckBlocks: keys res5.0 .. res5.2 as before
        res5.add_module("norm", get_norm(cfg.MODEL.RESNETS.NORM, res5[-1].out_channels))
        return arguments


class ProtocolTrainer(DefaultTrainer):
    """DefaultTrainer with the evaluator each test set's type calls for (METRICS)."""

    @classmethod
    def build_evaluator(cls, cfg: CfgNode, dataset_name: str, output_folder: str | None = None):
        output_folder = output_folder or os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
        evaluator_type = MetadataCatalog.get(dataset_name).get("evaluator_type")
        if evaluator_type == "coco":
            return COCOEvaluator(dataset_name, output_dir=output_folder)
        if evaluator_type == "pascal_voc":
            return PascalVOCDetectionEvaluator(dataset_name)
        raise Detectron2InputError(
            f"DATASETS.TEST has {dataset_name!r}, whose evaluator_type is {evaluator_type!r}: this command evaluates "
            "COCO-format sets (COCOEvaluator) and VOC (PascalVOCDetectionEvaluator); test on one of those")


def register_digit_scenes(root: Path) -> None:
    """Register the digit scenes under `root` as digit_scenes_train / digit_scenes_val (COCO format; once)."""
    for name, split in DIGIT_SCENES_SPLITS.items():
        if name not in DatasetCatalog.list():
            register_coco_instances(name, {}, str(root / f"{split}.json"), str(root / split))


def check_datasets(cfg: CfgNode, digit_scenes: Path) -> None:
    """Refuse, before anything starts, a dataset Detectron2 does not know or whose files are not there."""
    for name in [*cfg.DATASETS.TRAIN, *cfg.DATASETS.TEST]:
        if name in DIGIT_SCENES_SPLITS:
            split = DIGIT_SCENES_SPLITS[name]
            for path in (digit_scenes / f"{split}.json", digit_scenes / split):
                if not path.exists():
                    raise Detectron2InputError(
                        f"dataset {name}: {path} does not exist; write the digit scenes with `python -m transfer "
                        f"digit-scenes --out-dir {digit_scenes}` or pass --digit-scenes DIR")
            continue
        if name not in DatasetCatalog.list():
            raise Detectron2InputError(
                f"dataset {name!r} is not registered in Detectron2: use one of its builtin names (coco_2017_train, "
                "voc_2007_trainval, ...) or digit_scenes_train / digit_scenes_val")
        metadata = MetadataCatalog.get(name)
        for key in ("json_file", "image_root", "dirname"):
            path = metadata.get(key)
            if path is not None and not Path(path).exists():
                raise Detectron2InputError(
                    f"dataset {name}: Detectron2 reads {path}, which does not exist; put the data under "
                    f"$DETECTRON2_DATASETS (now {os.environ.get('DETECTRON2_DATASETS', 'datasets')}) as Detectron2's "
                    "datasets/README.md lays it out")


def check_saved_input_statistics(cfg: CfgNode, checkpoint: Path) -> None:
    """Refuse to evaluate a Detectron2 checkpoint with other input statistics than those it was trained with.

    A checkpoint does not store PIXEL_MEAN / PIXEL_STD (non-persistent buffers); the config Detectron2 saved
    next to it (OUTPUT_DIR/config.yaml) does.
    """
    saved_path = checkpoint.parent / "config.yaml"
    if not saved_path.is_file():
        return
    saved = get_cfg()
    saved.set_new_allowed(True)
    saved.merge_from_file(str(saved_path))
    for key in ("MODEL.PIXEL_MEAN", "MODEL.PIXEL_STD", "INPUT.FORMAT"):
        section, name = key.split(".", 1)
        mine, trained = cfg[section][name], saved[section][name]
        if (mine if isinstance(mine, str) else list(mine)) != (trained if isinstance(trained, str) else list(trained)):
            raise Detectron2InputError(
                f"--weights {checkpoint} was trained with {key}={trained}, the config gives {mine}: evaluate it "
                f"with --config {saved_path} (the full config of its run)")


def build_config(args: argparse.Namespace) -> CfgNode:
    """The frozen config of the run (order: YAML, converted pickle, output folder, KEY VALUE pairs)."""
    config_path = Path(args.config)
    if not config_path.is_file():
        raise Detectron2InputError(f"--config {config_path} does not exist; pick one of configs/transfer/detectron2/")
    cfg = get_cfg()
    cfg.set_new_allowed(False)
    try:
        cfg.merge_from_file(str(config_path))
    except (KeyError, ValueError, AssertionError) as error:
        raise Detectron2InputError(f"--config {config_path} is not a valid Detectron2 config ({error})") from None
    random_init = cfg.MODEL.WEIGHTS == ""

    weights = Path(args.weights) if args.weights else None
    if weights is None and not random_init:
        raise Detectron2InputError(
            f"--config {config_path} fine-tunes converted weights: pass --weights FILE.pkl (written by `python -m "
            "transfer detectron2 convert --run RUN_DIR`; also with --resume), or train the random-init baseline "
            "with the matching *_random_init.yaml config")
    if weights is not None:
        if random_init and not args.eval_only:
            raise Detectron2InputError(
                f"--config {config_path} is a random-init baseline (MODEL.WEIGHTS is empty) but --weights {weights} "
                "was given: drop --weights, or use the config without _random_init to fine-tune the weights")
        if not weights.is_file():
            raise Detectron2InputError(f"--weights {weights} does not exist; write it with `python -m transfer "
                                       "detectron2 convert --run RUN_DIR --out FILE.pkl`")
        if weights.suffix == ".pkl":
            info = read_detectron2_weights(weights)["hardview"]
            cfg.MODEL.PIXEL_MEAN = [float(v) for v in info["pixel_mean"]]
            cfg.MODEL.PIXEL_STD = [float(v) for v in info["pixel_std"]]
            cfg.INPUT.FORMAT = info["input_format"]
            cfg.MODEL.RESNETS.DEPTH = int(info["depth"])
            cfg.MODEL.RESNETS.STRIDE_IN_1X1 = bool(info["stride_in_1x1"])
        elif not args.eval_only:
            raise Detectron2InputError(
                f"--weights {weights}: training starts from the .pkl written by `python -m transfer detectron2 "
                "convert` (it carries the export's input statistics); a Detectron2 checkpoint such as "
                "model_final.pth is for --eval-only, and --resume continues from OUTPUT_DIR's last checkpoint")
        else:
            check_saved_input_statistics(cfg, weights)
        cfg.MODEL.WEIGHTS = str(weights)

    if args.output_dir:
        cfg.OUTPUT_DIR = args.output_dir
    elif weights is not None and weights.suffix != ".pkl":
        # A trained model evaluated: beside its run's files, not over them (default_setup writes config.yaml).
        cfg.OUTPUT_DIR = str(weights.parent / f"eval_{weights.stem}")
    elif weights is not None:
        cfg.OUTPUT_DIR = str(weights.parent / config_path.stem)
    else:
        cfg.OUTPUT_DIR = str(Path("runs") / "detectron2" / config_path.stem)

    opts = list(args.opts)
    if opts[:1] == ["opts"]:
        opts = opts[1:]
    if len(opts) % 2:
        raise Detectron2InputError(f"config overrides come in KEY VALUE pairs; got {len(opts)} words: {opts}")
    try:
        cfg.merge_from_list(opts)
    except (KeyError, ValueError, AssertionError) as error:
        raise Detectron2InputError(f"config overrides {opts}: {error}; keys are Detectron2's (e.g. "
                                   "SOLVER.MAX_ITER 1000, MODEL.DEVICE cpu)") from None

    if cfg.MODEL.DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print(f"note: MODEL.DEVICE={cfg.MODEL.DEVICE} but torch sees no GPU: running on the CPU")
        cfg.MODEL.DEVICE = "cpu"
    if cfg.MODEL.DEVICE == "cpu" and args.num_gpus * args.num_machines > 1:
        raise Detectron2InputError(
            f"--num-gpus {args.num_gpus} x --num-machines {args.num_machines}: Detectron2's launch starts one process "
            f"per GPU, and torch sees {torch.cuda.device_count()} GPUs here; use --num-gpus 1 on a CPU")
    if args.num_machines > 1 and args.dist_url == "auto":
        raise Detectron2InputError(f"--num-machines {args.num_machines} needs --dist-url tcp://HOST:PORT of machine 0 "
                                   "(the same on every machine); auto finds a port on one machine only")
    if torch.cuda.is_available() and args.num_gpus > torch.cuda.device_count():
        raise Detectron2InputError(f"--num-gpus {args.num_gpus}, but torch sees {torch.cuda.device_count()} GPUs; "
                                   "pass at most that many")
    check_datasets(cfg, Path(args.digit_scenes))
    cfg.freeze()
    return cfg


def train_worker(cfg: CfgNode, args: argparse.Namespace) -> dict[str, Any]:
    """One process of the run (Detectron2's launch calls it once per GPU): train and / or evaluate."""
    register_digit_scenes(Path(args.digit_scenes))
    default_setup(cfg, argparse.Namespace(config_file=args.config, eval_only=args.eval_only, opts=args.opts))
    if args.eval_only:
        model = ProtocolTrainer.build_model(cfg)
        DetectionCheckpointer(model, save_dir=cfg.OUTPUT_DIR).resume_or_load(cfg.MODEL.WEIGHTS, resume=args.resume)
        results = ProtocolTrainer.test(cfg, model)
    else:
        trainer = ProtocolTrainer(cfg)
        trainer.resume_or_load(resume=args.resume)
        trainer.train()
        results = getattr(trainer, "_last_eval_results", {})   # the final evaluation, run by DefaultTrainer's EvalHook
    if comm.is_main_process():
        write_results(cfg, args, results)
    return results


def write_results(cfg: CfgNode, args: argparse.Namespace, results: dict[str, Any]) -> Path:
    """OUTPUT_DIR/eval_results.json: the evaluators' numbers, each test set's metric named, and what ran."""
    test_sets = {name: {"metric": METRICS.get(MetadataCatalog.get(name).get("evaluator_type"), "unknown")}
                 for name in cfg.DATASETS.TEST}
    # One test set: Detectron2 returns its {task: {metric: value}} directly; several: keyed by set name.
    per_set = {cfg.DATASETS.TEST[0]: results} if len(cfg.DATASETS.TEST) == 1 else results
    for name, numbers in per_set.items():
        # pycocotools gives NaN for a size class without objects (APl here): null in JSON, which has no NaN.
        test_sets.setdefault(name, {})["results"] = {
            task: {k: (float(v) if math.isfinite(v) else None) for k, v in values.items()}
            for task, values in numbers.items()}
    record = {"config": str(args.config), "weights": cfg.MODEL.WEIGHTS or "random init",
              "max_iter": cfg.SOLVER.MAX_ITER, "eval_only": bool(args.eval_only), "test_sets": test_sets}
    path = Path(cfg.OUTPUT_DIR) / "eval_results.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    for name, entry in test_sets.items():
        for task, numbers in entry.get("results", {}).items():
            shown = ", ".join(f"{k} {numbers[k]:.2f}" for k in ("AP", "AP50", "AP75") if numbers.get(k) is not None)
            print(f"{name} {task}: {shown}  [{entry['metric'].split(':')[0]}]")
    print(f"results: {path}")
    return path


def train(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    print(f"Detectron2 {'evaluation' if args.eval_only else 'training'}: {args.config}, weights "
          f"{cfg.MODEL.WEIGHTS or 'random init'}, PIXEL_MEAN {list(cfg.MODEL.PIXEL_MEAN)}, PIXEL_STD "
          f"{list(cfg.MODEL.PIXEL_STD)} ({cfg.INPUT.FORMAT}), device {cfg.MODEL.DEVICE}, output {cfg.OUTPUT_DIR}")
    launch(train_worker, args.num_gpus, num_machines=args.num_machines, machine_rank=args.machine_rank,
           dist_url=args.dist_url, args=(cfg, args))
    return 0
