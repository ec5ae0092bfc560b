"""Hyper-parameter searches replayed on a measured grid: the protocol of the balance paper's Table 1, Table 2 and
Figure 6 (../shared/papers/000_714cee3a006382cb.txt, section 6.4).

A grid holds the objective (k-NN accuracy, R-mAP, ...) measured at every point of a product of positive values
per searched key, in multiplicative steps (the paper's: steps of 2 in Lambda_p and Lambda_e). Between grid points
the objective is interpolated linearly in log space, as the paper interpolates "from a precomputed grid with
sufficient resolution", so a search may propose any point of the box. Each method is run for many trajectories
(the paper: 80) of `budget` trials from independent seeds:

- `cd`: coordinate descent (launch/coordinate_descent.py) from a start drawn uniformly in the log box;
- `random`, `tpe`, `cmaes`: Optuna's RandomSampler, TPESampler and CmaEsSampler (with the `cmaes` package) on
  the same box, each key on a log scale.

Measures: AUC@k, the mean over trajectories of the normalised area under the best-so-far curve over the first k
trials, and n-95, the first number of trials at which a method's mean best-so-far curve reaches 95% of the best
value any method's mean curve reached within the budget.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launch.cluster import LaunchError
from launch.coordinate_descent import (PAPER_DIRECTIONS, area_under_curve, best_so_far, coordinate_descent,
                                       trials_to_reach)
from pretrain.runtime.argument_types import non_negative_int, number, positive_int

HELP = "searches replayed on a measured grid (the paper's Table 1-2)"
OPTUNA_SAMPLERS = ("random", "tpe", "cmaes")
METHODS = ("cd", *OPTUNA_SAMPLERS)


@dataclass
class Grid:
    """The objective measured on a grid: `values[i, j, ...]` at (axes[0][i], axes[1][j], ...)."""

    keys: list[str]               # the config keys searched, one per axis
    axes: list[np.ndarray]        # each key's grid values, positive and increasing
    values: np.ndarray            # the objective at every grid point (NaN: a run that did not finish)
    metric: str                   # what the values are (e.g. "knn top-1, k = 20")
    FIELDS = ("keys", "axes", "values", "metric")       # a grid file's (not a dataclass field: no annotation)

    def __post_init__(self):
        self.axes = [np.asarray(axis, dtype=float) for axis in self.axes]
        self.values = np.asarray(self.values, dtype=float)
        if self.values.shape != tuple(len(axis) for axis in self.axes) or len(self.keys) != len(self.axes):
            raise ValueError(f"a grid of {len(self.keys)} keys and axes of {[len(a) for a in self.axes]} points "
                             f"needs values of that shape, got {self.values.shape}")
        if any(np.any(axis <= 0) or np.any(np.diff(axis) <= 0) for axis in self.axes):
            raise ValueError("every grid axis must hold positive, increasing values (the search is in log space)")
        if np.isnan(self.values).any():
            raise ValueError(f"{int(np.isnan(self.values).sum())} grid points have no value: measure them first")

    @property
    def low(self) -> np.ndarray:
        return np.array([np.log(axis[0]) for axis in self.axes])

    @property
    def high(self) -> np.ndarray:
        return np.array([np.log(axis[-1]) for axis in self.axes])

    def objective(self, log_point) -> float:
        """The objective at a log-space point of the box, linear between the grid points in log space."""
        from scipy.interpolate import RegularGridInterpolator  # scipy: for a replay only, not every launch command

        if not hasattr(self, "_interpolator"):
            self._interpolator = RegularGridInterpolator([np.log(axis) for axis in self.axes], self.values)
        return float(self._interpolator(np.clip(np.asarray(log_point, dtype=float), self.low, self.high))[0])

    @classmethod
    def load(cls, path: str | Path) -> "Grid":
        """The grid in a JSON file (what `python -m launch grid` writes); ValueError when it holds no grid."""
        data = json.loads(Path(path).read_text())
        missing = [field for field in cls.FIELDS if field not in data] if isinstance(data, dict) else cls.FIELDS
        if missing:
            raise ValueError(f"is not a grid (it has no {', '.join(missing)}): a grid is a JSON object of "
                             f"{', '.join(cls.FIELDS)}, as `python -m launch grid` writes it")
        try:
            return cls(**{field: data[field] for field in cls.FIELDS})
        except TypeError as error:             # e.g. axes that are not lists of numbers
            raise ValueError(f"is not a grid: {error}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"keys": self.keys, "axes": [a.tolist() for a in self.axes],
                                          "values": self.values.tolist(), "metric": self.metric}, indent=1) + "\n")


def replay(grid: Grid, method: str, trajectories: int, budget: int, seed: int = 0,
           directions: np.ndarray | None = None, budgets: tuple[int, ...] | None = None) -> np.ndarray:
    """Objective values of `trajectories` searches of `budget` trials each, shape (trajectories, budget).

    cd: `directions` (default: the identity for other than 2 or 3 keys, else the paper's eq. 9 rows) and
    `budgets` per direction (default 3 each), from a start drawn uniformly in the log box.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r}: choose from {METHODS}")
    runs = []
    for trajectory in range(trajectories):
        rng = np.random.default_rng([seed, trajectory])
        if method == "cd":
            runs.append(replay_coordinate_descent(grid, budget, rng, directions, budgets))
        else:
            runs.append(replay_optuna(grid, method, budget, int(rng.integers(2**31))))
    return np.array(runs)


