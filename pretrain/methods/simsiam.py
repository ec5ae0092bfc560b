"""SimSiam (Chen & He, CVPR 2021): backbone + projector + predictor, negative cosine with stop-gradient.

HVS (Ferreira et al.) eq. 2: score every pair of the N views by the per-sample loss of eq. 1 and train on
the highest-loss pair. `method.fix_pred_lr` keeps the predictor at the base learning rate, as the paper.

Weight decay applies to every parameter, biases and BatchNorm included, as facebookresearch/simsiam's
main_simsiam.py (and the HVS authors' SimSiam) pass all of them to SGD with weight_decay 1e-4; SimCLR, BYOL-style
LARS recipes and DINO exclude them, SimSiam does not.

BatchNorm statistics per view: facebookresearch/simsiam's `SimSiam.forward` (builder.py) runs `z1 = encoder(x1)`
and `z2 = encoder(x2)`, and the predictor on each, so every BatchNorm of backbone, projector and predictor
normalises each view over the batch on its own; automl/hvp@main (builder.py) does the same in training. Its
selection pass (select_crops.py, `single_forward(torch.cat(images))`) encodes the whole pool of N views as one
batch, so the selection forward here does too: a forward of the method's own 2 views is per view, a forward of a
larger pool is joint. `method.per_view_batchnorm=false` normalises the 2 training views jointly as well (this
project's behaviour before 2026-11-25; SimCLR, SupCon and DINO batch their views jointly in their references).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from pretrain.losses.negative_cosine import negative_cosine_per_sample
from pretrain.methods.base import Method, encode_view_groups, require_one_view_group, split_decay_groups
from pretrain.models import backbone_from_config, mlp, projector_from_config


@dataclass
class Options:
    name: str = "simsiam"
    fix_pred_lr: bool = True                 # the predictor keeps the base lr (no cosine decay)
    per_view_batchnorm: bool = True          # the 2 training views through BatchNorm one at a time (the reference)


class SimSiam(Method):
    # facebookresearch/simsiam builds the encoder with zero_init_residual=True (simsiam/builder.py:24; automl/hvp@main
    # passes it too, pretrain.py:60 and :67); the projector's hidden layers are Linear(no bias)-BN-ReLU
    # (builder.py:28-33).
    reference_model = {"zero_init_residual": True, "proj_hidden_bn": True}
    # facebookresearch/simsiam main_simsiam.py passes every parameter to SGD
    reference_optim = {"decay_norm_and_bias": True}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        model = cfg.model
        self.backbone = backbone_from_config(cfg)
        self.projector = projector_from_config(cfg, self.backbone.num_features, last_bn="bn")
        self.predictor = mlp(model.proj_out_dim, model.pred_hidden_dim, model.proj_out_dim, 2)
        self.fix_pred_lr = cfg.method.fix_pred_lr
        self.per_view_batchnorm = cfg.method.per_view_batchnorm

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        require_one_view_group(cfg, 2, 2)

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        (group,) = views
        if self.per_view_batchnorm and group.shape[1] == sum(self.train_counts):     # the training views
            encoded = [self.encode(group[:, v]) for v in range(group.shape[1])]       # BatchNorm per view
            return {name: torch.stack([e[name] for e in encoded], dim=1) for name in encoded[0]}
        features, z = encode_view_groups(self.backbone, views, head=self.projector)   # the selection pool: jointly
        p = self.predictor(z.flatten(0, 1)).unflatten(0, z.shape[:2])
        return {"z": z, "p": p, "features": features}

    def encode(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """One batch of images (B, C, H, W) through backbone, projector and predictor: (B, D) each."""
        features = self.backbone(images)
        z = self.projector(features)
        return {"z": z, "p": self.predictor(z), "features": features}

    def sample_loss(self, outputs: dict[str, torch.Tensor], pair: Sequence[int], labels: torch.Tensor) -> torch.Tensor:
        z, p = outputs["z"], outputs["p"]
        a, b = pair
        return negative_cosine_per_sample(p[:, a], z[:, a], p[:, b], z[:, b])

    def param_groups(self) -> list[dict]:
        # SimSiam decays everything (module docstring): optim.decay_norm_and_bias, true by default, drops the no_decay
        # groups' flag (pretrain/runtime/optim.py); false gives the split of SimCLR and DINO.
        encoder = nn.ModuleList([self.backbone, self.projector])
        groups = split_decay_groups(encoder) + split_decay_groups(self.predictor, fixed_lr=self.fix_pred_lr)
        return [group for group in groups if group["params"]]


METHOD = SimSiam
