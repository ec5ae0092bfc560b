"""A benchmark file (YAML, configs/benchmarks/*.yaml; its format: launch/benchmark.py) read into its rows and the
paired comparisons its table makes, every value checked (`load_benchmark`: a LaunchError names the file, the row
and the value), and the record of the rows a benchmark directory ran with (`check_same_benchmark`,
DIR/benchmark.json)."""
from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from launch.cluster import LaunchError
from launch.jobs import Step
from pretrain.config import load_config
from transfer.finetune.config import load_finetune_config

MIN_MARKS = 6                   # the "enough points to see the shape"
ROW_KEYS = ("name", "label", "config", "overrides", "seeds", "minutes", "steps", "pflop", "marks", "supervised",
            "supervised_overrides")
BUDGETS = ("minutes", "steps", "pflop")
REFERENCE_KEYS = ("config", "overrides", "image_sizes", "seeds")
FILE_KEYS = ("name", "references", "rows", "comparisons")


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
    steps: int | None = None             # optimizer steps, or
    pflop: float | None = None           # counted compute (PFLOP), every schedule spanning the steps it buys
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
        if self.pflop is not None:
            return f"{self.pflop:g} PFLOP, {self.marks} marks"
        return "-"

    def budget_overrides(self) -> list[str]:
        """The training's keys for the budget: it stops there, and checkpoints (and exports) at each mark. A compute
        budget's steps are known once the run has counted one (pretrain/runtime/compute_budget.py): its marks are
        engine.checkpoints_per_run, spread over the steps it buys."""
        if self.minutes is not None:
            return [f"engine.max_minutes={self.minutes:g}",
                    f"engine.checkpoint_every_minutes={self.minutes / self.marks:.12g}", "engine.checkpoint_every_steps=0"]
        if self.pflop is not None:
            return [f"optim.budget_pflop={self.pflop!r}", f"engine.checkpoints_per_run={self.marks}",
                    "engine.checkpoint_every_steps=0"]
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
    cfg = load_config(row.config, list(row.overrides))
    for split in ("train", "val"):
        if not Path(cfg.data[split]).exists():
            raise LaunchError(f"{file}: row {row.name}: data.{split}={cfg.data[split]} does not exist: write it with "
                              f"`python -m pretrain.data` (see its --help), or set data.{split} in the row's overrides")


def parse_row(where: str, entry) -> Row:
    if not isinstance(entry, dict):
        raise LaunchError(f"{where} must be a mapping with name, config, seeds, minutes, steps or pflop, marks")
    name = entry.get("name")
    if not isinstance(name, str) or not name or "/" in name or name.strip(".") == "" or name != name.strip():
        raise LaunchError(f"{where}: name {name!r} must be a folder name (letters, digits, '_', '-')")
    where = f"{where} ({name})"
    check_keys(where, entry, ROW_KEYS)
    budgets = [key for key in BUDGETS if entry.get(key) is not None]
    if len(budgets) != 1:
        raise LaunchError(f"{where}: give one budget, minutes: M (of training), steps: N (optimizer steps) or "
                          f"pflop: X (counted compute), not {' and '.join(budgets) or 'none'}")
    minutes, steps, pflop = (entry.get(key) for key in BUDGETS)
    for key, value, meaning in (("minutes", minutes, "minutes of training"), ("pflop", pflop, "counted PFLOP")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise LaunchError(f"{where}: {key} {value!r} must be a positive number ({meaning})")
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
              steps=steps, pflop=None if pflop is None else float(pflop), marks=marks)
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


@dataclass(frozen=True)
class Benchmark:
    """A benchmark file: its rows (the references first) and its comparisons, (row, baseline row) name pairs whose
    paired differences over their common seeds the table reports (launch/benchmark_results.py)."""

    rows: list[Row]
    comparisons: tuple[tuple[str, str], ...] = ()


