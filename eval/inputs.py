"""What every evaluation protocol reads, and the options that name it: the backbone export under evaluation
(RUN_DIR/backbone.pth or --checkpoint FILE), the train and val data, the device, and the features of the data
through the frozen backbone, cached in RUN_DIR/eval/features_step{step}.pt (`EvaluationInputs`).

The protocols' commands (`python -m eval knn|linear|retrieval`, at the end of eval/knn.py, eval/linear.py and
eval/retrieval.py) each build one `EvaluationInputs` from their arguments and add the options of
`add_common_options`; `python -m eval watch` forwards the options of `add_data_options` to the protocols it runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from eval.features import (BackboneExport, EvaluationInputError, extract_features, load_backbone_export,
                           resolve_beton_path, resolve_checkpoint_path, resolve_device, stored_identity)
from eval.results import (RESULTS_DIR, evaluation_crop_fraction, evaluation_image_size,
                          feature_cache_path)
from pretrain.data.loader import build_image_loader
from pretrain.data.writer import classes_path, list_image_folder
from pretrain.runtime.argument_types import non_negative_int, number, positive_int
from pretrain.runtime.atomic_write import write_atomically
from pretrain.runtime.checkpoint import describe_write_error
from pretrain.runtime.exit_status import check_writable

# ============ inputs: checkpoint, data, features ============


class EvaluationInputs:
    """The export under evaluation, where results go, and the data it is evaluated on (resolved from args)."""

    def __init__(self, args: argparse.Namespace):
        self.checkpoint = resolve_checkpoint_path(args.run, args.checkpoint)
        self.out_dir = Path(args.run) if args.run is not None else self.checkpoint.parent
        self.device = resolve_device(args.device)
        self.export: BackboneExport = load_backbone_export(self.checkpoint, args.image_size)
        config = self.export.config
        self.image_size = args.image_size or evaluation_image_size(config)
        if self.image_size is None:
            raise EvaluationInputError(f"the config in {self.checkpoint} has no data.views[0].size: "
                                       "pass --image-size PIXELS")
        self.crop_fraction = args.crop_fraction or evaluation_crop_fraction(config)
        self.train_path = resolve_beton_path(args.train, config, "train")
        self.val_path = resolve_beton_path(args.val, config, "val")
        data = config.get("data", {})
        self.mean = data.get("mean")
        self.std = data.get("std")
        if self.mean is None or self.std is None:
            raise EvaluationInputError(f"the config in {self.checkpoint} has no data.mean / data.std to normalise "
                                       "images with; re-export the backbone from a run with a complete config")
        self.num_workers = args.num_workers if args.num_workers is not None else int(data.get("num_workers", 2))
        self.batch_size = args.feature_batch_size
        self.use_cache = not args.no_cache
        check_writable(self.out_dir / RESULTS_DIR)

    def check_same_classes(self) -> None:
        """k-NN and the linear probe match labels by index: refuse train and val sets with other class names."""
        train, val = class_names(self.train_path), class_names(self.val_path)
        if train is not None and val is not None and train != val:
            raise EvaluationInputError(
                f"the training and validation data have different classes ({self.train_path}: {len(train)} classes "
                f"{train[:4]}...; {self.val_path}: {len(val)} classes {val[:4]}...), and labels are matched by index: "
                "pass --train and --val of the same dataset")

    @property
    def cache_path(self) -> Path:
        return feature_cache_path(self.out_dir, self.export.step)

    def cache_key(self) -> dict[str, Any]:
        """What the cached features depend on; a cache with another key is recomputed, never reused. The files are
        named by path and identity (`stored_identity`): a .beton rewritten with other images at the same path is
        other data."""
        return {"checkpoint": str(self.checkpoint.resolve()), "checkpoint_identity": stored_identity(self.checkpoint),
                "train": str(self.train_path.resolve()), "train_identity": stored_identity(self.train_path),
                "val": str(self.val_path.resolve()), "val_identity": stored_identity(self.val_path),
                "image_size": int(self.image_size), "crop_fraction": self.crop_fraction,
                "mean": list(self.mean), "std": list(self.std)}

    def image_loader(self, path: Path):
        """All images of `path` in dataset order, resized and centre-cropped, without augmentation."""
        return build_image_loader(path, self.image_size, self.batch_size, device=self.device, mean=self.mean,
                                  std=self.std, num_workers=self.num_workers, crop_fraction=self.crop_fraction)

    def features(self) -> dict[str, torch.Tensor]:
        """`{train_features, train_labels, val_features, val_labels}` from the cache or a fresh extraction."""
        key = self.cache_key()
        if self.use_cache and self.cache_path.is_file():
            try:
                cached = torch.load(self.cache_path, map_location="cpu", weights_only=True)
            except Exception:  # a half-written or foreign file: recompute and overwrite it
                cached = {}
            if isinstance(cached, dict) and cached.get("key") == key:
                return cached["features"]
        backbone = self.export.backbone.to(self.device).eval()
        train_features, train_labels = extract_features(backbone, self.image_loader(self.train_path), self.device)
        val_features, val_labels = extract_features(backbone, self.image_loader(self.val_path), self.device)
        features = {"train_features": train_features, "train_labels": train_labels,
                    "val_features": val_features, "val_labels": val_labels}
        if self.use_cache:
            self.write_cache({"key": key, "features": features})
        return features

    def write_cache(self, cache: dict[str, Any]) -> None:
        """Save the cache atomically (a full disk leaves no half-written file); a failed write is one line naming the
        file (torch reports a full disk as a RuntimeError, "file write failed")."""
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.cache_path, lambda tmp: torch.save(cache, tmp))
        except (OSError, RuntimeError) as error:
            raise EvaluationInputError(
                f"could not write the feature cache {self.cache_path}: "
                f"{describe_write_error(error, self.cache_path.parent)}; free some space there, evaluate into a "
                "writable folder (--run DIR), or pass --no-cache") from None


def class_names(path: Path) -> list[str] | None:
    """A dataset's class names: OUT.classes.json next to a .beton (None without one), an image folder's
    sub-folders."""
    path = Path(path)
    if path.is_dir():
        try:
            return list_image_folder(path)[2]
        except ValueError:                 # no class folders or no images: the loader says so when it reads it
            return None
    names = classes_path(path)
    return json.loads(names.read_text()) if names.is_file() else None


# ============ outputs: console (the JSON and the TensorBoard scalars: eval/results.py) ============


def print_header(title: str, inputs: EvaluationInputs, num_train: int, num_val: int, seconds: float) -> None:
    export = inputs.export
    print(f"{title}: {export.arch} at step {export.step} (epoch {export.epoch}), "
          f"{num_train} train / {num_val} val images, {seconds:.1f} s")


# ============ options ============


# A seed of the probe's shuffling (torch) and of k-means (scikit-learn, which takes 0 to 2**32 - 1).
random_seed = number(int, at_least=0, at_most=2**32 - 1)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """The options every protocol shares: what to evaluate, on which data, where."""
    parser.add_argument("--run", metavar="RUN_DIR",
                        help="pretraining run directory: reads RUN_DIR/backbone.pth, writes RUN_DIR/eval and "
                             "RUN_DIR/tb")
    parser.add_argument("--checkpoint", metavar="FILE",
                        help="evaluate this backbone export instead of RUN_DIR/backbone.pth (results go to RUN_DIR "
                             "when --run is given, else next to FILE)")
    add_data_options(parser)
    parser.add_argument("--no-cache", action="store_true",
                        help="neither read nor write the feature cache RUN_DIR/eval/features_step{step}.pt")


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """On which data and where an export is evaluated (shared by the protocols and `watch`)."""
    parser.add_argument("--train", metavar="BETON",
                        help="training .beton (default: data.train of the export's config)")
    parser.add_argument("--val", metavar="BETON",
                        help="validation .beton (default: data.val of the export's config)")
    parser.add_argument("--image-size", type=positive_int, metavar="PIXELS",
                        help="evaluation image side (default: data.eval_image_size of the export's config, else "
                             "its data.views[0].size)")
    parser.add_argument("--crop-fraction", type=number(float, above=0, at_most=1), metavar="F",
                        help="centre crop side over the resized shorter side, in (0, 1]: 0.875 resizes to 256 and "
                             "crops 224; 1.0 keeps the whole of a square image (default: data.eval_crop_fraction of "
                             "the export's config)")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--num-workers", type=non_negative_int, metavar="N",
                        help="data loading workers (default: data.num_workers of the export's config)")
    parser.add_argument("--feature-batch-size", type=positive_int, default=256, metavar="N",
                        help="images per forward pass when extracting features (default: %(default)s)")
