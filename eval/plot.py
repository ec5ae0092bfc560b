"""`python -m eval plot RUN_DIR... --out FILE.png`: learning curves of pretraining runs from their results.

For every run, the k-NN top-1 (k = --k) of each evaluated export, RUN_DIR/eval/knn_stepNNNNNNN.json (written by
`python -m eval knn`, or by `python -m eval watch` for every checkpoint), against the training step; with
--online, also the online linear probe's running top-1 (`monitor/online_linear_top1` in RUN_DIR/metrics.jsonl,
smoothed over --smooth steps) as a dashed line of the same colour; with --baselines DIR (what `python -m eval
baselines --out-dir DIR` wrote), the raw-pixel and random-init k-NN as horizontal lines. A run is labelled by its
directory name.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from eval.baselines import KNN_K
from eval.features import EvaluationInputError
from eval.results import RESULTS_DIR
from pretrain.runtime.argument_types import positive_int
from pretrain.runtime.exit_status import check_writable

HELP = "plot k-NN accuracy against training step for runs (PNG)"
KNN_RESULT = re.compile(r"knn_step(\d{7})\.json")


def read_result(path: Path, fields: tuple[str, ...], what: str, remedy: str) -> dict:
    """The JSON object of a result file holding `fields`; EvaluationInputError naming the file when it is empty or
    damaged (results are written atomically, so something else touched it)."""
    text = path.read_text(errors="replace")
    try:
        result = json.loads(text)
    except json.JSONDecodeError as error:
        reason = "it is empty" if not text.strip() else f"it is not JSON: {error}"
    else:
        missing = [field for field in fields if not isinstance(result, dict) or field not in result]
        if not missing:
            return result
        reason = f"it has no {', '.join(missing)}"
    raise EvaluationInputError(f"{path} is not {what} ({reason}): {remedy}")


def knn_curve(run_dir: Path, k: int) -> list[tuple[int, float]]:
    """(step, k-NN top-1 at k) of every k-NN result of the run, by step."""
    points = []
    for path in sorted((run_dir / RESULTS_DIR).glob("knn_step*.json")):
        if not KNN_RESULT.fullmatch(path.name):
            continue
        result = read_result(path, ("step", "top1"), "a k-NN result", "delete it; `python -m eval watch --run "
                             f"{run_dir}` then evaluates its export again")
        top1 = result["top1"].get(str(k))
        if top1 is None:
            raise EvaluationInputError(f"{path} has no k-NN result at k={k} (it has k = {', '.join(result['top1'])}): "
                                       f"pass one of those as --k, or rerun `python -m eval knn --ks {k}`")
        points.append((int(result["step"]), float(top1)))
    return sorted(points)


def online_curve(run_dir: Path, smooth: int) -> list[tuple[int, float]]:
    """(step, mean online-probe top-1 over the last `smooth` logged steps) from RUN_DIR/metrics.jsonl."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    values = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:                  # a line torn by a kill: the run rewrites it on resume
            continue
        if "monitor/online_linear_top1" in record:
            values.append((int(record["step"]), float(record["monitor/online_linear_top1"])))
    curve = []
    for i, (step, _) in enumerate(values):
        window = [value for _, value in values[max(0, i - smooth + 1):i + 1]]
        curve.append((step, sum(window) / len(window)))
    return curve


def baseline_knn(baselines_dir: Path, k: int) -> dict[str, float]:
    """{"raw pixels": top-1, "random init": top-1} of BASELINES_DIR/eval/baselines_step0000000.json (k = 20)."""
    path = baselines_dir / RESULTS_DIR / "baselines_step0000000.json"
    if not path.is_file():
        raise EvaluationInputError(f"--baselines {baselines_dir}: no {path}; write it with `python -m eval baselines "
                                   f"--config CONFIG --out-dir {baselines_dir}`")
    if k != KNN_K:
        raise EvaluationInputError(f"--baselines holds k-NN at k = {KNN_K}, and --k is {k}: plot --k {KNN_K}")
    result = read_result(path, ("raw_pixels", "random_init"), "a baselines result",
                         f"write it again with `python -m eval baselines --config CONFIG --out-dir {baselines_dir}`")
    return {"raw pixels": result["raw_pixels"]["knn"], "random init": result["random_init"]["knn"]}


