"""Where results go and how they are written: the one place for RUN_DIR/eval/*.json and their TensorBoard scalars.

Every evaluation of a backbone export (`python -m eval knn|linear|retrieval`, `python -m eval watch`, the
fine-tuning and detection of `python -m transfer`) records its result as

    RUN_DIR/eval/{name}_step{step:07d}.json        the result, written last and atomically: the record that it is done
    RUN_DIR/eval/{name}_step{step:07d}{suffix}      optional extra files next to it (e.g. `_detections.json`)
    RUN_DIR/tb/events.out.tfevents.*.{name}_step{step:07d}
                                                   its TensorBoard scalars at the export's step, next to the
                                                   training curves, in an event file of their own

`name` is the protocol (`knn`, `linear`, `finetune_10pct_export`, `detection_random`, ...), followed, for an export
evaluated otherwise than its run's own evaluation, by what differs (`evaluation_suffix`): `_on_{val set}_{6 hex
digits}` for other data (`--train` / `--val`), `_at_{N}px` for another side (`--image-size`), `_crop{F}` for
another crop (`--crop-fraction`), so that such a result never replaces the run's own. A result is written
again (a re-run, or an attempt that crashed before its JSON) without duplicating its scalars in TensorBoard:
the event file named after the result is replaced, not added to.

This module imports nothing of the project but `pretrain.runtime.atomic_write` and `pretrain.runtime.provenance`
(which commit made a table), and TensorBoard only when it writes.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.provenance import CODE_ROOT, read_code_state

RESULTS_DIR = "eval"       # RUN_DIR/eval: the results (and the feature caches of `python -m eval`)
TENSORBOARD_DIR = "tb"     # RUN_DIR/tb: the training curves, and the results' scalars beside them


def result_stem(name: str, step: int) -> str:
    """`{name}_step{step:07d}`: the file name, without suffix, of the result of `name` on the export of `step`."""
    return f"{name}_step{int(step):07d}"


def result_path(run_dir: str | Path, name: str, step: int, suffix: str = ".json") -> Path:
    """RUN_DIR/eval/{name}_step{step:07d}{suffix}: one result per protocol and export step (`suffix` ".json"), or
    a file written next to it (e.g. suffix "_detections.json")."""
    return Path(run_dir) / RESULTS_DIR / f"{result_stem(name, step)}{suffix}"


def feature_cache_path(run_dir: str | Path, step: int) -> Path:
    """RUN_DIR/eval/features_step{step:07d}.pt: the features `python -m eval` extracted from the export of `step`
    (a cache, not a result: `python -m eval watch` deletes it once every protocol has run on that step)."""
    return result_path(run_dir, "features", step, ".pt")


def write_result(run_dir: str | Path, name: str, step: int, result: Mapping[str, Any],
                 scalars: Mapping[str, float], extra_files: Mapping[str, str] | None = None) -> Path:
    """Record a result: the `extra_files`, then the TensorBoard `scalars`, then the JSON; returns the JSON's path.

    run_dir:     the run directory (RUN_DIR).
    name, step:  the protocol and the export's step; the result is RUN_DIR/eval/{name}_step{step:07d}.json.
    result:      the JSON's content, written as given (indent 2), last and atomically: its existence says the
                 evaluation is done (what `python -m eval watch` looks for).
    scalars:     TensorBoard tag -> value, written at global step `step` to RUN_DIR/tb, in an event file of its
                 own named after the result. An event file of an earlier write of the same result (a re-run,
                 or an attempt that never reached its JSON) is deleted first, so the scalars are in
                 TensorBoard once, whatever the number of attempts.
    extra_files: suffix -> text of files written next to the JSON, each atomically, before the scalars and
                 the JSON: {"_detections.json": text} writes RUN_DIR/eval/{name}_step{step:07d}_detections.json
                 (find its path with `result_path(run_dir, name, step, suffix)`).
    """
    run_dir = Path(run_dir)
    path = result_path(run_dir, name, step)
    stem = result_stem(name, step)
    for suffix in extra_files or {}:
        if not suffix or suffix == ".json" or "/" in suffix:
            raise ValueError(f"extra file suffix {suffix!r} must be non-empty, other than '.json' (the result "
                             "itself) and name a file next to it")
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in (extra_files or {}).items():
        write_text_atomically(result_path(run_dir, name, step, suffix), text)
    write_scalars(run_dir / TENSORBOARD_DIR, stem, step, scalars)
    write_text_atomically(path, json.dumps(dict(result), indent=2) + "\n")
    return path


@contextmanager
def writer_thread_errors_reported_once() -> Iterator[None]:
    """TensorBoard's writer thread keeps an OSError it meets (a full disk) for the caller's next write, flush or close
    to raise, and then raises it in its own thread too, where `threading.excepthook` prints its traceback beside the
    caller's error. For the duration of the block, such an error of that thread (tensorboard's `_AsyncWriterThread`)
    is left to the caller; every other thread's exception goes to the hook as before."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError)):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def write_scalars(log_dir: Path, stem: str, step: int, scalars: Mapping[str, float]) -> None:
    """`scalars` at global step `step` in LOG_DIR/events.out.tfevents.*.{stem}, replacing any earlier such file."""
    from torch.utils.tensorboard import SummaryWriter  # tensorboard import is slow; only pay for it here

    suffix = f".{stem}"
    for earlier in Path(log_dir).glob(f"events.out.tfevents.*{suffix}"):
        earlier.unlink()
    try:
        with writer_thread_errors_reported_once():
            writer = SummaryWriter(log_dir=str(log_dir), filename_suffix=suffix)
            try:
                for tag, value in scalars.items():
                    writer.add_scalar(tag, value, global_step=int(step))
            finally:
                writer.close()
    except OSError as error:
        if error.filename is None:        # a full disk met by tensorboard's writer thread, which names no file
            error.filename = str(log_dir)
        raise


