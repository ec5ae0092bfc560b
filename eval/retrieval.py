"""Image-retrieval and clustering metrics on frozen features (the deep-metric-learning protocol).

Every image of the evaluated set is a query; the database is every OTHER image of the set, ranked by cosine
similarity of the L2-normalised features (most similar first; equal similarities rank by dataset index).
A database image is relevant when it has the query's class; R = R_q is the number of relevant images, the
query's class size minus one.

- Recall@k (Song et al. 2016; papers 001, 002): 1 if a relevant image is among the k first, averaged.
- precision@1: the share of queries whose first image is relevant (the same number as Recall@1).
- R-precision (Musgrave et al. 2020, "A Metric Learning Reality Check"): relevant images among the R first,
  over R.
- MAP@R (Musgrave et al.; paper 000, appendix C, eq. 15): (1/R) sum_{k=1..R} P(k) rel(k), P(k) the
  precision of the k first.
- R-mAP (paper 000, appendix C, eqs. 13-14): the average precision of the list cut at R,
  (1 / R_q(D[1:R])) sum_{k=1..R} P(k) rel(k): the same sum over the number of relevant images AMONG the R
  first instead of R (0 when there is none). It is never below MAP@R.
- NMI (paper 001, sec. 6): k-means with as many clusters as classes on the normalised features, then
  I(clusters, classes) / sqrt(H(clusters) H(classes)).

A query whose class has no other image (R = 0) can be neither right nor wrong: it is left out of every
retrieval metric (its image still is a database entry for the other queries) and counted in `no_relevant`.

The similarities are computed `chunk_size` queries at a time, so memory is O(chunk_size x N); only the first
max(R_max, max k) ranks of each query are kept. Runs on the device of `features` (CPU or GPU); k-means on the
CPU (scikit-learn).

`python -m eval retrieval` (the end of this file) scores a backbone export with them: `add_arguments`, `run`.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eval.features import EvaluationInputError, embed
from eval.inputs import EvaluationInputs, add_common_options, class_names, print_header, random_seed
from eval.results import write_results
from pretrain.runtime.argument_types import positive_int


def retrieval_per_query(features: torch.Tensor, labels: torch.Tensor, ks: Sequence[int] = (1, 2, 4, 8),
                        chunk_size: int = 1024) -> dict[str, torch.Tensor]:
    """Every query's Recall@k (for every k), precision@1, R-precision, MAP@R and R-mAP, (N,) float64 tensors
    on the CPU; NaN for a query without a relevant image (R = 0).

    features: (N, D) float (any device; the similarities are computed there); labels: (N,) class labels.

    Example:
        >>> per_query = retrieval_per_query(features, labels)
        >>> per_query["map@r"][0]       # the first image's MAP@R
    """
    if features.ndim != 2 or len(features) != len(labels):
        raise ValueError(f"features must be (N, D) with one label per row; got {tuple(features.shape)} and "
                         f"{len(labels)} labels")
    if len(features) < 2:
        raise ValueError(f"retrieval needs at least 2 images (a query and a database); got {len(features)}")
    if not ks or min(ks) < 1:
        raise ValueError(f"ks={tuple(ks)} must be positive ranks, e.g. 1 2 4 8")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of queries")
    device = features.device
    features = F.normalize(features.float(), dim=1)
    labels = torch.as_tensor(labels, device=device).long()
    _, inverse, class_sizes = torch.unique(labels, return_inverse=True, return_counts=True)
    relevant_counts = class_sizes[inverse] - 1                                     # R of every query
    depth = min(len(features) - 1, max(int(relevant_counts.max()), max(ks)))
    positions = torch.arange(1, depth + 1, device=device, dtype=torch.float64)
    names = [*(f"recall@{k}" for k in ks), "precision@1", "r_precision", "map@r", "r_map"]
    per_query = {name: torch.full((len(features),), float("nan"), dtype=torch.float64) for name in names}
    everyone = torch.arange(len(features), device=device)
    for start in range(0, len(features), chunk_size):
        queries = everyone[start:start + chunk_size]
        similarity = features[queries] @ features.T
        similarity[torch.arange(len(queries), device=device), queries] = float("-inf")   # not its own neighbour
        # A stable sort of (-similarity) keeps equal similarities in dataset order.
        order = torch.sort(-similarity, dim=1, stable=True).indices[:, :depth]
        relevant = (labels[order] == labels[queries, None]).double()               # (chunk, depth)
        r = relevant_counts[queries].double()
        within_r = positions[None, :] <= r[:, None]                                # ranks 1..R of each query
        hits_in_r = (relevant * within_r).sum(dim=1)
        precision_at = relevant.cumsum(dim=1) / positions                          # P(k)
        summed = (precision_at * relevant * within_r).sum(dim=1)                   # sum_{k<=R} P(k) rel(k)
        values = {**{f"recall@{k}": relevant[:, :k].amax(dim=1) for k in ks}, "precision@1": relevant[:, 0],
                  "r_precision": hits_in_r / r, "map@r": summed / r,
                  "r_map": torch.where(hits_in_r > 0, summed / hits_in_r.clamp(min=1), torch.zeros_like(summed))}
        counted = r > 0
        for name, value in values.items():
            per_query[name][start:start + len(queries)] = torch.where(counted, value, float("nan")).cpu()
    return per_query


def retrieval_metrics(features: torch.Tensor, labels: torch.Tensor, ks: Sequence[int] = (1, 2, 4, 8),
                      chunk_size: int = 1024) -> dict[str, float | int]:
    """The means over the queries with a relevant image of `retrieval_per_query` (fractions in [0, 1]), plus
    "queries" (how many counted) and "no_relevant" (how many were left out: classes of one image).

    Example:
        >>> metrics = retrieval_metrics(test_features, test_labels)
        >>> metrics["recall@1"], metrics["map@r"], metrics["r_map"]
    """
    per_query = retrieval_per_query(features, labels, ks, chunk_size)
    counted = ~per_query["precision@1"].isnan()
    metrics: dict[str, float | int] = {name: values[counted].mean().item() if counted.any() else float("nan")
                                       for name, values in per_query.items()}
    metrics["queries"] = int(counted.sum())
    metrics["no_relevant"] = len(counted) - int(counted.sum())
    return metrics


def clustering_nmi(features: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> float:
    """NMI of k-means (as many clusters as classes, on the L2-normalised features) against the classes,
    I / sqrt(H(clusters) H(classes)) as paper 001 defines it."""
    # scikit-learn takes seconds to import, and only k-means needs it
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score

    labels = np.asarray(torch.as_tensor(labels).cpu())
    classes = len(np.unique(labels))
    if classes < 2 or len(labels) < classes:
        raise ValueError(f"NMI needs at least 2 classes and as many images; got {classes} classes, "
                         f"{len(labels)} images")
    points = F.normalize(features.float(), dim=1).cpu().numpy()
    clusters = KMeans(n_clusters=classes, n_init=10, random_state=seed).fit_predict(points)
    return float(normalized_mutual_info_score(labels, clusters, average_method="geometric"))


# ============ python -m eval retrieval ============

HELP = "image retrieval (Recall@k, MAP@R, R-mAP) and k-means NMI among the validation images"
DESCRIPTION = ("Deep-metric-learning evaluation (eval/retrieval.py): every validation image queries the others by "
               "cosine similarity of L2-normalised features; Recall@k, precision@1, R-precision, MAP@R, R-mAP "
               "(paper 000, appendix C) and the NMI of k-means with as many clusters as classes.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    parser.add_argument("--split-classes", action="store_true",
                        help="evaluate only the images of the second half of the classes (labels >= C/2, C from "
                             "the data's class names): the unseen classes of a run trained on the first half")
    parser.add_argument("--ks", type=positive_int, nargs="+", default=[1, 2, 4, 8], metavar="K",
                        help="ranks of Recall@k (default: %(default)s)")
    parser.add_argument("--chunk-size", type=positive_int, default=1024, metavar="N",
                        help="queries scored at once; memory grows with N x images (default: %(default)s)")
    parser.add_argument("--features", choices=("embedding", "backbone"),
                        help="rank by the embedding the method trained (its exported head on the backbone's "
                             "features: the metric-learning methods) or by the backbone's features (default: the "
                             "embedding when the export has a head, else the backbone; a backbone result of an "
                             "export with a head is written as retrieval_backbone)")
    parser.add_argument("--seed", type=random_seed, default=0, help="k-means seed (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Retrieval (Recall@k, precision@1, R-precision, MAP@R, R-mAP) and k-means NMI among the validation images,
    with --split-classes among those of the second half of the classes (the DML split), written to
    RUN_DIR/eval/retrieval[_backbone]_step{step}.json and printed.

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
    return 0


def number_of_classes(path: Path, features: dict[str, torch.Tensor]) -> int:
    """The classes of a dataset: its class names (`class_names`), else the largest label of the train and val
    features plus one."""
    names = class_names(path)
    if names is not None:
        return len(names)
    return int(max(features["train_labels"].max(), features["val_labels"].max())) + 1
