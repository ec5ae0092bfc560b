"""The .beton writer: corrupt images skipped and reported, class order, max side, digits split, CLI errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pretrain.data.digits import digits_images, digits_split, write_digits
from pretrain.data.writer import classes_path, list_image_folder, skipped_report_path, write_image_folder
from tests.machine_speed import scaled
from tests.run_helpers import small_filesystem

REPO_ROOT = Path(__file__).resolve().parents[1]


def read_fields(path: Path) -> dict[str, np.ndarray]:
    from ffcv.reader import Reader

    reader = Reader(str(path))
    return {"image_height": reader.metadata["f0"]["height"], "image_width": reader.metadata["f0"]["width"],
            "label": reader.metadata["f1"], "index": reader.metadata["f2"],
            "height": reader.metadata["f3"], "width": reader.metadata["f4"]}


@pytest.fixture
def folder_with_corrupt_images(tmp_path) -> Path:
    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for name in ("zebra", "ant"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (30 + 10 * i, 80, 3), dtype=np.uint8)).save(root / name / f"{i}.jpg")
    good = (root / "ant" / "0.jpg").read_bytes()
    (root / "ant" / "truncated.jpg").write_bytes(good[:len(good) // 3])
    (root / "zebra" / "garbage.png").write_bytes(b"this is not a png")
    return root


def test_corrupt_images_are_skipped_counted_and_listed(folder_with_corrupt_images, tmp_path):
    out = tmp_path / "out" / "train.beton"
    report = write_image_folder(folder_with_corrupt_images, out, max_side=40)
    assert report.written == 6 and len(report.skipped) == 2
    lines = skipped_report_path(out).read_text().splitlines()
    assert sorted(Path(line.split("\t")[0]).name for line in lines) == ["garbage.png", "truncated.jpg"]
    assert all(line.split("\t")[1] for line in lines)             # every line has a reason
    assert "skipped 2" in report.summary()
    assert json.loads(classes_path(out).read_text()) == ["ant", "zebra"]   # sorted folder names
    fields = read_fields(out)
    assert fields["label"].tolist() == [0, 0, 0, 1, 1, 1]
    assert fields["index"].tolist() == list(range(6))
    assert (np.maximum(fields["height"], fields["width"]) <= 40).all()
    assert (fields["height"] == fields["image_height"]).all() and (fields["width"] == fields["image_width"]).all()
    assert fields["width"][0] == 40 and fields["height"][0] == 15          # 30x80 -> 15x40: aspect kept


def test_missing_or_empty_folders_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_image_folder(tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat" / "a.jpg")
    with pytest.raises(ValueError, match="no class sub-folders"):
        list_image_folder(tmp_path / "flat")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images"):
        list_image_folder(tmp_path / "empty")


def test_digits_split_is_stratified_and_reproducible():
    images, labels = digits_images()
    assert images.shape == (1797, 32, 32, 3) and images.dtype == np.uint8
    train, val = digits_split(labels)
    again_train, again_val = digits_split(labels)
    assert (train == again_train).all() and (val == again_val).all()
    assert len(val) == 360 and len(set(train) | set(val)) == 1797 and not set(train) & set(val)
    overall = np.bincount(labels, minlength=10) / len(labels)
    assert np.abs(np.bincount(labels[val], minlength=10) / len(val) - overall).max() < 0.01


def test_write_digits_skips_existing_files_unless_forced(tmp_path):
    reports = write_digits(tmp_path, write_mode="raw")
    assert [r.written for r in reports] == [1437, 360]
    fields = read_fields(tmp_path / "val.beton")
    _, labels = digits_images()
    _, val = digits_split(labels)
    assert fields["label"].tolist() == labels[val].tolist()
    assert [r.written for r in write_digits(tmp_path)] == [-1, -1]


@pytest.mark.slow
def test_cli_reports_a_missing_folder_and_has_help(tmp_path):
    run = write_cli("--image-folder", str(tmp_path / "nope"), "--out", str(tmp_path / "x.beton"))
    assert run.returncode == 2 and "does not exist" in run.stderr
    helped = write_cli("--help")
    assert helped.returncode == 0 and "--max-side" in helped.stdout


@pytest.mark.parametrize("command", [["pretrain.data", "write-digits"], ["pretrain.data", "write-fashion-mnist"],
                                     ["transfer", "digit-scenes"], ["transfer", "digit-scenes", "--moved-digits"]])
def test_an_out_dir_that_is_a_file_is_refused_in_one_line(tmp_path, capsys, command):
    """The writers' --out-dir, checked by one argparse type (`output_folder`); `transfer digit-scenes` gave
    FileExistsError's traceback."""
    import importlib

    main = importlib.import_module(f"{command[0]}.__main__").main
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as refused:
        main([*command[1:], "--out-dir", str(tmp_path / "a_file")])
    error = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and error.splitlines() == [error], error
    assert f"argument --out-dir: {tmp_path / 'a_file'} is a file" in error and "--help" in error
    assert (tmp_path / "a_file").read_text() == "x"


