"""Which code trained a table's rows, and whether the table mixes code that trains differently.

A table compares rows; rows trained weeks apart may have been trained by different code (a loss fixed, a default
changed), and their difference is then partly the code's. Every run records the code of each of its starts in
RUN_DIR/provenance.json (pretrain/runtime/provenance.py). From it, `python -m eval table` and `python -m launch
benchmark` show each row's commits ('9621bbb', '9621bbb+dirty', 'unknown' for a run from before it was recorded),
and `compare_training_code` says, in a line at the table's top, when the rows' code differs in the files that
train (TRAINING_PATHS):

- two commits whose `git diff --name-only A B -- TRAINING_PATHS` is not empty;
- uncommitted changes (tracked or untracked files) under TRAINING_PATHS in a run, unless another row's run was
  trained at the same commit with the very same changes (the same digest);
- a commit this checkout does not have (its files cannot be compared).

Commits that differ only elsewhere (docs, eval's table code, tests) train the same: no warning. A row without
provenance is named in a line of its own: its code cannot be checked.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pretrain.runtime.provenance import CODE_ROOT, CodeState, GitError, read_starts, run_git

# What trains: the pretraining (methods, losses, data, the runtime), the configs, fine-tuning and detection.
TRAINING_PATHS = ("pretrain/", "configs/", "transfer/")
SHOWN_FILES = 8          # the differing files a warning names, then how many more


def read_code_states(run_dirs: Iterable[Path]) -> list[CodeState]:
    """The distinct code states the runs' starts recorded, in order of first start; a run without a readable
    provenance.json adds an unknown state (commit None, its reason)."""
    states: list[CodeState] = []
    for run_dir in run_dirs:
        try:
            starts = read_starts(run_dir)
        except ValueError as error:
            starts, reason = [], str(error)
        else:
            reason = f"{run_dir} has no provenance.json (started before runs recorded it)"
        found = [CodeState.from_record(start.get("code") or {}) for start in starts] or [CodeState(None, reason=reason)]
        states += [state for state in found if state not in states]
    return states


def states_of(row: dict) -> list[CodeState]:
    """The code states a table's row holds under "commits" (as `CodeState.to_record` wrote them)."""
    return [CodeState.from_record(code) for code in row.get("commits", [])]


def commits_cell(states: Sequence[CodeState]) -> str:
    """'9621bbb', '9621bbb+dirty, 1f34963', 'unknown': a row's commits as its table cell."""
    return ", ".join(dict.fromkeys(state.label() for state in states)) or "unknown"


def describe(state: CodeState) -> str:
    """A state's label, with its changes' digest when dirty: two dirty trees of one commit are told apart."""
    return state.label() + (f" (changes {state.diff_sha256[:8]})" if state.dirty and state.diff_sha256 else "")


def is_training_file(path: str) -> bool:
    return path.startswith(TRAINING_PATHS)


@dataclass(frozen=True)
class CodeComparison:
    """What a table says of its rows' code: `mixed` when rows were trained by code that differs in TRAINING_PATHS
    (or cannot be compared), and the lines it prints at its top (mixed code, rows of unknown code)."""

    mixed: bool
    warnings: tuple[str, ...]


def compare_training_code(rows: Mapping[str, Sequence[CodeState]], code_root: Path = CODE_ROOT) -> CodeComparison:
    """Whether the rows (name -> the code states of its runs) were trained by the same training code; `code_root`:
    the checkout whose history compares commits (default: this code's)."""
    users: dict[CodeState, list[str]] = {}
    unknown = []
    for name, states in rows.items():
        for state in states:
            if state.commit is None:
                unknown.append(name)
            else:
                users.setdefault(state, []).append(name)
    known = list(users)
    differing: set[str] = set()
    missing: set[str] = set()
    for i, first in enumerate(known):
        for second in known[i + 1:]:
            files, unavailable = training_differences(first, second, Path(code_root))
            differing |= files
            missing |= unavailable
    warnings = []
    if differing or missing:
        shown = sorted(differing)[:SHOWN_FILES]
        more = len(differing) - len(shown)
        how = "differ in" if not missing else "differ in or cannot be compared in" if differing else \
            "cannot be compared in"
        warnings.append(
            f"Mixed code: the rows were trained at {len(known)} code states that {how} training files "
            f"({', '.join(TRAINING_PATHS)}): " + "; ".join(f"{describe(state)}: {', '.join(dict.fromkeys(names))}"
                                                          for state, names in users.items()) + ". "
            + (f"Differing: {', '.join(shown)}{f' and {more} more' if more else ''}. " if shown else "")
            + (f"Not in this checkout, so not compared: {', '.join(sorted(commit[:7] for commit in missing))}. "
               if missing else "")
            + "Their differences are partly the code's: compare rows trained at one commit, or rerun the others.")
    if unknown:
        names = list(dict.fromkeys(unknown))
        warnings.append(f"Unknown code: {', '.join(names)} {'has runs' if len(names) == 1 else 'have runs'} without "
                        "provenance.json (trained before runs recorded their commit): which code trained "
                        f"{'it' if len(names) == 1 else 'them'} cannot be checked.")
    return CodeComparison(bool(differing or missing), tuple(warnings))


def training_differences(first: CodeState, second: CodeState, code_root: Path) -> tuple[set[str], set[str]]:
    """The training files in which two code states differ (between their commits, and in either's uncommitted
    changes), and the commits of the two that `code_root` does not have (then not compared)."""
    files: set[str] = set()
    if first.commit != second.commit:
        missing = {state.commit for state in (first, second) if not has_commit(code_root, state.commit)}
        if missing:
            return files, missing
        names = run_git(code_root, "diff", "--name-only", "--no-renames", "-z", first.commit, second.commit, "--",
                        *TRAINING_PATHS).decode().split("\0")
        files |= {name for name in names if name}
    for state in (first, second):
        if state.dirty:
            files |= {path for path in state.changed_files if is_training_file(path)}
    return files, set()


def has_commit(code_root: Path, commit: str) -> bool:
    try:
        run_git(code_root, "cat-file", "-e", f"{commit}^{{commit}}")
    except GitError:
        return False
    return True
