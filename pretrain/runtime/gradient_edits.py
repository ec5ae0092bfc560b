"""What happens to the gradients between the backward of an optimizer step's last micro-batch and the step.

Two edits from facebookresearch/dino's main_dino.py, which DeepSpeed has no option for:

- per-parameter clipping (`utils.clip_gradients`): every parameter tensor's gradient is scaled to a norm of at
  most `clip` on its own (DINO: 3.0). DeepSpeed's `gradient_clipping` (`optim.grad_clip`) scales the whole
  gradient to a global norm instead; both can be set, the global clip then acts on the edited gradients.
- frozen parameters (`utils.cancel_gradients_last_layer`): the optimizer groups flagged `frozen_steps` (DINO's
  last layer in its first epoch) get no gradient before that step, so the optimizer skips them -- no update,
  no weight decay, no momentum or Adam moments, no step count -- and their first real step is the optimizer's
  first step for them (Adam's bias correction starts there).

How, per ZeRO stage (the gradients live in `p.grad` under stage 0, in DeepSpeed's flat partitions under 1-3):

- clipping works on this rank's piece of every reduced gradient (`local_gradient`) and all-reduces one vector of
  squared norms, not the gradients themselves (`deepspeed.utils.safe_get_full_grad` would all-reduce every
  whole gradient, doubling a step's communication);

- stage 0: `p.grad = None`, exactly as DINO; torch's optimizers skip such a parameter.
- stages 1-3: a flat partition holds several parameters and cannot skip one, so the frozen parameters' gradients
  are set to 0 (`deepspeed.utils.safe_set_full_grad`) and their group's lr is 0 (`set_schedule_values`): they
  do not move, and their moments stay exactly 0. At the first unfrozen step the optimizer state of their
  partitions is dropped, so the step count, and with it Adam's bias correction, starts there as in DINO. This
  needs the frozen parameters in groups of their own (`frozen_steps` is a group flag, so they are).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_local_grad, safe_set_local_grad, safe_update_full_grad_vectorized


@dataclass(frozen=True)
class FrozenGroup:
    index: int                          # the group's index in the optimizer's param_groups
    params: list[torch.nn.Parameter]
    steps: int                          # no gradient in optimizer steps 0 .. steps-1


class GradientEdits:
    """Per-parameter clipping and frozen groups, applied by `pretrain.runtime.loop.train_step` when DeepSpeed is
    about to take an optimizer step. Build it from the torch optimizer *before* `deepspeed.initialize`, which
    replaces the groups' parameters by its flat partitions under ZeRO 1-3."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip_per_parameter: float, zero_stage: int):
        self.clip = float(clip_per_parameter)
        self.zero_stage = zero_stage
        self.frozen = [FrozenGroup(index, list(group["params"]), int(group["frozen_steps"]))
                       for index, group in enumerate(optimizer.param_groups) if group.get("frozen_steps", 0) > 0]
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

    @property
    def active(self) -> bool:
        return self.clip > 0 or bool(self.frozen)

    @torch.no_grad()
    def apply(self, engine) -> None:
        """Edit the gradients of the step about to be taken (`engine.global_steps` steps were taken before it).
        Called on every rank (under ZeRO 1-3 the edits gather partitioned gradients)."""
        step = engine.global_steps
        frozen_now = {id(p) for group in self.frozen if step < group.steps for p in group.params}
        if self.clip > 0:
            self.clip_each_parameter([p for p in self.params if id(p) not in frozen_now])
        for group in self.frozen:
            if step < group.steps:
                self.cancel(group)
            elif step == group.steps and self.zero_stage > 0:
                self.restart_optimizer_state(engine, group)

    def clip_each_parameter(self, params: list[torch.nn.Parameter]) -> None:
        """DINO's clip_gradients: every gradient times min(1, clip / (its norm + 1e-6))."""
        pieces = [self.local_gradient(p) for p in params]
        squares = torch.stack([piece.float().pow(2).sum() if piece is not None else torch.zeros(())
                               for piece in pieces]) if pieces else torch.zeros(0)
        if self.zero_stage > 0 and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squares)                # the pieces of one gradient lie on several ranks
        # Every gradient is multiplied, by 1.0 where it is within the clip (exact: x * 1.0 == x): choosing which to
        # leave alone would read the scales back from the device, a wait on a GPU once a step.
        scales = (self.clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for p, piece, scale in zip(params, pieces, scales.unbind()):
            if piece is None:
                continue
            if hasattr(p, "ds_id"):                 # ZeRO 3: a copy of the local partition; write it back
                safe_set_local_grad(p, piece * scale)
            else:                                   # p.grad, or a view into ZeRO 1-2's flat partition
                piece.mul_(scale)

    def local_gradient(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """This rank's piece of p's reduced gradient (None: this rank holds none of it). ZeRO 1-2 reach it through
        the fragment mapping DeepSpeed keeps for its `safe_*` functions (`_hp_mapping`)."""
        if self.zero_stage == 0:
            return p.grad
        if hasattr(p, "ds_id"):
            return safe_get_local_grad(p)
        mapping = getattr(p, "_hp_mapping", None)
        return None if mapping is None else mapping.get_lp_grad_fragment(p._index_in_param_group)

    def cancel(self, group: FrozenGroup) -> None:
        if self.zero_stage == 0:
            for p in group.params:
                p.grad = None
        else:
            safe_update_full_grad_vectorized(group.params, lambda grad, param: torch.zeros_like(grad))

    @staticmethod
    def restart_optimizer_state(engine, group: FrozenGroup) -> None:
        """Drop the optimizer state of the group's flat partitions (ZeRO 1-3): its moments are 0 (it had no
        gradient), its step count is not, and the reference starts counting at this step."""
        zero = engine.optimizer
        if hasattr(zero, "single_partition_of_fp32_groups"):        # ZeRO 1 and 2: one partition per group
            partitions = [zero.single_partition_of_fp32_groups[group.index]]
        else:                                                       # ZeRO 3: the group's sub-groups
            partitions = [zero.fp32_partitioned_groups_flat[sub] for sub, index in zero.sub_group_to_group_id.items()
                          if index == group.index]
        for partition in partitions:
            zero.optimizer.state.pop(partition, None)