def write_cli(*args: str, timeout: int = 120):
    """`python -m pretrain.data write ARGS`, forked from a server that imported torch (tests/forked_runs.py)."""
    from tests import forked_runs

    return forked_runs.run("pretrain.data", ["write", *args], expect=None, timeout=timeout)


@pytest.fixture(scope="module")
def folder_with_a_huge_photo(tmp_path_factory) -> Path:
    """Two small images and one 6000 x 4000 JPEG (smooth, so it is quick to write and small on disk)."""
    import cv2

    root = tmp_path_factory.mktemp("huge") / "images"
    (root / "a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(root / "a" / f"small{i}.jpg")
    ramp = np.linspace(0, 255, 6000, dtype=np.float32)[None, :, None].repeat(4000, 0).repeat(3, 2)
    cv2.imwrite(str(root / "a" / "huge.jpg"), ramp.astype(np.uint8))
    return root


@pytest.mark.slow
def test_a_huge_photo_is_stored_at_the_default_max_side_and_nothing_hangs(folder_with_a_huge_photo, tmp_path):
    """A 6000 x 4000 JPEG is larger than FFCV's default page: written as it was, an FFCV worker died and the
    writer waited forever. The default now stores it at 512 px; `--max-side 0` keeps it, in larger pages."""
    from pretrain.data import DatasetError
    from pretrain.data.ffcv_loader import build_ffcv_loader

    bounded = write_cli("--image-folder", str(folder_with_a_huge_photo), "--out", str(tmp_path / "bounded.beton"))
    assert bounded.returncode == 0, bounded.stderr[-2000:]
    fields = read_fields(tmp_path / "bounded.beton")
    assert max(fields["height"].max(), fields["width"].max()) == 512
    assert sorted(zip(fields["height"].tolist(), fields["width"].tolist()))[-1] == (341, 512)   # aspect kept

    kept = write_cli("--image-folder", str(folder_with_a_huge_photo), "--out", str(tmp_path / "kept.beton"),
                     "--max-side", "0")
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert (4000, 6000) in zip(read_fields(tmp_path / "kept.beton")["height"].tolist(),
                               read_fields(tmp_path / "kept.beton")["width"].tolist())
    # Its decode buffers at batch 256 would need ~92 GB: refused by name, with the remedy, before FFCV allocates.
    with pytest.raises(DatasetError, match=r"largest image is 4000 x 6000 px.*--max-side 512"):
        build_ffcv_loader(tmp_path / "kept.beton", 32, 256, 1, drop_last=True)
    build_ffcv_loader(tmp_path / "bounded.beton", 32, 256, 1, drop_last=True)      # the bounded one is fine


@pytest.mark.slow
def test_a_killed_write_leaves_the_previous_beton_untouched(tmp_path):
    from ffcv.reader import Reader

    out = tmp_path / "data.beton"
    script = (
        "import sys, time, numpy as np\n"
        "from pretrain.data.writer import ArrayImageSet, write_beton\n"
        "n, delay = int(sys.argv[2]), float(sys.argv[3])\n"
        "def load(i):\n"
        "    time.sleep(delay)\n"
        "    return np.full((8, 8, 3), i % 255, np.uint8)\n"
        "write_beton(sys.argv[1], ArrayImageSet(load, [0] * n, None), workers=1)\n"
        "print('written', flush=True)\n")
    first = subprocess.run([sys.executable, "-c", script, str(out), "5", "0"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=scaled(120))
    assert "written" in first.stdout, first.stderr[-2000:]
    before = out.read_bytes()
    slow = subprocess.Popen([sys.executable, "-c", script, str(out), "400", "0.05"], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + scaled(60)
    while not (tmp_path / ".data.beton.partial").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)                                          # well into writing the 400 samples
    os.killpg(slow.pid, signal.SIGKILL)                      # the writer and its FFCV worker processes
    slow.wait(timeout=scaled(60))
    assert out.read_bytes() == before                        # the old file, whole
    assert Reader(str(out)).num_samples == 5
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".beton") == ["data.beton"]
    # The next write removes what the killed one left: its partial file and FFCV's shared memory (its resource
    # tracker died with it), which would otherwise stay in /dev/shm until the machine restarts.
    segment = Path("/dev/shm") / (tmp_path / ".data.beton.partial.shm").read_text()
    assert segment.exists()
    again = subprocess.run([sys.executable, "-c", script, str(out), "5", "0"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=scaled(120))
    assert "written" in again.stdout and f"the shared memory {segment.name}" in again.stderr, again.stderr[-2000:]
    assert not segment.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data.beton"]


def test_sixteen_bit_grayscale_png_is_scaled_to_eight_bits(tmp_path):
    import cv2
    from ffcv.fields.rgb_image import SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption

    root = tmp_path / "images" / "gradients"
    root.mkdir(parents=True)
    gradient = np.linspace(0, 65535, 32).round().astype(np.uint16)[None, :].repeat(16, 0)
    cv2.imwrite(str(root / "gray16.png"), gradient)
    assert Image.open(root / "gray16.png").mode == "I;16"                  # what Pillow makes of it
    write_image_folder(tmp_path / "images", tmp_path / "out.beton", write_mode="raw")
    loader = Loader(str(tmp_path / "out.beton"), batch_size=1, num_workers=1, order=OrderOption.SEQUENTIAL,
                    pipelines={"image": [SimpleRGBImageDecoder()], "label": None, "index": None, "height": None,
                               "width": None})
    (stored,) = next(iter(loader))
    expected = np.rint(gradient / 257.0).astype(np.uint8)
    for channel in range(3):
        assert np.array_equal(np.asarray(stored[0][..., channel]), expected)


def test_an_exif_rotated_photo_is_read_upright_by_the_writer_and_the_torchvision_loader(tmp_path):
    """A camera stores a portrait photo as landscape pixels plus EXIF orientation 6 (rotate 90 degrees clockwise to
    view); it used to be written on its side."""
    from pretrain.data.torchvision_loader import open_rgb
    from pretrain.data.writer import read_rgb

    pixels = np.zeros((10, 30, 3), np.uint8)            # 30 wide, 10 high as stored; a white first column
    pixels[:, 0] = 255
    exif = Image.Exif()
    exif[0x0112] = 6                                     # Orientation: rotate 90 CW to display
    Image.fromarray(pixels).save(tmp_path / "portrait.jpg", quality=95, exif=exif)
    upright = read_rgb(tmp_path / "portrait.jpg")
    assert upright.shape == (30, 10, 3)                  # displayed: 10 wide, 30 high
    assert upright[0, :, 0].mean() > 200 and upright[-1, :, 0].mean() < 50        # the white column is now the top row
    assert np.array_equal(np.asarray(open_rgb(tmp_path / "portrait.jpg")), upright)


def test_every_format_pillow_decodes_is_written_and_a_jpeg_quality_outside_1_to_100_is_refused(tmp_path):
    """BMP, GIF (animated: its first frame), TIFF and WebP files used to be left out without being counted."""
    folder = tmp_path / "images" / "things"
    folder.mkdir(parents=True)
    pixels = (np.random.default_rng(0).random((12, 12, 3)) * 255).astype(np.uint8)
    for suffix in ("jpg", "png", "bmp", "tif", "webp"):
        Image.fromarray(pixels).save(folder / f"image.{suffix}")
    frames = [Image.fromarray(pixels), Image.fromarray(255 - pixels)]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:])
    report = write_image_folder(tmp_path / "images", tmp_path / "out.beton", workers=1)
    assert report.written == 6 and not report.skipped
    with pytest.raises(ValueError, match="--jpeg-quality 150 must lie in 1-100"):
        write_image_folder(tmp_path / "images", tmp_path / "q.beton", jpeg_quality=150)
    assert not (tmp_path / "q.beton").exists()


