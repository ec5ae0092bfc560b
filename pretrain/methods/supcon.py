"""SupCon (Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020, L_out^sup; TCL paper eqs. 1-3) with
k >= 2 views per image, supervised by default or self-supervised (method.supervised=false).

Everything but the loss is TCL's (pretrain/methods/tcl.py): backbone + projector, hard view selection over
k-subsets, and the Figure-3 scalars, here the Lemma 1 values (eqs. 4-7) under the same names tcl/grad_pos
(mean |X_ip - P^s_ip|) and tcl/grad_neg (mean P^s_in), so that SupCon and TCL runs compare on one plot.

The network is HobbitLong/SupContrast's SupConResNet (networks/resnet_big.py): a ResNet without zero-initialised
residual branches and the head Linear-ReLU-Linear with biases, no BatchNorm (`reference_model` below;
`model.proj_hidden_bn=true` is the BatchNorm head this project used before). Differences from SupContrast: weight
decay skips biases and BatchNorm parameters, as TCL's (pretrain/methods/tcl.py says more).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from pretrain.losses.supcon import supcon_loss_and_gradient_means, supcon_per_sample
from pretrain.methods.tcl import TCL, check_views_and_temperature


@dataclass
class Options:
    name: str = "supcon"
    temperature: float = 0.1                 # t of eqs. 2-3
    supervised: bool = True                  # positives include the views of same-label images (needs labels)
    gather_negatives: bool = True            # contrast with every process's views, not only the local batch


class SupCon(TCL):
    # HobbitLong/SupContrast: SupConResNet builds its ResNet with zero_init_residual=False (networks/resnet_big.py:76,
    # `model_fun()` at :170) and the head Linear-ReLU-Linear with biases and no BatchNorm (:174-178).
    reference_model = {"zero_init_residual": False, "proj_hidden_bn": False}
    # HobbitLong/SupContrast set_optimizer: SGD(model.parameters(), weight_decay=...)
    reference_optim = {"decay_norm_and_bias": True}

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        check_views_and_temperature(cfg)

    def per_sample(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool) -> torch.Tensor:
        return supcon_per_sample(z, labels, self.options.temperature, gather_negatives)

    def loss_and_gradient_means(self, z: torch.Tensor, labels: torch.Tensor | None, gather_negatives: bool
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return supcon_loss_and_gradient_means(z, labels, self.options.temperature, gather_negatives)


METHOD = SupCon
