"""The balance paper's coordinate-descent search (launch/coordinate_descent.py; paper 000, section 5.2 and
Algorithms 1-2) on functions whose maximum is known, and the Table 1 measures on a hand-computed example."""
import math

import numpy as np
import pytest

from launch.coordinate_descent import (GOLDEN, PAPER_DIRECTIONS_2D, area_under_curve, best_so_far,
                                       coordinate_descent, golden_section_step, line_bracket, line_search,
                                       trials_to_reach)


# ============ Algorithm 2: the bounded golden-section line search ============


@pytest.mark.parametrize("peak, start", [(0.3, -1.0), (1.9, 0.0), (-0.99, 1.5), (0.0, 0.0)])
@pytest.mark.parametrize("shape", ["quadratic", "abs", "gaussian"])
def test_golden_section_finds_the_maximum_of_a_unimodal_function_within_its_budget(peak, start, shape):
    f = {"quadratic": lambda x: -(x - peak) ** 2, "abs": lambda x: -abs(x - peak),
         "gaussian": lambda x: math.exp(-(x - peak) ** 2)}[shape]
    evaluated = []

    def evaluate(x: float) -> float:
        evaluated.append(x)
        return f(x)

    low, high, best, value = -1.0, 2.0, start, f(start)
    for _ in range(30):
        low, best, high, value = golden_section_step(low, best, high, value, evaluate)
        assert low <= best <= high and value == f(best) == max([f(start)] + [f(x) for x in evaluated])
    assert len(evaluated) == 30 and all(-1.0 <= x <= 2.0 for x in evaluated)
    assert low <= peak <= high                              # the bracket always holds the maximum
    # each trial shrinks the bracket at least by the golden ratio every two steps: 3 * 0.618^14 < 4e-3
    assert high - low < 3 * (1 - GOLDEN) ** 14 and abs(best - peak) < 4e-3


def test_the_first_golden_step_goes_into_the_larger_side_at_the_golden_fraction():
    seen = []
    golden_section_step(0.0, 0.0, 10.0, 0.0, lambda x: seen.append(x) or 0.0)
    golden_section_step(0.0, 8.0, 10.0, 0.0, lambda x: seen.append(x) or 0.0)
    assert seen == pytest.approx([10 * GOLDEN, 8 - 8 * GOLDEN])


def test_a_lines_bracket_is_where_it_leaves_the_box():
    low, high = np.array([0.0, 0.0]), np.array([4.0, 2.0])
    assert line_bracket(np.array([1.0, 1.0]), np.array([-1.0, 1.0]), low, high) == (-1.0, 1.0)
    assert line_bracket(np.array([1.0, 1.0]), np.array([1.0, 1.0]), low, high) == (-1.0, 1.0)
    assert line_bracket(np.array([1.0, 1.0]), np.array([1.0, 0.0]), low, high) == (-1.0, 3.0)
    with pytest.raises(ValueError, match="outside the search box"):
        line_bracket(np.array([5.0, 1.0]), np.array([1.0, 0.0]), low, high)
    # a corner the direction leaves on both sides: no trial is spent there
    calls = []
    point, value, trials = line_search(lambda x: calls.append(x) or 1.0, np.array([0.0, 0.0]), 0.5,
                                       np.array([-1.0, 1.0]), 3, low, high)
    assert trials == 0 and calls == [] and value == 0.5


# ============ Algorithm 1: coordinate descent in the reparameterised log space ============


def rotated_quadratic(optimum: np.ndarray, narrow: float = 50.0):
    """A valley along the joint direction (1, 1): curvature `narrow` across it (the balance direction), 1 along
    it. A's rows are its eigenvectors; the identity's are not."""
    across, along = np.array([-1.0, 1.0]) / math.sqrt(2), np.array([1.0, 1.0]) / math.sqrt(2)
    return lambda x: -(narrow * ((x - optimum) @ across) ** 2 + ((x - optimum) @ along) ** 2)


def test_the_papers_directions_reach_a_rotated_optimum_faster_than_the_identity():
    """Table 2's effect (A_O against A_I) on a landscape whose eigen-directions are A_O's rows (curvature 10 across
    the valley, 1 along it): over 40 random optima and starts, 30 trials of (3, 3) budgets end far closer to the
    optimum with the paper's directions, and the area under the best-so-far curve is larger."""
    rng = np.random.default_rng(0)
    low, high = np.array([-6.0, -6.0]), np.array([6.0, 6.0])
    regret, auc = {"paper": [], "identity": []}, {"paper": [], "identity": []}
    for _ in range(40):
        optimum, start = rng.uniform(-4, 4, size=2), rng.uniform(-6, 6, size=2)
        f = rotated_quadratic(optimum, narrow=10.0)
        for name, directions in (("paper", PAPER_DIRECTIONS_2D), ("identity", np.eye(2))):
            search = coordinate_descent(f, start, low, high, directions, budgets=(3, 3), total=30)
            assert len(search.values) == 30
            regret[name].append(-search.best[1])
            auc[name].append(area_under_curve(best_so_far(search.values), 30))
    assert np.mean(regret["paper"]) < 0.1 * np.mean(regret["identity"])        # measured: 0.07 against 2.5
    assert sum(p < i for p, i in zip(regret["paper"], regret["identity"])) >= 30    # measured: 37 of 40
    assert np.mean(auc["paper"]) > np.mean(auc["identity"])