# ============ the result of evaluating an export (python -m eval, python -m transfer finetune) ============


def evaluation_crop_fraction(config: dict[str, Any]) -> float:
    """data.eval_crop_fraction of the export's config; 0.875 (256 -> 224) for exports written before it existed."""
    return float(config.get("data", {}).get("eval_crop_fraction", 0.875))


def trained_image_size(config: dict[str, Any]) -> int | None:
    """The side of the first training view group (None if the config has none): what a ViT's position embedding
    was built for."""
    views = config.get("data", {}).get("views") or []
    if views and isinstance(views[0], dict) and "size" in views[0]:
        return int(views[0]["size"])
    return None


def evaluation_image_size(config: dict[str, Any]) -> int | None:
    """The evaluation image side: data.eval_image_size when set (> 0), else the first training view group's size
    (None if the config has neither)."""
    return int(config.get("data", {}).get("eval_image_size") or 0) or trained_image_size(config)


class EvaluatedExport(Protocol):
    """What `write_results` reads of its `inputs` (eval's EvaluationInputs, transfer's FinetuneInputs)."""

    export: Any           # eval.features.BackboneExport: .step, .epoch, .arch, .config
    checkpoint: Path      # the export file evaluated
    out_dir: Path         # RUN_DIR
    train_path: Path
    val_path: Path
    image_size: int       # the side evaluated, recorded in the result
    crop_fraction: float  # the centre crop evaluated, recorded in the result


def data_suffix(config: Mapping[str, Any] | None, train_path: Path, val_path: Path) -> str:
    """"" when the export is evaluated on its run's own data (its config's data.train and data.val); else
    `_on_{val set}_{6 hex digits}`: the val set's folder and file name, and a digest of both paths (two val sets
    of one name, or another training set, get other digits)."""
    data = (config or {}).get("data", {}) or {}
    evaluated = [Path(train_path).resolve(), Path(val_path).resolve()]
    if evaluated == [Path(data[split]).resolve() if data.get(split) else None for split in ("train", "val")]:
        return ""
    digest = hashlib.sha256("\n".join(map(str, evaluated)).encode()).hexdigest()[:6]
    val_name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{evaluated[1].parent.name}-{evaluated[1].stem}").strip("-")
    return f"_on_{val_name}_{digest}"


