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
import errno
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eval.features import (BackboneExport, EvaluationInputError, embed, evaluation_crop_fraction, evaluation_image_size,
                           extract_features, load_backbone_export, resolve_beton_path, resolve_checkpoint_path,
                           resolve_device, stored_identity)
from eval.knn import weighted_knn
from eval.linear import train_linear_probe, train_linear_probe_on_views
from eval.results import RESULTS_DIR, check_writable, feature_cache_path, write_results
from eval.retrieval import clustering_nmi, retrieval_metrics
from pretrain.runtime.argument_types import CommandLineParser, non_negative_int, number, positive_float, positive_int
from pretrain.runtime.atomic_write import write_atomically

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
        from pretrain.data.loader import build_image_loader  # the FFCV data path is imported only when needed
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
        from pretrain.runtime.checkpoint import describe_write_error

        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.cache_path, lambda tmp: torch.save(cache, tmp))
        except (OSError, RuntimeError) as error:
            raise EvaluationInputError(
                f"could not write the feature cache {self.cache_path}: "
                f"{describe_write_error(error, self.cache_path.parent)}; free some space there, evaluate into a "
                "writable folder (--run DIR), or pass --no-cache") from None


# ============ outputs: console (the JSON and the TensorBoard scalars: eval/results.py) ============


def print_header(title: str, inputs: EvaluationInputs, num_train: int, num_val: int, seconds: float) -> None:
    export = inputs.export
    print(f"{title}: {export.arch} at step {export.step} (epoch {export.epoch}), "
          f"{num_train} train / {num_val} val images, {seconds:.1f} s")


# ============ protocols ============


def run_knn(args: argparse.Namespace) -> Path:
    """Weighted k-NN top-1 for every k; returns the JSON file written."""
    started = time.perf_counter()
    inputs = EvaluationInputs(args)
    inputs.check_same_classes()
    features = inputs.features()
    train_features = features["train_features"].to(inputs.device)
    top1 = weighted_knn(train_features, features["train_labels"], features["val_features"],
                        features["val_labels"], ks=args.ks, temperature=args.temperature,
                        chunk_size=args.chunk_size)
    seconds = time.perf_counter() - started
    num_train, num_val = len(features["train_labels"]), len(features["val_labels"])
    path = write_results(inputs, "knn", {str(k): accuracy for k, accuracy in top1.items()},
                         {f"eval/knn_top1_k{k}": accuracy for k, accuracy in top1.items()},
                         {"temperature": args.temperature, "num_train": num_train, "num_val": num_val,
                          "seconds": round(seconds, 3)})
    print_header(f"weighted k-NN (T={args.temperature})", inputs, num_train, num_val, seconds)
    print("      k   top-1")
    for k, accuracy in top1.items():
        print(f"  {k:5d}  {100 * accuracy:6.2f}%")
    print(f"results: {path}")
    return path


def run_linear(args: argparse.Namespace) -> Path:
    """Linear probe on frozen features (cached, or fresh augmented views with --augment); returns the JSON."""
    started = time.perf_counter()
    inputs = EvaluationInputs(args)
    inputs.check_same_classes()
    features = inputs.features()
    num_train, num_val = len(features["train_labels"]), len(features["val_labels"])
    if args.augment:
        protocol = "linear_augmented"
        num_classes = int(max(features["train_labels"].max(), features["val_labels"].max())) + 1
        accuracy = train_linear_probe_on_views(inputs.export.backbone, build_augmented_views(inputs, args),
                                           features["val_features"], features["val_labels"],
                                           num_classes=num_classes, epochs=args.epochs, lr=args.lr,
                                           momentum=args.momentum, weight_decay=args.weight_decay,
                                           device=inputs.device, seed=args.seed)
    else:
        protocol = "linear"
        accuracy = train_linear_probe(features["train_features"], features["train_labels"],
                                  features["val_features"], features["val_labels"], epochs=args.epochs,
                                  lr=args.lr, batch_size=args.batch_size, momentum=args.momentum,
                                  weight_decay=args.weight_decay, device=inputs.device, seed=args.seed)
    seconds = time.perf_counter() - started
    path = write_results(inputs, protocol, accuracy.final,
                         {f"eval/{protocol}_top1": accuracy.final, f"eval/{protocol}_best_top1": accuracy.best},
                         {"best_top1": accuracy.best, "best_epoch": accuracy.best_epoch,
                          "epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size,
                          "augment": bool(args.augment), "seed": args.seed, "num_train": num_train,
                          "num_val": num_val, "seconds": round(seconds, 3)})
    title = "linear probe" + (" (augmented views)" if args.augment else " (cached features)")
    print_header(title, inputs, num_train, num_val, seconds)
    print(f"  epochs {args.epochs}   top-1 after the last epoch {100 * accuracy.final:6.2f}%   best "
          f"{100 * accuracy.best:6.2f}% (epoch {accuracy.best_epoch}, chosen on the validation set)")
    print(f"results: {path}")
    return path


