"""SupCon (Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020, L_out^sup; TCL paper eqs. 1-3) with
k >= 2 views per image, supervised by default or self-supervised (method.supervised=false).

Everything but the loss is TCL's (pretrain/methods/tcl.py): backbone + projector, hard view selection over
k-subsets, and the Figure-3 scalars, here the Lemma 1 values (eqs. 4-7) under the same names tcl/grad_pos
(mean |X_ip - P^s_ip|) and tcl/grad_neg (mean P^s_in), so that SupCon and TCL runs compare on one plot.

The network is HobbitLong/SupContrast's SupConResNet (networks/resnet_big.py): a ResNet without zero-initialised
residual branches and the head Linear-ReLU-Linear with biases, no BatchNorm (`reference_model` below;
`model.proj_hidden_bn=true` is the BatchNorm head this project used before). Weight decay acts on every parameter, as
SupContrast's SGD does (`reference_optim`; `optim.decay_norm_and_bias=false` skips biases and BatchNorm).

The loss scale: SupContrast multiplies the loss by temperature / base_temperature (losses.py:103, base_temperature
0.07: 1.43x at t = 0.1, which with SGD acts as 1.43x the learning rate); the TCL authors' SupCon, which this method
follows by default (`method.base_temperature: null`), has no such factor. `method.base_temperature=0.07` gives
SupContrast's, and its preset (configs/pretrain/supcon_cifar_folder.yaml) sets it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig

from pretrain.losses.supcon import supcon_loss_and_gradient_means, supcon_per_sample
from pretrain.methods.tcl import TCL, check_views_and_temperature
from pretrain.runtime.config_error import ConfigError


@dataclass
class Options:
    name: str = "supcon"
    temperature: float = 0.1                 # t of eqs. 2-3
    supervised: bool = True                  # positives include the views of same-label images (needs labels)
    gather_negatives: bool = True            # contrast with every process's views, not only the local batch
    # The loss times temperature / base_temperature (SupContrast losses.py:103, 0.07 there); null: no factor (TCL's)
    base_temperature: Optional[float] = None


class SupCon(TCL):
    # HobbitLong/SupContrast: SupConResNet builds its ResNet with zero_init_residual=False (networks/resnet_big.py:76,
    # `model_fun()` at :170) and the head Linear-ReLU-Linear with biases and no BatchNorm (:174-178).
    reference_model = {"zero_init_residual": False, "proj_hidden_bn": False}
    # HobbitLong/SupContrast set_optimizer: SGD(model.parameters(), weight_decay=...)
    reference_optim = {"decay_norm_and_bias": True}

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        check_views_and_temperature(cfg)
        base = cfg.method.base_temperature
        if base is not None and not base > 0:
            raise ConfigError(f"method.base_temperature={base} must be positive (SupContrast: 0.07; the loss is "
                              "multiplied by temperature / base_temperature), or null for no factor")

    def loss_scale(self) -> float:
        """temperature / base_temperature (SupContrast), or 1 without a base temperature (the TCL authors')."""
        base = self.options.base_temperature
        return 1.0 if base is None else self.options.temperature / base

    def per_sample(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool) -> torch.Tensor:
        return self.loss_scale() * supcon_per_sample(z, labels, self.options.temperature, gather_negatives)

    def loss_and_gradient_means(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The loss (scaled, `loss_scale`) and the Lemma-1 means, which are the loss's unscaled coefficients."""
        loss, means = supcon_loss_and_gradient_means(z, labels, self.options.temperature, gather_negatives)
        return self.loss_scale() * loss, means


METHOD = SupCon
