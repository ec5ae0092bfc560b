"""`python -m eval table RUN_DIR ... [--out FILE.md]`: the results table of finished runs, read from what they wrote.

One row per run: the method and its hard view selection (RUN_DIR/config.yaml), the k-NN top-1 (k = 20) and the
linear-probe top-1 of its final export (RUN_DIR/eval/knn_stepN.json, linear_stepN.json: run `python -m eval knn`
and `linear` first), the training's minutes (the run's training clock, `perf/training_seconds`: a run killed and
resumed a day later shows the minutes it trained, not the day) and median images/s, and the median 1-minute load average
while it trained (RUN_DIR/metrics.jsonl: a load above the cores the run used says it shared the machine). A run
without a result of its final step is named, not shown with an older one. With `--mean-over-seeds`, runs whose
settings differ only in `seed` (and their names) make one row: the mean, the standard deviation (n - 1) and the 95%
t interval of the mean of the k-NN and the linear probe over the seeds (eval/statistics.py), and each seed's value.
The README's and docs' results tables are this command's output, with the sentence it ends with: the command and
the commit that made it.

Each row also shows the commits its runs trained at (RUN_DIR/provenance.json: '9621bbb', '+dirty' with uncommitted
changes, 'unknown' for a run from before it was recorded), and a line at the table's top says when the rows were
trained by code that differs in its training files (eval/training_code.py); FILE.json records each row's
`commits` and the table's `mixed_code`.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path

import numpy as np
import yaml

from eval.results import made_by
from eval.statistics import summary_record, summary_text
from eval.training_code import commits_cell, compare_training_code, read_code_states, states_of
from pretrain.runtime.atomic_write import write_text_atomically

HELP = "the results table of finished, evaluated runs (Markdown)"


class TableInputError(ValueError):
    """A run directory the table cannot be made from; the message names it and what to run."""


def selection(config: dict) -> str:
    """'-' without hard view selection, else what it chose from: '6 pairs of 4', 'the hardest of 4 candidates'."""
    hvs = config.get("hvs", {})
    if not hvs.get("enabled"):
        return "-"
    counts = [group["count"] for group in config["data"]["views"]]
    pools = list(hvs["num_views"])
    if len(pools) == 1:
        kind = {2: "pairs", 3: "triplets"}.get(counts[0], f"{counts[0]}-tuples")
        return f"{math.comb(pools[0], counts[0])} {kind} of {pools[0]}"
    candidates = math.prod(math.comb(n, k) for n, k in zip(pools, counts))
    cap = hvs.get("max_candidates", 0)
    return f"the hardest of {min(candidates, cap) if cap else candidates} candidates, pools {pools}"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TableInputError(f"{path}: cannot be read ({error})") from None


def run_row(run_dir: Path) -> tuple[dict, dict]:
    """What the table shows of one finished run, and the settings it ran with (its config.yaml)."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise TableInputError(f"{run_dir}: no config.yaml; pass the directory of a pretraining run")
    config = yaml.safe_load(config_path.read_text())
    finished = run_dir / "finished.json"
    if not finished.is_file():
        raise TableInputError(f"{run_dir}: not finished (no finished.json); rerun its command to resume it")
    step = read_json(finished)["step"]
    scores = {}
    for protocol in ("knn", "linear"):
        result = run_dir / "eval" / f"{protocol}_step{step:07d}.json"
        if not result.is_file():
            raise TableInputError(f"{run_dir}: no {protocol} result of its final step {step}; run "
                                  f"`python -m eval {protocol} --run {run_dir}`")
        top1 = read_json(result)["top1"]
        scores[protocol] = 100 * float(top1["20"] if protocol == "knn" else top1)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [line["perf/images_per_s"] for line in lines if "perf/images_per_s" in line][1:]
    loads = [line["perf/load_average_1min"] for line in lines if "perf/load_average_1min" in line]
    clock = [line["perf/training_seconds"] for line in lines if "perf/training_seconds" in line]
    minutes = clock[-1] / 60 if clock else float("nan")
    return {"run": run_dir.name, "method": config["method"]["name"], "selection": selection(config),
            "seed": config.get("seed", 0), "step": step, "knn": round(scores["knn"], 2),
            "linear": round(scores["linear"], 2), "minutes": round(minutes, 1),
            "images_per_s": round(float(np.median(rates)), 0) if rates else None,
            "load_average_1min": round(float(np.median(loads)), 2) if loads else None,
            "commits": [state.to_record() for state in read_code_states([run_dir])]}, config


