"""Hard view selection on a hand-made example: planted hardest pairs and the statistics of HVS sec. 5.1;
candidate combinations across view groups and the `hvs.max_candidates` cap."""
import math
import random
from itertools import combinations
from pathlib import Path

import pytest
import torch

from pretrain.hvs import candidate_combinations, select_hard_views
from pretrain.methods.base import Method
from tests.engine_helpers import DINO_MULTI_CROP


class DistanceMethod(Method):
    """A method whose per-sample pair loss is the distance between the two views' values."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.train_counts = [2]

    def sample_loss(self, outputs, pair, labels):
        z = outputs["z"]
        return (z[:, pair[0]] - z[:, pair[1]]).abs().flatten(1).mean(1)


def identity_forward(views):
    return {"z": torch.cat(views, dim=1)}


def all_pairs(n):
    return list(combinations(range(n), 2))


def select(views, boxes, **kwargs):
    return select_hard_views(identity_forward if "forward" not in kwargs else kwargs.pop("forward"),
                             DistanceMethod(), [views], [boxes], torch.zeros(len(views)), [2], **kwargs)


def box_iou(a, b):
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    area = lambda r: (r[2] - r[0]) * (r[3] - r[1])
    return inter / (area(a) + area(b) - inter)


VALUES = [[0.0, 1.0, 2.0, 10.0],   # sample 0: hardest pair (0, 3), loss 10
          [1.0, 7.0, 2.0, 3.0]]    # sample 1: hardest pair (0, 1), loss 6
BOXES = [[[0, 0, .5, .5], [.1, .25, .6, .75], [.25, 0, .75, .5], [.5, .25, 1, .75]],  # lowest IoU: (0, 3)
         [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, .5, 1], [0, 0, .5, .5]]]             # lowest IoU: (0, 3)


def planted_batch():
    views = torch.tensor(VALUES)[:, :, None, None, None].expand(2, 4, 3, 4, 4).clone()
    return views, torch.tensor(BOXES)


def test_hard_mode_picks_planted_pair_and_stats_are_right():
    views, boxes = planted_batch()
    selection = select(views, boxes)
    assert selection.chosen.tolist() == [[0, 3], [0, 1]]
    assert selection.views[0].shape == (2, 2, 3, 4, 4)
    assert selection.views[0][:, :, 0, 0, 0].tolist() == [[0.0, 10.0], [1.0, 7.0]]
    torch.testing.assert_close(selection.boxes[0], boxes[[[0], [1]], torch.tensor([[0, 3], [0, 1]])])

    pairs = all_pairs(4)
    losses = [[abs(v[a] - v[b]) for a, b in pairs] for v in VALUES]
    ious = [[box_iou(s[a], s[b]) for a, b in pairs] for s in BOXES]
    stats = selection.stats
    assert stats["hvs/selected_loss"] == pytest.approx((10 + 6) / 2)
    assert stats["hvs/mean_pair_loss"] == pytest.approx(sum(map(sum, losses)) / 12)
    assert stats["hvs/selected_iou"] == pytest.approx((0.0 + 1.0) / 2)
    assert stats["hvs/mean_pair_iou"] == pytest.approx(sum(map(sum, ious)) / 12, rel=1e-5)
    # sample 0 chose its lowest-IoU pair, sample 1 did not
    assert stats["hvs/lowest_iou_chosen_frac"] == pytest.approx(0.5)
    area = lambda r: (r[2] - r[0]) * (r[3] - r[1])
    scales = [[(area(s[a]) + area(s[b])) / 2 for a, b in pairs] for s in BOXES]
    assert stats["hvs/selected_scale"] == pytest.approx((scales[0][pairs.index((0, 3))] + scales[1][0]) / 2)
    assert stats["hvs/mean_pair_scale"] == pytest.approx(sum(map(sum, scales)) / 12)


def test_easy_mode_inverts_the_choice():
    views, boxes = planted_batch()
    selection = select(views, boxes, mode="easy")
    assert selection.chosen.tolist() == [[0, 1], [0, 2]]          # loss 1 for both (first of the ties)
    assert selection.stats["hvs/selected_loss"] == pytest.approx(1.0)


def test_low_resolution_selection_returns_full_size_views():
    views, boxes = planted_batch()
    seen = []

    def forward(pool):
        seen.append(pool[0].shape)
        return {"z": pool[0]}

    selection = select(views, boxes, forward=forward, selection_size=2)
    assert seen == [(2, 4, 3, 2, 2)]
    assert selection.views[0].shape == (2, 2, 3, 4, 4)
    assert selection.chosen.tolist() == [[0, 3], [0, 1]]


def test_bad_mode_is_refused():
    views, boxes = planted_batch()
    with pytest.raises(ValueError, match="hvs.mode='hardest'"):
        select(views, boxes, mode="hardest")


def test_simclr_selection_equals_argmax_of_every_pair_loss():
    """With the real SimCLR method, the chosen pair of every sample is the argmax of its pair losses."""
    from pretrain.config import load_config
    from pretrain.methods import build_method

    cfg = load_config(None, ["model.stem=small_stride2", "model.proj_hidden_dim=32", "model.proj_out_dim=16"])
    torch.manual_seed(0)
    method = build_method(cfg).train()
    views, boxes = torch.randn(6, 4, 3, 16, 16), torch.rand(6, 4, 4).sort(dim=-1).values[..., [0, 2, 1, 3]]
    selection = select_hard_views(method, method, [views], [boxes], torch.zeros(6), [2])
    with torch.no_grad():
        z = method([views])["z"]
    from pretrain.losses.ntxent import nt_xent_per_sample
    pair_losses = torch.stack([nt_xent_per_sample(z[:, a], z[:, b], cfg.method.temperature)
                               for a, b in all_pairs(4)], dim=1)
    expected = torch.tensor(all_pairs(4))[pair_losses.argmax(1)]
    assert selection.chosen.tolist() == expected.tolist()


def test_candidates_take_each_groups_count_from_its_pool():
    # DINO-like: one of 2 globals of each kind, 2 of 3 locals -> 2 * 2 * 3 = 12 candidates, flat indices
    candidates = candidate_combinations([1, 1, 2], [2, 2, 3])
    assert len(candidates) == len(set(candidates)) == 12
    for a, b, *locals_ in candidates:
        assert a in (0, 1) and b in (2, 3) and len(locals_) == 2 and set(locals_) <= {4, 5, 6}
    assert candidate_combinations([2], [4]) == all_pairs(4)


def test_max_candidates_caps_by_random_draws_and_zero_means_no_cap():
    counts, pools = [1, 1, 8], [2, 2, 16]
    total = 2 * 2 * math.comb(16, 8)                              # 51,480
    assert len(candidate_combinations(counts, pools, max_candidates=0)) == total   # 0: no cap, all of them
    capped = candidate_combinations(counts, pools, max_candidates=128, rng=random.Random(1))
    assert len(capped) == len(set(capped)) == 128                  # distinct
    for a, b, *locals_ in capped:
        assert a in (0, 1) and b in (2, 3) and sorted(locals_) == locals_ and set(locals_) <= set(range(4, 20))
    assert capped != candidate_combinations(counts, pools, max_candidates=128, rng=random.Random(2))
    # a cap above the number of candidates returns all of them, in order
    assert candidate_combinations([2], [4], max_candidates=128) == all_pairs(4)
    with pytest.raises(ValueError, match="max_candidates=-1"):
        candidate_combinations([2], [4], max_candidates=-1)


def test_selection_gathers_each_group_and_scores_only_the_capped_candidates():
    """Two groups (sizes 4 and 2 px); the method's loss is planted: a global pair and a local chosen."""
    class PlantedMethod(Method):
        iou_views = 2

        def __init__(self):
            torch.nn.Module.__init__(self)
            self.train_counts = [1, 1, 1]

        def sample_loss(self, outputs, combination, labels):
            z = outputs["z"]                          # (B, 6): flat values of the views
            return sum(z[:, i] for i in combination)

    batch = 3
    values = torch.rand(batch, 6)
    sizes = [4, 4, 2]
    pools = [2, 2, 2]
    views, start = [], 0
    for size, n in zip(sizes, pools):
        views.append(values[:, start:start + n, None, None, None].expand(batch, n, 3, size, size).clone())
        start += n
    boxes = [torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(batch, n, 4) for n in pools]

    def forward(pool):
        return {"z": torch.cat([v[:, :, 0, 0, 0] for v in pool], dim=1)}

    selection = select_hard_views(forward, PlantedMethod(), views, boxes, torch.zeros(batch), [1, 1, 1],
                                  max_candidates=5, rng=random.Random(0))
    assert selection.scores.shape == (batch, 5)
    scored = candidate_combinations([1, 1, 1], pools, 5, random.Random(0))
    best = torch.stack([sum(values[:, i] for i in c) for c in scored], dim=1).argmax(1)
    assert selection.chosen.tolist() == [list(scored[i]) for i in best.tolist()]
    for g, (size, v) in enumerate(zip(sizes, selection.views)):
        assert v.shape == (batch, 1, 3, size, size)
        torch.testing.assert_close(v[:, 0, 0, 0, 0], values[torch.arange(batch), selection.chosen[:, g]])
    assert selection.stats["hvs/selected_iou"] == pytest.approx(1.0)


