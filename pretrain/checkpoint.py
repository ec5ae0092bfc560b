"""Checkpoints: DeepSpeed checkpoints to resume a run, and the backbone export that eval and transfer read.

RUN_DIR/checkpoints/stepNNNNNNNN/                   DeepSpeed shards (model, optimizer, per rank) + client state
RUN_DIR/checkpoints/stepNNNNNNNN/trainer_state.json  step, data position and run layout; written last, so a
                                                    checkpoint without it is incomplete and never loaded
RUN_DIR/checkpoints/latest                          the newest complete checkpoint (for DeepSpeed's tools)
RUN_DIR/exports/backbone_stepNNNNNNNN.pth           the backbone export of every checkpoint (what the checkpoint-
                                                    watching evaluation reads); exports/published.txt lists
                                                    their steps in order; engine.keep_exports bounds them
RUN_DIR/backbone.pth                                the newest export (a hard link to it): {arch, stem,
                                                    state_dict, config, epoch, step}, and for the metric-learning
                                                    methods embedding_head: {in_dim, hidden_dim, out_dim,
                                                    num_layers, state_dict}; torch.load(weights_only=True)

Every file that a reader may see while it is written (trainer_state.json, latest, backbone.pth, ...) is
written to a temporary name and renamed: a crash or a full disk leaves the previous version, never half a
file. Resuming loads the newest checkpoint that loads and holds finite parameters, falling back to older
ones with a message; rotation deletes only older checkpoints once a newer one is complete.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from pretrain.atomic_write import write_text_atomically
from pretrain.distributed import all_ranks_agree, average_buffers, parameters_finite_on_every_rank
from pretrain.models import projector_shape

TRAINER_STATE = "trainer_state.json"

# What a checkpoint's step count, data position and schedule depend on. Resuming with any of them changed
# would silently train another run (other epochs, another schedule, zero steps), so it is refused. Settings
# that only change values (optim.lr, weight decay, clipping, logging, checkpoint frequency, max_steps) may
# change on resume: the new values apply from the resumed step on.
RUN_LAYOUT = {
    "world_size": "the number of processes",
    "batch_size": "the batch size per process",
    "grad_accum": "the micro-batches per optimizer step",
    "num_images": "the number of training images",
    "epochs": "the number of epochs",
    "seed": "the seed",
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message says why and what to do."""


def run_layout(options, world_size: int, num_images: int) -> dict[str, int]:
    """The settings of RUN_LAYOUT for this start; `options`: the loop's (`pretrain.loop.LoopOptions`)."""
    return {"world_size": world_size, "batch_size": options.batch_size, "grad_accum": options.grad_accum,
            "num_images": num_images, "epochs": options.epochs, "seed": options.seed}


def describe_write_error(error: Exception, directory: Path) -> str:
    """One line for a failed write; says "no space left on device" when that is why (torch's zip writer
    reports a full disk only as "file write failed")."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    full = free is not None and free < 1 << 20
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in reason or full:
        return f"no space left on device ({reason})"
    return reason


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoint directories with their trainer_state.json (complete), newest first."""
    return sorted((p for p in checkpoint_dir.glob("step*") if (p / TRAINER_STATE).is_file()), reverse=True)


