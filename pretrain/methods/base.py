"""The method protocol: all that the training loop and hard view selection need from a method.

A method is the training loop's task for pretraining (`pretrain.runtime.task.TrainingTask`, which it extends): its
`batch_loss` is views -> (hard view selection) -> forward -> loss, and its export at every checkpoint is the
backbone that eval and transfer read.

A method is one file in this package, `pretrain/methods/NAME.py`, that defines

    @dataclass class Options        its `method.*` config keys (with `name: str = "NAME"`) and defaults
    class NAME(Method)              the model: backbone, heads, loss
    METHOD = NAME                   what `build_method` instantiates when `method.name=NAME`

and, on the class, `reference_model`: the `model.*` values of the method's reference code (its file:line in a
comment beside them) that a config leaving those keys out (None) gets: `zero_init_residual`, and `proj_hidden_bn`
where the method builds its projector with `projector_from_config`. `load_config` fills them in.

Views arrive as the loader's view groups, a list of (B, n_g, C, H_g, W_g) tensors (SimCLR: one group of 2;
DINO: two 1-view global groups and one group of L locals). Inside a method every view has a *flat index*:
group 0's views first, then group 1's, and so on. A *combination* is a tuple of flat indices that takes
`count` views from every group, in group order; hard view selection scores combinations drawn from a
larger pool (`pretrain/hvs.py`), and the training step then runs on the chosen one, whose flat indices are
`0 .. k-1` again.

    forward(views) -> outputs                 one forward of all views; a dict of (B, n_total, ...) tensors, with
                                              "features": the backbone's (for the online monitors)
    batch_loss(engine, batch, position, autocast)   a ViewBatch -> (hard view selection) -> forward -> loss
    sample_loss(outputs, combination, labels) -> (B,)   per-sample loss of one combination
    candidate_losses(outputs, combinations, labels) -> (B, C)   all candidates (override to share work)
    selection_scalars(outputs, combinations, pick) -> {name: tensor}  extra hvs/* scalars (DINO: teacher entropy)
    loss(outputs, labels) -> scalar           the training loss on the chosen views
    param_groups() -> [dict, ...]             optimizer groups; flags: no_decay, fixed_lr, frozen_steps
    after_step(step)                          EMA teacher / queue updates, once per optimizer step
    scalars() -> {name: float}                method-specific values to log (e.g. tcl/grad_pos)
    monitor_scalars(features, labels)         monitor/rankme and the online probe's top-1 (monitor.*), from the
                                              "features" output of `forward`: (B, n_total, D) backbone features
    state_outside_engine() / load_state_outside_engine(state)   what DeepSpeed does not checkpoint
    backbone_to_export() -> nn.Module         the backbone that eval / transfer read (`write_export` writes it)
    embedding_head_to_export() -> nn.Module | None   the head whose L2-normalised output the loss shapes, exported
                                              beside the backbone for retrieval (the metric-learning methods);
                                              None (the default): the backbone is the representation
    modules_with_buffers() -> [nn.Module]     every module whose buffers the forward may change (the
                                              selection forward restores them: pretrain/hvs.py)
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.profiler import record_function

from pretrain.data.views import ViewBatch
from pretrain.data.writer import classes_path
from pretrain.hvs import candidate_combinations, select_hard_views
from pretrain.online_monitors import OnlineLinearProbe, rankme
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.task import BatchLoss, BatchPosition, Scalar, TrainingTask


class Method(TrainingTask):
    """Defaults for the optional parts of the protocol; subclasses define forward and sample_loss. after_step
    and scalars default to nothing (TrainingTask's defaults); the state outside the engine holds the online
    probe (subclasses with more extend it)."""

    # Hard view selection logs the IoU of a combination as the mean IoU over pairs of its first
    # `iou_views` views (None: all of them). DINO sets 2: the IoU of its two global crops.
    iou_views: int | None = None
    # Every method states its own (module docstring): no default here, so that none inherits another's reference.
    reference_model: dict[str, object]
    reference_optim: dict[str, object]

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__()
        self.train_counts = [group.count for group in cfg.data.views]
        self.cfg = cfg              # model.* / data.* for the export
        self.hvs = cfg.hvs          # hard view selection's settings (hvs.*)

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        """Raise pretrain.config.ConfigError for settings this method cannot train with."""

    @staticmethod
    def needs_labels(cfg: DictConfig) -> bool:
        """Whether the method trains on class labels with these settings (unlabeled data is refused then)."""
        return False

    def refuse_unknown_labels(self, labels: torch.Tensor, message: str) -> None:
        """ConfigError(`message`) when `labels` holds -1 (an image of unknown class), checked on the first batch this
        method sees only: the writer writes a file's labels all known or all -1 (pretrain/data/writer.py), and the
        check reads the labels back from the device, which on a GPU waits for its queue: once a run, not once a
        step (tests/test_device_reads.py)."""
        if self.__dict__.get("labels_known"):
            return
        if (labels < 0).any():
            raise ConfigError(message)
        self.__dict__["labels_known"] = True

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def batch_loss(self, engine, batch: ViewBatch, position: BatchPosition,
                   autocast: Callable[[], AbstractContextManager]) -> BatchLoss:
        """views -> (hard view selection) -> forward -> loss, through `engine` (which calls `forward`).

        batch.views: the loader's view groups, (B, n_g, C, H_g, W_g) each, with boxes (B, n_g, 4); with selection
        (`hvs.enabled`) every group holds its pool (hvs.num_views), without it the method's own view counts.
        Two autocast regions, not one: under ZeRO-3, which gathers and releases the parameters around every
        forward, bf16 weight copies cached in the selection forward would break the training backward.
        """
        hvs, views, selection = self.hvs, batch.views, None
        every_combination = hvs.enabled and hvs.mode == "all"           # no scoring: the whole pool trains
        if hvs.enabled and not every_combination:
            with autocast(), record_function("hardview/selection"):
                selection = select_hard_views(engine, self, batch.views, batch.boxes, batch.labels, self.train_counts,
                                              hvs.mode, hvs.selection_size, hvs.max_candidates, position.rng())
            views = selection.views
        with autocast(), record_function("hardview/forward"):
            outputs = engine(views)
        with record_function("hardview/loss"):
            fp32 = {name: tensor.float() for name, tensor in outputs.items()}
            loss = self.every_combination_loss(fp32, batch, position) if every_combination else \
                self.loss(fp32, batch.labels)
        with record_function("hardview/monitors"):
            scalars = self.monitor_scalars(outputs["features"], batch.labels) if "features" in outputs else {}
        if selection is None:
            return BatchLoss(loss, scalars)
        shown = min(8, batch.batch_size)
        return BatchLoss(loss, {**selection.stats, **scalars},
                         images=lambda: {"hvs/pool": self.denormalise(batch.views[0][:shown]),
                                         "hvs/selected": self.denormalise(selection.views[0][:shown])})

    @classmethod
    def trains_on_every_combination(cls) -> bool:
        """Whether `hvs.mode=all` can train this method: its training loss must be the mean of `sample_loss` over the
        trained views (the protocol's `loss`, kept by SimCLR and SimSiam). A method whose `loss` does more -- DINO
        moves its centre from the teacher's outputs, s-MoCo enqueues keys, the TCL family keeps gradient means and
        scores pairs otherwise than it trains -- would lose that in a mean of per-candidate losses."""
        return cls.loss is Method.loss

    def every_combination_loss(self, outputs: dict[str, torch.Tensor], batch: ViewBatch,
                               position: BatchPosition) -> torch.Tensor:
        """hvs.mode=all, the "all pairs" arm of a selection study (the multi-view loss HVS's reviewers asked for):
        no scoring; `outputs` are one forward of the whole pool with gradients (`batch_loss`), and the loss is
        averaged over every candidate combination (SimCLR with a pool of 4: its 6 pairs, each pair's NT-Xent against
        the other images' views of the same pair), back-propagated through all of them. BatchNorm normalises over the
        whole pool, as one forward of all the views does (and as the selection forward does); `hvs.max_candidates`
        caps the combinations as it caps the scored ones. Its cost is what it is: the counted FLOPs of a step are
        those of training on the pool."""
        pools = [v.shape[1] for v in batch.views]
        combinations = candidate_combinations(self.train_counts, pools, self.hvs.max_candidates, position.rng())
        return self.candidate_losses(outputs, combinations, batch.labels).mean()

    # ==== online monitors (pretrain/online_monitors.py): on the training forward's backbone features ====
    def monitor_scalars(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, Scalar]:
        """monitor/rankme of the first view's features, and the online probe's top-1 on the first view group's
        (features: (B, n_total, D) from `forward`'s "features"). The same keys on every process. The probe learns
        at every step; RankMe (a singular value decomposition, which on a GPU also waits for the device) is
        computed only on the steps that log it."""
        scalars: dict[str, Scalar] = {}
        if self.cfg.monitor.rankme:
            first_view = features[:, 0].detach()
            scalars["monitor/rankme"] = lambda: rankme(first_view)
        probe = self.online_probe()
        if probe is not None:
            first_group = features[:, :self.train_counts[0]]
            scalars["monitor/online_linear_top1"] = probe.update(
                first_group.flatten(0, 1), labels.repeat_interleave(first_group.shape[1]))
        return scalars

    def online_probe(self) -> OnlineLinearProbe | None:
        """The online linear probe, built on first use; None when monitor.online_probe is off or the training
        data has no class names (OUT.classes.json next to the .beton) to size it."""
        if "online_linear_probe" not in self.__dict__:
            classes = classes_path(self.cfg.data.train)
            probe = None
            if self.cfg.monitor.online_probe and classes.exists():
                probe = OnlineLinearProbe(self.backbone_to_export().num_features, len(json.loads(classes.read_text())),
                                          self.cfg.monitor.online_probe_lr, self.cfg.seed)
            self.__dict__["online_linear_probe"] = probe          # outside the module registry: DeepSpeed never sees it
        return self.__dict__["online_linear_probe"]

    def state_outside_engine(self) -> dict:
        """The online probe's state; methods with more state outside the engine (DINO, s-MoCo) extend it."""
        probe = self.online_probe()
        return {} if probe is None else {"online_probe": probe.state_dict()}

    def load_state_outside_engine(self, state: dict) -> None:
        probe = self.online_probe()
        if probe is not None and "online_probe" in state:      # checkpoints from before the probe: a fresh one
            probe.load_state_dict(state["online_probe"])

    def denormalise(self, views: torch.Tensor) -> torch.Tensor:
        """Normalised views -> pixels in [0, 1], to show them."""
        mean = torch.tensor(self.cfg.data.mean, device=views.device).view(3, 1, 1)
        std = torch.tensor(self.cfg.data.std, device=views.device).view(3, 1, 1)
        return (views.float() * std + mean).clamp(0, 1)

    def sample_loss(self, outputs: dict[str, torch.Tensor], combination: Sequence[int],
                    labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def candidate_losses(self, outputs: dict[str, torch.Tensor], combinations: Sequence[Sequence[int]],
                         labels: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.sample_loss(outputs, c, labels) for c in combinations], dim=1)

    def loss(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        return self.sample_loss(outputs, range(sum(self.train_counts)), labels).mean()

    def selection_scalars(self, outputs: dict[str, torch.Tensor], combinations: Sequence[Sequence[int]],
                          pick: torch.Tensor) -> dict[str, torch.Tensor]:
        """Method-specific hvs/* scalars of a selection (pick: (B,) the chosen candidate of every sample), 0-d
        tensors: reading one waits for the device, which the loop does only on the steps that log."""
        return {}

    def param_groups(self) -> list[dict]:
        return split_decay_groups(self)

    def backbone_to_export(self) -> nn.Module:
        return self.backbone

    def embedding_head_to_export(self) -> nn.Module | None:
        return None

    def write_export(self, run_dir: Path, epoch: int, step: int) -> None:
        # heavy: pretrain.export loads deepspeed, which pretrain.config (reading a method's Options) does not need
        from pretrain.export import export_backbone
        export_backbone(self, run_dir, self.cfg, epoch, step)

    def modules_with_buffers(self) -> list[nn.Module]:
        return [self]


def split_decay_groups(module: nn.Module, **flags) -> list[dict]:
    """Weights in one group; biases and normalisation parameters (1-D) in a `no_decay` group."""
    decay = [p for p in module.parameters() if p.ndim > 1]
    no_decay = [p for p in module.parameters() if p.ndim <= 1]
    return [{"params": decay, **flags}, {"params": no_decay, "no_decay": True, **flags}]


def encode_view_groups(encoder: nn.Module, views: list[torch.Tensor], head: nn.Module | None = None):
    """[(B, n_g, C, H_g, W_g), ...] -> (B, sum n_g, D) in flat view order; with a `head`, the pair (encoder
    features, head outputs), both (B, sum n_g, ...).

    Consecutive groups of the same resolution go through the encoder (and the head) in one call (DINO's globals,
    then its locals), so BatchNorm sees them as one batch.
    """
    batch = views[0].shape[0]
    runs: list[list[torch.Tensor]] = []
    for group in views:
        if runs and runs[-1][0].shape[-2:] == group.shape[-2:]:
            runs[-1].append(group)
        else:
            runs.append([group])
    features, outputs = [], []
    for run in runs:
        stack = torch.cat(run, dim=1)
        encoded = encoder(stack.flatten(0, 1))
        features.append(encoded.unflatten(0, (batch, stack.shape[1])))
        if head is not None:
            outputs.append(head(encoded).unflatten(0, (batch, stack.shape[1])))
    if head is None:
        return torch.cat(features, dim=1)
    return torch.cat(features, dim=1), torch.cat(outputs, dim=1)


def require_one_view_group(cfg: DictConfig, min_count: int = 2, max_count: int | None = None) -> None:
    """For methods that train on views of one kind: one view group, with `min_count`..`max_count` views."""
    name, views = cfg.method.name, cfg.data.views
    if len(views) != 1:
        raise ConfigError(f"method.name={name} trains on one view group, but data.views has {len(views)}")
    count = views[0].count
    if count < min_count or (max_count is not None and count > max_count):
        wanted = f"{min_count}" if max_count == min_count else f"at least {min_count}"
        raise ConfigError(f"method.name={name} trains on {wanted} views per image; data.views.0.count={count}")
