"""eval/training_code.py on a real git checkout made in the test: rows trained at commits that differ only in docs
train alike; a training file changed between commits, uncommitted changes under pretrain/ that differ, or a commit
the checkout lacks make the table's code mixed; a run without provenance is unknown, named but not "mixed"."""
from pathlib import Path

import pytest

from eval.training_code import commits_cell, compare_training_code, read_code_states
from pretrain.runtime.provenance import CodeState, record_start
from tests.git_checkouts import commit_all, make_checkout, write_files


@pytest.fixture
def checkout(tmp_path) -> Path:
    return make_checkout(tmp_path / "checkout")


def started(run_dir: Path, checkout: Path) -> Path:
    """A run directory whose start is recorded from `checkout` as it is now."""
    run_dir.mkdir(parents=True)
    record_start(run_dir, 0, {}, code_root=checkout)
    return run_dir


def test_commits_that_differ_only_outside_the_training_files_are_not_mixed(checkout, tmp_path):
    first = started(tmp_path / "first", checkout)
    later = commit_all(checkout, "docs", {"docs/notes.md": "b\n", "eval/table.py": "# how tables look\n"})
    second = started(tmp_path / "second", checkout)
    rows = {"a": read_code_states([first]), "b": read_code_states([second])}
    assert commits_cell(rows["b"]) == later[:7]
    comparison = compare_training_code(rows, checkout)
    assert (comparison.mixed, comparison.warnings) == (False, ())
    # a dirty tree whose changes are all outside the training files trains as its commit does
    write_files(checkout, {"docs/notes.md": "c\n"})
    docs_dirty = started(tmp_path / "docs_dirty", checkout)
    assert commits_cell(read_code_states([docs_dirty])) == later[:7] + "+dirty"
    assert not compare_training_code({**rows, "c": read_code_states([docs_dirty])}, checkout).mixed


def test_a_training_file_changed_between_the_rows_commits_is_mixed_code_naming_commits_rows_and_files(checkout,
                                                                                                      tmp_path):
    first = started(tmp_path / "first", checkout)
    same = started(tmp_path / "same", checkout)
    later = commit_all(checkout, "a loss fixed", {"pretrain/loss.py": "SCALE = 2\n", "configs/run.yaml": "lr: 1\n"})
    second = started(tmp_path / "second", checkout)
    rows = {"simclr": read_code_states([first, same]), "simclr_hvs": read_code_states([second])}
    comparison = compare_training_code(rows, checkout)
    assert comparison.mixed and len(comparison.warnings) == 1
    head = rows["simclr"][0].commit
    assert comparison.warnings[0] == (
        "Mixed code: the rows were trained at 2 code states that differ in training files (pretrain/, configs/, "
        f"transfer/): {head[:7]}: simclr; {later[:7]}: simclr_hvs. Differing: configs/run.yaml, pretrain/loss.py. "
        "Their differences are partly the code's: compare rows trained at one commit, or rerun the others.")
    # one row whose runs were trained at both: the same warning, and the row shows both commits
    resumed = read_code_states([first, second])
    assert commits_cell(resumed) == f"{head[:7]}, {later[:7]}"
    assert compare_training_code({"resumed": resumed}, checkout).mixed


def test_uncommitted_training_changes_that_differ_at_one_commit_are_mixed_and_the_same_changes_are_not(checkout,
                                                                                                     tmp_path):
    write_files(checkout, {"pretrain/loss.py": "SCALE = 5\n"})
    five, five_again = started(tmp_path / "five", checkout), started(tmp_path / "five_again", checkout)
    write_files(checkout, {"pretrain/new_loss.py": "NEW = 1\n"})                  # an untracked module added
    six = started(tmp_path / "six", checkout)
    same = {"a": read_code_states([five]), "b": read_code_states([five_again])}
    assert not compare_training_code(same, checkout).mixed                       # the very same changes
    comparison = compare_training_code({**same, "c": read_code_states([six])}, checkout)
    assert comparison.mixed
    digests = [states[0].diff_sha256[:8] for states in (same["a"], read_code_states([six]))]
    assert f"+dirty (changes {digests[0]}): a, b; " in comparison.warnings[0]
    assert f"+dirty (changes {digests[1]}): c. Differing: pretrain/loss.py, pretrain/new_loss.py." \
        in comparison.warnings[0]


def test_a_commit_this_checkout_lacks_is_mixed_and_a_run_without_provenance_is_unknown(checkout, tmp_path):
    here = started(tmp_path / "here", checkout)
    elsewhere = CodeState("f" * 40, dirty=False)                                 # e.g. a rebased-away commit
    comparison = compare_training_code({"a": read_code_states([here]), "b": [elsewhere]}, checkout)
    assert comparison.mixed and "Not in this checkout, so not compared: fffffff. " in comparison.warnings[0]

    old = tmp_path / "old"
    old.mkdir()                                                                 # a run from before provenance.json
    states = read_code_states([old])
    assert commits_cell(states) == "unknown" and "has no provenance.json" in states[0].reason
    comparison = compare_training_code({"a": read_code_states([here]), "old": states}, checkout)
    assert not comparison.mixed
    assert comparison.warnings == ("Unknown code: old has runs without provenance.json (trained before runs "
                                   "recorded their commit): which code trained it cannot be checked.",)
    (old / "provenance.json").write_text("{not json")
    assert "cannot be read" in read_code_states([old])[0].reason
