"""The deep-metric-learning methods of papers 000 and 001 as methods: the weighted contrastive method's
mini-batch pairs per batch design (eq. 23 with the weights of eqs. 24-25) against brute force, its hard view
selection, the balance method's sub-loss scalars, and their config checks. (s-MoCo: tests/test_smoco.py;
the balance method also runs in the every-method HVS and DeepSpeed tests.)"""
import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ConfigError, load_config
from pretrain.hvs import candidate_combinations, select_hard_views
from pretrain.methods import build_method

TINY = ["model.proj_hidden_dim=32", "model.proj_out_dim=16", "data.batch_size=8"]
COUNTS = torch.tensor([30, 20, 25, 40, 10])          # N_c of a pretend training set: L = 5, N = 125


def weighted_method(*overrides):
    method = build_method(load_config("configs/pretrain/weighted_contrastive_digits.yaml", [*TINY, *overrides]))
    method.class_counts = COUNTS
    return method


def brute_force_eq_23(f, labels, pairs, weight, eta_lambda=10.0, margin=1.0):
    total = 0.0
    for i, j in pairs:
        d = torch.sqrt(((f[i] - f[j]) ** 2).sum())
        if labels[i] == labels[j]:
            term = d ** 2
        else:
            eta = eta_lambda / 4 * (COUNTS[labels[i]] - 1) / COUNTS[labels[j]]
            term = eta * torch.clamp(margin - d, min=0) ** 2
        total = total + weight(labels[i], labels[j]) * term
    return total / len(pairs)


@pytest.mark.parametrize("design", ["p_random", "group", "uniform"])
def test_weighted_contrastive_trains_on_the_pairs_of_its_batch_design(design):
    overrides = {"p_random": ["data.batch_design.name=p_random", "data.batch_design.positive_fraction=0.3"],
                 "group": ["data.batch_design.name=group", "data.batch_design.images_per_class=2"],
                 "uniform": ["data.batch_design.name=uniform"]}[design]
    method = weighted_method(*overrides)
    f = F.normalize(torch.randn(8, 1, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1)
    labels = torch.tensor([0, 0, 1, 3, 2, 2, 4, 1])
    n, total = 125, 125 * 124
    if design == "p_random":               # the sampled pairs (2t, 2t+1), both orders; eq. 24
        pairs = [(i, i ^ 1) for i in range(8)]

        def weight(a, b):
            return (5 * COUNTS[a] * (COUNTS[a] - 1) / (0.3 * total) if a == b
                    else 20 * COUNTS[a] * COUNTS[b] / (0.7 * total))
    else:                                  # every ordered pair; eq. 25 with m = 2, n = 4 (group), W = 1 (uniform)
        pairs = list(itertools.permutations(range(8), 2))

        def weight(a, b):
            if design == "uniform":
                return 1.0
            return (5 * 7 * COUNTS[a] * (COUNTS[a] - 1) / (1 * total) if a == b
                    else 20 * 7 * COUNTS[a] * COUNTS[b] / (2 * 3 * total))
    assert n * (n - 1) == total
    loss = method.loss({"z": f}, labels)
    assert loss.item() == pytest.approx(brute_force_eq_23(f[:, 0], labels, pairs, weight).item(), rel=1e-6)
    unweighted = weighted_method(*overrides, "method.importance_weights=false").loss({"z": f}, labels)
    assert unweighted.item() == pytest.approx(brute_force_eq_23(f[:, 0], labels, pairs, lambda a, b: 1.0).item(),
                                              rel=1e-6)
    assert set(method.scalars()) == {"weighted_contrastive/positive_loss", "weighted_contrastive/negative_loss"}


def test_weighted_contrastive_selection_is_the_brute_force_argmax():
    method = weighted_method("hvs.enabled=true", "data.batch_design.name=p_random").train()
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(6, 4, 3, 8, 8, generator=g)]
    boxes = [torch.rand(6, 4, 4, generator=g).sort(dim=-1).values[..., [0, 2, 1, 3]]]
    labels = torch.tensor([0, 0, 1, 3, 2, 2])
    selection = select_hard_views(method, method, views, boxes, labels, method.train_counts, rng=random.Random(0))
    candidates = candidate_combinations([1], [4])                          # the hardest single view of 4
    with torch.no_grad():
        outputs = method(views)
        losses = torch.stack([method.sample_loss(outputs, c, labels) for c in candidates], dim=1)
    assert selection.chosen.tolist() == [list(candidates[i]) for i in losses.argmax(dim=1).tolist()]
    assert set(selection.stats) == {"hvs/selected_loss", "hvs/mean_pair_loss", "hvs/selected_scale",
                                    "hvs/mean_pair_scale"}                             # one view: no IoU


def test_balance_method_logs_its_sub_losses_and_trains_on_one_view():
    method = build_method(load_config("configs/pretrain/contrastive_balance_digits.yaml",
                                      [*TINY, "method.lambda_p=0.5", "method.lambda_e=3"]))
    outputs = method([torch.randn(8, 1, 3, 8, 8, generator=torch.Generator().manual_seed(2))])
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 3, 0])
    loss = method.loss({k: v.float() for k, v in outputs.items()}, labels)
    scalars = method.scalars()
    assert loss.item() == pytest.approx(0.5 * scalars["balance/positive_loss"] + 3 * scalars["balance/entropy_loss"],
                                        rel=1e-5)
    loss.backward()
    assert method.backbone.conv1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("config, overrides, match", [
    ("contrastive_balance", ["method.loss=triplet"], "method.loss='triplet' is not one of"),
    ("contrastive_balance", ["method.averaging=mean"], "method.averaging='mean' is not one of"),
    ("contrastive_balance", ["method.margin=3"], r"must lie in \(0, 2\]"),
    ("contrastive_balance", ["method.supervised=false"], "trains on at least 2 views per image"),
    ("weighted_contrastive", ["data.views.0.count=2"], "trains on 1 views per image"),
    ("weighted_contrastive", ["method.eta=traditional"], "method.eta='traditional' is not one of"),
    ("weighted_contrastive", ["method.balance_lambda=0"], "must be positive"),
])
def test_config_errors(config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(f"configs/pretrain/{config}_digits.yaml", overrides)


def test_unlabelled_batches_are_refused_in_one_line():
    method = weighted_method()
    with pytest.raises(ConfigError, match="needs class labels, but this batch has label -1"):
        method.loss({"z": F.normalize(torch.randn(4, 1, 16), dim=-1)}, torch.tensor([0, -1, 1, 1]))


def test_group_design_without_gathered_pairs_is_refused_on_several_processes():
    """Eq. 25's importance weights count the pairs of the global batch: a process that sees only its share of them
    (group design, method.gather_negatives=false, several processes) is refused; one process, gathered pairs or
    the p-random design (whose pairs never leave a process) train."""
    from pretrain.methods.weighted_contrastive import check_group_design_sees_its_pairs
    from pretrain.runtime.config_error import ConfigError

    for design, gather, processes in (("group", False, 1), ("group", True, 4), ("p_random", False, 4),
                                      ("uniform", False, 4)):
        check_group_design_sees_its_pairs(design, gather, processes)
    with pytest.raises(ConfigError, match="gather_negatives=false on 2 processes"):
        check_group_design_sees_its_pairs("group", False, 2)

