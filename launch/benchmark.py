"""`python -m launch benchmark FILE --out-dir DIR`: a results table (Markdown and JSON) and its plot of accuracy against
minutes of training, made by one command from a benchmark file; every (row, seed) is a `launch` job.

A benchmark file (YAML, configs/benchmarks/*.yaml) lists the rows of the table:

    name: digits
    references:                    # raw pixels and the random-init encoder (python -m eval baselines)
      config: configs/pretrain/simclr_digits.yaml
      image_sizes: [16, 32]        # each at these sides
      seeds: [0]
    rows:
      - name: simclr_hvs           # a pretraining run per seed, evaluated at each mark
        label: SimCLR + HVS        # in the table and the plot (default: the name)
        config: configs/pretrain/simclr_digits.yaml
        overrides: [hvs.enabled=true, optim.epochs=12]
        seeds: [0, 1, 2]
        minutes: 1.5               # of training (engine.max_minutes), or steps: N (engine.max_steps)
        marks: 6                   # evaluations along the run, evenly spaced (at least 6)
      - name: cross_entropy        # the config's network trained with cross-entropy on every label, from random init
        config: configs/pretrain/simclr_digits.yaml      # the network and the data (overrides: of this config)
        supervised: configs/transfer/finetune_digits.yaml
        supervised_overrides: [data.label_fraction=100%, optim.epochs=40]
        seeds: [0]
        minutes: 2
        marks: 6

Each (row, seed) is one job (`--cluster local` or Slurm, `--parallel K` at once; a Slurm job array) in
DIR/rows/NAME_seedS:
- a pretraining row: `python -m pretrain --config CONFIG engine.max_minutes=M engine.checkpoint_every_minutes=M/marks
  engine.checkpoint_every_steps=0 OVERRIDES seed=S` (a step budget: engine.max_steps=N
  engine.checkpoint_every_steps=N/marks), whose checkpoints are the marks and the last step, each with its export;
  then `python -m eval watch --run RUN --protocols knn,linear`: every export scored by k-NN (k = 20) and the
  linear probe, the existing evaluation;
- a supervised row: one pretraining step of CONFIG, whose export tells `python -m transfer finetune --from random`
  the network and the data (its weights are discarded), then the fine-tuning itself with the budget, scored on
  the validation set after every epoch and at the budget;
- a reference: `python -m eval baselines --config CONFIG --image-size N seed=S`.

Started again with the same command, a finished (row, seed) is read back, one whose job still runs is waited
for, and one that was killed is submitted again and resumes from its checkpoint: the training loop keeps its
clock in the checkpoint, so a resumed row trains the rest of its minutes. DIR/benchmark.json keeps the rows;
a row of the same name with other settings is refused (its runs would mean something else).

Written to DIR: table.md (also printed), table.json (every run's points, the rows' curves and finals, the machine
state) and curves.png (k-NN and linear against minutes of training, one line per row: the mean over seeds, the
band one standard deviation; the references as horizontal lines). The machine's state of each row is read from
its runs' metrics.jsonl (cores, torch threads, the 1-minute load average at every logged step): a load above
the cores says another process shared the machine, and the row's minutes bought less training. The table
names the command and the commit (git rev-parse HEAD) that made it.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import yaml

from launch.cluster import LaunchError
from launch.hpo import TrialJobs
from launch.jobs import Step
from pretrain.runtime.argument_types import output_folder, positive_int

MIN_MARKS = 6                   # the "enough points to see the shape"
ROW_KEYS = ("name", "label", "config", "overrides", "seeds", "minutes", "steps", "marks", "supervised",
            "supervised_overrides")
REFERENCE_KEYS = ("config", "overrides", "image_sizes", "seeds")
FINAL = 1 << 30                 # the key of a run's last point, whatever mark, step or epoch it fell on


# ============ the benchmark file ============

@dataclass(frozen=True)
class Row:
    """One row of the table: a pretraining run, a supervised (cross-entropy) run or a reference per seed."""

    name: str
    label: str
    kind: str                            # pretrain | supervised | reference
    config: str                          # the pretraining config (resolved path): network, data, preprocessing
    overrides: tuple[str, ...] = ()      # of the config
    seeds: tuple[int, ...] = (0,)
    minutes: float | None = None         # the budget: minutes of training, or
    steps: int | None = None             # optimizer steps
    marks: int = MIN_MARKS
    recipe: str | None = None            # a supervised row's fine-tuning recipe (resolved path)
    recipe_overrides: tuple[str, ...] = ()
    image_size: int | None = None        # a reference's evaluation side

    def run_name(self, seed: int) -> str:
        return f"{self.name}_seed{seed}"

    def budget(self) -> str:
        if self.minutes is not None:
            return f"{self.minutes:g} min, {self.marks} marks"
        if self.steps is not None:
            return f"{self.steps} steps, {self.marks} marks"
        return "-"

    def budget_overrides(self) -> list[str]:
        """The training's engine keys for the budget: it stops there, and checkpoints (and exports) at each mark."""
        if self.minutes is not None:
            return [f"engine.max_minutes={self.minutes:g}",
                    f"engine.checkpoint_every_minutes={self.minutes / self.marks:.12g}", "engine.checkpoint_every_steps=0"]
        return [f"engine.max_steps={self.steps}", f"engine.checkpoint_every_steps={max(1, self.steps // self.marks)}"]

    def job_steps(self, seed: int, run_dir: Path) -> list[Step]:
        """The stage command lines of the (row, seed)'s job."""
        config = ["--config", self.config]
        if self.kind == "reference":
            return [Step("eval", ["baselines", *config, "--out-dir", str(run_dir), "--image-size", str(self.image_size),
                                  *self.overrides, f"seed={seed}"], distributed=False)]
        named = [f"name={run_dir.name}", f"run_dir={run_dir}"]
        if self.kind == "supervised":
            # one step of the pretraining config: its export tells fine-tuning the network and the data
            network = Step("pretrain", [*config, *self.overrides, "engine.max_steps=1", "engine.checkpoint_every_steps=0",
                                        "engine.image_grid_every_steps=0", *named])
            return [network, Step("transfer", ["finetune", "--run", str(run_dir), "--config", self.recipe, "--from",
                                               "random", *self.budget_overrides(), *self.recipe_overrides,
                                               f"seed={seed}"])]
        return [Step("pretrain", [*config, *self.budget_overrides(), "engine.keep_exports=0", *self.overrides,
                                  f"seed={seed}", *named]),
                Step("eval", ["watch", "--run", str(run_dir), "--protocols", "knn,linear", "--poll-seconds", "1"],
                     distributed=False)]

    def settings(self) -> dict:
        """What a resumed benchmark must find unchanged for the row's runs to stand (its seeds may grow, its label
        change)."""
        return {key: value for key, value in asdict(self).items() if key not in ("seeds", "label")}