def save_checkpoint(engine, checkpoint_dir: Path, trainer_state: dict, client_state: dict, keep: int) -> None:
    """Save checkpoint `stepNNNNNNNN` of `trainer_state["step"]` on every rank; mark it complete, point `latest`
    at it, and keep the newest `keep` complete checkpoints (0: all).

    A failed write (a full disk) removes the partial checkpoint, leaves `latest` on the last complete one,
    and raises CheckpointError on every rank.
    """
    tag = f"step{trainer_state['step']:08d}"
    average_buffers(engine.module)
    failure = None
    try:
        engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as error:
        failure = describe_write_error(error, checkpoint_dir)
        dist.barrier()          # the one DeepSpeed's save ends with, which this rank did not reach
    if dist.get_rank() == 0 and failure is None:
        try:
            write_text_atomically(checkpoint_dir / tag / TRAINER_STATE, json.dumps(trainer_state, indent=1))
            write_text_atomically(checkpoint_dir / "latest", tag)
        except OSError as error:
            failure = describe_write_error(error, checkpoint_dir)
    if not all_ranks_agree(failure is None):
        previous = [p.name for p in complete_checkpoints(checkpoint_dir) if p.name != tag]
        if dist.get_rank() == 0:
            shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)
        dist.barrier()
        last = f"the last complete checkpoint is {previous[0]}" if previous else "no complete checkpoint exists yet"
        reason = failure or "failed on another process"
        raise CheckpointError(f"could not write checkpoint {checkpoint_dir / tag}: {reason}. The partial checkpoint "
                              f"was removed; {last}. Free space, then rerun the same command to resume from it.")
    if dist.get_rank() == 0 and keep > 0:
        complete = complete_checkpoints(checkpoint_dir)
        for old in complete[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in checkpoint_dir.glob("step*"):        # incomplete ones, older than the newest complete
            if leftover.is_dir() and leftover.name < complete[0].name and leftover not in complete:
                shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()


def resume_from_newest_loadable(engine, checkpoint_dir: Path, layout: dict[str, int]) -> tuple[dict, dict] | None:
    """Load the newest complete checkpoint that loads and holds finite parameters; return its
    (trainer_state, client_state), or None when the run has no complete checkpoint.

    Refused (CheckpointError) when the newest checkpoint was written with another RUN_LAYOUT, or when none
    loads. Older checkpoints are tried in turn, with a message naming each one skipped and why.
    """
    candidates = complete_checkpoints(checkpoint_dir)
    if not candidates:
        return None
    check_layout(candidates[0], layout)
    reasons = []
    for candidate in candidates:
        reason = None
        try:
            path, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=candidate.name)
            if path is None:
                reason = "DeepSpeed found no model states in it"
        except Exception as error:           # a torn zip, a missing shard, a shape mismatch: all mean "cannot use"
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        if all_ranks_agree(reason is None) and not parameters_finite_on_every_rank(engine.module):
            reason = "its parameters or BatchNorm statistics are not finite (NaN or inf): the run had diverged"
        if all_ranks_agree(reason is None):
            if reasons and dist.get_rank() == 0:
                print(f"resuming from {candidate.name}, the newest checkpoint that loads; skipped "
                      + "; ".join(reasons), flush=True)
            return json.loads((candidate / TRAINER_STATE).read_text()), client_state
        reasons.append(f"{candidate.name} ({reason or 'it failed to load on another process'})")
    raise CheckpointError(
        f"none of the {len(candidates)} checkpoints in {checkpoint_dir} can be resumed: " + "; ".join(reasons)
        + ". If they do not match this run's model or optimizer, resume with the settings in "
        f"{checkpoint_dir.parent / 'config.yaml'}, or start a new run with another name=... .")


def check_layout(checkpoint: Path, layout: dict[str, int]) -> None:
    saved = json.loads((checkpoint / TRAINER_STATE).read_text())
    changed = [f"{RUN_LAYOUT[key]} was {saved[key]} and is now {layout[key]}"
               for key in RUN_LAYOUT if key in saved and saved[key] != layout[key]]
    if changed:
        raise CheckpointError(
            f"cannot resume {checkpoint.parent.parent} from {checkpoint.name}: " + "; ".join(changed)
            + ". The run's steps, data position and schedule depend on these: resume with the settings it was "
            "trained with (processes: torchrun --nproc-per-node N), or start a new run with another name=... .")


def changed_settings(saved, current, keys: Sequence[str]) -> list[str]:
    """`key=old -> new` for every setting under `keys` (each a dotted key or a whole section) that differs between
    the configs `saved` and `current` (DictConfigs or plain dicts)."""
    saved, current = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(saved), resolve=True)), \
        OmegaConf.create(OmegaConf.to_container(OmegaConf.create(current), resolve=True))

    def leaves(key: str):
        node = OmegaConf.select(current, key)
        if OmegaConf.is_dict(node):
            for name in node:
                yield from leaves(f"{key}.{name}")
        else:
            yield key

    def plain(value):
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    return [f"{leaf}={plain(OmegaConf.select(saved, leaf))!r} -> {plain(OmegaConf.select(current, leaf))!r}"
            for key in keys for leaf in leaves(key)
            if plain(OmegaConf.select(saved, leaf)) != plain(OmegaConf.select(current, leaf))]


def check_resumable(saved_config_path: Path, config, keys: Sequence[str]) -> None:
    """Refuse to resume a run directory whose RUN_DIR/config.yaml differs from `config` in any setting under `keys`
    (what would make it another run: pretraining's model and method; fine-tuning's and detection's whole recipe)."""
    if not saved_config_path.is_file():
        return
    changed = changed_settings(OmegaConf.load(saved_config_path), config, keys)
    if changed:
        raise CheckpointError(
            f"{saved_config_path.parent} holds a run with other settings ({'; '.join(changed)}): resuming it would "
            "not train what this command asks for. Use another run name (name=...), rerun with the settings in "
            f"{saved_config_path}, or delete that directory.")


