"""How a benchmark's results are shown: table.md (the finals with their intervals, the flagged runs, the paired
differences at the end and at each mark, each row's curve, what hard view selection chose) and the plots of accuracy
against minutes of training and against counted compute. What they show is measured and summarised in
launch/benchmark_results.py; launch/benchmark.py writes both."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eval.statistics import summary_text
from eval.training_code import commits_cell, states_of
from launch.benchmark_results import FLAGGED_BELOW, REFERENCE_ROWS


def cell(value: dict | None) -> str:
    """A curve's point: mean ± std over the seeds (a point along the way; the finals also show their interval)."""
    if value is None:
        return "-"
    return f"{value['mean']:.2f}%" + (f" ± {value['std']:.2f}" if len(value["values"]) > 1 else "")


def final_cell(value: dict | None) -> str:
    return "-" if value is None else summary_text(value)


def paired_section(comparisons: list[dict]) -> list[str]:
    if not comparisons:
        return []
    lines = ["", "Paired differences: row minus baseline at the end of the budget, in points of top-1, over the seeds "
             "both rows finished (their runs paired by seed); the 95% t interval of the mean difference and the paired "
             "t-test's two-sided p-value.", "",
             "| row | baseline | measure | seeds | difference | 95% CI | p |", "|" + " --- |" * 7]
    names = {"knn": "k-NN", "linear": "linear"}
    for comparison in comparisons:
        row, baseline = comparison["labels"]
        if "error" in comparison:
            lines.append(f"| {row} | {baseline} | - | - | {comparison['error']} | - | - |")
        for result in comparison["measures"]:
            if "error" in result:
                lines.append(f"| {row} | {baseline} | {names[result['measure']]} | - | {result['error']} | - | - |")
                continue
            interval, p_value = "-", "-"                  # differences without spread: no interval, no test
            if result["p_value"] is not None:
                low, high = result["ci95"]
                interval, p_value = f"[{low:+.2f}, {high:+.2f}]", f"{result['p_value']:.3g}"
            note = f" ({result['note']})" if result["note"] else ""
            lines.append(f"| {row} | {baseline} | {names[result['measure']]} | {', '.join(map(str, result['seeds']))} "
                         f"| {result['difference']:+.2f}{note} | {interval} | {p_value} |")
    return lines


def marks_section(comparisons: list[dict]) -> list[str]:
    """The paired differences along the way: a column per mark, each cell the difference and its 95% interval."""
    measured = [(comparison, result) for comparison in comparisons for result in comparison["measures"]
                if result.get("marks")]
    if not measured:
        return []
    width = max(len(result["marks"]) for _, result in measured)
    names = {"knn": "k-NN", "linear": "linear"}
    lines = ["", "Paired differences at each mark (the i-th mark of each row: the same share of the budget), row minus "
             "baseline in points of top-1 with the 95% t interval; the last mark is the budget's end.", "",
             "| row | baseline | measure | " + " | ".join(f"mark {i + 1}" for i in range(width)) + " |",
             "|" + " --- |" * (3 + width)]
    for comparison, result in measured:
        cells = [f"{mark['difference']:+.2f}" + ("" if mark["p_value"] is None else
                                                   f" [{mark['ci95'][0]:+.2f}, {mark['ci95'][1]:+.2f}]")
                 for mark in result["marks"]]
        row, baseline = comparison["labels"]
        lines.append(f"| {row} | {baseline} | {names[result['measure']]} | "
                     + " | ".join(cells + [""] * (width - len(cells))) + " |")
    return lines


