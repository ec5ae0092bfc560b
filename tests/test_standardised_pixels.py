"""Tests of the standard raw-pixel reference (eval/standardised_pixels.py): the hyper-parameters it chooses are those a
brute-force search over the same grid chooses on the same validation split, the evaluation images choose nothing,
and the standardisation is the training images'. On scikit-learn's 8 x 8 digits (1,797 images): seconds."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier
from sklearn.preprocessing import StandardScaler

from eval.standardised_pixels import (LOGISTIC_C_GRID, LOGISTIC_MAX_ITER, NEIGHBOURS_GRID, distinct_channels,
                                      score_standardised_pixels)
from pretrain.data.fashion_mnist import held_out


@pytest.fixture(scope="module")
def eight_pixel_digits():
    """(train_x, train_y, test_x, test_y): the first 1,200 of the 8 x 8 digits to train on, the other 597 to score."""
    images, labels = load_digits(return_X_y=True)
    return images[:1200] / 16, labels[:1200], images[1200:] / 16, labels[1200:]


@pytest.fixture(scope="module")
def scored(eight_pixel_digits):
    return score_standardised_pixels(*eight_pixel_digits)


def test_the_chosen_c_k_and_weights_maximise_validation_accuracy_by_brute_force(eight_pixel_digits, scored):
    """Each candidate fit alone on the training images outside `held_out` and scored on those inside it: the
    recorded validation accuracies are these, and the choice is the first best of the grid."""
    train_x, train_y, test_x, test_y = eight_pixel_digits
    validation = held_out(train_y)
    scaler = StandardScaler().fit(train_x)
    train_z, test_z = scaler.transform(train_x), scaler.transform(test_x)
    fit, check = (train_z[~validation], train_y[~validation]), (train_z[validation], train_y[validation])

    logistic = [LogisticRegression(C=c, max_iter=LOGISTIC_MAX_ITER).fit(*fit).score(*check) for c in LOGISTIC_C_GRID]
    recorded = scored["logistic_regression"]["validation"]
    assert list(recorded.values()) == pytest.approx(logistic, abs=1.5 / validation.sum())   # warm-started path: 1 image
    assert scored["logistic_regression"]["C"] == LOGISTIC_C_GRID[int(np.argmax(logistic))]
    chosen = LogisticRegression(C=scored["logistic_regression"]["C"], max_iter=LOGISTIC_MAX_ITER).fit(train_z, train_y)
    assert scored["linear"] == pytest.approx(chosen.score(test_z, test_y), abs=1.5 / len(test_y))

    candidates = [(k, weights) for k in NEIGHBOURS_GRID["n_neighbors"] for weights in NEIGHBOURS_GRID["weights"]]
    neighbours = [KNeighborsClassifier(n_neighbors=k, weights=weights).fit(*fit).score(*check)
                  for k, weights in candidates]
    assert [c["accuracy"] for c in scored["k_nearest_neighbours"]["validation"]] == neighbours
    k, weights = candidates[int(np.argmax(neighbours))]
    assert (scored["k_nearest_neighbours"]["n_neighbors"], scored["k_nearest_neighbours"]["weights"]) == (k, weights)
    assert scored["knn"] == KNeighborsClassifier(n_neighbors=k, weights=weights).fit(train_z, train_y).score(test_z,
                                                                                                             test_y)
    assert (scored["train_images"], scored["validation_images"], scored["features"]) == (1200, validation.sum(), 64)
    assert scored["warnings"] == [] and all(n < LOGISTIC_MAX_ITER for n in scored["logistic_regression"][
        "iterations"].values())


def test_the_evaluation_images_choose_nothing(eight_pixel_digits, scored):
    """Shuffled evaluation labels and noise for evaluation images: the same choices and validation accuracies, only
    the final scores move (to about chance)."""
    train_x, train_y, test_x, test_y = eight_pixel_digits
    generator = np.random.default_rng(0)
    garbled = score_standardised_pixels(train_x, train_y, generator.uniform(size=test_x.shape),
                                        generator.permutation(test_y))
    for classifier in ("logistic_regression", "k_nearest_neighbours"):
        assert {key: value for key, value in garbled[classifier].items() if key != "seconds"} == \
            {key: value for key, value in scored[classifier].items() if key != "seconds"}
    assert scored["linear"] > 0.85 and scored["knn"] > 0.85
    assert garbled["linear"] < 0.3 and garbled["knn"] < 0.3


def test_the_standardisation_is_the_training_images(eight_pixel_digits, scored):
    """Evaluation images brighter by a constant: standardised with the training images' statistics, as the
    reference is, they fall off the training distribution; standardised with their own, the shift would vanish.
    (k-NN, whose refit is exact: a logistic regression far off its data moves with its solver's last digits.)"""
    train_x, train_y, test_x, test_y = eight_pixel_digits
    brighter = score_standardised_pixels(train_x, train_y, test_x + 0.5, test_y)
    chosen = scored["k_nearest_neighbours"]
    train_scaler, own_scaler = StandardScaler().fit(train_x), StandardScaler().fit(test_x + 0.5)
    model = KNeighborsClassifier(n_neighbors=chosen["n_neighbors"], weights=chosen["weights"]).fit(
        train_scaler.transform(train_x), train_y)
    with_training_statistics = model.score(train_scaler.transform(test_x + 0.5), test_y)
    with_own_statistics = model.score(own_scaler.transform(test_x + 0.5), test_y)
    assert brighter["knn"] == with_training_statistics
    assert with_own_statistics - with_training_statistics > 0.3       # the two are told apart


def test_gray_copied_to_three_channels_keeps_one_and_a_too_small_training_set_is_refused():
    gray = np.repeat(np.random.default_rng(0).uniform(size=(4, 1, 9)), 3, axis=1)
    assert distinct_channels(gray) == 1
    gray[2, 1, 5] += 0.01
    assert distinct_channels(gray) == 3
    with pytest.raises(ValueError, match="held_out kept 0 of 10 training images.*at least 6 images of a class"):
        score_standardised_pixels(np.ones((10, 4)), np.arange(10) % 2, np.ones((2, 4)), np.array([0, 1]))
