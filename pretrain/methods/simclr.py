"""SimCLR (Chen et al., ICML 2020): backbone + MLP projector, NT-Xent between two views of each image.

With hard view selection (HVS appendix H.1), every pair of the N views is scored by its per-sample NT-Xent
loss computed against the other images' views of the same pair, and the highest-loss pair is trained on.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from pretrain.losses.ntxent import nt_xent_per_sample
from pretrain.methods.pairs import all_pairs, encode_view_stack, split_decay_groups
from pretrain.models import create_backbone, mlp


class SimCLR(nn.Module):
    def __init__(self, cfg: DictConfig):
        super().__init__()
        m = cfg.model
        self.backbone = create_backbone(m.arch, m.stem, cfg.data.views[0].size, m.zero_init_residual)
        self.projector = mlp(self.backbone.num_features, m.proj_hidden_dim, m.proj_out_dim, m.proj_layers)
        self.temperature = cfg.method.temperature
        self.gather_negatives = cfg.method.gather_negatives

    def forward(self, views: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"z": encode_view_stack(nn.Sequential(self.backbone, self.projector), views)}

    candidates = staticmethod(all_pairs)

    def sample_loss(self, outputs: dict[str, torch.Tensor], pair: tuple[int, int]) -> torch.Tensor:
        # Selection scores use the local batch as negatives: cheap and the same on every process.
        z = outputs["z"]
        return nt_xent_per_sample(z[:, pair[0]], z[:, pair[1]], self.temperature)

    def loss(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        z = outputs["z"]
        return nt_xent_per_sample(z[:, 0], z[:, 1], self.temperature, self.gather_negatives).mean()

    def param_groups(self) -> list[dict]:
        return split_decay_groups(self)

    def after_step(self, step: int) -> None:
        pass