@pytest.mark.slow
def test_a_full_disk_ends_the_write_with_the_reason_and_no_partial_file(tmp_path):
    """A real full disk: the output folder on a 300 KB tmpfs in a private mount namespace (tests/run_helpers.py:
    small_filesystem). FFCV's workers die on ENOSPC and its parent used to wait for them forever (the forked run's
    timeout names such a hang), the partial file keeping the disk full."""
    images = tmp_path / "images" / "noise"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(300):
        Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8)).save(images / f"{i}.png")
    with small_filesystem(tmp_path / "disk", "300k") as disk:
        written = write_cli("--image-folder", str(tmp_path / "images"), "--out", str(disk / "x.beton"),
                            "--write-mode", "raw")
        last_line = written.stderr.strip().splitlines()[-1]
        assert written.returncode == 2, last_line
        assert last_line.startswith("error: ") and "no space left on device" in last_line
        assert os.listdir(disk) == []                                       # no partial .beton keeps the disk full


SLOW_WRITE = """
import sys, time
import numpy as np
from pretrain.data.writer import ArrayImageSet, write_beton


def image(i):
    time.sleep(0.02)                  # 400 images on 2 workers: about 4 s, time to be killed in the middle
    return np.full((16, 16, 3), i % 255, dtype=np.uint8)

write_beton(sys.argv[1], ArrayImageSet(image, [0] * 400, None), write_mode="raw")
"""


