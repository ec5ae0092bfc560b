"""Balanced contrastive losses (Sors et al., "Simple and Effective Balance of Contrastive Losses", paper 000):
the contrastive margin loss (eqs. 1-2, q = 1) or InfoNCE (eqs. 3-4) split into a positive and an entropy
sub-loss weighted by lambda_p and lambda_e (eq. 5), supervised by the class labels (deep metric learning)
or by the views of an image (self-supervised, method.supervised=false).

Views: one group of k >= 1 views per image (k = 1, one augmented view per image, is the DML setting; the
positives then come from the labels). Everything but the loss is TCL's (pretrain/methods/tcl.py): backbone
+ projector with L2-normalised outputs, hard view selection over k-subsets of the pool (k = 1: the hardest
single view per image), negatives gathered across processes.

Batch aggregation (section 4.1, margin loss only): method.averaging=separate averages the positive and the
negative pairs separately (lambda_p = lambda_e = 1 is the "separate average"); averaging=global takes one
mean over all pairs, the implicit, batch-size dependent balance of most implementations; lambda_p /
lambda_e other than 1 on top of separate averaging give the tuned balance. InfoNCE always averages over the
positive pairs (eq. 8).

`scalars()` logs the two sub-losses of the last training batch, balance/positive_loss (mean l_p) and
balance/entropy_loss (mean l_e), the axes of the paper's Figure 4.

The embedding the loss shapes is the projector's L2-normalised output, and the export carries the projector
(`embedding_head_to_export`), so that `python -m eval retrieval` evaluates that embedding by default
(`--features backbone`: the backbone's pooled features). Departure: the paper's network is a ResNet-18 with GeM
pooling (section 6.2) and names no projection (its Table 3 notes the implementations that add a linear one);
here the backbone average-pools and the head is the `model.proj_*` MLP (2 layers in the digits config;
`model.proj_layers=1` makes it one linear layer); a loss on the pooled features themselves is not offered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from pretrain.losses.contrastive_margin_balance import AVERAGING, margin_balance_per_sample
from pretrain.losses.infonce_balance import infonce_balance_per_sample
from pretrain.methods.base import require_one_view_group
from pretrain.methods.tcl import TCL
from pretrain.runtime.config_error import ConfigError

LOSSES = ("margin", "infonce")


@dataclass
class Options:
    name: str = "contrastive_balance"
    loss: str = "margin"                     # margin (eqs. 1-2) | infonce (eqs. 3-4)
    margin: float = 0.5                      # m of the margin loss, Euclidean distance of unit vectors (0, 2]
    temperature: float = 0.1                 # t of InfoNCE
    lambda_p: float = 1.0                    # weight of the positive sub-loss (eq. 5)
    lambda_e: float = 1.0                    # weight of the entropy sub-loss (eq. 5)
    averaging: str = "separate"              # margin loss: separate | global (section 4.1)
    supervised: bool = True                  # positives are the images of the same class (needs labels)
    gather_negatives: bool = True            # contrast with every process's views, not only the local batch


class ContrastiveBalance(TCL):
    # Paper 000 publishes no code and names no projection head (module docstring): the backbone at torchvision's
    # init (no zero-init) and the project's MLP with BatchNorm hidden layers, as before these became per-method values.
    reference_model = {"zero_init_residual": False, "proj_hidden_bn": True}
    # the paper publishes no code: this project's choice
    reference_optim = {"decay_norm_and_bias": False}

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        method = cfg.method
        require_one_view_group(cfg, 1 if method.supervised else 2)
        if method.loss not in LOSSES:
            raise ConfigError(f"method.loss={method.loss!r} is not one of {LOSSES}")
        if method.averaging not in AVERAGING:
            raise ConfigError(f"method.averaging={method.averaging!r} is not one of {AVERAGING}")
        if not 0 < method.margin <= 2:
            raise ConfigError(f"method.margin={method.margin} must lie in (0, 2], distances of unit vectors "
                              "(paper: 0.5)")
        if method.temperature <= 0:
            raise ConfigError(f"method.temperature={method.temperature} must be positive (the paper uses 0.1)")
        if min(method.lambda_p, method.lambda_e) < 0:
            raise ConfigError(f"method.lambda_p={method.lambda_p} and method.lambda_e={method.lambda_e} must be >= 0")

    def per_sample(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool) -> torch.Tensor:
        return self.loss_and_gradient_means(z, labels, gather_negatives)[0]

    def loss_and_gradient_means(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(per-sample loss, (mean l_p, mean l_e)); TCL's loss() keeps the pair for `scalars()`."""
        o = self.options
        if o.loss == "margin":
            return margin_balance_per_sample(z, labels, o.margin, o.lambda_p, o.lambda_e, o.averaging,
                                             gather_negatives)
        return infonce_balance_per_sample(z, labels, o.temperature, o.lambda_p, o.lambda_e, gather_negatives)

    def embedding_head_to_export(self) -> nn.Module:
        return self.projector

    def scalars(self) -> dict[str, float]:
        if self.gradient_means is None:
            return {}
        positive, entropy = self.gradient_means
        return {"balance/positive_loss": positive.item(), "balance/entropy_loss": entropy.item()}


METHOD = ContrastiveBalance