def check_keys(where: str, entry: dict, known: tuple[str, ...]) -> None:
    for key in entry:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the keys are {', '.join(known)}"
            raise LaunchError(f"{where}: unknown key {key!r}{hint}")


def existing_file(where: str, key: str, value) -> str:
    """A path the file names, resolved against the current directory, as every command reads its paths."""
    if not isinstance(value, str) or not Path(value).is_file():
        raise LaunchError(f"{where}: {key} {value!r} is not a file (paths are relative to the current directory: run "
                          "from the repository's root)")
    return str(Path(value).resolve())


def string_list(where: str, key: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) and "=" in item for item in value):
        raise LaunchError(f"{where}: {key} {value!r} must be a list of key=value overrides, e.g. [optim.epochs=8]")
    return tuple(value)


def seed_list(where: str, value) -> tuple[int, ...]:
    if value is None:
        return (0,)
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                            for s in value) or len(set(value)) != len(value):
        raise LaunchError(f"{where}: seeds {value!r} must be a list of distinct integers >= 0, e.g. [0, 1, 2]")
    return tuple(value)


def check_loads(where: str, load, *args) -> None:
    """Load a config as its job will, so that a bad key or value is named now, not in a job's log."""
    try:
        load(*args)
    except (ValueError, FileNotFoundError) as error:
        raise LaunchError(f"{where}: {error}") from None


