"""What a benchmark measured: each (row, seed) read back from its run directory once complete (`read_run`: a
pretraining run's k-NN and linear probe at every mark, a supervised run's classifier top-1 after every epoch, a
reference's raw-pixel, random-init and standardised-pixel rows), the machine's state while it trained, the share of its
schedule it trained and the compute it counted (`schedule_trained`), and the code that trained it (`row_code_states`),
and the rows summarised into the table (Markdown and JSON: each row's mean, std and 95% t interval over its seeds, the
paired differences the file asks for, eval/statistics.py; the runs whose schedule was cut or ended before the budget,
flagged: `schedule_flags`; what hard view selection chose). launch/benchmark_table.py shows them: table.md and the
plots."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from eval.results import result_path
from eval.statistics import paired_difference, summary_record
from eval.training_code import read_code_states
from launch.benchmark_file import Row
from launch.trials import read_lines
from pretrain.runtime.compute_budget import PFLOP, read_schedule
from pretrain.runtime.provenance import CodeState

FINAL = 1 << 30                 # the key of a run's last point, whatever mark, step or epoch it fell on
# A run that trained less of its schedule than this, or (minutes budget) ended it before this share of the minutes, is
# flagged: its result is not its recipe's at the budget (an lr not yet decayed, or minutes not spent).
FLAGGED_BELOW = 0.95
# A reference's rows: `python -m eval baselines`' encoders and their labels. Standardised pixels are scored by scikit-
# learn's tuned k-NN and logistic regression (eval/standardised_pixels.py), not k = 20 and the probe: the label says so.
# A result written before they existed has no such row, and its table shows the other two.
REFERENCE_ROWS = (("raw_pixels", "raw pixels"), ("random_init", "random init"),
                  ("standardised_pixels", "standardised pixels (scikit-learn: tuned k-NN, logistic regression)"))


@dataclass
class Run:
    """What one (row, seed) measured: its points (minutes of training, accuracy), its last one, its machine and how
    much of its schedule it trained (`schedule_trained`)."""

    seed: int
    run_dir: str
    points: list[dict]                   # {key, step, minutes, knn, linear}, by minutes
    machine: dict = field(default_factory=dict)
    schedule: dict = field(default_factory=dict)    # {schedule_steps, steps, pflop}; {}: not recorded
    selection: dict = field(default_factory=dict)   # hard view selection's scalars, means over the logged steps

    @property
    def final(self) -> dict:
        return self.points[-1]


def machine_state(lines: list[dict]) -> dict:
    """Cores, torch threads and the 1-minute load average while the run trained (every logged step's)."""
    def values(key):
        return [line[key] for line in lines if key in line]

    loads = values("perf/load_average_1min")
    return {"cores": max(values("perf/cpu_cores"), default=None), "threads": max(values("perf/cpu_threads"), default=None),
            "load_median": round(float(np.median(loads)), 2) if loads else None,
            "load_max": round(float(max(loads)), 2) if loads else None}


def schedule_trained(run_dir: Path, steps: int) -> dict:
    """The schedule's steps (RUN_DIR/schedule.json, pretrain/runtime/compute_budget.py), the `steps` the run trained,
    and the PFLOP they counted (None: a run without a compute budget counts none); {} for a run without the record
    (trained before it was written)."""
    record = read_schedule(run_dir)
    if record is None:
        return {}
    flops = record.get("flops_per_step")
    return {"schedule_steps": record["schedule_steps"], "steps": steps,
            "pflop": None if flops is None else steps * flops["total"] / PFLOP}


# Hard view selection's scalars (pretrain/hvs.py: selection_stats) that the table's "chosen views" section shows
SELECTION_SCALARS = ("selected_loss", "mean_pair_loss", "selected_iou", "mean_pair_iou", "selected_scale",
                     "mean_pair_scale", "lowest_iou_chosen_frac")


def selection_means(lines: list[dict]) -> dict:
    """Each of SELECTION_SCALARS averaged over the run's logged steps that have it ({} for a run without selection):
    what the selection chose over the whole run, not at one step."""
    means = {}
    for name in SELECTION_SCALARS:
        values = [line[f"hvs/{name}"] for line in lines if f"hvs/{name}" in line]
        if values:
            means[name] = float(np.mean(values))
    return means


def schedule_flags(row: Row, run: Run) -> list[str]:
    """Why a run's final is not its recipe's at the budget, one line each: its schedule cut before FLAGGED_BELOW of its
    steps (a minutes budget or engine.max_steps stopped it with the lr not decayed), or, under a minutes budget, a
    schedule that ended before FLAGGED_BELOW of the minutes (the budget not spent)."""
    flags, schedule, minutes = [], run.schedule, run.final["minutes"]
    if schedule and schedule["steps"] < FLAGGED_BELOW * schedule["schedule_steps"]:
        flags.append(f"seed {run.seed}: cut at {100 * schedule['steps'] / schedule['schedule_steps']:.0f}% of its "
                     f"schedule ({schedule['steps']} of {schedule['schedule_steps']} steps)")
    if row.minutes is not None and minutes < FLAGGED_BELOW * row.minutes:
        flags.append(f"seed {run.seed}: its schedule ended after {minutes:.2f} of the budget's {row.minutes:g} "
                     "minutes")
    return flags


def mark_keys(row: Row, points: list[dict]) -> None:
    """Key every point but the last by the mark it stands for, so that the seeds' curves are averaged mark by mark:
    a minutes budget's mark i is the first point at or past i x minutes / marks (the loop checkpoints there), a
    steps or compute budget's its step (a compute budget buys every seed the same steps), a supervised run's its
    epoch; the last point is FINAL. Others (a checkpoint a signal added) keep no key: they are in the run's points,
    not in the row's curve."""
    by_step = row.steps is not None or row.pflop is not None
    for point in points[:-1]:
        point["key"] = point.get("epoch") if row.kind == "supervised" else point["step"] if by_step else None
    if row.kind == "pretrain" and row.minutes is not None:
        for mark in range(1, row.marks):
            first = next((p for p in points[:-1] if p["minutes"] >= mark * row.minutes / row.marks - 1e-9), None)
            if first is not None and first["key"] is None:
                first["key"] = mark
    points[-1]["key"] = FINAL
    for point in points:
        point.pop("epoch", None)


def read_pretraining(row: Row, seed: int, run_dir: Path) -> Run | None:
    """A finished pretraining run whose every export is scored by k-NN and the linear probe, else None."""
    from eval.watch import pending    # eval brings timm and deepspeed: imported when a run is read back

    finished = run_dir / "finished.json"
    if not finished.is_file() or pending(run_dir, ["knn", "linear"]) != ([], []):
        return None
    every_line = read_lines(run_dir / "metrics.jsonl")
    lines = [line for line in every_line if "perf/training_seconds" in line]
    steps = sorted(int(path.stem.rsplit("_step", 1)[1]) for path in (run_dir / "eval").glob("knn_step*.json"))
    steps = [step for step in steps if result_path(run_dir, "linear", step).is_file()]
    if not lines or not steps or steps[-1] != json.loads(finished.read_text())["step"]:
        return None
    logged = [line["step"] for line in lines]
    seconds = [line["perf/training_seconds"] for line in lines]
    record = read_schedule(run_dir) or {}
    flops = (record.get("flops_per_step") or {}).get("total")              # counted: a compute budget's runs
    points = []
    for step in steps:
        knn = json.loads(result_path(run_dir, "knn", step).read_text())["top1"]["20"]
        linear = json.loads(result_path(run_dir, "linear", step).read_text())["top1"]
        points.append({"step": step, "minutes": float(np.interp(step, logged, seconds)) / 60, "knn": knn,
                       "linear": linear, **({"pflop": step * flops / PFLOP} if flops else {})})
    mark_keys(row, points)
    return Run(seed, str(run_dir), points, machine_state(lines), schedule_trained(run_dir, steps[-1]),
               selection_means(every_line))


def read_supervised(row: Row, seed: int, run_dir: Path) -> Run | None:
    """A finished cross-entropy run: its classifier's validation top-1 after every epoch and at the budget."""
    if not list((run_dir / "eval").glob("finetune_*_random_step*.json")):
        return None
    runs = [path.parent for path in (run_dir / "finetune").glob("*/metrics.jsonl")]
    if len(runs) != 1:
        return None
    lines = read_lines(runs[0] / "metrics.jsonl")
    points = [{"step": line["step"], "epoch": line["epoch"], "minutes": line["perf/training_seconds"] / 60,
               "knn": None, "linear": line["val/top1"]} for line in lines if "val/top1" in line]
    if not points:
        return None
    mark_keys(row, points)
    return Run(seed, str(run_dir), points, machine_state(lines), schedule_trained(runs[0], lines[-1]["step"]))


def read_reference(row: Row, seed: int, run_dir: Path) -> dict | None:
    path = result_path(run_dir, "baselines", 0)
    return json.loads(path.read_text()) if path.is_file() else None


def read_run(row: Row, seed: int, run_dir: Path):
    reader = {"pretrain": read_pretraining, "supervised": read_supervised, "reference": read_reference}[row.kind]
    return reader(row, seed, run_dir)


def row_code_states(row: Row, run_dirs: list[Path]) -> list[CodeState]:
    """The code that trained the row's runs (their provenance.json): a supervised run's fine-tuning, in
    RUN_DIR/finetune/NAME, beside the one pretraining step that sized its network."""
    if row.kind == "supervised":
        run_dirs = [folder for run_dir in run_dirs for folder in
                    (run_dir, *sorted(path.parent for path in (run_dir / "finetune").glob("*/metrics.jsonl")))]
    return read_code_states(run_dirs)


# ============ the table, its JSON and the plot ============

def spread(values: list[float]) -> dict:
    """Accuracies over seeds in percent: mean, standard deviation (n - 1), 95% t interval of the mean (both None for
    one seed), n and the values (eval/statistics.py: `summary_record`)."""
    return summary_record([100 * float(value) for value in values])


def row_curve(runs: list[Run], measure: str) -> list[dict]:
    """The row's curve: at every key all its seeds have, the mean minutes and the mean and std of `measure`."""
    keys = set.intersection(*({p["key"] for p in run.points if p["key"] is not None} for run in runs))
    curve = []
    for key in sorted(keys):
        points = [next(p for p in run.points if p["key"] == key) for run in runs]
        if points[0][measure] is None:
            continue
        counted = [p["pflop"] for p in points if "pflop" in p]
        curve.append({"minutes": round(float(np.mean([p["minutes"] for p in points])), 3),
                      **({"pflop": float(f"{np.mean(counted):.6g}")} if len(counted) == len(points) else {}),
                      **spread([p[measure] for p in points])})
    return curve


def summarise(row: Row, results: list) -> list[dict]:
    """The table's rows of one benchmark row (a reference gives three: raw pixels, random init, standardised pixels;
    two from results written before the third existed)."""
    if row.kind == "reference":
        return [{"row": row.name, "label": f"{title}, {row.label}", "kind": encoder, "budget": "-",
                 "seeds": list(row.seeds), "knn": spread([r[encoder]["knn"] for r in results]),
                 "linear": spread([r[encoder]["linear"] for r in results])}
                for encoder, title in REFERENCE_ROWS if all(encoder in r for r in results)]
    finals = [run.final for run in results]
    machines = [run.machine for run in results]
    counted = [run.schedule["pflop"] for run in results if run.schedule.get("pflop") is not None]
    summary = {"row": row.name, "label": row.label + (" (classifier top-1)" if row.kind == "supervised" else ""),
               "kind": row.kind, "budget": row.budget(), "seeds": list(row.seeds),
               "knn": spread([p["knn"] for p in finals]) if row.kind == "pretrain" else None,
               "linear": spread([p["linear"] for p in finals]),
               "minutes": round(float(np.mean([p["minutes"] for p in finals])), 2),
               "steps": [p["step"] for p in finals],
               "pflop": float(f"{np.mean(counted):.6g}") if len(counted) == len(results) else None,
               "schedule_share": [round(run.schedule["steps"] / run.schedule["schedule_steps"], 4) if run.schedule
                                  else None for run in results],
               "flags": [flag for run in results for flag in schedule_flags(row, run)],
               "cores": max((m["cores"] for m in machines if m["cores"]), default=None),
               "threads": max((m["threads"] for m in machines if m["threads"]), default=None),
               "load_median": max((m["load_median"] for m in machines if m["load_median"] is not None), default=None),
               "load_max": max((m["load_max"] for m in machines if m["load_max"] is not None), default=None),
               "curve": {measure: row_curve(results, measure) for measure in ("knn", "linear")},
               "selection": selection_summary(results),
               "runs": [asdict(run) for run in results]}
    return [summary]


def selection_summary(runs: list[Run]) -> dict:
    """The chosen views of a row with hard view selection: each scalar's run means (`selection_means`), then their
    mean and std over the seeds ({} for a row without selection, or with seeds that logged different scalars)."""
    names = set.intersection(*(set(run.selection) for run in runs)) if runs else set()
    summary = {}
    for name in SELECTION_SCALARS:
        if name in names:
            values = [run.selection[name] for run in runs]
            summary[name] = {"mean": round(float(np.mean(values)), 4),
                             "std": round(float(np.std(values, ddof=1)), 4) if len(values) > 1 else None}
    return summary


def paired_differences(entries: list[dict], comparisons: Iterable[tuple[str, str]]) -> list[dict]:
    """Each (row, baseline row) comparison's paired difference at the end of the budget, row minus baseline in points
    of top-1, per measure (k-NN, linear) over the seeds both finished: mean, 95% t interval, the paired t-test's
    two-sided p-value (eval/statistics.py: `paired_difference`), or what kept it from being computed."""
    by_row = {entry["row"]: entry for entry in entries if entry["kind"] in ("pretrain", "supervised")}
    results = []
    for row, baseline in comparisons:
        found = [by_row.get(row), by_row.get(baseline)]
        comparison = {"row": row, "baseline": baseline,
                      "labels": [entry["label"] if entry else name for entry, name in zip(found, (row, baseline))],
                      "measures": []}
        results.append(comparison)
        if None in found:
            missing = [name for entry, name in zip(found, (row, baseline)) if entry is None]
            comparison["error"] = f"no finished run of {' and '.join(missing)} in this table"
            continue
        for measure in ("knn", "linear"):
            if found[0][measure] is None or found[1][measure] is None:
                continue                                     # a supervised row has no k-NN
            values = [{run["seed"]: 100 * run["points"][-1][measure] for run in entry["runs"]} for entry in found]
            try:
                paired = paired_difference(*values)
            except ValueError as error:
                comparison["measures"].append({"measure": measure, "error": str(error)})
                continue
            comparison["measures"].append({**difference_record(paired), "measure": measure,
                                           "marks": marks_differences(found, measure)})
    return results


def difference_record(paired) -> dict:
    return {"seeds": list(paired.seeds), "n": paired.n, "difference": round(paired.mean, 2),
            "ci95": [round(bound, 2) for bound in paired.interval],
            "p_value": None if paired.p_value is None else float(f"{paired.p_value:.3g}"), "note": paired.note}


def marks_differences(found: list[dict], measure: str) -> list[dict]:
    """The paired difference at every mark both rows have, mark by mark: the i-th keyed point of each run (the marks
    split a budget evenly, so the i-th mark of two rows at the same budget is the same share of it: of its counted
    compute, its minutes or its steps), the last one the budget's end. A mark with fewer than 2 common seeds, or
    without the measure, is left out."""
    def by_mark(entry: dict) -> list[dict[int, float]]:
        marks: list[dict[int, float]] = []
        for run in entry["runs"]:
            keyed = [p for p in run["points"] if p.get("key") is not None]
            for index, point in enumerate(keyed):
                if index == len(marks):
                    marks.append({})
                if point[measure] is not None:
                    marks[index][run["seed"]] = 100 * point[measure]
        return marks

    row, baseline = by_mark(found[0]), by_mark(found[1])
    results = []
    for index in range(min(len(row), len(baseline))):
        try:
            paired = paired_difference(row[index], baseline[index])
        except ValueError:
            continue
        results.append({"mark": index + 1, **difference_record(paired)})
    return results
