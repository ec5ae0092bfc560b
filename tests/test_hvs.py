"""Hard view selection on a hand-made example: planted hardest pairs and the statistics of HVS sec. 5.1."""
import pytest
import torch

from pretrain.hvs import select_hard_views
from pretrain.methods.pairs import all_pairs


class DistanceMethod:
    """A method whose per-sample pair loss is the distance between the two views' values."""

    candidates = staticmethod(all_pairs)

    @staticmethod
    def sample_loss(outputs, pair):
        z = outputs["z"]
        return (z[:, pair[0]] - z[:, pair[1]]).abs().flatten(1).mean(1)


def identity_forward(views):
    return {"z": views}


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
    selection = select_hard_views(identity_forward, DistanceMethod, views, boxes)
    assert selection.chosen.tolist() == [[0, 3], [0, 1]]
    assert selection.views.shape == (2, 2, 3, 4, 4)
    assert selection.views[:, :, 0, 0, 0].tolist() == [[0.0, 10.0], [1.0, 7.0]]
    torch.testing.assert_close(selection.boxes, boxes[[[0], [1]], torch.tensor([[0, 3], [0, 1]])])

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


def test_easy_mode_inverts_the_choice():
    views, boxes = planted_batch()
    selection = select_hard_views(identity_forward, DistanceMethod, views, boxes, mode="easy")
    assert selection.chosen.tolist() == [[0, 1], [0, 2]]          # loss 1 for both (first of the ties)
    assert selection.stats["hvs/selected_loss"] == pytest.approx(1.0)


def test_low_resolution_selection_returns_full_size_views():
    views, boxes = planted_batch()
    seen = []

    def forward(pool):
        seen.append(pool.shape)
        return {"z": pool}

    selection = select_hard_views(forward, DistanceMethod, views, boxes, selection_size=2)
    assert seen == [(2, 4, 3, 2, 2)]
    assert selection.views.shape == (2, 2, 3, 4, 4)
    assert selection.chosen.tolist() == [[0, 3], [0, 1]]


def test_bad_mode_is_refused():
    views, boxes = planted_batch()
    with pytest.raises(ValueError, match="hvs.mode='hardest'"):
        select_hard_views(identity_forward, DistanceMethod, views, boxes, mode="hardest")


def test_simclr_selection_equals_argmax_of_every_pair_loss():
    """With the real SimCLR method, the chosen pair of every sample is the argmax of its pair losses."""
    from pretrain.config import load_config
    from pretrain.methods import build_method

    cfg = load_config(None, ["model.stem=small_stride2", "model.proj_hidden_dim=32", "model.proj_out_dim=16"])
    torch.manual_seed(0)
    method = build_method(cfg).train()
    views, boxes = torch.randn(6, 4, 3, 16, 16), torch.rand(6, 4, 4).sort(dim=-1).values[..., [0, 2, 1, 3]]
    selection = select_hard_views(method, method, views, boxes)
    with torch.no_grad():
        z = method(views)["z"]
    from pretrain.losses.ntxent import nt_xent_per_sample
    pair_losses = torch.stack([nt_xent_per_sample(z[:, a], z[:, b], cfg.method.temperature)
                               for a, b in all_pairs(4)], dim=1)
    expected = torch.tensor(all_pairs(4))[pair_losses.argmax(1)]
    assert selection.chosen.tolist() == expected.tolist()