def check_fresh_start(run_dir: Path) -> None:
    """A directory without a checkpoint to resume must not hold the exports of an earlier run: starting afresh
    would overwrite them."""
    exports = [run_dir / "backbone.pth", *sorted((run_dir / EXPORTS).glob("backbone_step*.pth"))]
    export = next((path for path in exports if path.is_file()), None)
    if export is not None:
        raise CheckpointError(
            f"{run_dir} holds a backbone export ({export}) but no complete checkpoint to resume from: starting "
            "afresh would overwrite it. Start this run with another name=... , or move that directory away.")


EXPORTS = "exports"
PUBLISHED = "published.txt"


def export_path(run_dir: Path, step: int) -> Path:
    """Where the backbone export of the checkpoint of `step` goes."""
    return Path(run_dir) / EXPORTS / f"backbone_step{step:08d}.pth"


def published_export_steps(run_dir: Path) -> list[int]:
    """The steps whose exports pretraining has published, in order (some may since have been rotated away)."""
    index = Path(run_dir) / EXPORTS / PUBLISHED
    if not index.is_file():
        return []
    return [int(line) for line in index.read_text().split() if line.isdigit()]


def publish_export(run_dir: Path, step: int, keep: int) -> None:
    """Rank 0, once the export of `step` is complete: make it RUN_DIR/backbone.pth (a hard link, atomically
    replaced, so no space is spent twice), append `step` to exports/published.txt, and delete the exports
    beyond the newest `keep` (0: keep all; a checkpoint-watching evaluation may not have read them yet)."""
    run_dir = Path(run_dir)
    export = export_path(run_dir, step)
    tmp = run_dir / f".backbone.pth.tmp{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        os.link(export, tmp)
    except OSError:                     # a file system without hard links
        shutil.copyfile(export, tmp)
    os.replace(tmp, run_dir / "backbone.pth")
    steps = [s for s in published_export_steps(run_dir) if s != step] + [step]
    write_text_atomically(run_dir / EXPORTS / PUBLISHED, "".join(f"{s}\n" for s in steps))
    if keep > 0:
        for old in sorted((run_dir / EXPORTS).glob("backbone_step*.pth"))[:-keep]:
            old.unlink(missing_ok=True)


def export_backbone(module: nn.Module, run_dir: Path, cfg: DictConfig, epoch: int, step: int) -> Path:
    """Write {arch, stem, state_dict, config, epoch, step} for the evaluation and transfer stages to
    RUN_DIR/exports/backbone_stepNNNNNNNN.pth and publish it as RUN_DIR/backbone.pth (`publish_export`).

    The backbone is the method's `backbone_to_export()` (DINO: the teacher's, unless method.export=student).
    A method whose loss trains an embedding on a head (`embedding_head_to_export()`, the metric-learning methods'
    projector) adds embedding_head: {in_dim, hidden_dim, out_dim, num_layers, last_bn, hidden_bn} (`projector_shape`,
    what rebuilds it with `pretrain.models.mlp`) and its state_dict; readers of the backbone read `state_dict` as before.
    Every rank must call this (ZeRO-3 gathers the partitioned parameters); rank 0 writes the file,
    atomically, so a reader never sees half a file. Returns the export's path.
    """
    path = export_path(run_dir, step)
    backbone = module.backbone_to_export()
    head = module.embedding_head_to_export()
    parameters = [*backbone.parameters(), *(head.parameters() if head is not None else [])]
    failure = None
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
        if dist.get_rank() == 0:
            export = {"arch": cfg.model.arch, "stem": cfg.model.stem, "state_dict": fp32_cpu_state(backbone),
                      "config": OmegaConf.to_container(cfg, resolve=True), "epoch": epoch, "step": step}
            if head is not None:
                export["embedding_head"] = {**projector_shape(cfg, backbone.num_features),
                                            "state_dict": fp32_cpu_state(head)}
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                path.parent.mkdir(exist_ok=True)
                torch.save(export, tmp)
                os.replace(tmp, path)
                publish_export(run_dir, step, cfg.engine.keep_exports)
            except (OSError, RuntimeError) as error:
                failure = describe_write_error(error, path.parent)
                tmp.unlink(missing_ok=True)
    if not all_ranks_agree(failure is None):
        raise CheckpointError(f"could not write the backbone export {path}: {failure or 'failed on rank 0'}; the "
                              f"checkpoint of step {step} is complete. Free space, then rerun the same command.")
    dist.barrier()
    return path


def fp32_cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state_dict as CPU copies, floating-point tensors in fp32."""
    return {name: (t.float() if t.is_floating_point() else t).detach().cpu().clone()
            for name, t in module.state_dict().items()}