def selection_section(entries: list[dict]) -> list[str]:
    """What hard view selection chose, per row with selection: the chosen candidate's loss, IoU and crop scale against
    the mean over the scored candidates, and the share of images whose lowest-IoU candidate was chosen (each a mean
    over the run's logged steps, then mean ± std over the seeds)."""
    chosen = [entry for entry in entries if entry.get("selection")]
    if not chosen:
        return []

    def value(selection: dict, name: str) -> str:
        if name not in selection:
            return "-"
        found = selection[name]
        return f"{found['mean']:.3f}" + ("" if found["std"] is None else f" ± {found['std']:.3f}")

    lines = ["", "Chosen views (hard view selection, pretrain/hvs.py): the chosen candidate against the mean over the "
             "scored candidates, each a mean over the run's logged steps, then mean ± std over the seeds. Scale: the "
             "crops' area as a share of the image.", "",
             "| row | loss, chosen | loss, mean | IoU, chosen | IoU, mean | scale, chosen | scale, mean | "
             "lowest-IoU candidate chosen |", "|" + " --- |" * 8]
    for entry in chosen:
        selection = entry["selection"]
        lines.append(f"| {entry['label']} | " + " | ".join(value(selection, name) for name in (
            "selected_loss", "mean_pair_loss", "selected_iou", "mean_pair_iou", "selected_scale", "mean_pair_scale",
            "lowest_iou_chosen_frac")) + " |")
    return lines


def markdown(entries: list[dict], made_by: str, comparisons: list[dict] = (),
             code_warnings: tuple[str, ...] = ()) -> str:
    """table.md: the code warnings (eval/training_code.py) at the top, the command and commit, the finals, the
    paired differences at the end and at each mark (`paired_differences`), each row's curve mark by mark, then what
    hard view selection chose (`selection_section`)."""
    lines = [*(line for warning in code_warnings for line in (warning, "")), made_by, "",
             "k-NN: top-1 at k = 20; linear: the linear probe's top-1 (a supervised row: its classifier's); "
             "mean ± std over the seeds and the 95% t interval of the mean, at the end of the budget. Minutes trained "
             "(measured) and PFLOP trained (counted: a compute budget's runs; matrix products, convolutions and "
             "attention), means over the seeds; schedule trained: each seed's steps over its schedule's, a share "
             f"below {FLAGGED_BELOW:.0%} flagged. Load: the 1-minute load average while the row trained; a run alone "
             "shows about its own threads and loader workers, more says another process shared the cores. Commits: "
             "the code its runs trained at.", "",
             "| row | budget | seeds | k-NN | linear | k-NN by seed | linear by seed | minutes trained | "
             "PFLOP trained | schedule trained | steps | cores | threads | load (1 min), median / max | commits |",
             "|" + " --- |" * 15]
    for entry in entries:
        by_seed = [", ".join(f"{v:.2f}" for v in entry[m]["values"]) if entry[m] else "-" for m in ("knn", "linear")]
        load = "" if entry.get("load_median") is None else f"{entry['load_median']:.2f} / {entry['load_max']:.2f}"
        minutes = "" if entry.get("minutes") is None else f"{entry['minutes']:.2f}"
        steps = ", ".join(str(s) for s in entry.get("steps", []))
        pflop = "" if entry.get("pflop") is None else f"{entry['pflop']:.4g}"
        lines.append(f"| {entry['label']} | {entry['budget']} | {', '.join(map(str, entry['seeds']))} | "
                     f"{final_cell(entry['knn'])} | {final_cell(entry['linear'])} | {by_seed[0]} | {by_seed[1]} | "
                     f"{minutes} | {pflop} | {schedule_cell(entry.get('schedule_share'))} | {steps} | "
                     f"{entry.get('cores') or ''} | {entry.get('threads') or ''} | {load} | "
                     f"{commits_cell(states_of(entry))} |")
    return "\n".join(lines + flagged_section(entries) + paired_section(list(comparisons))
                     + marks_section(list(comparisons)) + along_the_way(entries) + selection_section(entries))


def schedule_cell(shares: list[float | None] | None) -> str:
    """Each seed's share of its schedule trained, "(cut)" after one below FLAGGED_BELOW ("?": not recorded)."""
    if not shares:
        return ""
    return ", ".join("?" if share is None else f"{100 * share:.0f}%" + (" (cut)" if share < FLAGGED_BELOW else "")
                     for share in shares)


def flagged_section(entries: list[dict]) -> list[str]:
    """Below the finals, every flagged run (`schedule_flags`), row by row: a result that is not its recipe's at the
    budget, said where the result is read."""
    flagged = [entry for entry in entries if entry.get("flags")]
    if not flagged:
        return []
    return ["", f"Flagged: runs whose schedule was cut before {FLAGGED_BELOW:.0%} of its steps (the lr not yet "
            f"decayed), or, under a minutes budget, ended before {FLAGGED_BELOW:.0%} of the minutes (the budget not "
            "spent); their finals are not their recipe's at the budget.", "",
            *(f"- {entry['label']}: {'; '.join(entry['flags'])}" for entry in flagged)]