def plot_runs(run_dirs: list[Path], out: Path, k: int = 20, online: bool = False, smooth: int = 50,
              title: str | None = None, baselines: Path | None = None) -> dict[str, list[tuple[int, float]]]:
    """Draw the curves to `out` (PNG); return {run name: k-NN points}. EvaluationInputError for a run without a
    k-NN result (and without online values when `online`), or missing baselines."""
    import matplotlib  # only the command that draws pays for its import

    matplotlib.use("Agg")                             # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 4.5))
    curves = {}
    for index, run_dir in enumerate(run_dirs):
        if not run_dir.is_dir():
            raise EvaluationInputError(f"{run_dir} is not a run directory")
        points = knn_curve(run_dir, k)
        online_points = online_curve(run_dir, smooth) if online else []
        if not points and not online_points:
            raise EvaluationInputError(f"{run_dir} has no k-NN result ({run_dir / RESULTS_DIR}/knn_step*.json): run "
                                       f"`python -m eval watch --run {run_dir}` (every checkpoint) or `python -m eval "
                                       f"knn --run {run_dir}` (the last) first")
        colour = f"C{index % 10}"
        if points:
            axes.plot([s for s, _ in points], [100 * v for _, v in points], "o-", color=colour, label=run_dir.name)
        if online_points:
            axes.plot([s for s, _ in online_points], [100 * v for _, v in online_points], "--", color=colour,
                      alpha=0.6, label=f"{run_dir.name} (online probe, train batches)")
        curves[run_dir.name] = points
    anchors = baseline_knn(baselines, k) if baselines else {}
    for (name, top1), style in zip(anchors.items(), (":", "-.")):
        axes.axhline(100 * top1, color="black", linestyle=style, linewidth=1, label=f"{name} ({100 * top1:.2f}%)")
    if anchors:                                       # axhline does not widen the autoscaled range
        low, high = axes.get_ylim()
        axes.set_ylim(low, max(high, 100 * max(anchors.values()) + 1))
    axes.set_xlabel("training step")
    axes.set_ylabel(f"top-1, %: k-NN (k = {k})" + (", online probe dashed" if online else ""))
    axes.set_title(title or "k-NN accuracy during pretraining")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))     # beside the curves, not on them
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return curves


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="pretraining run directories")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write (e.g. docs/knn_curves.png)")
    parser.add_argument("--k", type=positive_int, default=20, help="the k-NN result's k to plot (default: %(default)s)")
    parser.add_argument("--online", action="store_true",
                        help="also draw the online linear probe's running top-1 (monitor/online_linear_top1)")
    parser.add_argument("--smooth", type=positive_int, default=50,
                        help="steps the online probe's top-1 is averaged over (default: %(default)s)")
    parser.add_argument("--title", help="the figure's title (default: k-NN accuracy during pretraining)")
    parser.add_argument("--baselines", type=Path, metavar="DIR",
                        help="draw the raw-pixel and random-init k-NN of `python -m eval baselines --out-dir DIR`")


def run(args) -> int:
    if args.out.is_dir() or args.out.suffix.lower() != ".png":
        raise EvaluationInputError(f"--out {args.out} must be a .png file (e.g. {args.out.with_suffix('.png').name} "
                                   "or docs/knn_curves.png)")
    check_writable(args.out.parent)
    curves = plot_runs(args.runs, args.out, args.k, args.online, args.smooth, args.title, args.baselines)
    for name, points in curves.items():
        last = f"{100 * points[-1][1]:.2f}% at step {points[-1][0]}" if points else "no k-NN result"
        print(f"{name}: {len(points)} k-NN point(s), last {last}")
    print(f"wrote {args.out}")
    return 0