PER_RUN_KEYS = ("seed", "name", "run_dir")      # what runs of one recipe over several seeds differ in


def recipe(config: dict) -> str:
    """The run's settings but its seed and its names, as canonical JSON: equal for the seeds of one recipe."""
    return json.dumps({key: value for key, value in config.items() if key not in PER_RUN_KEYS}, sort_keys=True)


def mean_over_seeds(rows: list[dict], recipes: list[str]) -> list[dict]:
    """One row per recipe (`recipe` of each row's run), in the order of its first run: its runs, seeds, and k-NN /
    linear mean, std, 95% t interval of the mean and values (eval/statistics.py: `summary_record`)."""
    groups: dict[str, list[dict]] = {}
    for row, key in zip(rows, recipes):
        groups.setdefault(key, []).append(row)
    merged = []
    for runs in groups.values():
        seeds = [run["seed"] for run in runs]
        if len(set(seeds)) < len(seeds):
            raise TableInputError(f"{', '.join(run['run'] for run in runs)}: the same settings and the same seed "
                                  f"twice ({seeds}); pass each run once")
        merged.append({"runs": [run["run"] for run in runs], "method": runs[0]["method"],
                       "selection": runs[0]["selection"], "seeds": seeds,
                       **{protocol: summary_record([run[protocol] for run in runs]) for protocol in ("knn", "linear")},
                       "minutes": round(float(np.mean([run["minutes"] for run in runs])), 1),
                       "commits": list({json.dumps(code, sort_keys=True): code
                                        for run in runs for code in run["commits"]}.values())})
    return merged


def markdown_over_seeds(rows: list[dict]) -> str:
    lines = ["| runs | method | HVS | seeds | k-NN, mean ± std, 95% CI | linear, mean ± std, 95% CI | k-NN by seed | "
             "linear by seed | minutes (mean) | commits |", "|" + " --- |" * 10]
    for row in rows:
        lines.append(f"| {', '.join(row['runs'])} | {row['method']} | {row['selection']} | "
                     f"{', '.join(map(str, row['seeds']))} | {summary_text(row['knn'])} | "
                     f"{summary_text(row['linear'])} | "
                     f"{', '.join(f'{v:.2f}' for v in row['knn']['values'])} | "
                     f"{', '.join(f'{v:.2f}' for v in row['linear']['values'])} | {row['minutes']:.1f} | "
                     f"{commits_cell(states_of(row))} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| run | method | HVS | k-NN | linear | minutes | images/s | load (1 min) | commit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        load = "" if row["load_average_1min"] is None else f"{row['load_average_1min']:.2f}"
        rate = "" if row["images_per_s"] is None else f"{row['images_per_s']:.0f}"
        lines.append(f"| {row['run']} | {row['method']} | {row['selection']} | {row['knn']:.2f}% | "
                     f"{row['linear']:.2f}% | {row['minutes']:.1f} | {rate} | {load} | "
                     f"{commits_cell(states_of(row))} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished pretraining runs, evaluated")
    parser.add_argument("--out", metavar="FILE.md", help="also write the table there, and the rows as FILE.json")
    parser.add_argument("--mean-over-seeds", action="store_true",
                        help="one row per recipe: runs whose settings differ only in seed, with the mean, std "
                             "(n - 1) and 95%% t interval of k-NN and linear over their seeds, and each seed's value")


def run(args: argparse.Namespace) -> int:
    rows, configs = zip(*(run_row(Path(run)) for run in args.runs))
    if args.mean_over_seeds:
        rows = mean_over_seeds(list(rows), [recipe(config) for config in configs])
    command = shlex.join(["python", "-m", "eval", "table", *args.runs, *(["--out", args.out] if args.out else []),
                          *(["--mean-over-seeds"] if args.mean_over_seeds else [])])
    code = compare_training_code({row.get("run") or ", ".join(row["runs"]): states_of(row) for row in rows})
    stamp = made_by(command)[0]
    table = "".join(warning + "\n\n" for warning in code.warnings) + \
        (markdown_over_seeds(rows) if args.mean_over_seeds else markdown(rows)) + "\n\n" + stamp
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(out, table + "\n")
        write_text_atomically(out.with_suffix(".json"), json.dumps(
            {"made_by": stamp, "mixed_code": code.mixed, "code_warnings": list(code.warnings), "rows": list(rows)},
            indent=1) + "\n")
    return 0
