"""Reparameterised coordinate descent, the hyper-parameter search of the balance paper (../shared/papers/
000_714cee3a006382cb.txt: section 5.2, eq. 9-10, and appendix B, Algorithms 1 and 2).

The search works in log space: a configuration h holds positive values (for the paper, h = (Lambda_p, Lambda_e, b)
with Lambda = lr x lambda), and x = log h. The rows of a matrix A are the search directions in log space; the
paper's (eq. 9) are the balance (-1, 1, 0), the joint learning rate (1, 1, 0) and the batch size (0, 0, 1), and
r = A log h (eq. 10) are the coordinates along them.

- Algorithm 1 (`coordinate_descent`): from a starting point, a line search of c_i trials along row i of A, then
  along the next row, cycling, until the total budget of trials is spent. The slope rule (appendix B, below
  Algorithm 2): after a line search whose improvement per trial is below `slope_threshold` (0.02), every
  direction's budget is doubled, so that the search looks closer once it is near the optimum.
- Algorithm 2 (`line_search`): a bounded golden-section search on the line x_l + gamma a, its bracket where the
  line leaves the search box, started from the line's known point gamma = 0 (the best so far: no trial is spent
  on it). Each step evaluates one point, at the golden fraction into the larger side of the current best point
  (the triplet form of golden-section search), and shrinks the bracket around the best.

The objective is maximised (accuracy, R-mAP). Everything here is deterministic given the objective's values: a
search that is restarted with its finished trials' values reproduces the same path.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

GOLDEN = (3 - math.sqrt(5)) / 2          # 0.381966...: the golden-section fraction
PAPER_DIRECTIONS = np.array([[-1.0, 1.0, 0.0],     # eq. 9: balance (Lambda_e against Lambda_p)
                             [1.0, 1.0, 0.0],      # joint learning rate
                             [0.0, 0.0, 1.0]])     # batch size
PAPER_DIRECTIONS_2D = PAPER_DIRECTIONS[:2, :2]     # the 2-D searches of Tables 1-2: b fixed


def golden_section_step(low: float, best: float, high: float, best_value: float,
                        evaluate: Callable[[float], float]) -> tuple[float, float, float, float]:
    """One trial of the bounded golden-section search for a maximum: evaluate the point at the golden fraction into
    the larger of [low, best] and [best, high], then shrink the bracket. Returns (low, best, high, best_value)."""
    if high - best >= best - low:
        trial = best + GOLDEN * (high - best)
    else:
        trial = best - GOLDEN * (best - low)
    value = evaluate(trial)
    if value > best_value:               # the trial is the new best: the old best bounds it on the other side
        if trial > best:
            low = best
        else:
            high = best
        return low, trial, high, value
    if trial > best:                     # the best stays: the trial bounds it on the trial's side
        high = trial
    else:
        low = trial
    return low, best, high, best_value


def line_bracket(start: np.ndarray, direction: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[float, float]:
    """[gamma_min, gamma_max]: the part of the line start + gamma * direction inside the box [low, high]."""
    if np.any(start < low - 1e-12) or np.any(start > high + 1e-12):
        raise ValueError(f"the line's start {start.tolist()} lies outside the search box {low.tolist()} - {high.tolist()}")
    if not np.any(direction != 0):
        raise ValueError("a search direction must not be the zero vector")
    gamma_min, gamma_max = -math.inf, math.inf
    for x, a, lo, hi in zip(start, direction, low, high):
        if a != 0:
            ends = sorted(((lo - x) / a, (hi - x) / a))
            gamma_min, gamma_max = max(gamma_min, ends[0]), min(gamma_max, ends[1])
    return gamma_min, gamma_max


def line_search(evaluate: Callable[[np.ndarray], float], start: np.ndarray, start_value: float,
                direction: np.ndarray, trials: int, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, float, int]:
    """Algorithm 2: `trials` golden-section steps on the line start + gamma * direction within the box, from
    gamma = 0 (value `start_value`, known). Returns the best point of the line, its value, and the trials spent:
    none when the line meets the box in the start alone (a corner the direction leaves on both sides)."""
    gamma_low, gamma_high = line_bracket(start, direction, low, high)
    if gamma_high - gamma_low < 1e-12:
        return start, start_value, 0
    bracket = (gamma_low, 0.0, gamma_high, start_value)
    for _ in range(trials):
        bracket = golden_section_step(*bracket, lambda gamma: evaluate(np.clip(start + gamma * direction, low, high)))
    best_gamma, best_value = bracket[1], bracket[3]
    return np.clip(start + best_gamma * direction, low, high), best_value, trials


@dataclass
class Search:
    """A coordinate-descent search's record: every trial in order (log-space point, value) and each line search
    (direction index, its number of trials, the budgets after the slope rule)."""

    points: list[np.ndarray] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    lines: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)

    @property
    def best(self) -> tuple[np.ndarray, float]:
        index = int(np.argmax(self.values))
        return self.points[index], self.values[index]


def coordinate_descent(evaluate: Callable[[np.ndarray], float], start: Sequence[float], low: Sequence[float],
                       high: Sequence[float], directions: np.ndarray, budgets: Sequence[int], total: int,
                       slope_threshold: float = 0.02) -> Search:
    """Algorithm 1, maximising `evaluate` (a log-space point -> metric) in the box [low, high] of log space.

    start:      the starting point (log space); it is the first trial.
    directions: A, one search direction per row (log space); the first row is searched first.
    budgets:    trials per line search along each row (the paper's default: 3 each).
    total:      the number of trials, the start included.
    slope_threshold: after a line search improving the best by less than this per trial, double every budget.
    """
    low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    directions = np.atleast_2d(np.asarray(directions, dtype=float))
    budgets = [int(b) for b in budgets]
    if directions.shape != (len(budgets), len(low)) or len(high) != len(low) or len(start) != len(low):
        raise ValueError(f"{directions.shape[0]} directions of {directions.shape[1]} coordinates, {len(budgets)} "
                         f"budgets, a start of {len(start)} and a box of {len(low)} coordinates: they must agree")
    if min(budgets) < 1 or total < 1:
        raise ValueError(f"budgets {budgets} and total {total} must be >= 1")
    search = Search()

    def trial(point: np.ndarray) -> float:
        value = float(evaluate(point))
        search.points.append(point.copy())
        search.values.append(value)
        return value

    point = np.clip(np.asarray(start, dtype=float), low, high)
    value = trial(point)
    index, stuck = 0, 0
    while len(search.values) < total and stuck < len(budgets):
        before = value
        point, value, trials = line_search(trial, point, value, directions[index],
                                           min(budgets[index], total - len(search.values)), low, high)
        stuck = stuck + 1 if trials == 0 else 0          # every direction leaves the box here: nowhere to go
        if trials and (value - before) / trials < slope_threshold:
            budgets = [2 * b for b in budgets]
        search.lines.append((index, trials, tuple(budgets)))
        index = (index + 1) % len(budgets)
    return search


# ============ comparing searches: the paper's Table 1 measures ============


def best_so_far(values: Sequence[float]) -> np.ndarray:
    """The best value after each trial."""
    return np.maximum.accumulate(np.asarray(values, dtype=float))


def area_under_curve(curve: Sequence[float], trials: int) -> float:
    """AUC@k: the mean of the best-so-far curve over its first k trials (a curve shorter than k is held at its
    last value), i.e. the normalised area under the curve of the best value against the number of runs."""
    curve = np.asarray(curve, dtype=float)
    if len(curve) < trials:
        curve = np.concatenate([curve, np.full(trials - len(curve), curve[-1])])
    return float(curve[:trials].mean())


def trials_to_reach(curve: Sequence[float], target: float) -> int | None:
    """n-95 when `target` is 95% of the best value any method reached: the first number of trials at which the
    (mean) best-so-far curve reaches the target; None when it never does."""
    reached = np.nonzero(np.asarray(curve, dtype=float) >= target)[0]
    return int(reached[0]) + 1 if len(reached) else None