def worker_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (FFCV's writer workers)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return children


@pytest.mark.slow
def test_a_write_killed_with_sigkill_leaves_no_worker_and_the_next_write_removes_what_it_left(tmp_path, capsys):
    """`kill -9` of the writer used to leave an FFCV worker running on, which kept the shared memory segment
    (/dev/shm/psm_*) and `.NAME.beton.partial` until the machine restarted. Its workers now die with it; and when the
    whole process group is killed (its resource tracker too, as Slurm does), the next write removes the partial file
    and the segment (its name is recorded beside the partial file), and says so."""
    from pretrain.data.writer import ArrayImageSet, write_beton

    out = tmp_path / "x.beton"
    partial, record = tmp_path / ".x.beton.partial", tmp_path / ".x.beton.partial.shm"

    def start_and_wait_for_the_workers() -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, str(out)], cwd=REPO_ROOT, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + scaled(60)
        # the record must name a live segment: in part 2 the record of part 1's write (its segment freed) is still
        # there until the new write replaces it, and a child of the writer (its resource tracker) may already run
        while not (record.exists() and record.read_text() and Path(f"/dev/shm/{record.read_text()}").exists()
                   and worker_pids(process.pid)):
            assert process.poll() is None and time.time() < deadline, "the write ended before it was killed"
            time.sleep(0.05)
        return process

    # 1. SIGKILL to the writer alone: its workers die too, and its resource tracker frees the segment.
    process = start_and_wait_for_the_workers()
    workers, segment = worker_pids(process.pid), record.read_text()
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=scaled(60))
    deadline = time.time() + scaled(20)
    while any(Path(f"/proc/{pid}").exists() for pid in workers) or Path(f"/dev/shm/{segment}").exists():
        assert time.time() < deadline, f"workers {workers} or /dev/shm/{segment} outlived the killed write"
        time.sleep(0.1)
    assert partial.exists() and not out.exists()

    # 2. SIGKILL to the whole process group: the segment stays, and the next write removes it and the partial file.
    process = start_and_wait_for_the_workers()
    segment = record.read_text()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=scaled(60))
    time.sleep(0.5)
    assert Path(f"/dev/shm/{segment}").exists() and partial.exists()
    capsys.readouterr()
    write_beton(out, ArrayImageSet(lambda i: np.zeros((8, 8, 3), np.uint8), [0, 1], None), write_mode="raw")
    note = capsys.readouterr().err
    assert f"removed {partial} and the shared memory {segment}, left by a write to {out} that was killed" in note
    assert not Path(f"/dev/shm/{segment}").exists() and not partial.exists() and not record.exists()
    assert read_fields(out)["label"].tolist() == [0, 1]


def test_a_second_write_to_the_same_file_while_one_runs_is_refused(tmp_path):
    """Two writes to one .beton would write one partial file together; the second is refused by name."""
    from pretrain.data import DatasetError
    from pretrain.data.writer import ArrayImageSet, locked_partial_file, write_beton

    out = tmp_path / "x.beton"
    with locked_partial_file(out):
        with pytest.raises(DatasetError, match="another write to .*x.beton is in progress"):
            write_beton(out, ArrayImageSet(lambda i: np.zeros((8, 8, 3), np.uint8), [0], None), write_mode="raw")
    assert not out.exists() and not (tmp_path / ".x.beton.partial").exists()


def failing_image(index: int) -> np.ndarray:
    """An image loader whose sample 40 fails in FFCV's worker: an exception, or the worker killed outright (a segfault
    or the OOM killer)."""
    if index == 40:
        if os.environ.get("HARDVIEW_TEST_FAILURE") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("this image cannot be loaded")
    return np.zeros((8, 8, 3), np.uint8)