def along_the_way(entries: list[dict]) -> list[str]:
    """The rows' curves as a table, for comparing rows at equal minutes: a column per mark, each cell the mark's
    minutes of training and k-NN / linear (mean ± std over the seeds, as the plot draws them)."""
    curves = [entry for entry in entries if entry.get("curve") and entry["curve"]["linear"]]
    if not curves:
        return []
    width = max(len(entry["curve"]["linear"]) for entry in curves)
    lines = ["", "Along the way: at each mark, the minutes of training (mean over the seeds), then k-NN / linear; the "
             "last mark is the budget's end.", "",
             "| row | " + " | ".join(f"mark {i + 1}" for i in range(width)) + " |", "| --- |" + " --- |" * width]
    for entry in curves:
        linear = entry["curve"]["linear"]
        knn = entry["curve"]["knn"] if len(entry["curve"]["knn"]) == len(linear) else [None] * len(linear)
        cells = [f"{lin['minutes']:.1f} min: {cell(k)} / {cell(lin)}" for k, lin in zip(knn, linear)]
        lines.append(f"| {entry['label']} | " + " | ".join(cells + [""] * (width - len(cells))) + " |")
    return lines


CURVE_MARKERS = ("o", "s", "^", "D")


def curve_styles(labels: list[str]) -> dict[str, tuple[tuple, str]]:
    """(colour, marker) of each row's curves, the same in both panels and distinct for up to 80 rows: matplotlib's
    20 qualitative colours (tab20: the 10 of its default cycle, then their light tints), then the next marker."""
    from matplotlib import colormaps

    colours = colormaps["tab20"].colors
    order = [*range(0, 20, 2), *range(1, 20, 2)]              # the 10 strong colours first, then their tints
    return {label: (colours[order[i % 20]], CURVE_MARKERS[i // 20 % len(CURVE_MARKERS)])
            for i, label in enumerate(labels)}


PLOT_AXES = {"minutes": "minutes of training", "pflop": "PFLOP of training (counted)"}


def plot(entries: list[dict], path: Path, title: str, x_axis: str = "minutes") -> None:
    """k-NN and linear against minutes of training (x_axis="minutes") or counted compute ("pflop": the rows with a
    compute budget): a line per row (mean over seeds, band: +- one std), the references as horizontal lines, a
    supervised row's classifier top-1 beside the linear probes."""
    import matplotlib  # only the command that draws pays for its import
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(14, 5), layout="constrained")
    references = [encoder for encoder, _ in REFERENCE_ROWS]
    sizes = sorted({entry["row"] for entry in entries if entry["kind"] in references})
    styles = curve_styles([entry["label"] for entry in entries if entry["kind"] not in references])
    for axes, measure, name in zip(panels, ("knn", "linear"), ("k-NN top-1 (k = 20)", "linear probe top-1")):
        for entry in entries:
            if entry["kind"] in references:
                axes.axhline(entry[measure]["mean"], linestyle=("--", ":", "-.")[references.index(entry["kind"])],
                             color=("black", "gray", "silver")[sizes.index(entry["row"]) % 3], linewidth=1,
                             label=entry["label"])
                continue
            curve = entry["curve"][measure]
            if not curve or any(x_axis not in p for p in curve):
                continue
            x = [p[x_axis] for p in curve]
            mean, std = np.array([p["mean"] for p in curve]), np.array([p["std"] or 0.0 for p in curve])
            colour, marker = styles[entry["label"]]
            axes.plot(x, mean, marker=marker, markersize=3, color=colour, label=entry["label"])
            if len(entry["seeds"]) > 1:
                axes.fill_between(x, mean - std, mean + std, color=colour, alpha=0.2)
        axes.set_xlim(left=0)
        axes.set_xlabel(PLOT_AXES[x_axis])
        axes.set_ylabel(f"{name}, %")
        axes.grid(alpha=0.3)
    handles, labels = panels[1].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="outside right upper")
    figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=120)
    plt.close(figure)
