"""Bad input to `python -m pretrain`, as a new user types it: each is refused before anything starts, with exit
status 2 and one line (no traceback) that names the bad value and says what to do.

(Resuming with another batch size or number of processes, a run directory in use, a full disk, a divergence:
tests/test_pretrain_run.py. The data writer's and the evaluation's bad input: test_writer.py, test_eval.py.)
"""
from pathlib import Path

import pytest

from pretrain.__main__ import main
from tests.run_helpers import small_filesystem

ROOT = Path(__file__).parents[1]
CONFIG = str(ROOT / "configs/pretrain/simclr_digits.yaml")


def refused(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err                  # one line, no traceback
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize("override, expected", [
    ("optim.epochs=-1", "optim.epochs=-1 must be a finite number >= 1"),
    ("optim.epochs=0", "optim.epochs=0 must be a finite number >= 1"),
    ("optim.lr=-1", "optim.lr=-1.0 must be a finite number > 0"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number > 0"),
    ("data.views.0.size=0", "data.views.0: ViewGroup needs count >= 1 and size >= 1, got count=2, size=0"),
    ("model.arch=resnet181", "model.arch='resnet181' is not a timm model name; did you mean resnet18"),
    ("engine.max_steps=-3", "engine.max_steps=-3 must be a finite number >= 0"),
    ("data.num_workers=-1", "data.num_workers=-1 must be a finite number >= 0"),
    ("hvs.enabld=true", "did you mean 'hvs.enabled'"),
    ("data.views.0.scale=[0.9,0.2]", "data.views.0: ViewGroup.scale must satisfy 0 < min <= max <= 1"),
    ("data.eval_crop_fraction=1.5", "data.eval_crop_fraction=1.5 must lie in (0, 1]"),
    ("optim.lr=[1", "is not valid YAML; quote it"),
    ("optim.betas=[1.5,0.999]", "optim.betas=[1.5, 0.999] must be two numbers in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ("name=''", "name='' must be a folder name"),          # it trained into runs/ itself, among every other run
    ("name=a/b", "name='a/b' must be a folder name"),
])
def test_bad_values_are_refused_by_name(capsys, tmp_path, override, expected):
    refused(capsys, ["--config", CONFIG, override, f"run_dir={tmp_path / 'run'}"], "config error: ", expected)
    assert not (tmp_path / "run").exists()


def test_invalid_yaml_and_a_list_at_the_top_level(capsys, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\noptim:\n  lr: [0.1\n")
    refused(capsys, ["--config", str(broken)], f"config file '{broken}' is not valid YAML at line")
    listed = tmp_path / "list.yaml"
    listed.write_text("- name: x\n- optim: {lr: 0.1}\n")
    refused(capsys, ["--config", str(listed)], "holds a list at its top level")


def test_training_data_the_backend_cannot_read(capsys, tmp_path, digits):
    run_dir = f"run_dir={tmp_path / 'run'}"
    refused(capsys, ["--config", CONFIG, run_dir, f"data.train={tmp_path / 'nope.beton'}"], "does not exist",
            "python -m pretrain.data write")
    refused(capsys, ["--config", CONFIG, run_dir, f"data.train={tmp_path}"], "is a folder, but data.backend=ffcv")
    refused(capsys, ["--config", CONFIG, run_dir, f"data.train={ROOT / 'README.md'}"], "README.md")
    partial = tmp_path / "partial.beton"
    whole = (digits / "train.beton").read_bytes()
    partial.write_bytes(whole[: len(whole) // 2])
    refused(capsys, ["--config", CONFIG, run_dir, f"data.train={partial}"], str(partial))
    refused(capsys, ["--config", CONFIG, run_dir, f"data.train={digits / 'train.beton'}", "data.backend=torchvision"],
            "is a file, but data.backend=torchvision reads an image folder")
    assert not (tmp_path / "run").exists()


def test_more_loader_workers_than_the_machine_has_run_with_what_there_is(capsys, tmp_path, digits):
    """data.num_workers above numba's thread limit crashed in numba ("number of threads must be between 1 and N");
    the ImageNet-sized configs ship num_workers: 8."""
    import numba

    assert main(["--config", CONFIG, f"run_dir={tmp_path / 'run'}", f"data.train={digits / 'train.beton'}",
                 f"data.val={digits / 'val.beton'}", "data.num_workers=64", "engine.max_steps=1",
                 "model.proj_hidden_dim=64", "engine.image_grid_every_steps=0"]) == 0
    assert (f"data.num_workers=64 is more than the {numba.config.NUMBA_NUM_THREADS} threads this machine gives "
            f"numba: using {numba.config.NUMBA_NUM_THREADS}") in capsys.readouterr().err


def test_a_run_dir_that_is_a_file_is_refused_by_name(capsys, tmp_path, digits):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    refused(capsys, ["--config", CONFIG, f"run_dir={afile}", f"data.train={digits / 'train.beton'}"],
            f"run_dir={afile} is a file")
    assert afile.read_text() == "mine"


def test_the_torchvision_backend_names_an_unreadable_image_or_an_empty_folder_in_one_line(capsys, tmp_path, digits):
    """A text file named .jpg used to end in a DataLoader worker's traceback at whichever batch held it, and a folder
    of class folders without images in a traceback at the first batch."""
    folder = tmp_path / "images"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
    common = ["--config", CONFIG, f"run_dir={tmp_path / 'run'}", f"data.train={folder}", "data.backend=torchvision",
              f"data.val={digits / 'val.beton'}", "engine.max_steps=1", "data.batch_size=5", "data.num_workers=1",     # one batch: all 5 images
              "engine.image_grid_every_steps=0"]
    refused(capsys, common, "has class sub-folders but no images")
    from PIL import Image

    for name in ("a", "b"):
        for i in range(2):
            Image.new("RGB", (20, 20), (i * 100, 50, 50)).save(folder / name / f"{i}.png")
    (folder / "b" / "notes.jpg").write_text("not a JPEG")
    error = refused(capsys, common, f"Cannot read {folder / 'b' / 'notes.jpg'}", "OUT.skipped.txt")
    assert "Traceback" not in error and "DataLoader worker" not in error


def test_a_missing_validation_set_is_refused_before_training(capsys, tmp_path, digits):
    """data.val is read by every evaluation of the run, not by the training: a typo trained for the whole schedule
    and exited 0, and only the evaluation found it missing."""
    refused(capsys, ["--config", CONFIG, f"run_dir={tmp_path / 'run'}", f"data.train={digits / 'train.beton'}",
                     f"data.val={tmp_path / 'vall.beton'}"], f"data.val='{tmp_path / 'vall.beton'}' does not exist")
    assert not (tmp_path / "run").exists()


def test_views_too_large_for_memory_are_refused_before_the_first_batch(capsys, tmp_path, digits):
    """data.views.0.size=100000 asked the allocator for 30 TB at the first batch, in a traceback."""
    refused(capsys, ["--config", CONFIG, f"run_dir={tmp_path / 'run'}", f"data.train={digits / 'train.beton'}",
                     f"data.val={digits / 'val.beton'}", "data.views.0.size=100000"],
            "views of data.views.0: 2 x 100000 px would take", "half of this machine's memory")
    assert not (tmp_path / "run").exists()


def test_a_file_where_the_run_directory_would_go_is_refused_in_one_line(tmp_path, digits, capsys):
    """run_dir=notes.txt/run: a file on the path, said as such (it was refused as "this user may not write there",
    the file not being searchable), before any process starts."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    assert main(["--config", CONFIG, f"run_dir={notes / 'run'}", f"data.train={digits / 'train.beton'}",
                 f"data.val={digits / 'val.beton'}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: cannot write {notes}: Not a directory; put the run on a writable filesystem with space left "
        "(run_dir=PATH), or free some space")
    assert notes.read_text() == "not a folder"


def test_a_run_directory_where_no_folder_can_be_made_is_refused_in_one_line(digits, capsys):
    """/proc takes no new folders (mkdir: "No such file or directory"), which check_writable cannot see ahead: the
    run's directory is refused by name in one line with status 2 when it is made, not with a traceback."""
    import os

    run_dir = f"/proc/hardview_{os.getpid()}/run"
    assert main(["--config", CONFIG, f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
                 f"data.val={digits / 'val.beton'}"]) == 2
    err = capsys.readouterr().err.strip()
    if os.geteuid() == 0:                               # root may write into /proc's folder; mkdir itself refuses
        assert err == (f"error: cannot create the run directory {run_dir}: No such file or directory "
                       f"(/proc/hardview_{os.getpid()}); choose run_dir=PATH where folders can be created")
    else:                                               # another user may not: refused before any process starts
        assert err == "error: cannot write /proc: Permission denied; put the run on a writable filesystem with " \
                      "space left (run_dir=PATH), or free some space"


@pytest.mark.slow
def test_a_run_directory_on_a_read_only_filesystem_is_refused_in_one_line(tmp_path, digits, capsys):
    """A real read-only filesystem (a tmpfs mounted ro in a private mount namespace, tests/run_helpers.py:
    small_filesystem; chmod does not stop root): the run's directory cannot be created there, said in one line with
    exit status 2, not a traceback."""
    with small_filesystem(tmp_path / "disk", "1m", read_only=True) as disk:
        refused(capsys, ["--config", CONFIG, f"run_dir={disk / 'run'}", f"data.train={digits / 'train.beton'}",
                         f"data.val={digits / 'val.beton'}"], f"error: cannot write {disk}: Read-only file system")