def run_retrieval(args: argparse.Namespace) -> Path:
    """Retrieval (Recall@k, precision@1, R-precision, MAP@R, R-mAP) and k-means NMI among the validation images,
    with --split-classes among those of the second half of the classes (the DML split); returns the JSON.

    The images are ranked by the embedding the method trained (its exported head on the backbone's features) when
    the export has one, else by the backbone's features; --features chooses. The default's result is
    `retrieval`, the backbone's of an export with a head `retrieval_backbone` (both can be kept)."""
    started = time.perf_counter()
    inputs = EvaluationInputs(args)
    head = inputs.export.embedding_head
    default = "embedding" if head is not None else "backbone"
    evaluated = args.features or default
    if evaluated == "embedding" and head is None:
        raise EvaluationInputError(f"{inputs.checkpoint} has no embedding head (its method trains none, or it was "
                                   "exported before heads were): evaluate its backbone with --features backbone")
    protocol = "retrieval" if evaluated == default else f"retrieval_{evaluated}"
    features = inputs.features()
    val_features, val_labels = features["val_features"], features["val_labels"]
    if len(val_labels) and int(val_labels.min()) < 0:
        raise EvaluationInputError(f"{inputs.val_path} has images without a class label (-1); retrieval needs the "
                                   "classes: write it from an image folder with one sub-folder per class")
    num_classes = None
    if args.split_classes:
        num_classes = number_of_classes(inputs.val_path, features)
        keep = val_labels >= num_classes // 2
        if not keep.any():
            raise EvaluationInputError(f"--split-classes keeps the images of classes {num_classes // 2}-"
                                       f"{num_classes - 1} of {inputs.val_path}, and it has none")
        val_features, val_labels = val_features[keep], val_labels[keep]
    if evaluated == "embedding":
        val_features = embed(head, val_features.to(inputs.device)).cpu()
    metrics = retrieval_metrics(val_features.to(inputs.device), val_labels, ks=args.ks, chunk_size=args.chunk_size)
    num_classes_evaluated = len(torch.unique(val_labels))
    if num_classes_evaluated >= 2:
        metrics["nmi"] = clustering_nmi(val_features, val_labels, seed=args.seed)
    else:                                    # k-means against one class has no mutual information to measure
        metrics["nmi"], metrics["nmi_skipped"] = None, "one class: NMI is undefined"
    seconds = time.perf_counter() - started
    tags = {"precision@1": "precision_at_1", "r_precision": "r_precision", "map@r": "map_at_r", "r_map": "r_map",
            **({"nmi": "nmi"} if metrics["nmi"] is not None else {}),
            **{f"recall@{k}": f"recall_at_{k}" for k in args.ks}}
    classes_evaluated = sorted(int(c) for c in torch.unique(val_labels))
    path = write_results(inputs, protocol, metrics["recall@1"] if 1 in args.ks else metrics["precision@1"],
                         {f"eval/{protocol}_{tag}": metrics[name] for name, tag in tags.items()},
                         {**metrics, "features": evaluated, "dimensions": int(val_features.shape[1]),
                          "split_classes": bool(args.split_classes), "classes": classes_evaluated,
                          "num_images": len(val_labels), "seed": args.seed, "seconds": round(seconds, 3)})
    print_header(f"retrieval on the {evaluated} ({int(val_features.shape[1])} dimensions)"
                 + (", second half of the classes" if args.split_classes else ""), inputs,
                 len(features["train_labels"]), len(val_labels), seconds)
    print(f"  {len(val_labels)} images of classes {classes_evaluated}, every one a query against the others"
          + (f" ({metrics['no_relevant']} without another image of their class left out)"
             if metrics["no_relevant"] else ""))
    for name in [*(f"recall@{k}" for k in args.ks), "precision@1", "r_precision", "map@r", "r_map", "nmi"]:
        print(f"  {name:12s} {100 * metrics[name]:6.2f}%" if metrics[name] is not None
              else f"  {name:12s} skipped ({metrics['nmi_skipped']})")
    print(f"results: {path}")
    return path


