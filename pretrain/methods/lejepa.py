"""LeJEPA (Balestriero & LeCun, arXiv 2511.08544, 2025): backbone + projector, V views of each image, one loss:
the views' embeddings predict their mean, and SIGReg keeps them an isotropic Gaussian (pretrain/losses/lejepa.py). No
teacher, no stop-gradient, no negatives; one trade-off weight, `method.lamb`.

As the reference's minimal code (rbalestr-lab/lejepa MINIMAL.md): V views of one kind (its V = 4), the projector an
MLP with BatchNorm to a small embedding (2048-2048-16 there; `model.proj_*`), SIGReg over 256 random directions drawn
anew every step, the Epps-Pulley statistic on 17 knots of [0, 3], lambda 0.02, AdamW with weight decay 0.05. The
directions come from a generator seeded by the run's seed and the optimizer step (the reference: a global step
counter, or torch's global generator in the minimal code), so a resumed run draws what the uninterrupted one drew and
every process draws the same. Departures: the paper's global and local crops (2 + 6-8 views of two sizes, the
prediction target the globals' mean) are the multi-crop variant; this method trains the minimal code's single view
group, every view predicting the mean of all.

Hard view selection: a candidate takes `data.views.0.count` of the pool's views, and is scored by its prediction
term alone. SIGReg is a statistic of the whole batch, which no single image's candidate has; the prediction term is
what differs between one image's candidates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from pretrain.losses.lejepa import lejepa_loss, prediction_per_sample, random_directions
from pretrain.methods.base import Method, encode_view_groups, require_one_view_group
from pretrain.models import backbone_from_config, projector_from_config
from pretrain.runtime.config_error import ConfigError


@dataclass
class Options:
    name: str = "lejepa"
    lamb: float = 0.02                       # SIGReg's weight lambda; the prediction term's is 1 - lambda (MINIMAL.md)
    num_slices: int = 256                    # random directions SIGReg projects on, drawn anew every step
    knots: int = 17                          # quadrature points of the Epps-Pulley integral on [0, t_max]
    t_max: float = 3.0
    gather: bool = True                      # SIGReg over every process's images (the reference all-reduces)


class LeJEPA(Method):
    # The minimal code uses timm's models as they come (ViT-S/8) and torchvision's MLP with BatchNorm: no reference for
    # a ResNet's zero-init, which timm's default (zero_init_last) gives; the projector's hidden layers
    # Linear-BN-ReLU (torchvision.ops.MLP(norm_layer=BatchNorm1d), whose linear layers keep their bias).
    reference_model = {"zero_init_residual": True, "proj_hidden_bn": True}
    # MINIMAL.md: AdamW(net.parameters(), weight_decay=5e-2): every parameter decays
    reference_optim = {"decay_norm_and_bias": True}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        self.backbone = backbone_from_config(cfg)
        self.projector = projector_from_config(cfg, self.backbone.num_features)
        self.options = cfg.method
        self.seed = int(cfg.seed)
        self.steps_done = 0
        self.last_terms: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        require_one_view_group(cfg, 2)
        o = cfg.method
        if not 0 <= o.lamb <= 1:
            raise ConfigError(f"method.lamb={o.lamb} must be in [0, 1]: SIGReg's weight (the reference: 0.02-0.05)")
        if o.num_slices < 1 or o.knots < 2 or not o.t_max > 0:
            raise ConfigError(f"method.num_slices={o.num_slices} must be >= 1, method.knots={o.knots} >= 2 and "
                              f"method.t_max={o.t_max} positive (the reference: 256, 17, 3)")

    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        features, z = encode_view_groups(self.backbone, views, head=self.projector)
        return {"z": z, "features": features}

    def directions(self, dim: int, device: torch.device) -> torch.Tensor:
        """This step's SIGReg directions: the same on every process, and on a resume (seeded by the step)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps_done)
        return random_directions(dim, self.options.num_slices, generator, device)

    def sample_loss(self, outputs: dict[str, torch.Tensor], combination: Sequence[int],
                    labels: torch.Tensor) -> torch.Tensor:
        return prediction_per_sample(outputs["z"][:, list(combination)])

    def loss(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        z, o = outputs["z"], self.options
        loss, prediction, regulariser = lejepa_loss(z, self.directions(z.shape[-1], z.device), o.lamb, o.t_max,
                                                    o.knots, o.gather)
        self.last_terms = (prediction.detach(), regulariser.detach())
        return loss

    def scalars(self) -> dict[str, float]:
        """lejepa/prediction and lejepa/sigreg of the last micro-batch (the loop calls this on the steps that log)."""
        if self.last_terms is None:
            return {}
        return {"lejepa/prediction": float(self.last_terms[0]), "lejepa/sigreg": float(self.last_terms[1])}

    def after_step(self, step: int) -> None:
        self.steps_done = step

    def state_outside_engine(self) -> dict:
        return {**super().state_outside_engine(), "steps_done": self.steps_done}

    def load_state_outside_engine(self, state: dict) -> None:
        super().load_state_outside_engine(state)
        self.steps_done = int(state.get("steps_done", 0))


METHOD = LeJEPA
