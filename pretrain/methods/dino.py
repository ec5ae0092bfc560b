"""DINO (Caron et al., ICCV 2021): self-distillation with no labels, multi-crop, an EMA teacher and centring.

The student (backbone + DINO head) sees every crop, the teacher (an exponential moving average of the
student) only the two global crops; the loss is the cross-entropy between the centred, sharpened teacher
and the student over every (teacher view, other student view) pair (`pretrain/losses/dino.py`).

Views: `data.views` group 0 and group 1 are the two global crop types (count 1 each; DINO's first global
crop is always blurred, the second blurred with p 0.1 and solarised with p 0.2), every further group holds
local crops; the DINO configs resize them bicubically (`interpolation: bicubic`), as DataAugmentationDINO.
With hard view selection (HVS sec. 3.3) the groups hold pools, e.g. hvs.num_views=[2, 2, 16],
and a candidate is one global of each type plus the locals; at most `hvs.max_candidates` (128) are scored,
all from one cross-entropy table (`candidate_losses`).

The teacher and the centre live outside the nn.Module registry (`self.__dict__`), in fp32: DeepSpeed never
wraps, shards, casts or checkpoints them. They travel in the checkpoint's client state
(`state_outside_engine`) and are updated once per optimizer step (`after_step`).

Stochastic depth: the ViT student drops residual blocks at rates rising linearly to `method.drop_path_rate` (0.1,
main_dino.py:105 and :164; HVS Table 7), the teacher drops none (main_dino.py:166 builds it without the rate; here
it is the student's copy with every DropPath made an identity, `without_stochastic_depth`), so that its target is
deterministic. ResNets get none (main_dino.py:176: torchvision's ResNets take no rate).

Differences from facebookresearch/dino, main_dino.py, worth knowing:
- none in gradient clipping: the DINO configs clip every parameter tensor's gradient to norm 3.0 on its own
  (`optim.grad_clip_per_parameter: 3.0`, DINO's `utils.clip_gradients`, main_dino.py:332). The HVS paper's
  Table 7 lists `clip_grad 3.0`, the name of that DINO option, but the HVS authors' DINO branch (automl/hvp@dino,
  pretrain.py:437) clips the global norm with `clip_grad_norm_`: their variant is
  `optim.grad_clip=3.0 optim.grad_clip_per_parameter=0` (DeepSpeed's global-norm clipping);
- none in the frozen last layer either: for its first `freeze_last_layer_epochs` it gets no gradient (DINO's
  `cancel_gradients_last_layer`), so the optimizer neither moves it nor builds moments or a step count for it
  (`frozen_steps`, `pretrain/runtime/gradient_edits.py`, which says how under ZeRO 1-3);
- under `engine.precision=bf16` the student's backbone and head MLP run under bf16 autocast, the teacher and the
  heads' last layers in fp32 (DINO's fp16 AMP runs everything in fp16, with 8x finer rounding than bf16);
- schedules are per optimizer step (DINO's teacher temperature is per epoch).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from pretrain.losses.dino import dino_cross_entropy_table, dino_loss_per_sample, dino_teacher_entropy
from pretrain.methods.base import Method, encode_view_groups, split_decay_groups
from pretrain.models import backbone_from_config, is_vision_transformer, without_stochastic_depth
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.distributed import average_buffers, with_sync_batchnorm
from pretrain.runtime.optim import cosine_schedule

NUM_GLOBAL_GROUPS = 2   # data.views groups 0 and 1: the teacher's views


@dataclass
class Options:
    name: str = "dino"
    out_dim: int = 65536                     # prototypes K of the last layer
    norm_last_layer: bool = True             # last layer's rows kept at norm 1 (no trainable magnitude)
    use_bn_in_head: bool = False             # BatchNorm after the hidden layers of the head (ResNets)
    student_temp: float = 0.1
    teacher_temp: float = 0.04               # after the warm-up
    warmup_teacher_temp: float = 0.04        # at step 0, linearly to teacher_temp
    warmup_teacher_temp_epochs: float = 0.0
    momentum_teacher: float = 0.996          # EMA momentum at step 0, cosine to 1 at the end of the run
    center_momentum: float = 0.9
    freeze_last_layer_epochs: float = 1.0    # the last layer gets no gradient during these first epochs
    export: str = "teacher"                  # backbone written to backbone.pth: teacher | student
    drop_path_rate: float = 0.1              # the ViT student's stochastic depth (last block's rate); teacher: none
    # Hard view selection's score of a candidate: cross_entropy (the HVS paper's and its authors' code: the
    # training loss) | kl (the cross-entropy minus the teacher's entropy, which does not favour flat teachers)
    hvs_score: str = "cross_entropy"


class WeightNormLinear(nn.Module):
    """Linear layer without bias whose rows are `magnitude * direction / ||direction||` (weight
    normalisation, Salimans & Kingma 2016), as DINO's `nn.utils.weight_norm` last layer.

    Written as one module with its own parameters, not torch's parametrizations (which keep them in a
    sub-module): DeepSpeed ZeRO-3 gathers a module's own parameters before its forward. With
    `learn_magnitude=False` (DINO's norm_last_layer) the magnitude is fixed to 1 and is no parameter at all.
    The magnitude starts at 1, as DINO's `weight_g.data.fill_(1)`.
    """

    def __init__(self, in_dim: int, out_dim: int, learn_magnitude: bool):
        super().__init__()
        self.direction = nn.Parameter(nn.Linear(in_dim, out_dim, bias=False).weight.detach().clone())
        if learn_magnitude:
            self.magnitude = nn.Parameter(torch.ones(out_dim, 1))   # (out, 1) as DINO's weight_g
        else:
            self.register_parameter("magnitude", None)

    def normalised_weight(self) -> torch.Tensor:
        weight = F.normalize(self.direction, dim=1)
        return weight if self.magnitude is None else weight * self.magnitude

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.normalised_weight())


class DINOHead(nn.Module):
    """MLP (Linear [-BN] -GELU blocks, then a linear bottleneck), L2 normalisation, weight-normalised
    linear layer to the K prototypes (DINO's `DINOHead`)."""

    def __init__(self, in_dim: int, hidden_dim: int, bottleneck_dim: int, out_dim: int, num_layers: int,
                 use_bn: bool, norm_last_layer: bool):
        super().__init__()
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers += [nn.Linear(dim, hidden_dim), *([nn.BatchNorm1d(hidden_dim)] if use_bn else []), nn.GELU()]
            dim = hidden_dim
        layers.append(nn.Linear(dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim, learn_magnitude=not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.mlp(x)
        # The prototypes' logits in fp32 even under bf16 autocast: divided by temperatures of 0.04-0.1, logits
        # rounded to bf16 (steps of ~0.004 near 1) become errors of ~0.1 in the softmax's exponent.
        with torch.autocast(x.device.type, enabled=False):
            return self.last_layer(F.normalize(hidden.float(), dim=-1))


def teacher_temp_schedule(warmup_temp: float, temp: float, warmup_steps: int, total_steps: int) -> np.ndarray:
    """Per optimizer step: linear from `warmup_temp` to `temp` over `warmup_steps` (both ends included, as
    DINO's per-epoch `np.linspace`), then `temp`."""
    warmup_steps = min(warmup_steps, total_steps)
    return np.concatenate([np.linspace(warmup_temp, temp, warmup_steps), np.full(total_steps - warmup_steps, temp)])


def value_at(schedule: np.ndarray, step: int) -> float:
    """`schedule[step]`, clamped to its ends (a method built outside a run has a one-step schedule, and after the
    run's last step the temperature is read one step past the end)."""
    return float(schedule[min(max(step, 0), len(schedule) - 1)])


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DINO(Method):
    iou_views = 2   # HVS logs the IoU of the two chosen global crops
    # main_dino.py:176 builds a ResNet as torchvision_models.__dict__[args.arch](): torchvision's default,
    # zero_init_residual=False (automl/hvp@dino the same, pretrain.py:213). The DINO head is not model.proj_*'s MLP.
    reference_model = {"zero_init_residual": False}
    # facebookresearch/dino utils.get_params_groups: no decay for biases and norms
    reference_optim = {"decay_norm_and_bias": False}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        model, method = cfg.model, cfg.method
        self.backbone = backbone_from_config(cfg, method.drop_path_rate if is_vision_transformer(model.arch) else 0.0)
        self.head = DINOHead(self.backbone.num_features, model.proj_hidden_dim, model.proj_out_dim, method.out_dim,
                             model.proj_layers, method.use_bn_in_head, method.norm_last_layer)
        self.student_temp = method.student_temp
        self.center_momentum = method.center_momentum
        self.export = method.export
        self.hvs_score = method.hvs_score
        self.sync_batchnorm = cfg.engine.sync_batchnorm

        # Outside the module registry (see the module docstring): fp32, no gradients, no stochastic depth.
        teacher = copy.deepcopy(nn.ModuleDict({"backbone": self.backbone, "head": self.head})).float()
        without_stochastic_depth(teacher)
        self.__dict__["teacher"] = teacher.requires_grad_(False)
        self.__dict__["center"] = torch.zeros(method.out_dim)
        self.__dict__["teacher_entropy"] = torch.tensor(float("nan"))
        # This optimizer step's teacher outputs, summed over its micro-batches: the centre moves once per step.
        self.__dict__["step_teacher_sum"] = torch.zeros(method.out_dim)
        self.__dict__["step_teacher_stats"] = torch.zeros(2)          # (rows summed, entropy summed over rows)
        self.steps_done = 0             # optimizer steps taken: indexes the schedules
        self.teacher_placed = False     # moved to the views' device and made equal on every rank

        # ==== schedules, indexed by optimizer step: over the run's schedule, as the lr's ====
        self.momentum_schedule = cosine_schedule(method.momentum_teacher, 1.0, schedule_steps)
        self.teacher_temp_schedule = teacher_temp_schedule(
            method.warmup_teacher_temp, method.teacher_temp, round(method.warmup_teacher_temp_epochs * steps_per_epoch),
            schedule_steps)
        self.frozen_steps = round(method.freeze_last_layer_epochs * steps_per_epoch)

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        method, views = cfg.method, cfg.data.views
        if len(views) < NUM_GLOBAL_GROUPS or views[0].count != 1 or views[1].count != 1:
            layout = [group.count for group in views]
            raise ConfigError(
                f"method.name=dino needs data.views = two global crop groups of count 1, then local crop groups; "
                f"got counts {layout}. Write e.g. data.views: [{{count: 1, size: 224, scale: [0.4, 1.0], "
                "blur_p: 1.0}, {count: 1, size: 224, scale: [0.4, 1.0], blur_p: 0.1, solarize_p: 0.2}, "
                "{count: 8, size: 96, scale: [0.05, 0.4], blur_p: 0.5}] (with hard view selection, the pools "
                "go in hvs.num_views, e.g. [2, 2, 16])")
        if method.hvs_score not in ("cross_entropy", "kl"):
            raise ConfigError(f"method.hvs_score={method.hvs_score!r} is not one of ('cross_entropy', 'kl'); the HVS "
                              "paper scores by the cross-entropy")
        if method.export not in ("teacher", "student"):
            raise ConfigError(f"method.export={method.export!r} is not one of ('teacher', 'student'); DINO evaluates "
                              "the teacher's backbone")
        if min(method.student_temp, method.teacher_temp, method.warmup_teacher_temp) <= 0:
            raise ConfigError(f"method.student_temp, teacher_temp and warmup_teacher_temp must be positive "
                              f"(got {method.student_temp}, {method.teacher_temp}, {method.warmup_teacher_temp}; "
                              "DINO: 0.1, 0.04)")
        for key in ("momentum_teacher", "center_momentum"):
            if not 0 <= method[key] <= 1:
                raise ConfigError(f"method.{key}={method[key]} must lie in [0, 1] (DINO: 0.996 and 0.9)")
        if method.out_dim < 1 or cfg.model.proj_layers < 1:
            raise ConfigError(f"method.out_dim={method.out_dim} and model.proj_layers={cfg.model.proj_layers} "
                              "must be at least 1 (DINO: 65536 and 3)")
        if min(method.warmup_teacher_temp_epochs, method.freeze_last_layer_epochs) < 0:
            raise ConfigError("method.warmup_teacher_temp_epochs and method.freeze_last_layer_epochs must be >= 0")
        if not 0 <= method.drop_path_rate < 1:
            raise ConfigError(f"method.drop_path_rate={method.drop_path_rate} must lie in [0, 1): the largest share of "
                              "samples for which a ViT block is skipped (DINO: 0.1)")

    # ==== teacher ====
    def teacher_on(self, device: torch.device) -> nn.ModuleDict:
        """The teacher on `device`; the first time, also the same on every rank (rank 0's) and, on GPUs with
        several processes, with SyncBatchNorm as the student (DINO converts both)."""
        teacher = self.teacher
        if not self.teacher_placed:
            teacher.to(device)
            self.__dict__["center"] = self.center.to(device)
            if world_size() > 1:
                for tensor in teacher.state_dict().values():
                    dist.broadcast(tensor, src=0)
                teacher = with_sync_batchnorm(teacher, device, world_size(), self.sync_batchnorm)
                self.__dict__["teacher"] = teacher
            self.teacher_placed = True
        return teacher

    def teacher_temp(self) -> float:
        """Teacher temperature of the step being taken."""
        return value_at(self.teacher_temp_schedule, self.steps_done)

    # ==== forward and losses ====
    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        features = encode_view_groups(self.backbone, views)               # one backbone call per resolution
        student = self.head(features.flatten(0, 1)).unflatten(0, features.shape[:2])
        teacher = self.teacher_on(views[0].device)
        teacher.train(self.training)
        # The teacher runs in fp32 whatever the precision of the student: its sharpened output (temperature 0.04)
        # is the target, and it costs one forward of the two globals without a backward.
        with torch.no_grad(), torch.autocast(views[0].device.type, enabled=False):
            teacher_features = encode_view_groups(teacher["backbone"], [v.float() for v in views[:NUM_GLOBAL_GROUPS]])
            logits = teacher["head"](teacher_features.flatten(0, 1)).unflatten(0, teacher_features.shape[:2])
        return {"student": student, "teacher": logits, "features": features}

    def sample_loss(self, outputs: dict[str, torch.Tensor], combination: Sequence[int],
                    labels: torch.Tensor) -> torch.Tensor:
        # The globals' flat indices (groups 0 and 1 come first) are also their rows of outputs["teacher"].
        combination = list(combination)
        student = outputs["student"][:, combination]
        teacher = outputs["teacher"][:, combination[:NUM_GLOBAL_GROUPS]]
        return dino_loss_per_sample(student, teacher, self.center.to(student.device), self.student_temp,
                                    self.teacher_temp())

    def candidate_losses(self, outputs: dict[str, torch.Tensor], combinations: Sequence[Sequence[int]],
                         labels: torch.Tensor) -> torch.Tensor:
        """All candidates from one (B, teacher pool, student pool) cross-entropy table; with
        `method.hvs_score=kl` every term less its teacher view's entropy (H(P_t, P_s) - H(P_t) = KL(P_t || P_s))."""
        student = outputs["student"]
        center = self.center.to(student.device)
        table = dino_cross_entropy_table(student, outputs["teacher"], center, self.student_temp, self.teacher_temp())
        if self.hvs_score == "kl":
            table = table - dino_teacher_entropy(outputs["teacher"], center, self.teacher_temp())[:, :, None]
        teacher_index, student_index = self.candidate_terms(combinations, student.device)
        return table[:, teacher_index, student_index].mean(dim=-1)                          # (B, C)

    @staticmethod
    def candidate_terms(combinations: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(C, P) teacher and student view indices of the P = DINOLoss pairs of every candidate."""
        combos = torch.as_tensor(combinations, device=device)                               # (C, k)
        k = combos.shape[1]
        terms = [(a, b) for a in range(NUM_GLOBAL_GROUPS) for b in range(k) if b != a]
        return combos[:, [a for a, _ in terms]], combos[:, [b for _, b in terms]]

    def selection_scalars(self, outputs: dict[str, torch.Tensor], combinations: Sequence[Sequence[int]],
                          pick: torch.Tensor) -> dict[str, torch.Tensor]:
        """The teacher entropy of the chosen candidate (the mean over its two globals) against the mean candidate:
        scoring by the cross-entropy favours flat teachers (`dino_teacher_entropy`), which this shows (0-d
        tensors, read on the steps that log)."""
        teacher = outputs["teacher"]
        entropy = dino_teacher_entropy(teacher, self.center.to(teacher.device), self.teacher_temp())     # (B, T)
        globals_of = torch.as_tensor(combinations, device=teacher.device)[:, :NUM_GLOBAL_GROUPS]       # (C, 2)
        per_candidate = entropy[:, globals_of].mean(dim=-1)                                             # (B, C)
        rows = torch.arange(len(pick), device=pick.device)
        return {"hvs/selected_teacher_entropy": per_candidate[rows, pick].mean(),
                "hvs/mean_candidate_teacher_entropy": per_candidate.mean()}

    def loss(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        loss = super().loss(outputs, labels)
        self.add_to_step_teacher_output(outputs["teacher"][:, :NUM_GLOBAL_GROUPS].detach())
        return loss

    @torch.no_grad()
    def add_to_step_teacher_output(self, teacher_logits: torch.Tensor) -> None:
        """Add a micro-batch's teacher logits to this optimizer step's sums, from which `update_center` moves
        the centre once per step (with gradient accumulation a step has several micro-batches; DINO's
        reference has one). Also sums the entropy of the centred, sharpened teacher distribution: collapse to
        one prototype drives it to 0, collapse to the uniform distribution to log K."""
        teacher_logits = teacher_logits.float().flatten(0, 1)                          # (rows, K)
        center = self.center.to(teacher_logits.device)
        log_probs = F.log_softmax((teacher_logits - center) / self.teacher_temp(), dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        self.__dict__["step_teacher_sum"] = self.step_teacher_sum.to(center.device) + teacher_logits.sum(0)
        self.__dict__["step_teacher_stats"] = self.step_teacher_stats.to(center.device) + torch.stack(
            [torch.tensor(float(len(teacher_logits)), device=center.device), entropy.sum()])

    @torch.no_grad()
    def update_center(self) -> None:
        """c <- m c + (1 - m) mean of the teacher logits of the step just taken, over all its micro-batches and
        all processes (DINO's `update_center`, once per optimizer step); then the step's sums restart."""
        totals = torch.cat([self.step_teacher_sum, self.step_teacher_stats])
        if world_size() > 1:
            dist.all_reduce(totals)
        # A step without a training forward (which the engine's loop never takes) leaves the centre as it was; decided
        # on the device (torch.where), since an `if` on `rows` would wait for the device once a step on a GPU.
        rows = totals[-2]
        trained = rows > 0
        center = self.center.to(totals.device)
        batch_center = totals[:-2] / rows
        self.__dict__["center"] = torch.where(
            trained, center * self.center_momentum + batch_center * (1 - self.center_momentum), center)
        self.__dict__["teacher_entropy"] = torch.where(trained, totals[-1] / rows, self.teacher_entropy.to(rows.device))
        self.__dict__["step_teacher_sum"] = torch.zeros_like(self.step_teacher_sum)
        self.__dict__["step_teacher_stats"] = torch.zeros_like(self.step_teacher_stats)

    # ==== once per optimizer step ====
    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """The centre from this step's teacher outputs, then the EMA teacher <- m teacher + (1 - m) student with
        m of the step just taken (step - 1)."""
        import deepspeed  # heavy: deepspeed (~0.4 s); load_config imports this module for its Options and needs none

        self.update_center()
        self.steps_done = step
        momentum = self.teacher_momentum()
        student = [*self.backbone.parameters(), *self.head.parameters()]
        teacher = [*self.teacher["backbone"].parameters(), *self.teacher["head"].parameters()]
        # ZeRO-3 partitions the student's parameters: gather them (a no-op for stages 0-2).
        with deepspeed.zero.GatheredParameters(student, modifier_rank=None):
            for s, t in zip(student, teacher, strict=True):
                t.mul_(momentum).add_(s.detach().to(device=t.device, dtype=torch.float32), alpha=1 - momentum)

    def teacher_momentum(self) -> float:
        """EMA momentum of the last step taken (of the first step before any)."""
        return value_at(self.momentum_schedule, self.steps_done - 1)

    def param_groups(self) -> list[dict]:
        # The last layer gets no gradient in its first `frozen_steps` (DINO's `cancel_gradients_last_layer`;
        # `pretrain/runtime/gradient_edits.py` reads the group flag), so it is in groups of its own.
        body = nn.ModuleList([self.backbone, self.head.mlp])
        groups = split_decay_groups(body) + split_decay_groups(self.head.last_layer, frozen_steps=self.frozen_steps)
        return [group for group in groups if group["params"]]

    def scalars(self) -> dict[str, float]:
        # The values of the step just taken, as the engine logs that step's lr.
        return {"dino/teacher_temp": value_at(self.teacher_temp_schedule, self.steps_done - 1),
                "dino/teacher_momentum": self.teacher_momentum(),
                "dino/teacher_entropy": float(self.teacher_entropy)}

    # ==== checkpoint and export ====
    def state_outside_engine(self) -> dict:
        """Teacher, centre and step counter for the checkpoint's client state. Called on every rank: the
        teacher's BatchNorm statistics (updated by its own forwards, per rank) are averaged first, as
        save_checkpoint does for the student, so that rank 0's export is the mean teacher."""
        average_buffers(self.teacher)
        return {**super().state_outside_engine(), "teacher": {name: t.detach().cpu().clone() for name, t in self.teacher.state_dict().items()},
                "center": self.center.detach().cpu().clone(), "steps_done": self.steps_done}

    def load_state_outside_engine(self, state: dict) -> None:
        if not state:
            return
        super().load_state_outside_engine(state)
        self.teacher.load_state_dict(state["teacher"])
        self.__dict__["center"] = state["center"].to(self.center.device)
        self.steps_done = int(state["steps_done"])

    def backbone_to_export(self) -> nn.Module:
        return self.backbone if self.export == "student" else self.teacher["backbone"]

    def modules_with_buffers(self) -> list[nn.Module]:
        return [self, self.teacher]        # the teacher's BatchNorm statistics move in its forward too


METHOD = DINO