def evaluation_suffix(config: Mapping[str, Any] | None, train_path: str | Path | None = None,
                      val_path: str | Path | None = None, image_size: int | None = None,
                      crop_fraction: float | None = None) -> str:
    """What sets an evaluation apart from its run's own, as a suffix of the protocol's name: "" with the export
    config's data, side (`evaluation_image_size`) and crop (`evaluation_crop_fraction`), which is what None means
    for each; else `data_suffix`, then `_at_{N}px` for another side, then `_crop{F}` for another crop fraction. A
    result scored otherwise is thus never written over the run's own (`eval knn --run R --image-size 24` beside the
    16 px result)."""
    config = config or {}
    data = config.get("data", {}) or {}
    suffix = data_suffix(config, Path(train_path if train_path is not None else data.get("train") or ""),
                         Path(val_path if val_path is not None else data.get("val") or ""))
    own_side = evaluation_image_size(config)
    if image_size is not None and own_side is not None and int(image_size) != own_side:
        suffix += f"_at_{int(image_size)}px"
    if crop_fraction is not None and not math.isclose(float(crop_fraction), evaluation_crop_fraction(config)):
        suffix += f"_crop{float(crop_fraction):g}"
    return suffix


def write_results(inputs: EvaluatedExport, protocol: str, top1: dict[str, float] | float,
                  scalars: Mapping[str, float], details: Mapping[str, Any]) -> Path:
    """Write the result of `protocol` on `inputs.export`: the TensorBoard `scalars` at the export's step, then
    INPUTS.OUT_DIR/eval/{protocol}{suffix}_step{step:07d}.json (see `write_result`); returns the JSON's path.

    With the run's own data, side and crop the suffix is empty; otherwise (`evaluation_suffix`) the result is
    e.g. {protocol}_on_{val set}_{digits} or {protocol}_at_24px, and its scalars are under `eval{suffix}/`
    instead of `eval/`: the run's own result and curve stay. The JSON holds protocol, step, epoch, checkpoint,
    arch, top1, train, val, image_size and crop_fraction (what was evaluated), then `details`.
    """
    export = inputs.export
    suffix = evaluation_suffix(export.config, inputs.train_path, inputs.val_path, inputs.image_size,
                               inputs.crop_fraction)
    result = {"protocol": protocol, "step": export.step, "epoch": export.epoch,
              "checkpoint": str(inputs.checkpoint), "arch": export.arch, "top1": top1,
              "train": str(inputs.train_path), "val": str(inputs.val_path), "image_size": inputs.image_size,
              "crop_fraction": inputs.crop_fraction, **details}
    if suffix:
        scalars = {re.sub(r"^eval/", f"eval{suffix}/", tag): value for tag, value in scalars.items()}
    return write_result(inputs.out_dir, protocol + suffix, export.step, result, scalars)


def made_by(command: str, code_root: Path = CODE_ROOT) -> tuple[str, str]:
    """Which command and which commit made a results table: (the sentence that says so, the commit). The commit is
    this checkout's (`pretrain.runtime.provenance.read_code_state`, as every run records its own), marked "with
    uncommitted changes" and the digest of those changes when tracked files differ from it or untracked files
    (not ignored) are there: a table made from a new, uncommitted module is not made "at" the commit alone.
    `code_root`: the checkout (default: this code's)."""
    code = read_code_state(code_root)
    if code.commit is None:
        commit = f"unknown ({code.reason})"
    elif code.dirty:
        commit = f"{code.commit} with uncommitted changes (sha256 {code.diff_sha256[:12]})"
    else:
        commit = code.commit
    return f"Made by `{command}` at commit {commit}.", commit