def class_names(path: Path) -> list[str] | None:
    """A dataset's class names: OUT.classes.json next to a .beton (None without one), an image folder's
    sub-folders."""
    from pretrain.data.writer import classes_path, list_image_folder

    path = Path(path)
    if path.is_dir():
        try:
            return list_image_folder(path)[2]
        except ValueError:                 # no class folders or no images: the loader says so when it reads it
            return None
    names = classes_path(path)
    return json.loads(names.read_text()) if names.is_file() else None


def number_of_classes(path: Path, features: dict[str, torch.Tensor]) -> int:
    """The classes of a dataset: its class names (`class_names`), else the largest label of the train and val
    features plus one."""
    names = class_names(path)
    if names is not None:
        return len(names)
    return int(max(features["train_labels"].max(), features["val_labels"].max())) + 1


def build_augmented_views(inputs: EvaluationInputs, args: argparse.Namespace):
    """The training set as one RandomResizedCrop(0.08-1) + flip view per image, fresh every epoch."""
    from pretrain.data.loader import build_view_loader
    from pretrain.data.views import ViewGroup

    group = ViewGroup(count=1, size=inputs.image_size, scale=(0.08, 1.0), jitter_p=0.0, grayscale_p=0.0)
    canvas_size = inputs.export.config.get("data", {}).get("canvas_size")          # 0 (the decoded image) counts
    canvas_size = inputs.image_size if canvas_size is None else canvas_size
    return build_view_loader(inputs.train_path, [group], args.batch_size, device=inputs.device,
                             canvas_size=canvas_size, mean=inputs.mean, std=inputs.std,
                             num_workers=inputs.num_workers, seed=args.seed, drop_last=True)


# ============ argument parsing ============


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
                        help="evaluation image side (default: data.views[0].size of the export's config)")
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