def check_data(file: str, row: Row) -> None:
    """The row's data exist (every job of the row would fail on a missing .beton): checked before running, not when
    the file is read, so that a file can be checked where its data are not."""
    from pretrain.config import load_config

    cfg = load_config(row.config, list(row.overrides))
    for split in ("train", "val"):
        if not Path(cfg.data[split]).exists():
            raise LaunchError(f"{file}: row {row.name}: data.{split}={cfg.data[split]} does not exist: write it with "
                              f"`python -m pretrain.data` (see its --help), or set data.{split} in the row's overrides")


def parse_row(where: str, entry) -> Row:
    from pretrain.config import load_config
    from transfer.finetune.config import load_finetune_config

    if not isinstance(entry, dict):
        raise LaunchError(f"{where} must be a mapping with name, config, seeds, minutes or steps, marks")
    name = entry.get("name")
    if not isinstance(name, str) or not name or "/" in name or name.strip(".") == "" or name != name.strip():
        raise LaunchError(f"{where}: name {name!r} must be a folder name (letters, digits, '_', '-')")
    where = f"{where} ({name})"
    check_keys(where, entry, ROW_KEYS)
    budgets = [key for key in ("minutes", "steps") if entry.get(key) is not None]
    if len(budgets) != 1:
        raise LaunchError(f"{where}: give one budget, minutes: M (of training) or steps: N, not "
                          f"{' and '.join(budgets) or 'none'}")
    minutes, steps = entry.get("minutes"), entry.get("steps")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                or not 0 < minutes < math.inf):
        raise LaunchError(f"{where}: minutes {minutes!r} must be a positive number (minutes of training)")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise LaunchError(f"{where}: steps {steps!r} must be a positive integer (optimizer steps)")
    marks = entry.get("marks", MIN_MARKS)
    if isinstance(marks, bool) or not isinstance(marks, int) or marks < MIN_MARKS or (steps and marks > steps):
        raise LaunchError(f"{where}: marks {marks!r} must be an integer >= {MIN_MARKS} (evaluations along the run: the "
                          "curve's points)" + (f" and at most steps ({steps})" if steps else ""))
    config = existing_file(where, "config", entry.get("config"))
    overrides = string_list(where, "overrides", entry.get("overrides"))
    row = Row(name=name, label=str(entry.get("label") or name), kind="pretrain", config=config, overrides=overrides,
              seeds=seed_list(where, entry.get("seeds")), minutes=None if minutes is None else float(minutes),
              steps=steps, marks=marks)
    if entry.get("supervised") is not None:
        row = Row(**{**asdict(row), "kind": "supervised",
                     "recipe": existing_file(where, "supervised", entry["supervised"]),
                     "recipe_overrides": string_list(where, "supervised_overrides", entry.get("supervised_overrides"))})
        check_loads(where, load_config, config, list(overrides))
        check_loads(where, load_finetune_config, row.recipe, [*row.budget_overrides(), *row.recipe_overrides])
    elif entry.get("supervised_overrides") is not None:
        raise LaunchError(f"{where}: supervised_overrides without supervised: RECIPE")
    else:
        check_loads(where, load_config, config, [*row.budget_overrides(), *overrides])
    return row


