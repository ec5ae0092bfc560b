"""Real git checkouts made in a test (git init, files, commits), for the tests of what code a run was trained by
(test_provenance, test_training_code, test_eval_results): dirty trees, untracked files and commits that differ in
some folders only are made, not patched in."""
import subprocess
from pathlib import Path


def git(repo: Path, *args: str) -> str:
    """`git ARGS` in `repo` with a fixed author (a test machine may have none configured); its stdout."""
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c",
                           "commit.gpgsign=false", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def write_files(repo: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)


def commit_all(repo: Path, message: str, files: dict[str, str] | None = None) -> str:
    """Write `files` (path -> text), commit everything, return the new commit."""
    write_files(repo, files or {})
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def make_checkout(repo: Path) -> Path:
    """A checkout with one commit: a training module, a config, docs and a .gitignore of runs/."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    commit_all(repo, "first", {"pretrain/loss.py": "SCALE = 1\n", "configs/run.yaml": "lr: 0.1\n",
                               "docs/notes.md": "a\n", ".gitignore": "/runs/\n"})
    return repo


def this_checkouts_label(root: Path) -> str:
    """What a table shows for a run started from `root` now: HEAD's short hash, '+dirty' when `git status` lists
    anything (tracked changes or untracked files)."""
    head = git(root, "rev-parse", "HEAD")
    return head[:7] + ("+dirty" if git(root, "status", "--porcelain") else "")