def default_directions(dimensions: int) -> np.ndarray:
    return PAPER_DIRECTIONS[:dimensions, :dimensions] if dimensions in (2, 3) else np.eye(dimensions)


def replay_coordinate_descent(grid: Grid, budget: int, rng: np.random.Generator, directions: np.ndarray | None,
                              budgets: tuple[int, ...] | None) -> list[float]:
    dimensions = len(grid.axes)
    directions = default_directions(dimensions) if directions is None else np.asarray(directions, dtype=float)
    start = rng.uniform(grid.low, grid.high)
    search = coordinate_descent(grid.objective, start, grid.low, grid.high, directions,
                                budgets or (3,) * len(directions), total=budget)
    values = search.values
    return values + [values[-1]] * (budget - len(values))     # a search stuck in a corner repeats its last trial


def replay_optuna(grid: Grid, sampler: str, budget: int, seed: int) -> list[float]:
    import optuna  # seconds to import: only a replay of its samplers pays for it

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    samplers = {"random": optuna.samplers.RandomSampler, "tpe": optuna.samplers.TPESampler,
                "cmaes": optuna.samplers.CmaEsSampler}
    study = optuna.create_study(direction="maximize", sampler=samplers[sampler](seed=seed))
    names = [f"x{i}" for i in range(len(grid.axes))]

    def objective(trial) -> float:
        point = [np.log(trial.suggest_float(name, float(axis[0]), float(axis[-1]), log=True))
                 for name, axis in zip(names, grid.axes)]
        return grid.objective(point)

    study.optimize(objective, n_trials=budget)
    return [trial.value for trial in study.trials]


def summary(curves: dict[str, np.ndarray], auc_at: tuple[int, ...] = (10, 20)) -> list[dict]:
    """Per method: AUC@k for each k with its standard deviation over the trajectories (`auc@k sd`, n - 1), and
    n-95 (None: not within the budget), from its (trajectories, budget) objective values."""
    per_method = {method: best_so_far_curves(values) for method, values in curves.items()}
    means = {method: per_trajectory.mean(axis=0) for method, per_trajectory in per_method.items()}
    target = 0.95 * max(curve[-1] for curve in means.values())
    rows = []
    for method, per_trajectory in per_method.items():
        row = {"method": method, "trajectories": len(per_trajectory), "budget": per_trajectory.shape[1]}
        for k in auc_at:
            areas = [area_under_curve(curve, k) for curve in per_trajectory]
            row[f"auc@{k}"] = float(np.mean(areas))
            row[f"auc@{k} sd"] = float(np.std(areas, ddof=1)) if len(areas) > 1 else None
        row["n-95"] = trials_to_reach(means[method], target)
        row["final"] = float(means[method][-1])
        rows.append(row)
    return rows


def best_so_far_curves(values: np.ndarray) -> np.ndarray:
    return np.array([best_so_far(run) for run in values])


# ============ Table 2: coordinate descent's directions, budgets and order ============

