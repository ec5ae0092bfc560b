"""TCL (Animesh & Chandraker, "Tuned Contrastive Learning"): backbone + MLP projector, the TCL loss between the
k >= 2 views of each image (eqs. 9-11), self-supervised (the paper: k = 3, positive triplets) or supervised
(method.supervised=true: views of images of the same class are positives too).

With hard view selection the engine draws N views per image (hvs.num_views=[N]), scores every k-subset by
its per-sample loss against the other images' views at the same positions, and trains on the hardest.

`scalars()` logs the paper's Figure-3 quantities of the last training batch: tcl/grad_pos, the mean hard-
positive gradient coefficient |X_ip - P_ip + Y_ip| (eq. 17), and tcl/grad_neg, the mean P_in (eq. 16).
SupCon (pretrain/methods/supcon.py) is this method with the SupCon loss and logs its own (Lemma 1) values
under the same names, so the runs' curves overlay as in Figure 3.

The network is the TCL authors' (chaitanyaanimesh/Tuned-Contrastive-Learning, built on HobbitLong/SupContrast): a
ResNet without zero-initialised residual branches and the head Linear-ReLU-Linear with biases and no BatchNorm
(`reference_model` below); `model.proj_hidden_bn=true` gives the Linear(no bias)-BN-ReLU-Linear head this project
used before.

Weight decay acts on every parameter, as the TCL code and SupContrast pass every parameter to SGD with weight decay
1e-4 (train.py:657-662; SupContrast util.py:79-82; `reference_optim`); `optim.decay_norm_and_bias=false` skips biases
and BatchNorm parameters (SimCLR's split).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from pretrain.losses.tcl import tcl_loss_and_gradient_means, tcl_per_sample
from pretrain.methods.base import Method, encode_view_groups, require_one_view_group
from pretrain.models import backbone_from_config, projector_from_config
from pretrain.runtime.config_error import ConfigError


@dataclass
class Options:
    name: str = "tcl"
    temperature: float = 0.1                 # t of eqs. 9-11
    k1: float = 5000.0                       # weight of the positives' exp(-z_i.z_p) term (>= 1, Theorem 1)
    k2: float = 1.0                          # weight of the negatives' term (>= 1, Theorem 2)
    supervised: bool = False                 # positives include the views of same-label images (needs labels)
    gather_negatives: bool = True            # contrast with every process's views, not only the local batch


def check_views_and_temperature(cfg: DictConfig) -> None:
    """One view group of k >= 2 views and a positive temperature (TCL and SupCon)."""
    require_one_view_group(cfg, 2)
    if cfg.method.temperature <= 0:
        raise ConfigError(f"method.temperature={cfg.method.temperature} must be positive (the paper uses 0.1)")


class TCL(Method):
    # The TCL authors' code (chaitanyaanimesh/Tuned-Contrastive-Learning, built on HobbitLong/SupContrast): a ResNet
    # with zero_init_residual=False (models/resnet_big_pretrained_cifar.py:77) and the head Linear-ReLU-Linear with
    # biases and no BatchNorm (:113), SupContrast's SupConResNet head.
    reference_model = {"zero_init_residual": False, "proj_hidden_bn": False}
    # the TCL code builds on SupContrast: SGD over every parameter
    reference_optim = {"decay_norm_and_bias": True}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        self.backbone = backbone_from_config(cfg)
        self.projector = projector_from_config(cfg, self.backbone.num_features)
        self.options = OmegaConf.to_object(cfg.method)      # this method's Options
        self.gradient_means: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def needs_labels(cfg: DictConfig) -> bool:
        return bool(cfg.method.supervised)

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        check_views_and_temperature(cfg)
        for key in ("k1", "k2"):
            value = cfg.method[key]
            if not value >= 1:
                raise ConfigError(f"method.{key}={value} must be >= 1: TCL's eq. 11 requires k1, k2 >= 1 (its "
                                  "Theorems 1 and 2 rely on it); the default is k1=5000, k2=1")

    # ---- the loss: SupCon overrides these two ----
    def per_sample(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool) -> torch.Tensor:
        o = self.options
        return tcl_per_sample(z, labels, o.temperature, o.k1, o.k2, gather_negatives)

    def loss_and_gradient_means(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        o = self.options
        return tcl_loss_and_gradient_means(z, labels, o.temperature, o.k1, o.k2, gather_negatives)

    # ---- the method protocol ----
    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        # Normalised in fp32: under bf16 the loss still sees unit vectors.
        features, z = encode_view_groups(self.backbone, views, head=self.projector)
        return {"z": F.normalize(z.float(), dim=-1), "features": features}

    def sample_loss(self, outputs: dict[str, torch.Tensor], combination: Sequence[int],
                    labels: torch.Tensor) -> torch.Tensor:
        # Scored as training scores: against the views at the same positions of every process when
        # method.gather_negatives (every process scores the same number of candidates, so the gathers pair up).
        return self.per_sample(outputs["z"][:, list(combination)], self.class_labels(labels),
                               self.options.gather_negatives)

    def loss(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        z, labels = outputs["z"], self.class_labels(labels)
        gather = self.options.gather_negatives
        per_sample, self.gradient_means = self.loss_and_gradient_means(z, labels, gather)
        return per_sample.mean()

    def scalars(self) -> dict[str, float]:
        if self.gradient_means is None:
            return {}
        grad_pos, grad_neg = self.gradient_means
        return {"tcl/grad_pos": grad_pos.item(), "tcl/grad_neg": grad_neg.item()}

    def class_labels(self, labels: torch.Tensor) -> torch.Tensor | None:
        """The labels the loss uses: None when self-supervised; refused when supervised but unknown (-1)."""
        if not self.options.supervised:
            return None
        self.refuse_unknown_labels(
            labels, f"method.name={self.options.name} with method.supervised=true needs class labels, but this batch "
                    "has label -1 (unknown): write the .beton from an image folder with one sub-folder per class "
                    "(python -m pretrain.data write --image-folder DIR --out FILE), or set method.supervised=false")
        return labels


METHOD = TCL
