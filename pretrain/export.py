"""The backbone export of pretraining: what eval and transfer read, written at every checkpoint.

RUN_DIR/exports/backbone_stepNNNNNNNN.pth           the backbone export of every checkpoint (what the checkpoint-
                                                    watching evaluation reads); exports/published.txt lists
                                                    their steps in order; engine.keep_exports bounds them
RUN_DIR/backbone.pth                                the newest export (a hard link to it): {arch, stem,
                                                    state_dict, config, epoch, step}, and for the metric-learning
                                                    methods embedding_head: {in_dim, hidden_dim, out_dim,
                                                    num_layers, state_dict}; torch.load(weights_only=True)

An export is written to a temporary name and renamed, as every checkpoint file is (pretrain/runtime/checkpoint.py):
a crash or a full disk leaves the previous version, never half a file. The method's `write_export` (the
training task's hook, called by the loop after each checkpoint) calls `export_backbone`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from pretrain.models import projector_shape
from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.checkpoint import CheckpointError, describe_write_error
from pretrain.runtime.distributed import all_ranks_agree

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
    import deepspeed  # here, not with the module: the readers of exports (eval, transfer) start 0.5-0.8 s sooner

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


def check_fresh_start(run_dir: Path) -> None:
    """A directory without a checkpoint to resume must not hold the exports of an earlier run: starting afresh
    would overwrite them."""
    exports = [run_dir / "backbone.pth", *sorted((run_dir / EXPORTS).glob("backbone_step*.pth"))]
    export = next((path for path in exports if path.is_file()), None)
    if export is not None:
        raise CheckpointError(
            f"{run_dir} holds a backbone export ({export}) but no complete checkpoint to resume from: starting "
            "afresh would overwrite it. Start this run with another name=... , or move that directory away.")
