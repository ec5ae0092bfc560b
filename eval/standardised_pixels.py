"""Raw pixels scored as a dataset's authors score them, the reference a reviewer expects beside `eval baselines`' own:
every pixel standardised with the training images' mean and std (scikit-learn's StandardScaler), then a logistic
regression and a k-nearest-neighbours classifier (scikit-learn), each with its hyper-parameters chosen on a
validation split of the training images, refit on all of them, and scored once on the evaluation images.

Why a second raw-pixel row: `eval baselines`' `raw_pixels` row scores the pixels as a pretrained encoder's features
are scored (the config's normalisation, one mean and std for every pixel; cosine k-NN at k = 20, T = 0.07; the
linear probe's 100 epochs of SGD), which keeps encoder and pixels on one protocol; it is not tuned for pixels. The
standard reference is. Fashion-MNIST's authors (github.com/zalandoresearch/fashion-mnist, benchmark/runner.py: uint8
pixels through a StandardScaler fit on the 60,000 training images; benchmark/baselines.json: the grids) report
LogisticRegression at 84.2% (C=1, one-vs-rest, L1 penalty; Xiao, Rasul & Vollgraf 2017, arXiv:1708.07747, Table 3).
Their runner scores every grid point on the test images, so their best row is chosen on what it is scored on; here
the test images choose nothing.

The validation split is `held_out` (pretrain/data/fashion_mnist.py): a sixth of each class of the training images,
drawn by a fixed generator; on Fashion-MNIST's 60,000 it is search_val.beton's 10,000 images, those the searches
score on. Both classifiers see it through scikit-learn's PredefinedSplit, one fixed split rather than K folds: the
60,000-image fits cost minutes each on a CPU (docs/benchmarks.md, the standard raw-pixel reference: 12 minutes in
all at 28 px).
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from eval.features import extract_features
from pretrain.data.fashion_mnist import held_out
from pretrain.data.loader import build_image_loader

# C is scikit-learn's inverse regularisation strength on the summed loss: 0.001 to 1 spans strong to weak
# regularisation for tens of thousands of standardised images; lbfgs fits the whole path warm-started, largest C last.
LOGISTIC_C_GRID = (0.001, 0.01, 0.1, 1.0)
LOGISTIC_MAX_ITER = 1000          # Fashion-MNIST at 28 px converged within 614 lbfgs iterations at every C
# The authors' k and weights (benchmark/baselines.json); their p = 1 (Manhattan) is left out: scikit-learn has no BLAS
# path for it: 11 times the Euclidean search's time on Fashion-MNIST's 784 pixels, measured (minutes a candidate).
NEIGHBOURS_GRID = {"n_neighbors": [1, 5, 9], "weights": ["uniform", "distance"]}


def stored_pixels(path: str | Path, image_size: int, cfg: DictConfig, device: torch.device
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 3, image_size^2) float64 in [0, 1], labels (N,)): the stored 8-bit values / 255, resized and
    cropped as the config's evaluation does, but not normalised by its mean and std (StandardScaler does that per
    pixel). At a dataset's own side and crop fraction 1 these are its pixels unchanged."""
    loader = build_image_loader(path, image_size, 256, device=device, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
                                num_workers=cfg.data.num_workers, crop_fraction=cfg.data.eval_crop_fraction)
    images, labels = extract_features(lambda x: x, loader, device)
    return images.double().numpy().reshape(len(images), 3, -1), labels.numpy()


def distinct_channels(train_images: np.ndarray) -> int:
    """1 when every training image's three channels are equal (a gray dataset stored as RGB, as the project writes
    Fashion-MNIST and the digits), else 3. A gray image's copies would triple the features, and the cost, and change
    nothing but the effective C; the test images take the same choice, made on the training images alone."""
    return 1 if (train_images[:, 1:] == train_images[:, :1]).all() else 3


