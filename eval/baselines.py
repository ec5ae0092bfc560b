"""`python -m eval baselines --config CONFIG`: the anchors a pretrained encoder is compared with, on the config's
data and with its evaluation preprocessing: raw pixels and the config's backbone at its random initialisation
(seed `seed` of the config), each by k-NN (k = 20, T = 0.07) and the linear probe (100 epochs, cached
features), the protocols of `python -m eval knn` and `python -m eval linear` with their defaults.

Beside them, the standard raw-pixel reference of the dataset's authors (eval/standardised_pixels.py): the stored
pixels standardised with the training images' statistics, a logistic regression ("linear") and a k-NN classifier
("knn") of scikit-learn, each tuned on a fixed sixth of the training images, the evaluation images choosing nothing.

The result goes to OUT_DIR/eval/baselines_step0000000.json (and its TensorBoard scalars, `baseline/...`):
{"raw_pixels": {"knn": top-1, "linear": top-1}, "random_init": {...}, "standardised_pixels": {"knn": top-1,
"linear": top-1, "logistic_regression": {"C": chosen, "grid": ..., "validation": ...}, "k_nearest_neighbours": {...},
...}, "image_size": ..., "train": ..., ...}.
`make demo` computes its random-init and raw-pixel rows with the same function (`evaluate_encoder`). Each start
appends its code, config and machine to OUT_DIR/provenance.json, as a training run's start does
(pretrain/runtime/provenance.py): `launch benchmark` shows a reference row's commit as it shows the others'.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from eval.features import extract_features, resolve_beton_path, resolve_device
from eval.knn import weighted_knn
from eval.linear import train_linear_probe
from eval.results import RESULTS_DIR, evaluation_image_size, write_result
from eval.standardised_pixels import standardised_pixel_references
from pretrain.config import load_config
from pretrain.data.loader import build_image_loader
from pretrain.models import create_backbone
from pretrain.runtime.argument_types import positive_int
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.exit_status import check_writable
from pretrain.runtime.provenance import record_start

HELP = ("raw pixels and the random-init backbone on a config's data (k-NN and linear probe), and standardised "
        "pixels by tuned scikit-learn classifiers")
KNN_K, KNN_TEMPERATURE = 20, 0.07


def config_evaluation_size(cfg: DictConfig) -> int:
    """The evaluation side a run of `cfg` is scored at (`eval.results.evaluation_image_size`)."""
    return evaluation_image_size(OmegaConf.to_container(cfg, resolve=True))


def evaluate_encoder(encode: Callable[[torch.Tensor], torch.Tensor], cfg: DictConfig, device: torch.device,
                     train: str | Path, val: str | Path, image_size: int | None = None) -> dict[str, float]:
    """k-NN (k=20, T=0.07) and linear-probe top-1 of `encode`, trained on `train`, scored on `val`, on images of
    `image_size` px (default: the config's evaluation side) preprocessed as the config's evaluation does."""
    size = image_size or config_evaluation_size(cfg)

    def features(path):
        loader = build_image_loader(path, size, 256, device=device, mean=tuple(cfg.data.mean),
                                    std=tuple(cfg.data.std), num_workers=cfg.data.num_workers,
                                    crop_fraction=cfg.data.eval_crop_fraction)
        return extract_features(encode, loader, device)

    train_x, train_y = features(train)
    val_x, val_y = features(val)
    return {"knn": weighted_knn(train_x, train_y, val_x, val_y, ks=(KNN_K,), temperature=KNN_TEMPERATURE)[KNN_K],
            "linear": train_linear_probe(train_x, train_y, val_x, val_y, device=device).final}


def random_init_backbone(cfg: DictConfig) -> torch.nn.Module:
    """The config's backbone at its random initialisation, drawn from the config's seed, in eval mode, with every
    residual branch on. Not `model.zero_init_residual`: a ResNet whose branches start at zero (SimCLR's and SimSiam's
    start, a training-start choice) is its shortcuts alone, at chance on 16 px digits (16.7% k-NN), where the random
    feature extractor this row stands for scores 91.9%."""
    torch.manual_seed(cfg.seed)
    return create_backbone(cfg.model.arch, cfg.model.stem, cfg.data.views[0].size, zero_init_residual=False).eval()


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="a pretraining config: its data, preprocessing and backbone")
    parser.add_argument("--out-dir", type=Path,
                        help="where the result goes (default: runs/baselines_NAME, NAME the config's name)")
    parser.add_argument("--image-size", type=positive_int, metavar="PIXELS",
                        help="evaluation image side (default: data.eval_image_size of the config, else "
                             "data.views[0].size)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the config")


def run(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or Path("runs") / f"baselines_{cfg.name}"
    if out_dir.exists() and not out_dir.is_dir():
        print(f"error: --out-dir {out_dir} is a file; pass a folder (it gets eval/ and tb/)", file=sys.stderr)
        return 2
    check_writable(out_dir / RESULTS_DIR)
    device = resolve_device(args.device)
    train, val = (resolve_beton_path(None, {"data": {split: cfg.data[split]}}, split, f"data.{split}={{}}")
                  for split in ("train", "val"))         # before any work: a config's paths are relative to here
    out_dir.mkdir(parents=True, exist_ok=True)
    record_start(out_dir, 0, OmegaConf.to_container(cfg, resolve=True))    # the code and the machine of this result
    started = time.time()
    size = args.image_size or config_evaluation_size(cfg)
    encoders = {"raw_pixels": lambda x: x.flatten(1), "random_init": random_init_backbone(cfg).to(device)}
    table = {name: evaluate_encoder(encode, cfg, device, train, val, size) for name, encode in encoders.items()}
    standardised = standardised_pixel_references(cfg, device, train, val, size)
    for warning in standardised["warnings"]:
        print(f"warning: standardised pixels: {warning}", file=sys.stderr)
    result = {**table, "standardised_pixels": standardised, "image_size": size, "arch": cfg.model.arch,
              "seed": cfg.seed, "train": str(train), "val": str(val),
              "knn": {"k": KNN_K, "temperature": KNN_TEMPERATURE}, "seconds": round(time.time() - started, 1)}
    rows = {**table, "standardised_pixels": {protocol: standardised[protocol] for protocol in ("knn", "linear")}}
    path = write_result(out_dir, "baselines", 0, result,
                        {f"baseline/{name}_{protocol}": value for name, row in rows.items()
                         for protocol, value in row.items()})
    print(f"{'encoder':<20}{'k-NN':>10}{'linear':>10}")
    for name, row in rows.items():
        print(f"{name:<20}{row['knn']:>10.2%}{row['linear']:>10.2%}")
    logistic, neighbours = standardised["logistic_regression"], standardised["k_nearest_neighbours"]
    print(f"standardised_pixels, chosen on {standardised['validation_images']} of the {standardised['train_images']} "
          f"training images: k-NN k={neighbours['n_neighbors']}, {neighbours['weights']} (validation "
          f"{max(c['accuracy'] for c in neighbours['validation']):.2%}, {neighbours['seconds']:.0f} s); logistic "
          f"regression C={logistic['C']:g} (validation {max(logistic['validation'].values()):.2%}, "
          f"{logistic['seconds']:.0f} s)")
    print(f"results: {path}")
    return 0
