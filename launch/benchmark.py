"""`python -m launch benchmark FILE --out-dir DIR`: a results table (Markdown and JSON) and its plot of accuracy against
minutes of training, made by one command from a benchmark file; every (row, seed) is a `launch` job. A row's budget
is minutes of training, optimizer steps or counted compute (PFLOP).

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
        minutes: 1.5               # one budget: minutes of training (engine.max_minutes), or steps: N
                                   # (engine.max_steps), or pflop: X (optim.budget_pflop, counted compute)
        marks: 6                   # evaluations along the run, evenly spaced (at least 6)
      - name: simclr_hvs_compute   # the same at equal counted compute: its schedule spans the steps X PFLOP buy
        config: configs/pretrain/simclr_digits.yaml
        overrides: [hvs.enabled=true]
        pflop: 0.009
        marks: 6
      - name: cross_entropy        # the config's network trained with cross-entropy on every label, from random init
        config: configs/pretrain/simclr_digits.yaml      # the network and the data (overrides: of this config)
        supervised: configs/transfer/finetune_digits.yaml
        supervised_overrides: [data.label_fraction=100%, optim.epochs=40]
        seeds: [0]
        minutes: 2
        marks: 6
    comparisons:                   # optional: [row, baseline row] pairs, paired by seed in the table
      - [simclr_hvs, simclr]

Each (row, seed) is one job (`--cluster local` or Slurm, `--parallel K` at once; a Slurm job array) in
DIR/rows/NAME_seedS:
- a pretraining row: `python -m pretrain --config CONFIG engine.max_minutes=M engine.checkpoint_every_minutes=M/marks
  engine.checkpoint_every_steps=0 OVERRIDES seed=S` (a step budget: engine.max_steps=N
  engine.checkpoint_every_steps=N/marks; a compute budget: optim.budget_pflop=X engine.checkpoints_per_run=marks
  engine.checkpoint_every_steps=0, the run counting one step's FLOPs at its start and every schedule spanning the
  steps X buys, pretrain/runtime/compute_budget.py), whose checkpoints are the marks and the last step, each with its
  export; then `python -m eval watch --run RUN --protocols knn,linear`: every export scored by k-NN (k = 20) and the
  linear probe, the existing evaluation;
- a supervised row: one pretraining step of CONFIG, whose export tells `python -m transfer finetune --from random`
  the network and the data (its weights are discarded), then the fine-tuning itself with the budget, scored on
  the validation set after every epoch and at the budget;
- a reference: `python -m eval baselines --config CONFIG --image-size N seed=S`.

Started again with the same command, a finished (row, seed) is read back, one whose job still runs is waited
for, and one that was killed is submitted again and resumes from its checkpoint: the training loop keeps its
clock in the checkpoint, so a resumed row trains the rest of its minutes. DIR/benchmark.json keeps the rows;
a row of the same name with other settings is refused once one of its runs has started (they would mean something
else).

Written to DIR: table.md (also printed; the finals, the flagged runs, the paired differences, then each row's curve a
column per mark), table.json (every run's points, the rows' curves and finals, the machine state, the share of its
schedule each run trained, the PFLOP counted, the flags, the commits, the paired differences) and curves.png (k-NN
and linear against minutes of training, one line per row: the mean over seeds, the band one standard deviation; the
references as horizontal lines). A row's finals are the mean ± std over its seeds
and the 95% t interval of the mean (eval/statistics.py). The machine's state of each row is read from its runs'
metrics.jsonl (cores, torch threads, the 1-minute load average at every logged step): a load above the cores says
another process shared the machine, and the row's minutes bought less training. Each row shows the minutes its runs
trained (measured) and, for a compute budget, the PFLOP they trained (counted), and each seed's share of its schedule
(the steps it trained over RUN_DIR/schedule.json's): a run cut before 95% of its schedule (its lr not yet decayed), or,
under a minutes budget, one whose schedule ended before 95% of the minutes, is flagged below the finals, its result
not its recipe's at the budget (launch/benchmark_results.py: schedule_flags). The table names the command and
the commit (git rev-parse HEAD) that made it, each row the commits its runs trained at (their provenance.json), and
a line at its top says when the rows were trained by code that differs in its training files
(eval/training_code.py; table.json's `mixed_code`).

`comparisons` (optional): for each [row, baseline row] pair of the file's pretraining or supervised rows, the table's
"Paired differences" give, per measure (k-NN, linear), row minus baseline at the end of the budget over the seeds
both rows finished: the mean difference, its 95% t interval and the paired t-test's two-sided p-value, with the
seeds used (fewer than 2 common seeds: said in its place, not computed).

`--rows A,B` runs (or tables) only the rows named, e.g. references_16px,simclr_20min; `--seeds 0` only those seeds
of each row, e.g. one seed of every row before the others; the other runs are left as they are.

`--finished-only` writes the same three files from the runs finished so far and submits nothing: a long benchmark's
table while it is under way, each row over its finished seeds, the runs still to come named in the table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from eval.results import made_by
from eval.training_code import compare_training_code
from launch.benchmark_file import Row, check_data, check_same_benchmark, load_benchmark, select_rows, select_seeds
from launch.benchmark_results import paired_differences, read_run, row_code_states, summarise
from launch.benchmark_table import markdown, plot
from launch.cluster import add_cluster_arguments, cluster_options
from launch.eval_watch import split
from launch.jobs import Step
from launch.trials import TrialJobs
from pretrain.runtime.argument_types import number_list, output_folder, positive_int
from pretrain.runtime.atomic_write import write_text_atomically

HELP = "a benchmark file's rows as jobs: the table and the plot of accuracy against minutes of training"
EPILOG = ("example:\n  python -m launch benchmark configs/benchmarks/digits.yaml --cluster local --out-dir "
          "runs/benchmark_digits")


# ============ the (row, seed) jobs ============

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
    """The (row, seed) jobs, run as a search's trials are (launch/trials.py: at most `parallel` at once, a finished
    one read back, a running one waited for, a killed one submitted again), each in DIR/rows/NAME_seedS."""

    plans: dict[str, list[Step]] = field(default_factory=dict)
    kind: ClassVar[str] = "row"

    def run_dir(self, name: str) -> Path:
        return self.search_dir / "rows" / name

    def steps(self, name: str, trial_overrides: list[str]) -> list[Step]:
        return self.plans[name]


# ============ the command ============

def run(args: argparse.Namespace, row_jobs: type[BenchmarkJobs] = BenchmarkJobs) -> int:
    options = cluster_options(args)
    benchmark = load_benchmark(args.file)
    rows = benchmark.rows
    if args.rows:
        rows = select_rows(args.file, rows, args.rows)
    if args.seeds:
        rows = select_seeds(args.file, rows, args.seeds)
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
    if not args.finished_only:
        failed = []

        def finished(tag, value):
            if value is None:
                failed.append(tag)

        jobs.run(iter([((row.name, seed), row.run_name(seed), []) for row in rows for seed in row.seeds]), finished,
                 as_array=True)
        if failed:
            names = ", ".join(f"{name}_seed{seed}" for name, seed in failed)
            print(f"error: {len(failed)} of {len(runs)} runs failed ({names}): their logs are named above. Run the "
                  "same command again to retry them; the finished ones are kept. No table is written.", file=sys.stderr)
            return 1
    return write_results(args, rows, runs, out_dir, benchmark.comparisons)


def write_results(args: argparse.Namespace, rows: list[Row], runs: dict[tuple[str, int], Path], out_dir: Path,
                  comparisons: tuple[tuple[str, str], ...] = ()) -> int:
    """table.md (printed), table.json, curves.png and (rows with a compute budget) curves_pflop.png of the finished
    runs: every run after the jobs; with --finished-only, the (row, seed) runs finished so far, each row over its finished seeds, the others named.
    Each row shows the commits its runs trained at, the table's top says when they mix training code, and the
    file's comparisons get their paired differences."""
    entries, not_finished, code = [], [], {}
    for row in rows:
        results = {seed: read_run(row, seed, runs[row.name, seed]) for seed in row.seeds}
        done = tuple(seed for seed, result in results.items() if result is not None)
        not_finished += [row.run_name(seed) for seed in row.seeds if seed not in done]
        if done:
            code[row.name] = row_code_states(row, [runs[row.name, seed] for seed in done])
            for entry in summarise(replace(row, seeds=done), [results[seed] for seed in done]):
                entries.append({**entry, "commits": [state.to_record() for state in code[row.name]]})
    if not entries:
        print(f"error: no run of {args.file} has finished in {out_dir}: no table is written (run the command without "
              "--finished-only to run them)", file=sys.stderr)
        return 1
    stamp, commit = made_by(f"python -m launch {shlex.join(args.argv)}")     # the command and the commit
    if not_finished:
        unfinished = ("1 run of the file has not finished and is" if len(not_finished) == 1
                      else f"{len(not_finished)} runs of the file have not finished and are")
        stamp += f" A partial table: {unfinished} not in it ({', '.join(not_finished)})."
    mixed = compare_training_code(code)
    paired = paired_differences(entries, comparisons)
    table = markdown(entries, stamp, paired, mixed.warnings)
    print(table)
    write_text_atomically(out_dir / "table.md", table + "\n")
    write_text_atomically(out_dir / "table.json", json.dumps(
        {"made_by": stamp, "file": args.file, "mixed_code": mixed.mixed, "code_warnings": list(mixed.warnings),
         "not_finished": not_finished, "comparisons": paired, "rows": entries}, indent=1) + "\n")
    plot(entries, out_dir / "curves.png", f"{args.file}, commit {commit}")
    plots = [out_dir / "curves.png"]
    if any("pflop" in point for entry in entries for point in (entry.get("curve") or {}).get("linear", [])):
        plot(entries, out_dir / "curves_pflop.png", f"{args.file}, commit {commit}", x_axis="pflop")
        plots.append(out_dir / "curves_pflop.png")
    print(f"results: {out_dir / 'table.md'}, {out_dir / 'table.json'}, {', '.join(map(str, plots))}")
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
    parser.add_argument("--rows", type=split, default=None,
                        metavar="NAME[,NAME...]",
                        help="only these rows of the file (their names; the references are references_{N}px), e.g. "
                             "the cheap ones first; default: every row")
    parser.add_argument("--seeds", type=number_list(int, at_least=0), default=None, metavar="S[,S...]",
                        help="only these seeds of each row (the rows without any of them left out), e.g. one seed of "
                             "every row before the others; default: every row's seeds")
    parser.add_argument("--finished-only", action="store_true",
                        help="write the table and the plot of the runs finished so far, each row over its finished "
                             "seeds, and submit nothing (e.g. while a long benchmark is under way)")
    add_cluster_arguments(parser)
