"""Weighted k-nearest-neighbour classification on frozen features (the k-NN protocol of DINO).

Caron et al. 2021, "Emerging Properties in Self-Supervised Vision Transformers", Sec. 4.1 and
`eval_knn.py` (after Wu et al. 2018, "Unsupervised Feature Learning via Non-Parametric Instance
Discrimination", Eq. 8): features are L2-normalised, a test sample's k nearest training samples under
cosine similarity s_i each vote for their class with weight exp(s_i / T), and the class with the largest
total vote is the prediction.

`python -m eval knn` (the end of this file) scores a backbone export with it: `add_arguments`, `run`.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from eval.inputs import EvaluationInputs, add_common_options, print_header
from eval.results import write_results
from pretrain.runtime.argument_types import positive_float, positive_int


def weighted_knn(train_features: torch.Tensor, train_labels: torch.Tensor,
                 test_features: torch.Tensor, test_labels: torch.Tensor,
                 ks: Sequence[int] = (10, 20, 100, 200), temperature: float = 0.07,
                 chunk_size: int = 1024) -> dict[int, float]:
    """Top-1 accuracy (a fraction in [0, 1]) of weighted k-NN for every k in `ks`.

    train_features: (N, D) float; train_labels: (N,) integer class labels >= 0.
    test_features:  (M, D) float; test_labels:  (M,) integer class labels.
    ks: neighbour counts; each is capped at N, so the result's keys are the capped values (a k that
      caps onto another appears once). The computation runs on the device of `train_features`.
    temperature: T in the vote weight exp(similarity / T).
    chunk_size: test samples scored at once; memory is O(chunk_size * N) for the similarities.
    Ties between classes go to the smallest class index (`argmax`).

    Example:
        >>> accuracy = weighted_knn(train_x, train_y, val_x, val_y, ks=(20,))
        >>> accuracy[20]
        0.97
    """
    if train_features.ndim != 2 or test_features.ndim != 2 or train_features.shape[1] != test_features.shape[1]:
        raise ValueError(f"features must be (N, D) and (M, D) with one D; got {tuple(train_features.shape)} "
                         f"and {tuple(test_features.shape)}")
    if len(train_labels) != len(train_features) or len(test_labels) != len(test_features):
        raise ValueError(f"one label per feature row: {len(train_labels)} labels for {len(train_features)} train "
                         f"rows, {len(test_labels)} labels for {len(test_features)} test rows")
    if len(train_features) == 0 or len(test_features) == 0:
        raise ValueError(f"need at least one train and one test sample; got {len(train_features)} and "
                         f"{len(test_features)}")
    if not ks or min(ks) < 1:
        raise ValueError(f"ks={tuple(ks)} must be a non-empty list of positive neighbour counts, e.g. 10 20 100 200")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (DINO uses 0.07)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of test samples")
    if int(train_labels.min()) < 0:
        raise ValueError(f"train labels must be class indices >= 0; found {int(train_labels.min())} "
                         "(a .beton without labels cannot be used for k-NN)")

    device = train_features.device
    capped_ks = sorted({min(int(k), len(train_features)) for k in ks})
    max_k = capped_ks[-1]
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    train_features = F.normalize(train_features.float(), dim=1)
    train_labels = train_labels.to(device).long()
    correct = dict.fromkeys(capped_ks, 0)
    for start in range(0, len(test_features), chunk_size):
        features = F.normalize(test_features[start:start + chunk_size].to(device).float(), dim=1)
        labels = test_labels[start:start + chunk_size].to(device).long()
        similarity = features @ train_features.T                       # (chunk, N) cosine similarities
        top_similarity, top_index = similarity.topk(max_k, dim=1)       # sorted, most similar first
        weights = (top_similarity / temperature).exp()
        neighbour_labels = train_labels[top_index]
        for k in capped_ks:
            votes = torch.zeros(len(features), num_classes, device=device)
            votes.scatter_add_(1, neighbour_labels[:, :k], weights[:, :k])
            correct[k] += int((votes.argmax(dim=1) == labels).sum())
    return {k: correct[k] / len(test_features) for k in capped_ks}


# ============ python -m eval knn ============

HELP = "weighted k-NN top-1 on frozen features (DINO protocol)"
DESCRIPTION = ("Weighted k-NN (Caron et al. 2021): cosine similarity of L2-normalised features, votes of the k "
               "nearest training images weighted by exp(sim/T).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    parser.add_argument("--ks", type=positive_int, nargs="+", default=[10, 20, 100, 200], metavar="K",
                        help="neighbour counts to report, each capped at the number of training images "
                             "(default: %(default)s)")
    parser.add_argument("--temperature", type=positive_float, default=0.07,
                        help="T in the vote weight exp(similarity / T) (default: %(default)s)")
    parser.add_argument("--chunk-size", type=positive_int, default=1024, metavar="N",
                        help="validation images scored at once; memory grows with N x training images "
                             "(default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Weighted k-NN top-1 for every k, written to RUN_DIR/eval/knn_step{step}.json and printed."""
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
    return 0