# ==== the selection forward leaves every buffer as it found it ====

METHOD_CONFIGS = ["simclr_digits.yaml", "simsiam_digits.yaml", "dino_digits.yaml", "tcl_digits.yaml",
                  "supcon_digits.yaml", "contrastive_balance_digits.yaml", "smoco_digits.yaml", "lejepa_digits.yaml"]


def everything_the_method_keeps(method) -> dict[str, torch.Tensor]:
    """Parameters and buffers of the module, and what it keeps outside it (DINO's teacher and centre)."""
    state = {f"module.{name}": value.clone() for name, value in method.state_dict().items()}
    for name, value in method.state_outside_engine().items():
        for key, tensor in (value.items() if isinstance(value, dict) else [("", value)]):
            if isinstance(tensor, torch.Tensor):
                state[f"outside.{name}.{key}"] = tensor.clone()
    return state


@pytest.mark.parametrize("selection_size", [None, 8])
@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_selection_in_train_mode_leaves_every_buffer_bit_identical(config, selection_size):
    from pretrain.config import load_config, views_to_draw
    from pretrain.methods import build_method

    root = Path(__file__).parents[1] / "configs/pretrain"
    cfg = load_config(root / config, ["hvs.enabled=true", "model.proj_hidden_dim=32", "model.proj_out_dim=16",
                                      *(["method.out_dim=64", *DINO_MULTI_CROP] if config.startswith("dino") else [])])
    torch.manual_seed(0)
    method = build_method(cfg).train()                                  # the mode the engine trains in
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(4, group.count, 3, group.size, group.size, generator=g) for group in views_to_draw(cfg)]
    boxes = [torch.rand(4, v.shape[1], 4, generator=g).sort(dim=-1).values[..., [0, 2, 1, 3]] for v in views]
    with torch.no_grad():
        method(views)                     # DINO places its teacher in its first forward: not the subject here
    before = everything_the_method_keeps(method)
    selection = select_hard_views(method, method, views, boxes, torch.arange(4) % 2, method.train_counts,
                                  selection_size=selection_size, max_candidates=8, rng=random.Random(0))
    after = everything_the_method_keeps(method)
    assert selection.chosen.shape[0] == 4
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed == []
    assert any("running_mean" in name for name in before)              # there were statistics to protect