def score_standardised_pixels(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray
                              ) -> dict:
    """Top-1 on (test_x, test_y) of a logistic regression ("linear") and a k-NN classifier ("knn") on standardised
    features, each tuned on `held_out(train_y)` of the training images and refit on all of them. The record names
    the chosen hyper-parameters, the grids, every candidate's validation accuracy and the solver's iterations; the
    test arrays enter after every choice is made (the scaler, C, k and weights are fit on training images only).

    Ties go to the first candidate in grid order (smallest C; smallest k, uniform before distance), scikit-learn's
    choice. Warnings from the fits (a ConvergenceWarning: lbfgs stopped at max_iter) are returned in "warnings"."""
    validation = held_out(train_y)
    if not validation.any() or validation.all():
        raise ValueError(f"held_out kept {int(validation.sum())} of {len(train_y)} training images for validation "
                         "(a sixth of each class, rounded down): give the training set at least 6 images of a class")
    from sklearn.exceptions import ConvergenceWarning  # heavy: scikit-learn, imported by the command that fits
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import GridSearchCV, PredefinedSplit
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.preprocessing import StandardScaler

    split = PredefinedSplit(np.where(validation, 0, -1))        # -1: fit on it; 0: the one validation fold
    scaler = StandardScaler().fit(train_x)
    train_z, test_z = scaler.transform(train_x), scaler.transform(test_x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        started = time.time()
        logistic = LogisticRegressionCV(Cs=list(LOGISTIC_C_GRID), cv=split, l1_ratios=(0.0,), scoring="accuracy",
                                        solver="lbfgs", max_iter=LOGISTIC_MAX_ITER,
                                        use_legacy_attributes=False).fit(train_z, train_y)
        logistic_seconds = time.time() - started
        started = time.time()
        neighbours = GridSearchCV(KNeighborsClassifier(), NEIGHBOURS_GRID, cv=split,
                                  scoring="accuracy").fit(train_z, train_y)
        neighbours_scored = neighbours.score(test_z, test_y)
        neighbours_seconds = time.time() - started
    logistic_validation = np.ravel(logistic.scores_)             # one fold, one l1_ratio: a score per C
    candidates = neighbours.cv_results_
    return {
        "knn": float(neighbours_scored),
        "linear": float(logistic.score(test_z, test_y)),
        "train_images": len(train_y), "validation_images": int(validation.sum()), "features": train_x.shape[1],
        "standardisation": "each feature's mean and std over the training images (StandardScaler)",
        "logistic_regression": {
            "C": float(logistic.C_), "grid": list(LOGISTIC_C_GRID), "penalty": "l2", "solver": "lbfgs",
            "max_iter": LOGISTIC_MAX_ITER,
            "validation": {str(c): float(score) for c, score in zip(LOGISTIC_C_GRID, logistic_validation)},
            "iterations": {str(c): int(n) for c, n in zip(LOGISTIC_C_GRID, np.ravel(logistic.n_iter_))},
            "seconds": round(logistic_seconds, 1)},
        "k_nearest_neighbours": {
            **neighbours.best_params_, "metric": "euclidean", "grid": NEIGHBOURS_GRID,
            "validation": [{**params, "accuracy": float(score)}
                           for params, score in zip(candidates["params"], candidates["mean_test_score"])],
            "seconds": round(neighbours_seconds, 1)},
        "warnings": [f"{warning.category.__name__}: {warning.message}" for warning in caught],
    }


def standardised_pixel_references(cfg: DictConfig, device: torch.device, train: str | Path, val: str | Path,
                                  image_size: int) -> dict:
    """`score_standardised_pixels` on the config's data at `image_size`: its training images (`train`) against its
    evaluation images (`val`), with how many channels were kept ("channels")."""
    train_images, train_y = stored_pixels(train, image_size, cfg, device)
    test_images, test_y = stored_pixels(val, image_size, cfg, device)
    channels = distinct_channels(train_images)
    result = score_standardised_pixels(train_images[:, :channels].reshape(len(train_y), -1), train_y,
                                       test_images[:, :channels].reshape(len(test_y), -1), test_y)
    return {**result, "channels": channels}
