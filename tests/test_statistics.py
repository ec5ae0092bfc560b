"""eval/statistics.py against scipy (ttest_rel, t.interval) and against the closed form of Student's t with 2
degrees of freedom, F(t) = 1/2 + t / (2 sqrt(t^2 + 2)); one seed, too few common seeds, differences without spread."""
import math

import numpy as np
import pytest
from scipy import stats

from eval.statistics import paired_difference, summarise_seeds, summary_record, summary_text


def test_the_summary_over_seeds_is_the_mean_the_sample_std_and_the_t_interval_of_the_mean():
    values = [80.0, 82.0, 81.0]
    summary = summarise_seeds(values)
    assert (summary.mean, summary.std, summary.n, summary.note) == (81.0, 1.0, 3, None)
    # by hand: t_{0.975, 2} = 0.95 sqrt(2 / (1 - 0.95^2)) (the closed form's inverse), s / sqrt(3) = 1 / sqrt(3)
    half = 0.95 * math.sqrt(2 / (1 - 0.95 ** 2)) / math.sqrt(3)
    assert summary.interval == pytest.approx((81.0 - half, 81.0 + half), abs=1e-12)
    assert half == pytest.approx(2.4841, abs=1e-4)
    rng = np.random.default_rng(0)
    for n in (2, 5, 10):
        sample = rng.normal(70, 3, n)
        summary = summarise_seeds(sample.tolist())
        assert summary.std == pytest.approx(np.std(sample, ddof=1), rel=1e-12)
        assert summary.interval == pytest.approx(stats.t.interval(0.95, n - 1, loc=sample.mean(),
                                                                  scale=stats.sem(sample)), rel=1e-12)


def test_one_seed_has_a_mean_and_says_it_has_no_spread_and_no_interval():
    summary = summarise_seeds([78.5])
    assert (summary.mean, summary.std, summary.interval, summary.n) == (78.5, None, None, 1)
    assert "one seed: no spread and no interval" in summary.note
    with pytest.raises(ValueError, match="no values"):
        summarise_seeds([])
    with pytest.raises(ValueError, match="not finite"):
        summarise_seeds([1.0, float("nan")])


def test_the_paired_difference_is_scipys_paired_t_test_over_the_common_seeds():
    row = {0: 81.0, 1: 83.0, 2: 82.0, 7: 90.0}           # seed 7: the baseline has none, left out
    baseline = {0: 80.0, 1: 81.0, 2: 79.0, 3: 60.0}
    paired = paired_difference(row, baseline)
    assert (paired.mean, paired.n, paired.seeds, paired.note) == (2.0, 3, (0, 1, 2), None)
    # by hand, differences 1, 2, 3: s = 1, t = 2 sqrt(3); with 2 degrees of freedom p = 1 - t / sqrt(t^2 + 2)
    t = 2 * math.sqrt(3)
    assert paired.p_value == pytest.approx(1 - t / math.sqrt(t ** 2 + 2), abs=1e-12)
    half = 0.95 * math.sqrt(2 / (1 - 0.95 ** 2)) / math.sqrt(3)
    assert paired.interval == pytest.approx((2.0 - half, 2.0 + half), abs=1e-12)
    reference = stats.ttest_rel([81.0, 83.0, 82.0], [80.0, 81.0, 79.0])
    assert paired.p_value == pytest.approx(reference.pvalue, rel=1e-12)
    assert paired.interval == pytest.approx(tuple(reference.confidence_interval(0.95)), rel=1e-12)

    rng = np.random.default_rng(1)
    for n in (2, 4, 9):
        a, b = rng.normal(80, 2, n), rng.normal(79, 2, n)
        paired = paired_difference(dict(enumerate(a)), dict(enumerate(b)))
        reference = stats.ttest_rel(a, b)
        assert paired.p_value == pytest.approx(reference.pvalue, rel=1e-10)
        assert paired.interval == pytest.approx(tuple(reference.confidence_interval(0.95)), rel=1e-10)
        assert paired.mean == pytest.approx(float(np.mean(a - b)), rel=1e-12)


def test_fewer_than_two_common_seeds_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"at least 2 seeds both rows ran; they share 1 \(0; the row has seeds "
                                         r"\[0, 1\], the baseline \[0, 2\]\)"):
        paired_difference({0: 1.0, 1: 2.0}, {0: 1.0, 2: 3.0})
    with pytest.raises(ValueError, match=r"they share 0 \(none;"):
        paired_difference({0: 1.0}, {1: 1.0})


def test_differences_without_spread_give_their_value_and_no_t_test():
    """scipy's t statistic is then inf (p = 0) for a non-zero difference and nan for zero: neither is a test."""
    paired = paired_difference({0: 81.0, 1: 82.0, 2: 83.0}, {0: 80.0, 1: 81.0, 2: 82.0})
    assert (paired.mean, paired.interval, paired.p_value) == (1.0, (1.0, 1.0), None)
    assert paired.note == "the 3 differences are all 1: no spread, so no t-test and no interval"
    equal = paired_difference({0: 5.0, 1: 6.0}, {0: 5.0, 1: 6.0})
    assert (equal.mean, equal.p_value) == (0.0, None)
    assert math.isnan(stats.ttest_rel([5.0, 6.0], [5.0, 6.0]).pvalue)


def test_a_summary_as_a_tables_json_and_cell():
    record = summary_record([80.0, 82.0, 81.0])
    assert record == {"mean": 81.0, "std": 1.0, "ci95": [78.52, 83.48], "n": 3, "values": [80.0, 82.0, 81.0]}
    assert summary_text(record) == "81.00% ± 1.00, 95% CI [78.52, 83.48]"
    single = summary_record([78.714])
    assert single == {"mean": 78.71, "std": None, "ci95": None, "n": 1, "values": [78.71]}
    assert summary_text(single) == "78.71% (1 seed: no interval)"