def test_lowest_iou_chosen_counts_a_pick_tied_at_the_minimum():
    """DINO's IoU is that of the two globals, shared by every candidate with the same globals: a selector
    that picks a lowest-IoU candidate which is not the first of the ties must still count."""
    from pretrain.hvs import selection_stats

    # pools [2, 2, 3], one global of each kind + 1 local: 12 candidates, 3 per pair of globals
    table = torch.tensor(candidate_combinations([1, 1, 1], [2, 2, 3]))
    boxes = torch.tensor([[[0, 0, .5, .5], [0, 0, 1, 1],                # global kind 1: views 0, 1
                           [.5, .5, 1, 1], [0, 0, .6, .6],              # global kind 2: views 2, 3
                           [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]])  # locals
    lowest = [c for c, (a, b, _) in enumerate(table.tolist()) if (a, b) == (0, 2)]   # IoU 0: disjoint globals
    assert len(lowest) == 3
    for pick in lowest:                                   # each of the tied candidates is a lowest-IoU pick
        stats = selection_stats(torch.zeros(1, 12), torch.tensor([pick]), boxes, table, iou_views=2)
        assert stats["hvs/lowest_iou_chosen_frac"] == 1.0
    other = next(c for c in range(12) if c not in lowest)
    assert selection_stats(torch.zeros(1, 12), torch.tensor([other]), boxes, table, 2)["hvs/lowest_iou_chosen_frac"] == 0.0


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_every_method_selects_the_brute_force_argmax_in_train_mode(config):
    """For every method, in the mode the engine trains in: the chosen candidate of each sample is the argmax
    of its losses computed one candidate at a time (`sample_loss`) on a forward of the same pool (hvs.mode=easy:
    the argmin)."""
    from pretrain.config import load_config, views_to_draw
    from pretrain.methods import build_method

    root = Path(__file__).parents[1] / "configs/pretrain"
    cfg = load_config(root / config, ["hvs.enabled=true", "model.proj_hidden_dim=32", "model.proj_out_dim=16",
                                      *(["method.out_dim=64", *DINO_MULTI_CROP] if config.startswith("dino") else [])])
    torch.manual_seed(0)
    method = build_method(cfg).train()
    g = torch.Generator().manual_seed(4)
    views = [torch.randn(6, group.count, 3, group.size, group.size, generator=g) for group in views_to_draw(cfg)]
    boxes = [torch.rand(6, v.shape[1], 4, generator=g).sort(dim=-1).values[..., [0, 2, 1, 3]] for v in views]
    labels = torch.arange(6) % 3
    selection = select_hard_views(method, method, views, boxes, labels, method.train_counts, max_candidates=20,
                                  rng=random.Random(0))
    scored = candidate_combinations(method.train_counts, [v.shape[1] for v in views], 20, random.Random(0))
    with torch.no_grad():
        outputs = {name: tensor.float() for name, tensor in method(views).items()}
        losses = torch.stack([method.sample_loss(outputs, combination, labels) for combination in scored], dim=1)
    assert selection.chosen.tolist() == [list(scored[i]) for i in losses.argmax(dim=1).tolist()]
    torch.testing.assert_close(selection.scores, losses, rtol=1e-4, atol=1e-5)
    easiest = select_hard_views(method, method, views, boxes, labels, method.train_counts, mode="easy",
                                max_candidates=20, rng=random.Random(0))     # hvs.mode=easy: the minimum of the same
    assert easiest.chosen.tolist() == [list(scored[i]) for i in losses.argmin(dim=1).tolist()]
    assert easiest.chosen.tolist() != selection.chosen.tolist()


@pytest.mark.parametrize("config", ["simclr_digits.yaml", "simsiam_digits.yaml"])
def test_all_mode_equals_the_mean_of_the_separately_computed_pair_losses_in_value_and_gradient(config):
    """hvs.mode=all ("all pairs"): the loss of a pool of 4 views is the mean of the 6 pairs' training losses, each
    computed on its own (a forward of the pair's 2 views, the method's plain loss), and so is its gradient, for every
    parameter. In eval mode, where a view's output does not depend on the others in its forward (in train mode
    BatchNorm normalises over the whole pool, which is what one forward of the pool means)."""
    from contextlib import nullcontext

    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.task import BatchPosition

    root = Path(__file__).parents[1] / "configs/pretrain"
    cfg = load_config(root / config, ["hvs.enabled=true", "hvs.mode=all", "model.proj_hidden_dim=32",
                                      "model.proj_out_dim=16", "model.pred_hidden_dim=8", "monitor.online_probe=false"])
    torch.manual_seed(0)
    method = build_method(cfg).eval()
    g = torch.Generator().manual_seed(2)
    views = torch.randn(5, 4, 3, 16, 16, generator=g)               # 5 images: no power of two hides a mistake
    labels = torch.arange(5)
    batch = ViewBatch([views], [torch.rand(5, 4, 4, generator=g)], labels, labels)
    parameters = [p for p in method.parameters() if p.requires_grad]

    every_pair = method.batch_loss(method, batch, BatchPosition(0, 0, 0, 0), nullcontext).loss
    gradient = torch.autograd.grad(every_pair, parameters, allow_unused=True)
    separate = [method.loss(method([views[:, list(pair)]]), labels) for pair in all_pairs(4)]
    expected = torch.stack(separate).mean()
    expected_gradient = torch.autograd.grad(expected, parameters, allow_unused=True)
    torch.testing.assert_close(every_pair, expected, rtol=1e-6, atol=1e-6)
    assert len(set(round(loss.item(), 4) for loss in separate)) == 6            # six different pairs were averaged
    for name, got, want in zip([n for n, p in method.named_parameters() if p.requires_grad], gradient,
                               expected_gradient):
        assert (got is None) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
    assert any(g is not None and g.abs().sum() > 0 for g in gradient)


def test_all_mode_is_refused_for_a_method_whose_loss_is_more_than_the_mean_of_its_sample_losses():
    from pretrain.config import ConfigError, load_config

    root = Path(__file__).parents[1] / "configs/pretrain"
    for config in ("dino_digits.yaml", "smoco_digits.yaml", "tcl_digits.yaml"):
        with pytest.raises(ConfigError, match=r"hvs.mode=all .* method.name=(dino|smoco|tcl)'s training loss .* "
                                              r"use hvs.mode=all with simclr or simsiam"):
            load_config(root / config, ["hvs.enabled=true", "hvs.mode=all"])
    load_config(root / "simclr_digits.yaml", ["hvs.enabled=true", "hvs.mode=all"])