def build_parser() -> argparse.ArgumentParser:
    """`python -m eval {knn,linear,retrieval,watch,baselines,plot,table} [options]`."""
    parser = CommandLineParser(prog="python -m eval", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{knn,linear,retrieval,watch,baselines,plot,table}")

    knn = commands.add_parser("knn", help="weighted k-NN top-1 on frozen features (DINO protocol)",
                              description="Weighted k-NN (Caron et al. 2021): cosine similarity of L2-normalised "
                                          "features, votes of the k nearest training images weighted by exp(sim/T).")
    add_common_options(knn)
    knn.add_argument("--ks", type=positive_int, nargs="+", default=[10, 20, 100, 200], metavar="K",
                     help="neighbour counts to report, each capped at the number of training images "
                          "(default: %(default)s)")
    knn.add_argument("--temperature", type=positive_float, default=0.07,
                     help="T in the vote weight exp(similarity / T) (default: %(default)s)")
    knn.add_argument("--chunk-size", type=positive_int, default=1024, metavar="N",
                     help="validation images scored at once; memory grows with N x training images "
                          "(default: %(default)s)")
    knn.set_defaults(handler=run_knn)

    linear = commands.add_parser("linear", help="linear probe on frozen features",
                                 description="Linear probe (MAE head: BatchNorm without affine, then Linear) trained "
                                             "with SGD + momentum and a cosine schedule on frozen features; reports "
                                             "validation top-1 after the last epoch (top1) and the best over epochs "
                                             "(best_top1, as DINO's eval_linear.py; chosen on the validation set).")
    add_common_options(linear)
    linear.add_argument("--augment", action="store_true",
                        help="train on fresh RandomResizedCrop(0.08-1) + flip views every epoch through the frozen "
                             "backbone instead of cached features (slower); validation stays un-augmented")
    linear.add_argument("--epochs", type=positive_int, default=100,
                        help="training epochs of the linear classifier (default: %(default)s)")
    # The probe standardises its features (BatchNorm), so one lr range fits every backbone: MAE's probe peaks at 6.4
    # (0.1 x 16384 / 256); beyond 10 the weights blow up (1e300 is not even a float32).
    linear.add_argument("--lr", type=number(float, above=0, at_most=10), default=0.1,
                        help="peak learning rate of the cosine schedule, in (0, 10] (default: %(default)s)")
    linear.add_argument("--batch-size", type=number(int, at_least=2), default=256, metavar="N",
                        help="linear-probe batch size, at least 2: the probe's BatchNorm standardises each batch "
                             "(default: %(default)s)")
    linear.add_argument("--momentum", type=number(float, at_least=0, below=1), default=0.9,
                        help="SGD momentum, in [0, 1) (default: %(default)s)")
    linear.add_argument("--weight-decay", type=number(float, at_least=0, at_most=1), default=0.0,
                        help="SGD weight decay, in [0, 1] (default: %(default)s)")
    linear.add_argument("--seed", type=random_seed, default=0,
                        help="seed of the classifier init, shuffling and augmentation (default: %(default)s)")
    linear.set_defaults(handler=run_linear)

    retrieval = commands.add_parser(
        "retrieval", help="image retrieval (Recall@k, MAP@R, R-mAP) and k-means NMI among the validation images",
        description="Deep-metric-learning evaluation (eval/retrieval.py): every validation image queries the others "
                    "by cosine similarity of L2-normalised features; Recall@k, precision@1, R-precision, MAP@R, "
                    "R-mAP (paper 000, appendix C) and the NMI of k-means with as many clusters as classes.")
    add_common_options(retrieval)
    retrieval.add_argument("--split-classes", action="store_true",
                           help="evaluate only the images of the second half of the classes (labels >= C/2, C from "
                                "the data's class names): the unseen classes of a run trained on the first half")
    retrieval.add_argument("--ks", type=positive_int, nargs="+", default=[1, 2, 4, 8], metavar="K",
                           help="ranks of Recall@k (default: %(default)s)")
    retrieval.add_argument("--chunk-size", type=positive_int, default=1024, metavar="N",
                           help="queries scored at once; memory grows with N x images (default: %(default)s)")
    retrieval.add_argument("--features", choices=("embedding", "backbone"),
                           help="rank by the embedding the method trained (its exported head on the backbone's "
                                "features: the metric-learning methods) or by the backbone's features (default: the "
                                "embedding when the export has a head, else the backbone; a backbone result of an "
                                "export with a head is written as retrieval_backbone)")
    retrieval.add_argument("--seed", type=random_seed, default=0, help="k-means seed (default: %(default)s)")
    retrieval.set_defaults(handler=run_retrieval)

    from eval import watch
    follow = commands.add_parser("watch", help="evaluate every checkpoint of a (running) pretraining run, once each",
                                 description=watch.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    watch.add_arguments(follow)
    add_data_options(follow)
    follow.set_defaults(handler=functools.partial(watch.watch, evaluate=evaluate))

    from eval import baselines
    anchors = commands.add_parser("baselines", help="raw pixels and the random-init backbone on a config's data "
                                                    "(k-NN and linear probe)",
                                  description=baselines.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    baselines.add_arguments(anchors)
    anchors.set_defaults(handler=baselines.run_baselines)

    from eval import plot
    curves = commands.add_parser("plot", help="plot k-NN accuracy against training step for runs (PNG)",
                                 description=plot.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plot.add_arguments(curves)
    curves.set_defaults(handler=plot.run_plot)

    from eval import table
    results = commands.add_parser("table", help="the results table of finished, evaluated runs (Markdown)",
                                  description=table.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    table.add_arguments(results)
    results.set_defaults(handler=table.run_table)
    return parser


def evaluate(argv: list[str]) -> None:
    """Run one protocol in this process as `python -m eval ARGV` would, its errors let through: how the watcher
    evaluates an export (handed to `eval.watch.watch`, which does not import this module back)."""
    args = build_parser().parse_args(argv)
    args.handler(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from eval.table import TableInputError
    from pretrain.data import DatasetError
    from pretrain.runtime.exit_status import UNWRITABLE, one_line

    try:
        status = args.handler(args)
    except (EvaluationInputError, DatasetError, TableInputError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)     # a loader worker's error: its own message
        return 2
    except OSError as error:        # results, a plot, the watcher's lock where they cannot be written
        if error.errno not in (*UNWRITABLE, errno.ENOTDIR):    # ENOTDIR: a file on the path (--run notes.txt/run)
            raise
        print(f"error: cannot write {error.filename or 'the results'}: {error.strerror}; write to a folder on a "
              "writable filesystem with space left (--run, --out or --out-dir), or free some space", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