@pytest.mark.parametrize("failure, exit", [("raise", "exit status 1"), ("kill", "signal SIGKILL")])
def test_a_writer_worker_that_ends_early_fails_the_write_by_its_exit_and_leaves_nothing(tmp_path, monkeypatch, capfd,
                                                                                       failure, exit):
    """FFCV's writer waits for its workers' progress without looking at them: a worker that ended before the write
    was done made the write wait forever. The write now fails within a second or two, naming the worker's exit,
    with nothing left behind: no partial file, no worker, the lock released for the next write."""
    from multiprocessing import resource_tracker

    from pretrain.data.writer import ArrayImageSet, write_beton

    monkeypatch.setenv("HARDVIEW_TEST_FAILURE", failure)
    out = tmp_path / "x.beton"
    resource_tracker.ensure_running()          # a child of this process from the first shared memory on, not a worker
    children_before = set(worker_pids(os.getpid()))
    with pytest.raises(ChildProcessError, match=rf"an FFCV writer worker \(pid \d+\) ended with {exit} before the "
                                                rf"write to {tmp_path} was done.*run the write again"):
        write_beton(out, ArrayImageSet(failing_image, [0] * 200, None), write_mode="raw", workers=2)
    if failure == "raise":
        assert "RuntimeError: this image cannot be loaded" in capfd.readouterr().err   # the worker's traceback
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    assert set(worker_pids(os.getpid())) <= children_before                  # both workers ended and reaped
    monkeypatch.setenv("HARDVIEW_TEST_FAILURE", "none")
    write_beton(out, ArrayImageSet(lambda i: np.zeros((8, 8, 3), np.uint8), [0, 1], None), write_mode="raw")
    assert read_fields(out)["label"].tolist() == [0, 1]


def test_float_tiffs_are_scaled_from_0_1_or_skipped_by_name(tmp_path):
    """32-bit float TIFFs (Pillow mode F) were stored black: convert('RGB') clips 0.5 and 0.9 to 0. Values in [0, 1]
    are scaled by 255; another range is skipped and listed with the reason."""
    from pretrain.data.writer import read_rgb

    root = tmp_path / "images" / "a"
    root.mkdir(parents=True)
    values = np.array([[0.5, 0.9], [0.0, 1.0]], dtype=np.float32)
    Image.fromarray(values, mode="F").save(root / "unit.tif")
    Image.fromarray(values * 300, mode="F").save(root / "other_range.tif")
    Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(root / "plain.png")
    assert read_rgb(root / "unit.tif")[..., 0].tolist() == [[128, 229], [0, 255]]     # float32 0.9 x 255 = 229.49
    assert (read_rgb(root / "unit.tif") == read_rgb(root / "unit.tif")[..., :1]).all()     # gray in R, G, B
    report = write_image_folder(tmp_path / "images", tmp_path / "f.beton", write_mode="raw")
    assert report.written == 2 and [Path(path).name for path, _ in report.skipped] == ["other_range.tif"]
    assert "32-bit float image with values from 0 to 300" in report.skipped[0][1]


def test_a_worker_error_is_raised_in_ffcvs_wait_not_wherever_a_signal_lands(tmp_path):
    """A SIGCHLD handler raised the worker's error wherever the main thread happened to be, and an `except OSError`
    there (ChildProcessError is one) or a garbage collector's finalizer swallowed it: FFCV then waited forever
    (2026-11-29, a fresh clone's `make test` hung in the test above; one write in some 300 on a busy CPU). The check
    now runs in FFCV's own wait, `ffcv.writer.sleep`, whose loop catches nothing. Here the write spends its time in
    code that swallows OSErrors, as the handler's victims did, between short waits of FFCV's: the error must reach
    the caller, naming the worker's exit, within a few of those waits."""
    import multiprocessing

    import ffcv.writer

    from pretrain.data.writer_workers import run_watching_workers_and_disk

    def write_that_swallows_os_errors_between_waits():
        worker = multiprocessing.get_context("fork").Process(target=sys.exit, args=(3,))
        worker.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)               # a signal handler's error raised here was lost
            except OSError:
                pass
            ffcv.writer.sleep(0)               # FFCV's wait between two reads of its workers' progress

    started = time.monotonic()
    with pytest.raises(ChildProcessError, match=r"\(pid \d+\) ended with exit status 3 before the write"):
        run_watching_workers_and_disk(write_that_swallows_os_errors_between_waits, tmp_path / "x.beton.partial", 1)
    assert time.monotonic() - started < 5 and ffcv.writer.sleep is time.sleep     # FFCV's own wait back after
