"""pretrain/runtime/provenance.py on real git checkouts made in the test: the commit, a dirty tree (tracked changes and
untracked files, not ignored ones), the digest that tells two dirty trees apart, no checkout (a reason, never an
exception); RUN_DIR/provenance.json appended start by start; `made_by` reading the same state. A whole run's record
is checked in tests/test_pretrain_run.py (its start, two refused starts, a resume and a rerun)."""
import json
from pathlib import Path

import pytest

from eval.results import made_by
from pretrain.runtime.provenance import PROVENANCE_FILE, CodeState, read_code_state, read_starts, record_start
from tests.git_checkouts import commit_all, git, make_checkout


@pytest.fixture
def checkout(tmp_path) -> Path:
    return make_checkout(tmp_path / "checkout")


def test_a_clean_checkout_is_its_commit_and_an_ignored_file_leaves_it_clean(checkout):
    (checkout / "runs").mkdir()
    (checkout / "runs" / "metrics.jsonl").write_text("{}\n")          # ignored by .gitignore: not code
    assert read_code_state(checkout) == CodeState(git(checkout, "rev-parse", "HEAD"), dirty=False)


def test_tracked_changes_and_untracked_files_make_a_dirty_tree_whose_digest_tells_the_changes_apart(checkout):
    head = git(checkout, "rev-parse", "HEAD")
    (checkout / "pretrain" / "hvs.py").write_text("def select(): ...\n")       # a new module, not yet added
    untracked = read_code_state(checkout)
    assert (untracked.commit, untracked.dirty, untracked.changed_files) == (head, True, ("pretrain/hvs.py",))
    assert len(untracked.diff_sha256) == 64

    (checkout / "pretrain" / "hvs.py").write_text("def select(): return 1\n")   # the same file, other contents
    edited = read_code_state(checkout)
    assert edited.diff_sha256 != untracked.diff_sha256

    (checkout / "pretrain" / "hvs.py").unlink()
    (checkout / "pretrain" / "loss.py").write_text("SCALE = 2\n")               # a tracked change
    tracked = read_code_state(checkout)
    assert tracked.dirty and tracked.changed_files == ("pretrain/loss.py",)
    git(checkout, "add", "pretrain/loss.py")                                   # staged: the same change
    assert read_code_state(checkout).diff_sha256 == tracked.diff_sha256
    (checkout / "pretrain" / "loss.py").write_text("SCALE = 3\n")
    assert read_code_state(checkout).diff_sha256 not in (tracked.diff_sha256, None)
    (checkout / "pretrain" / "loss.py").write_text("SCALE = 1\n")
    git(checkout, "add", "pretrain/loss.py")
    assert read_code_state(checkout) == CodeState(head, dirty=False)           # back to the commit: clean


def test_outside_a_checkout_the_commit_is_none_with_the_reason(checkout, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    state = read_code_state(plain)
    assert state.commit is None and state.dirty is None and state.reason
    inside = read_code_state(checkout / "pretrain")       # e.g. a package installed into a checkout's .venv
    assert inside.commit is None and f"lies inside {checkout.resolve()}" in inside.reason
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert read_code_state(empty).commit is None and "HEAD" in read_code_state(empty).reason     # no commit yet
    assert made_by("python -m eval table r", plain)[0].startswith("Made by `python -m eval table r` at commit "
                                                                   "unknown (")


def test_made_by_marks_an_untracked_file_as_uncommitted_changes(checkout):
    """It read `git status --untracked-files=no`: a table made with a new module not yet added said "at commit X"."""
    head = git(checkout, "rev-parse", "HEAD")
    assert made_by("cmd", checkout) == (f"Made by `cmd` at commit {head}.", head)
    (checkout / "pretrain" / "new_method.py").write_text("x = 1\n")
    sentence, commit = made_by("cmd", checkout)
    digest = read_code_state(checkout).diff_sha256
    assert sentence == f"Made by `cmd` at commit {head} with uncommitted changes (sha256 {digest[:12]})."
    assert commit.startswith(f"{head} with uncommitted changes")


def test_every_start_is_appended_and_an_unreadable_record_is_kept_aside(checkout, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("method:\n  name: simclr\nseed: 3\n")
    first = record_start(run_dir, 0, code_root=checkout)
    assert first["code"] == {"commit": git(checkout, "rev-parse", "HEAD"), "dirty": False, "diff_sha256": None,
                             "changed_files": [], "reason": None}
    assert first["config"] == {"method": {"name": "simclr"}, "seed": 3}
    assert set(first["packages"]) == {"python", "torch", "torchvision", "deepspeed", "timm", "ffcv", "numpy"}
    assert first["packages"]["torch"].startswith(__import__("torch").__version__.split("+")[0])
    assert first["machine"]["cpu_count"] >= first["machine"]["cpu_affinity"] >= 1
    assert first["machine"]["torch_threads"] >= 1 and first["started"].endswith("+00:00")

    later = commit_all(checkout, "second", {"pretrain/loss.py": "SCALE = 2\n"})    # resumed at another commit
    record_start(run_dir, 40, code_root=checkout)
    starts = read_starts(run_dir)
    assert [(start["step"], start["code"]["commit"]) for start in starts] == [(0, first["code"]["commit"]),
                                                                             (40, later)]
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", PROVENANCE_FILE]   # no temporary left

    (run_dir / PROVENANCE_FILE).write_text('[{"started": ')                 # damaged by hand
    record_start(run_dir, 50, {"seed": 4}, code_root=checkout)
    assert [(s["step"], s["config"]) for s in read_starts(run_dir)] == [(50, {"seed": 4})]
    assert (run_dir / (PROVENANCE_FILE + ".unreadable")).read_text() == '[{"started": '
    assert read_starts(tmp_path) == []                                        # a run from before: nothing recorded
    json.loads((run_dir / PROVENANCE_FILE).read_text())
