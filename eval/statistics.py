"""How much a table's numbers over seeds say: the one place their statistics are computed.

    summarise_seeds([80.0, 82.0, 81.0])                 mean, sample std, 95% t interval of the mean, n
    paired_difference({0: 81.2, 1: 82.0}, {0: 80.1, 1: 81.5})
                                                        row minus baseline over the seeds both ran: mean difference,
                                                        its 95% t interval, the paired t-test's two-sided p-value
    summary_record / summary_text                      a summary as a table's JSON and its cell

Both are Student's t: with the few seeds a benchmark affords (2 to 5), the normal approximation's interval would
be far too narrow (t at 95% is 12.71 for 2 seeds, 4.30 for 3, against 1.96). A paired comparison pairs the rows'
runs by seed: rows that share a seed share its data order and initialisation, so the seed-to-seed spread largely
cancels in the difference, and two rows whose intervals overlap may still differ clearly.

The textbook formulas of Student's t (Student, "The probable error of a mean", Biometrika 6, 1908), for values
x_1..x_n (the differences d_i = row_i - baseline_i for the paired test):

    mean m = sum(x) / n;  s = sqrt(sum((x - m)^2) / (n - 1));  interval m -+ t_{0.975, n-1} s / sqrt(n)
    t = m / (s / sqrt(n));  p = 2 P(T_{n-1} >= |t|)

tests/test_statistics.py checks them against scipy.stats.ttest_rel and scipy.stats.t.interval, and against the
closed form of the t distribution with 2 degrees of freedom.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def student_t():
    """scipy's Student t distribution, imported when a statistic is computed: scipy.stats takes 1.2-1.7 s to import
    on a slow CPU, and every `python -m launch` and `python -m eval` process imports this module for its tables."""
    from scipy.stats import t

    return t


CONFIDENCE = 0.95


@dataclass(frozen=True)
class SeedSummary:
    """A measure over seeds. `std` (n - 1) and `interval` are None for one seed: one value has no spread, and no
    interval can be drawn from it; `note` then says so."""

    mean: float
    std: float | None
    interval: tuple[float, float] | None     # the CONFIDENCE t interval of the mean
    n: int
    note: str | None = None


@dataclass(frozen=True)
class PairedDifference:
    """Row minus baseline over their common seeds. With differences that are all equal, `interval` is that value and
    `p_value` None: the t statistic divides by their spread, which is zero (`note` says so)."""

    mean: float
    interval: tuple[float, float]
    p_value: float | None
    n: int
    seeds: tuple[int, ...]
    note: str | None = None


def t_interval(mean: float, std: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """mean -+ t_{(1 + confidence) / 2, n - 1} std / sqrt(n): the t interval of a mean of n values of sample std
    `std`."""
    half = student_t().ppf((1 + confidence) / 2, n - 1) * std / math.sqrt(n)
    return (mean - half, mean + half)


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1) of at least two values."""
    n = len(values)
    mean = math.fsum(values) / n
    return mean, math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (n - 1))


def check_values(values: Sequence[float], what: str) -> list[float]:
    values = [float(value) for value in values]
    if not values:
        raise ValueError(f"{what}: no values; a summary over seeds needs at least one")
    if not all(math.isfinite(value) for value in values):
        raise ValueError(f"{what}: {values} holds a value that is not finite")
    return values


def summarise_seeds(values: Sequence[float], confidence: float = CONFIDENCE) -> SeedSummary:
    """Mean, sample standard deviation (n - 1), the `confidence` t interval of the mean and n, of a measure's values
    over seeds. One value: its mean, no std and no interval (the note says so). No value, or one not finite: a
    ValueError."""
    values = check_values(values, "summary over seeds")
    if len(values) == 1:
        return SeedSummary(values[0], None, None, 1, "one seed: no spread and no interval (run more seeds)")
    mean, std = mean_and_std(values)
    return SeedSummary(mean, std, t_interval(mean, std, len(values), confidence), len(values))


def paired_difference(row: Mapping[int, float], baseline: Mapping[int, float],
                      confidence: float = CONFIDENCE) -> PairedDifference:
    """Row minus baseline over the seeds both have (seed -> value): the mean difference, its `confidence` t
    interval, the two-sided p-value of the paired t-test (H0: the mean difference is 0), n and the seeds.

    Raises ValueError naming the seeds when fewer than 2 are common: one difference has no spread to test it by."""
    seeds = tuple(sorted(set(row) & set(baseline)))
    if len(seeds) < 2:
        raise ValueError(f"a paired comparison needs at least 2 seeds both rows ran; they share "
                         f"{len(seeds)} ({', '.join(map(str, seeds)) or 'none'}; the row has seeds "
                         f"{sorted(row)}, the baseline {sorted(baseline)}): run the same seeds of both")
    differences = check_values([row[seed] - baseline[seed] for seed in seeds], "paired differences")
    n = len(differences)
    mean, std = mean_and_std(differences)
    if std == 0:
        return PairedDifference(mean, (mean, mean), None, n, seeds,
                                f"the {n} differences are all {mean:g}: no spread, so no t-test and no interval")
    statistic = mean / (std / math.sqrt(n))
    p_value = float(2 * student_t().sf(abs(statistic), n - 1))
    return PairedDifference(mean, t_interval(mean, std, n, confidence), p_value, n, seeds)


def summary_record(values: Sequence[float], digits: int = 2) -> dict:
    """`summarise_seeds` as a table's JSON holds it, rounded to `digits`: mean, std and ci95 ([low, high]; both None
    for one seed), n, and the values themselves."""
    summary = summarise_seeds(values)
    return {"mean": round(summary.mean, digits),
            "std": None if summary.std is None else round(summary.std, digits),
            "ci95": None if summary.interval is None else [round(bound, digits) for bound in summary.interval],
            "n": summary.n, "values": [round(float(value), digits) for value in values]}


def summary_text(record: Mapping, unit: str = "%") -> str:
    """A `summary_record` as a table's cell: '81.00% ± 1.00, 95% CI [78.52, 83.48]' (mean ± std, the t interval of
    the mean), '78.71% (1 seed: no interval)'."""
    if record.get("ci95") is None:
        return f"{record['mean']:.2f}{unit} (1 seed: no interval)"
    low, high = record["ci95"]
    return f"{record['mean']:.2f}{unit} ± {record['std']:.2f}, 95% CI [{low:.2f}, {high:.2f}]"