def parse_references(where: str, entry) -> list[Row]:
    from pretrain.config import load_config

    if entry is None:
        return []
    if not isinstance(entry, dict):
        raise LaunchError(f"{where} must be a mapping: config, image_sizes, seeds")
    check_keys(where, entry, REFERENCE_KEYS)
    config = existing_file(where, "config", entry.get("config"))
    overrides = string_list(where, "overrides", entry.get("overrides"))
    sizes = entry.get("image_sizes")
    if not isinstance(sizes, list) or not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                                            for s in sizes):
        raise LaunchError(f"{where}: image_sizes {sizes!r} must be a list of positive integers (pixels), e.g. [16, 28]")
    check_loads(where, load_config, config, list(overrides))
    seeds = seed_list(where, entry.get("seeds"))
    return [Row(name=f"references_{size}px", label=f"{size} px", kind="reference", config=config, overrides=overrides,
                seeds=seeds, image_size=size) for size in sizes]


def load_benchmark(path: str) -> list[Row]:
    """The rows of a benchmark file, every value checked (a LaunchError names the file, the row and the value)."""
    file = Path(path)
    if not file.is_file():
        raise LaunchError(f"{path}: no such benchmark file (configs/benchmarks/ holds the shipped ones)")
    try:
        content = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise LaunchError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(content, dict) or not isinstance(content.get("rows"), list) or not content["rows"]:
        raise LaunchError(f"{path} must be a mapping with a non-empty list `rows` (see configs/benchmarks/digits.yaml)")
    check_keys(str(path), content, ("name", "references", "rows"))
    rows = [*parse_references(f"{path}: references", content.get("references")),
            *(parse_row(f"{path}: rows[{index}]", entry) for index, entry in enumerate(content["rows"]))]
    names = [row.name for row in rows]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise LaunchError(f"{path}: two rows are named {', '.join(twice)}: each row needs its own name (its folder)")
    return rows


def check_same_benchmark(out_dir: Path, rows: list[Row]) -> None:
    """A benchmark directory holds one benchmark's runs: a row found again under its name must have the settings it
    ran with (new rows and new seeds are welcome); only then is DIR/benchmark.json written."""
    saved_path = out_dir / "benchmark.json"
    saved = json.loads(saved_path.read_text())["rows"] if saved_path.is_file() else {}
    for row in rows:
        before = saved.get(row.name)
        if before is not None and before != json.loads(json.dumps(row.settings())):
            changed = [key for key in row.settings() if before.get(key) != json.loads(json.dumps(row.settings()[key]))]
            raise LaunchError(f"{out_dir} holds row {row.name} with other settings ({', '.join(changed)}: "
                              f"{', '.join(repr(before.get(key)) for key in changed)} there): pass another --out-dir, "
                              "or give the row another name")
    saved.update({row.name: row.settings() for row in rows})
    out_dir.mkdir(parents=True, exist_ok=True)
    saved_path.write_text(json.dumps({"rows": saved}, indent=1) + "\n")


# ============ reading a finished (row, seed) back ============

@dataclass
class Run:
    """What one (row, seed) measured: its points (minutes of training, accuracy), its last one and its machine."""

    seed: int
    run_dir: str
    points: list[dict]                   # {key, step, minutes, knn, linear}, by minutes
    machine: dict = field(default_factory=dict)

    @property
    def final(self) -> dict:
        return self.points[-1]


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def machine_state(lines: list[dict]) -> dict:
    """Cores, torch threads and the 1-minute load average while the run trained (every logged step's)."""
    def values(key):
        return [line[key] for line in lines if key in line]

    loads = values("perf/load_average_1min")
    return {"cores": max(values("perf/cpu_cores"), default=None), "threads": max(values("perf/cpu_threads"), default=None),
            "load_median": round(float(np.median(loads)), 2) if loads else None,
            "load_max": round(float(max(loads)), 2) if loads else None}


