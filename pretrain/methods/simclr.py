"""SimCLR (Chen et al., ICML 2020): backbone + MLP projector, NT-Xent between two views of each image.

With hard view selection (HVS appendix H.1), every pair of the N views is scored by its per-sample NT-Xent
loss computed against the other images' views of the same pair -- of every process's images when
method.gather_negatives, as the training loss and the HVS authors' `acs_fwd` do -- and the highest-loss pair is
trained on.

The projector is `model.proj_*`'s MLP; the SimCLR configs end it with a BatchNorm with a scale and no shift
after a linear layer without bias (`model.proj_last_bn: bn_scale`), as google-research/simclr's projection head
and the HVS paper's Table 9 (`use_bn_in_head: true`); `model.proj_last_bn=none` ends it with a plain linear layer.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from pretrain.losses.ntxent import DIRECTIONS, nt_xent_per_sample
from pretrain.methods.base import Method, encode_view_groups, require_one_view_group
from pretrain.models import backbone_from_config, projector_from_config
from pretrain.runtime.config_error import ConfigError


@dataclass
class Options:
    name: str = "simclr"
    temperature: float = 0.2                 # NT-Xent temperature
    gather_negatives: bool = True            # negatives from every process, not only the local batch
    lambda_p: float = 1.0                    # weight of the positive term (paper 000, eq. 5; 1, 1: NT-Xent)
    lambda_e: float = 1.0                    # weight of the entropy term
    # How the two directions' losses combine: mean (automl/hvp, lightly) or sum (google-research/simclr objective.py:86,
    # which with LARS halves the weight decay's pull and doubles the step of BatchNorm and biases: pretrain/losses/ntxent.py)
    directions: str = "mean"


class SimCLR(Method):
    # google-research/simclr: each residual block's last BatchNorm starts at zero (resnet.py:395 and :480,
    # init_zero=True); the head's hidden layers are linear + BatchNorm + ReLU (model_util.py:162-165, use_bn=True).
    reference_model = {"zero_init_residual": True, "proj_hidden_bn": True}
    # google-research/simclr excludes BatchNorm from the decay (LARS's exclude_from_weight_decay, add_weight_decay)
    reference_optim = {"decay_norm_and_bias": False}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        self.backbone = backbone_from_config(cfg)
        self.projector = projector_from_config(cfg, self.backbone.num_features)
        self.temperature = cfg.method.temperature
        self.gather_negatives = cfg.method.gather_negatives
        self.lambdas = {"lambda_p": cfg.method.lambda_p, "lambda_e": cfg.method.lambda_e,
                        "directions": cfg.method.directions}

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        require_one_view_group(cfg, 2, 2)
        if cfg.method.directions not in DIRECTIONS:
            raise ConfigError(f"method.directions={cfg.method.directions!r} must be one of {DIRECTIONS}: the mean of "
                              "NT-Xent's two directions (automl/hvp, lightly) or their sum (google-research/simclr)")
        if min(cfg.method.lambda_p, cfg.method.lambda_e) < 0:
            raise ConfigError(f"method.lambda_p={cfg.method.lambda_p} and method.lambda_e={cfg.method.lambda_e} "
                              "must be >= 0 (1 and 1: NT-Xent)")

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        features, z = encode_view_groups(self.backbone, views, head=self.projector)
        return {"z": z, "features": features}

    def sample_loss(self, outputs: dict[str, torch.Tensor], pair: Sequence[int], labels: torch.Tensor) -> torch.Tensor:
        # Scored as training scores: against the negatives of every process when method.gather_negatives (the HVS
        # authors' acs_fwd gathers them too). Every process scores the same number of candidates, so the gathers
        # pair up across processes.
        a, b = pair
        return nt_xent_per_sample(outputs["z"][:, a], outputs["z"][:, b], self.temperature, self.gather_negatives,
                                  **self.lambdas)


METHOD = SimCLR