def parse_comparisons(path: str, entry, rows: list[Row]) -> tuple[tuple[str, str], ...]:
    """`comparisons: [[row, baseline_row], ...]`: pairs of the file's pretraining or supervised rows, each once."""
    if entry is None:
        return ()
    if not isinstance(entry, list):
        raise LaunchError(f"{path}: comparisons {entry!r} must be a list of [row, baseline_row] pairs, e.g. "
                          "[[simclr_hvs, simclr]]")
    compared = {row.name: row for row in rows if row.kind != "reference"}
    pairs = []
    for index, pair in enumerate(entry):
        where = f"{path}: comparisons[{index}]"
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(name, str) for name in pair):
            raise LaunchError(f"{where} {pair!r} must be a pair of row names [row, baseline_row], e.g. "
                              "[simclr_hvs, simclr]")
        for name in pair:
            if name in compared:
                continue
            if any(row.name == name for row in rows):
                raise LaunchError(f"{where}: {name!r} is a reference row (raw pixels and random init): compare rows "
                                  "that train, pretraining or supervised")
            close = difflib.get_close_matches(name, list(compared), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (its rows: {', '.join(compared)})"
            raise LaunchError(f"{where}: {name!r} is not a row of the file{hint}")
        if pair[0] == pair[1]:
            raise LaunchError(f"{where}: {pair!r} compares row {pair[0]} with itself: name a baseline row")
        if tuple(pair) in pairs:
            raise LaunchError(f"{where}: {pair!r} is listed twice")
        pairs.append(tuple(pair))
    return tuple(pairs)


def load_benchmark(path: str) -> Benchmark:
    """The rows and comparisons of a benchmark file, every value checked (a LaunchError names the file, the row and
    the value)."""
    file = Path(path)
    if not file.is_file():
        raise LaunchError(f"{path}: no such benchmark file (configs/benchmarks/ holds the shipped ones)")
    try:
        content = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise LaunchError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(content, dict) or not isinstance(content.get("rows"), list) or not content["rows"]:
        raise LaunchError(f"{path} must be a mapping with a non-empty list `rows` (see configs/benchmarks/digits.yaml)")
    check_keys(str(path), content, FILE_KEYS)
    rows = [*parse_references(f"{path}: references", content.get("references")),
            *(parse_row(f"{path}: rows[{index}]", entry) for index, entry in enumerate(content["rows"]))]
    names = [row.name for row in rows]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise LaunchError(f"{path}: two rows are named {', '.join(twice)}: each row needs its own name (its folder)")
    return Benchmark(rows, parse_comparisons(str(path), content.get("comparisons"), rows))


def select_rows(path: str, rows: list[Row], names: list[str]) -> list[Row]:
    """The rows named (`--rows`), in the file's order: e.g. the cheap rows first, or a file's rows split between
    machines. A name the file does not have is refused with the names it has."""
    known = {row.name for row in rows}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise LaunchError(f"{path} has no row {', '.join(unknown)} (its rows: {', '.join(row.name for row in rows)})")
    return [row for row in rows if row.name in names]


def select_seeds(path: str, rows: list[Row], seeds: list[int]) -> list[Row]:
    """Each row with only the seeds named (`--seeds`), the rows without any of them left out: e.g. one seed of every
    row before the others. A seed no row has is refused with the seeds the rows have."""
    known = sorted({seed for row in rows for seed in row.seeds})
    unknown = [seed for seed in seeds if seed not in known]
    if unknown:
        raise LaunchError(f"{path}: no row has seed {', '.join(map(str, unknown))} (the rows' seeds: "
                          f"{', '.join(map(str, known))})")
    return [replace(row, seeds=tuple(seed for seed in row.seeds if seed in seeds)) for row in rows
            if set(row.seeds) & set(seeds)]


def check_same_benchmark(out_dir: Path, rows: list[Row]) -> None:
    """A benchmark directory holds one benchmark's runs: a row found again under its name must have the settings it
    ran with (new rows and new seeds are welcome; a row none of whose runs has started yet may change, e.g. its
    epochs sized anew); only then is DIR/benchmark.json written. A setting the saved row lacks (written before the
    setting existed, as `pflop`) counts as unset (None)."""
    saved_path = out_dir / "benchmark.json"
    saved = json.loads(saved_path.read_text())["rows"] if saved_path.is_file() else {}
    started = {entry.name for entry in (out_dir / "rows").iterdir()} if (out_dir / "rows").is_dir() else set()
    for row in rows:
        before = saved.get(row.name)
        has_runs = any(re.fullmatch(re.escape(row.name) + r"_seed\d+", name) for name in started)
        settings = json.loads(json.dumps(row.settings()))
        changed = [key for key in settings if before is not None and before.get(key) != settings[key]]
        if has_runs and changed:
            raise LaunchError(f"{out_dir} holds row {row.name} with other settings ({', '.join(changed)}: "
                              f"{', '.join(repr(before.get(key)) for key in changed)} there): pass another --out-dir, "
                              "or give the row another name")
    saved.update({row.name: row.settings() for row in rows})
    out_dir.mkdir(parents=True, exist_ok=True)
    saved_path.write_text(json.dumps({"rows": saved}, indent=1) + "\n")