def mark_keys(row: Row, points: list[dict]) -> None:
    """Key every point but the last by the mark it stands for, so that the seeds' curves are averaged mark by mark:
    a minutes budget's mark i is the first point at or past i x minutes / marks (the loop checkpoints there), a
    steps budget's its step, a supervised run's its epoch; the last point is FINAL. Others (a checkpoint a signal
    added) keep no key: they are in the run's points, not in the row's curve."""
    for point in points[:-1]:
        point["key"] = point.get("epoch") if row.kind == "supervised" else point["step"] if row.steps else None
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
    from eval.results import result_path
    from eval.watch import pending

    finished = run_dir / "finished.json"
    if not finished.is_file() or pending(run_dir, ["knn", "linear"]) != ([], []):
        return None
    lines = [line for line in read_lines(run_dir / "metrics.jsonl") if "perf/training_seconds" in line]
    steps = sorted(int(path.stem.rsplit("_step", 1)[1]) for path in (run_dir / "eval").glob("knn_step*.json"))
    steps = [step for step in steps if result_path(run_dir, "linear", step).is_file()]
    if not lines or not steps or steps[-1] != json.loads(finished.read_text())["step"]:
        return None
    logged = [line["step"] for line in lines]
    seconds = [line["perf/training_seconds"] for line in lines]
    points = []
    for step in steps:
        knn = json.loads(result_path(run_dir, "knn", step).read_text())["top1"]["20"]
        linear = json.loads(result_path(run_dir, "linear", step).read_text())["top1"]
        points.append({"step": step, "minutes": float(np.interp(step, logged, seconds)) / 60, "knn": knn,
                       "linear": linear})
    mark_keys(row, points)
    return Run(seed, str(run_dir), points, machine_state(lines))


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
    return Run(seed, str(run_dir), points, machine_state(lines))


def read_reference(row: Row, seed: int, run_dir: Path) -> dict | None:
    from eval.results import result_path

    path = result_path(run_dir, "baselines", 0)
    return json.loads(path.read_text()) if path.is_file() else None


def read_run(row: Row, seed: int, run_dir: Path):
    reader = {"pretrain": read_pretraining, "supervised": read_supervised, "reference": read_reference}[row.kind]
    return reader(row, seed, run_dir)


@dataclass
class RowResults:
    """What TrialJobs asks of an objective: `read(run_dir)` is None until the (row, seed) is complete, else its
    headline value (final k-NN; a supervised row's top-1; a reference's random-init k-NN)."""

    runs: dict[Path, tuple[Row, int]]
    protocol: ClassVar[str] = "final"
    field: ClassVar[str] = "accuracy"

    def read(self, run_dir: Path) -> float | None:
        row, seed = self.runs[run_dir]
        result = read_run(row, seed, run_dir)
        if result is None:
            return None
        if row.kind == "reference":
            return result["random_init"]["knn"]
        return result.final["knn"] if row.kind == "pretrain" else result.final["linear"]


@dataclass
class BenchmarkJobs(TrialJobs):
    """The (row, seed) jobs, run as a search's trials are (launch/hpo.py: at most `parallel` at once, a finished
    one read back, a running one waited for, a killed one submitted again), each in DIR/rows/NAME_seedS."""

    plans: dict[str, list[Step]] = field(default_factory=dict)
    kind: ClassVar[str] = "row"

    def run_dir(self, name: str) -> Path:
        return self.search_dir / "rows" / name

    def steps(self, name: str, trial_overrides: list[str]) -> list[Step]:
        return self.plans[name]


# ============ the table, its JSON and the plot ============

def spread(values: list[float]) -> dict:
    """Mean and standard deviation (n - 1; 0 for one value) of accuracies, in percent."""
    percent = [100 * value for value in values]
    return {"mean": round(float(np.mean(percent)), 2),
            "std": round(float(np.std(percent, ddof=1)), 2) if len(percent) > 1 else 0.0,
            "values": [round(value, 2) for value in percent]}


def row_curve(runs: list[Run], measure: str) -> list[dict]:
    """The row's curve: at every key all its seeds have, the mean minutes and the mean and std of `measure`."""
    keys = set.intersection(*({p["key"] for p in run.points if p["key"] is not None} for run in runs))
    curve = []
    for key in sorted(keys):
        points = [next(p for p in run.points if p["key"] == key) for run in runs]
        if points[0][measure] is None:
            continue
        curve.append({"minutes": round(float(np.mean([p["minutes"] for p in points])), 3),
                      **spread([p[measure] for p in points])})
    return curve


