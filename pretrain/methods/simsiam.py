"""SimSiam (Chen & He, CVPR 2021): backbone + projector + predictor, negative cosine with stop-gradient.

HVS (Ferreira et al.) eq. 2: score every pair of the N views by the per-sample loss of eq. 1 and train on
the highest-loss pair. `method.fix_pred_lr` keeps the predictor at the base learning rate, as the paper.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from pretrain.losses.negative_cosine import negative_cosine_per_sample
from pretrain.methods.pairs import all_pairs, encode_view_stack, split_decay_groups
from pretrain.models import create_backbone, mlp


class SimSiam(nn.Module):
    def __init__(self, cfg: DictConfig):
        super().__init__()
        m = cfg.model
        self.backbone = create_backbone(m.arch, m.stem, cfg.data.views[0].size, m.zero_init_residual)
        self.projector = mlp(self.backbone.num_features, m.proj_hidden_dim, m.proj_out_dim, m.proj_layers,
                             last_bn=True)
        self.predictor = mlp(m.proj_out_dim, m.pred_hidden_dim, m.proj_out_dim, 2)
        self.fix_pred_lr = cfg.method.fix_pred_lr

    def forward(self, views: torch.Tensor) -> dict[str, torch.Tensor]:
        z = encode_view_stack(nn.Sequential(self.backbone, self.projector), views)
        p = encode_view_stack(self.predictor, z)
        return {"z": z, "p": p}

    candidates = staticmethod(all_pairs)

    def sample_loss(self, outputs: dict[str, torch.Tensor], pair: tuple[int, int]) -> torch.Tensor:
        z, p = outputs["z"], outputs["p"]
        a, b = pair
        return negative_cosine_per_sample(p[:, a], z[:, a], p[:, b], z[:, b])

    def loss(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.sample_loss(outputs, (0, 1)).mean()

    def param_groups(self) -> list[dict]:
        encoder = nn.ModuleList([self.backbone, self.projector])
        return split_decay_groups(encoder) + split_decay_groups(self.predictor, fixed_lr=self.fix_pred_lr)

    def after_step(self, step: int) -> None:
        pass