def test_on_a_separable_quadratic_two_line_searches_along_its_axes_find_the_optimum():
    """With A the Hessian's eigenvectors, each line search solves its coordinate: after one search per direction
    the point is at the optimum up to the golden-section tolerance."""
    optimum = np.array([0.7, -1.3])
    f = rotated_quadratic(optimum)
    search = coordinate_descent(f, [-5.0, 5.0], [-6.0, -6.0], [6.0, 6.0], PAPER_DIRECTIONS_2D, budgets=(25, 25),
                                total=51, slope_threshold=0.0)
    assert [index for index, *_ in search.lines] == [0, 1]
    assert np.allclose(search.best[0], optimum, atol=1e-3)


def test_the_slope_rule_doubles_every_budget_after_a_line_search_that_gained_little():
    flat = coordinate_descent(lambda x: 0.5, [0.0, 0.0], [-1, -1], [1, 1], PAPER_DIRECTIONS_2D, (3, 3), total=1 + 3 + 6 + 12)
    assert [(index, trials) for index, trials, _ in flat.lines] == [(0, 3), (1, 6), (0, 12)]
    assert [budgets for *_, budgets in flat.lines] == [(6, 6), (12, 12), (24, 24)]
    # A steep slope (gains well above 0.02 per trial) keeps the budgets.
    steep = coordinate_descent(lambda x: -100 * float(np.sum((x - 0.5) ** 2)), [-1.0, 0.5], [-1, -1], [1, 1],
                               PAPER_DIRECTIONS_2D, (3, 3), total=7)
    assert [(index, trials, budgets) for index, trials, budgets in steep.lines] == [(0, 3, (3, 3)), (1, 3, (3, 3))]
    # The last line search is cut to what the total budget leaves, and the start is the first trial.
    cut = coordinate_descent(lambda x: 0.0, [0.0, 0.0], [-1, -1], [1, 1], PAPER_DIRECTIONS_2D, (3, 3), total=5)
    assert [trials for _, trials, _ in cut.lines] == [3, 1] and np.allclose(cut.points[0], [0.0, 0.0])


def test_a_restarted_search_with_its_finished_values_takes_the_same_path():
    f = rotated_quadratic(np.array([1.0, 2.0]))
    first = coordinate_descent(f, [-3.0, 0.5], [-6, -6], [6, 6], PAPER_DIRECTIONS_2D, (3, 3), total=15)
    again = coordinate_descent(f, [-3.0, 0.5], [-6, -6], [6, 6], PAPER_DIRECTIONS_2D, (3, 3), total=15)
    assert np.array_equal(np.array(first.points), np.array(again.points)) and first.values == again.values


def test_mismatched_shapes_and_budgets_are_refused_by_name():
    with pytest.raises(ValueError, match="must agree"):
        coordinate_descent(lambda x: 0.0, [0.0, 0.0, 0.0], [-1, -1], [1, 1], PAPER_DIRECTIONS_2D, (3, 3), total=5)
    with pytest.raises(ValueError, match="must be >= 1"):
        coordinate_descent(lambda x: 0.0, [0.0, 0.0], [-1, -1], [1, 1], PAPER_DIRECTIONS_2D, (0, 3), total=5)


# ============ Table 1's measures ============


def test_auc_and_n95_against_hand_computed_values():
    values = [0.2, 0.5, 0.4, 0.7, 0.6, 0.9]
    curve = best_so_far(values)
    assert curve.tolist() == [0.2, 0.5, 0.5, 0.7, 0.7, 0.9]
    assert area_under_curve(curve, 4) == pytest.approx((0.2 + 0.5 + 0.5 + 0.7) / 4)
    assert area_under_curve(curve, 8) == pytest.approx((0.2 + 0.5 + 0.5 + 0.7 + 0.7 + 0.9 + 0.9 + 0.9) / 8)
    assert trials_to_reach(curve, 0.95 * 0.7) == 4          # 0.665: first reached at the 4th trial
    assert trials_to_reach(curve, 0.95 * 1.0) is None         # never
