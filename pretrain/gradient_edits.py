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
from deepspeed.utils import safe_update_full_grad_vectorized


@dataclass(frozen=True)
class FrozenGroup:
    index: int                          # the group's index in the optimizer's param_groups
    params: list[torch.nn.Parameter]
    steps: int                          # no gradient in optimizer steps 0 .. steps-1


class GradientEdits:
    """Per-parameter clipping and frozen groups, applied by `pretrain.loop.train_step` when DeepSpeed is about to
    take an optimizer step. Build it from the torch optimizer *before* `deepspeed.initialize`, which replaces the
    groups' parameters by its flat partitions under ZeRO 1-3."""

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
            clip = self.clip

            def clipped(grad: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
                # DINO's clip_gradients: scale by clip / (norm + 1e-6) when that is below 1
                return grad * min(1.0, clip / (float(grad.norm()) + 1e-6))

            safe_update_full_grad_vectorized([p for p in self.params if id(p) not in frozen_now], clipped)
        for group in self.frozen:
            if step < group.steps:
                self.cancel(group)
            elif step == group.steps and self.zero_stage > 0:
                self.restart_optimizer_state(engine, group)

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