def ablation(grid: Grid, trajectories: int, budget: int, seed: int = 0) -> list[dict]:
    """The paper's Table 2 settings on this grid: AUC@20 of coordinate descent with the paper's directions A_O
    and budgets (3, 3), the identity A_I (3, 3), A_O (7, 7) and (15, 15), and A_O (3, 3) with the joint direction
    searched first ("rev")."""
    dimensions = len(grid.axes)
    paper = default_directions(dimensions)
    settings = [("A_O (3, 3)", paper, 3), ("A_I (3, 3)", np.eye(dimensions), 3), ("A_O (7, 7)", paper, 7),
                ("A_O (15, 15)", paper, 15), ("A_O (3, 3) rev", paper[[1, 0, *range(2, dimensions)]], 3)]
    rows = []
    for name, directions, per_direction in settings:
        values = replay(grid, "cd", trajectories, budget, seed, directions, (per_direction,) * dimensions)
        rows.append({"setting": name, "auc@20": float(np.mean([area_under_curve(curve, 20)
                                                              for curve in best_so_far_curves(values)]))})
    return rows


# ============ the command: python -m launch hpo-replay ============

def format_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    table = [columns] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in table)


def plot_curves(curves: dict[str, np.ndarray], grid: Grid, out: Path) -> None:
    """Figure 6's form: each method's mean best-so-far curve against the number of trials."""
    import matplotlib  # only the command that draws pays for its import
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method, values in curves.items():
        mean = best_so_far_curves(values).mean(axis=0)
        axes.plot(np.arange(1, len(mean) + 1), mean, label=method)
    axes.axhline(grid.values.max(), color="grey", linestyle=":", label="grid maximum")
    axes.set_xlabel("trials")
    axes.set_ylabel(f"best so far ({grid.metric})")
    axes.set_title(f"mean of {len(next(iter(curves.values())))} searches per method")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def add_arguments(parser) -> None:
    parser.add_argument("--grid", required=True, type=Path, help="a measured grid (JSON: keys, axes, values, metric)")
    parser.add_argument("--methods", default=",".join(METHODS), help="methods to replay (default: %(default)s)")
    parser.add_argument("--trajectories", type=positive_int, default=80,
                        help="searches per method (default: %(default)s)")
    parser.add_argument("--budget", type=number(int, at_least=20), default=50,
                        help="trials per search, at least 20: AUC@20 needs 20 (default: %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the first search (default: %(default)s)")
    parser.add_argument("--ablation", action="store_true", help="also the Table 2 settings of coordinate descent")
    parser.add_argument("--out-dir", type=Path, required=True, help="where replay.json and replay.png go")


def run(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise LaunchError(f"--methods {args.methods!r}: choose from {', '.join(METHODS)}")
    if not args.grid.is_file():
        raise LaunchError(f"--grid {args.grid}: no such file; measure one with `python -m launch grid`")
    try:
        grid = Grid.load(args.grid)
    except ValueError as error:              # not JSON, or not a grid (Grid.load names what is missing)
        raise LaunchError(f"--grid {args.grid}: {error}") from None
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise LaunchError(f"--out-dir {args.out_dir} is a file: pass a directory")
    curves = {}
    for method in methods:
        curves[method] = replay(grid, method, args.trajectories, args.budget, args.seed)
        print(f"replayed {method}: {args.trajectories} searches of {args.budget} trials", flush=True)
    rows = summary(curves)
    print(f"\n{grid.metric} on the grid of {' x '.join(grid.keys)} (maximum {grid.values.max():.3f})")
    print(format_table(rows, ["method", "auc@10", "auc@20", "auc@20 sd", "n-95", "final"]))
    result = {"grid": str(args.grid), "metric": grid.metric, "grid_maximum": float(grid.values.max()),
              "trajectories": args.trajectories, "budget": args.budget, "seed": args.seed, "summary": rows}
    if args.ablation:
        result["ablation"] = ablation(grid, args.trajectories, args.budget, args.seed)
        print("\ncoordinate descent, Table 2's settings")
        print(format_table(result["ablation"], ["setting", "auc@20"]))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "replay.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_curves(curves, grid, args.out_dir / "replay.png")
    print(f"results: {args.out_dir / 'replay.json'}, {args.out_dir / 'replay.png'}")
    return 0