def summarise(row: Row, results: list) -> list[dict]:
    """The table's rows of one benchmark row (a reference gives two: raw pixels and random init)."""
    if row.kind == "reference":
        return [{"row": row.name, "label": f"{title}, {row.label}", "kind": encoder, "budget": "-",
                 "seeds": list(row.seeds), "knn": spread([r[encoder]["knn"] for r in results]),
                 "linear": spread([r[encoder]["linear"] for r in results])}
                for encoder, title in (("raw_pixels", "raw pixels"), ("random_init", "random init"))]
    finals = [run.final for run in results]
    machines = [run.machine for run in results]
    summary = {"row": row.name, "label": row.label + (" (classifier top-1)" if row.kind == "supervised" else ""),
               "kind": row.kind, "budget": row.budget(), "seeds": list(row.seeds),
               "knn": spread([p["knn"] for p in finals]) if row.kind == "pretrain" else None,
               "linear": spread([p["linear"] for p in finals]),
               "minutes": round(float(np.mean([p["minutes"] for p in finals])), 2),
               "steps": [p["step"] for p in finals],
               "cores": max((m["cores"] for m in machines if m["cores"]), default=None),
               "threads": max((m["threads"] for m in machines if m["threads"]), default=None),
               "load_median": max((m["load_median"] for m in machines if m["load_median"] is not None), default=None),
               "load_max": max((m["load_max"] for m in machines if m["load_max"] is not None), default=None),
               "curve": {measure: row_curve(results, measure) for measure in ("knn", "linear")},
               "runs": [asdict(run) for run in results]}
    return [summary]


def cell(value: dict | None) -> str:
    if value is None:
        return "-"
    return f"{value['mean']:.2f}%" + (f" ± {value['std']:.2f}" if len(value["values"]) > 1 else "")


