"""Weighted contrastive loss with importance sampling (Hong, Park & Kim, "Deep Metric Learning via Weighted
Contrastive Loss", paper 001): the contrastive loss (eta = 1) or the balanced contrastive loss (eq. 15) on
the pairs of a mini-batch (eq. 23), each pair weighted by the importance weight W of the batch design that
drew it (eqs. 24-25), so that the mini-batch gradient estimates the full loss of eq. 10 whatever the design.

Views: one group of one view per image (the paper's one augmented image per example); with hard view
selection the engine draws a pool (hvs.num_views=[4]) and each image trains on its hardest single view.

The batch design is the loader's, `data.batch_design` (pretrain/data/batch_designs.py):
- uniform: a random subset of distinct images; its pairs are every ordered pair, W = 1;
- p_random: B/2 sampled pairs, batch positions (2t, 2t+1); the loss runs over those pairs (both orders);
- group: n classes x m images; every ordered pair of the global batch (negatives gathered across processes).
`method.importance_weights=false` sets W = 1: the biased mini-batch estimate of paper 001's Table 1 rows "N".

N_c (the class sizes, and L and N from them) come from the labels of data.train.

`scalars()` logs weighted_contrastive/positive_loss (mean g(D) over the batch's positive pairs) and
weighted_contrastive/negative_loss (mean eta h(D) over its negative pairs), without importance weights.

The embedding: the paper replaces the classifier of its (ImageNet-pretrained) ResNet-50 by one linear layer to
128 dimensions (section 6); `model.proj_layers: 1` (the digits config) is that layer, on the backbone's pooled
features, `model.proj_layers: 2` the MLP of the self-supervised methods. The distances D are taken between
L2-normalised embeddings (the paper normalises only for its triplet and cluster baselines; on unit vectors the
margin alpha lies in (0, 2] whatever the embedding's scale). The export carries the head
(`embedding_head_to_export`): `python -m eval retrieval` evaluates the embedding by default, as the paper does,
and `--features backbone` the backbone's features. The paper's recipe (Adam, the lr times 0.9 every 5% of
training, (4, 16)-group batches) and what the digits config keeps of it:
configs/pretrain/weighted_contrastive_digits.yaml.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.nn.functional import all_gather

from pretrain.data.batch_designs import BatchDesign, class_counts, classes_per_batch, dataset_labels
from pretrain.losses.weighted_contrastive import (ETAS, balanced_eta, contrastive_eta, group_importance_weights,
                                                  minibatch_loss_per_anchor, p_random_importance_weights, pair_terms)
from pretrain.methods.base import require_one_view_group
from pretrain.methods.tcl import TCL
from pretrain.runtime.config_error import ConfigError


@dataclass
class Options:
    name: str = "weighted_contrastive"
    eta: str = "balanced"                    # balanced (eq. 15) | contrastive (eta = 1, eq. 4)
    balance_lambda: float = 256.0            # lambda of eq. 15: negatives compared per positive pair
    margin: float = 1.0                      # alpha of h(D) = max(0, alpha - D)^2, unit vectors: (0, 2]
    importance_weights: bool = True          # W of the batch design (eqs. 24-25); false: W = 1
    gather_negatives: bool = True            # pairs across every process's images (uniform and group designs)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_group_design_sees_its_pairs(design_name: str, gather_negatives: bool, processes: int) -> None:
    """The group design's importance weights (eq. 25) count every pair of the *global* batch: on several processes
    without gathered candidates each process sees only its share of them, and the weights would be wrong."""
    if design_name == "group" and not gather_negatives and processes > 1:
        raise ConfigError(f"data.batch_design.name=group with method.gather_negatives=false on {processes} processes: "
                          "the importance weights (paper 001, eq. 25) assume every pair of the global batch; set "
                          "method.gather_negatives=true, or train on one process")


class WeightedContrastive(TCL):
    # Paper 001 fine-tunes an ImageNet-pretrained ResNet-50 (section 6), whose init no zero-init touches: from
    # scratch, torchvision's default (false). Its embedding is one linear layer (model.proj_layers 1: no hidden layer);
    # model.proj_layers 2 is the project's MLP with BatchNorm hidden layers.
    reference_model = {"zero_init_residual": False, "proj_hidden_bn": True}
    # the paper publishes no code: this project's choice
    reference_optim = {"decay_norm_and_bias": False}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        self.design = BatchDesign(**OmegaConf.to_container(cfg.data.batch_design))
        check_group_design_sees_its_pairs(self.design.name, cfg.method.gather_negatives, world_size())
        self.global_batch = cfg.data.batch_size * world_size()
        self.train_path = cfg.data.train
        # N_c of the training set, read on first use (tests set it directly).
        self.class_counts: torch.Tensor | None = None

    @staticmethod
    def needs_labels(cfg: DictConfig) -> bool:
        return True

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        method = cfg.method
        require_one_view_group(cfg, 1, 1)
        if method.eta not in ETAS:
            raise ConfigError(f"method.eta={method.eta!r} is not one of {ETAS}")
        if method.balance_lambda <= 0:
            raise ConfigError(f"method.balance_lambda={method.balance_lambda} must be positive (paper 001: 128-512 "
                              "with about 100 training classes; about L - 1 reproduces the contrastive loss, eq. 17)")
        if not 0 < method.margin <= 2:
            raise ConfigError(f"method.margin={method.margin} must lie in (0, 2], distances of unit vectors")

    def counts(self, device: torch.device) -> torch.Tensor:
        if self.class_counts is None:
            self.class_counts = torch.as_tensor(class_counts(dataset_labels(self.train_path)))
        return self.class_counts.to(device)

    def class_labels(self, labels: torch.Tensor) -> torch.Tensor:
        self.refuse_unknown_labels(labels, "method.name=weighted_contrastive needs class labels, but this batch has "
                                   "label -1 (unknown): write the .beton from an image folder with one sub-folder "
                                   "per class")
        return labels

    def per_sample(self, z: torch.Tensor, labels: torch.Tensor, gather_negatives: bool) -> torch.Tensor:
        return self.loss_and_gradient_means(z, labels, gather_negatives)[0]

    def loss_and_gradient_means(self, z: torch.Tensor, labels: torch.Tensor, gather_negatives: bool
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(B,) eq. 23 shares of the local images (one view each) and the means of the two pair terms."""
        o = self.options
        anchors = z[:, 0]
        labels = labels.to(z.device)
        candidates, candidate_labels, offset = anchors, labels, 0
        # The p-random design's pairs never leave a process: no gather needed for them.
        if gather_negatives and self.design.name != "p_random" and world_size() > 1:
            candidates = torch.cat(all_gather(anchors), dim=0)
            gathered = [torch.empty_like(labels) for _ in range(world_size())]
            dist.all_gather(gathered, labels)
            candidate_labels = torch.cat(gathered)
            offset = dist.get_rank() * len(anchors)
        rows = torch.arange(len(anchors), device=z.device)
        if self.design.name == "p_random":          # batch positions (2t, 2t + 1) are the pairs
            pairs = torch.zeros(len(anchors), len(candidates), dtype=torch.bool, device=z.device)
            pairs[rows, (rows ^ 1).clamp(max=len(candidates) - 1)] = True
            pairs[rows, rows] = False                # an odd last image (HVS scoring) has no partner
        else:                                        # every ordered pair of distinct images
            pairs = torch.ones(len(anchors), len(candidates), dtype=torch.bool, device=z.device)
            pairs[rows, rows + offset] = False
        counts = self.counts(z.device)
        if o.eta == "balanced":
            eta = balanced_eta(labels, candidate_labels, counts, o.balance_lambda)
        else:
            eta = contrastive_eta(labels, candidate_labels)
        weights = self.importance_weights(labels, candidate_labels, counts)
        same = labels[:, None] == candidate_labels[None, :]
        terms = pair_terms(anchors, candidates, same, eta, o.margin)
        per_anchor = minibatch_loss_per_anchor(terms, pairs, weights)
        with torch.no_grad():
            positive_pairs, negative_pairs = pairs & same, pairs & ~same
            positive = terms[positive_pairs].mean() if positive_pairs.any() else terms.new_zeros(())
            negative = terms[negative_pairs].mean() if negative_pairs.any() else terms.new_zeros(())
        return per_anchor, (positive, negative)

    def importance_weights(self, labels: torch.Tensor, candidate_labels: torch.Tensor,
                           counts: torch.Tensor) -> torch.Tensor:
        """(A, M) W of the loader's batch design (ones without importance weights or for the uniform design)."""
        if not self.options.importance_weights or self.design.name == "uniform":
            return torch.ones(len(labels), len(candidate_labels), device=labels.device)
        if self.design.name == "p_random":
            return p_random_importance_weights(labels, candidate_labels, counts, self.design.positive_fraction)
        return group_importance_weights(labels, candidate_labels, counts, self.design.images_per_class,
                                        classes_per_batch(self.design, self.global_batch))

    def embedding_head_to_export(self) -> nn.Module:
        return self.projector

    def scalars(self) -> dict[str, float]:
        if self.gradient_means is None:
            return {}
        positive, negative = self.gradient_means
        return {"weighted_contrastive/positive_loss": positive.item(),
                "weighted_contrastive/negative_loss": negative.item()}


METHOD = WeightedContrastive