def markdown(entries: list[dict], made_by: str) -> str:
    lines = [made_by, "", "k-NN: top-1 at k = 20; linear: the linear probe's top-1 (a supervised row: its classifier's); "
             "mean ± std over the seeds, at the end of the budget. Load: the 1-minute load average while the row "
             "trained; a run alone shows about its own threads and loader workers, more says another process shared "
             "the cores.", "",
             "| row | budget | seeds | k-NN | linear | k-NN by seed | linear by seed | minutes trained | steps | cores | "
             "threads | load (1 min), median / max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for entry in entries:
        by_seed = [", ".join(f"{v:.2f}" for v in entry[m]["values"]) if entry[m] else "-" for m in ("knn", "linear")]
        load = "" if entry.get("load_median") is None else f"{entry['load_median']:.2f} / {entry['load_max']:.2f}"
        minutes = "" if entry.get("minutes") is None else f"{entry['minutes']:.2f}"
        steps = ", ".join(str(s) for s in entry.get("steps", []))
        lines.append(f"| {entry['label']} | {entry['budget']} | {', '.join(map(str, entry['seeds']))} | "
                     f"{cell(entry['knn'])} | {cell(entry['linear'])} | {by_seed[0]} | {by_seed[1]} | {minutes} | "
                     f"{steps} | {entry.get('cores') or ''} | {entry.get('threads') or ''} | {load} |")
    return "\n".join(lines)


def plot(entries: list[dict], path: Path, title: str) -> None:
    """k-NN and linear against minutes of training: a line per row (mean over seeds, band: +- one std), the
    references as horizontal lines, a supervised row's classifier top-1 beside the linear probes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(14, 5), layout="constrained")
    sizes = sorted({entry["row"] for entry in entries if entry["kind"] in ("raw_pixels", "random_init")})
    for axes, measure, name in zip(panels, ("knn", "linear"), ("k-NN top-1 (k = 20)", "linear probe top-1")):
        for entry in entries:
            if entry["kind"] in ("raw_pixels", "random_init"):
                axes.axhline(entry[measure]["mean"], linestyle="--" if entry["kind"] == "raw_pixels" else ":",
                             color=("black", "gray", "silver")[sizes.index(entry["row"]) % 3], linewidth=1,
                             label=entry["label"])
                continue
            curve = entry["curve"][measure]
            if not curve:
                continue
            x = [p["minutes"] for p in curve]
            mean, std = np.array([p["mean"] for p in curve]), np.array([p["std"] for p in curve])
            line, = axes.plot(x, mean, marker="o", markersize=3, label=entry["label"])
            if len(entry["seeds"]) > 1:
                axes.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        axes.set_xlim(left=0)
        axes.set_xlabel("minutes of training")
        axes.set_ylabel(f"{name}, %")
        axes.grid(alpha=0.3)
    handles, labels = panels[1].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="outside right upper")
    figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def provenance(argv: list[str]) -> tuple[str, str]:
    """Which command and which commit made the table: (the sentence that says so, the commit)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = (git("rev-parse", "HEAD") or "unknown (not a git checkout)") + \
        (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    return f"Made by `python -m launch {shlex.join(argv)}` at commit {commit}.", commit


# ============ the command ============

def run_benchmark(args: argparse.Namespace, row_jobs: type[BenchmarkJobs] = BenchmarkJobs) -> int:
    from launch.cluster import cluster_options
    from pretrain.runtime.atomic_write import write_text_atomically

    options = cluster_options(args)
    rows = load_benchmark(args.file)
    for row in rows:
        check_data(args.file, row)
    out_dir = Path(args.out_dir).resolve()
    check_same_benchmark(out_dir, rows)
    runs = {(row.name, seed): out_dir / "rows" / row.run_name(seed) for row in rows for seed in row.seeds}
    jobs = row_jobs(options, out_dir, None, [], RowResults({run_dir: (row, seed) for row in rows for seed in row.seeds
                                                             for run_dir in [runs[row.name, seed]]}),
                    [], args.parallel, args.keep_checkpoints,
                    plans={row.run_name(seed): row.job_steps(seed, runs[row.name, seed])
                           for row in rows for seed in row.seeds})
    failed = []

    def finished(tag, value):
        if value is None:
            failed.append(tag)

    jobs.run(iter([((row.name, seed), row.run_name(seed), []) for row in rows for seed in row.seeds]), finished,
             as_array=True)
    if failed:
        names = ", ".join(f"{name}_seed{seed}" for name, seed in failed)
        print(f"error: {len(failed)} of {len(runs)} runs failed ({names}): their logs are named above. Run the same "
              "command again to retry them; the finished ones are kept. No table is written.", file=sys.stderr)
        return 1
    entries = [entry for row in rows
               for entry in summarise(row, [read_run(row, seed, runs[row.name, seed]) for seed in row.seeds])]
    made_by, commit = provenance(args.argv)
    table = markdown(entries, made_by)
    print(table)
    write_text_atomically(out_dir / "table.md", table + "\n")
    write_text_atomically(out_dir / "table.json", json.dumps({"made_by": made_by, "file": args.file,
                                                              "rows": entries}, indent=1) + "\n")
    plot(entries, out_dir / "curves.png", f"{args.file}, commit {commit}")
    print(f"results: {out_dir / 'table.md'}, {out_dir / 'table.json'}, {out_dir / 'curves.png'}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a benchmark file (configs/benchmarks/*.yaml)")
    parser.add_argument("--out-dir", required=True, type=output_folder,
                        help="the benchmark's directory: rows/ (one run per row and seed), table.md, table.json, "
                             "curves.png")
    parser.add_argument("--parallel", type=positive_int, default=1,
                        help="runs at once (default: %(default)s: minutes measured beside another run are not the "
                             "machine's)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each finished run's checkpoints and exports (default: removed once it is scored; "
                             "its results, metrics, logs and final backbone.pth stay)")
