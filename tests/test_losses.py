"""The losses against brute-force computations of their paper equations."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.losses.negative_cosine import negative_cosine_per_sample
from pretrain.losses.ntxent import nt_xent_per_sample


def brute_force_nt_xent(z_a, z_b, t, directions="mean"):
    """SimCLR eq. 1, one anchor at a time, with explicit sums over the 2B - 1 candidates; a sample's two directions
    averaged, or summed as google-research/simclr does (objective.py:86)."""
    z = [v / v.norm() for v in torch.cat([z_a, z_b]).double()]
    n = len(z_a)

    def l(i, j):
        denominator = sum(math.exp(float(z[i] @ z[k]) / t) for k in range(2 * n) if k != i)
        return -math.log(math.exp(float(z[i] @ z[j]) / t) / denominator)

    weight = 1.0 if directions == "sum" else 0.5
    return torch.tensor([weight * (l(i, i + n) + l(i + n, i)) for i in range(n)], dtype=torch.float64)


@pytest.mark.parametrize("directions", ["mean", "sum"])
def test_nt_xent_matches_brute_force(directions):
    torch.manual_seed(0)
    z_a, z_b = torch.randn(6, 5), torch.randn(6, 5)
    for t in (0.1, 0.5, 1.0):
        got = nt_xent_per_sample(z_a, z_b, t, directions=directions)
        assert got.shape == (6,)
        torch.testing.assert_close(got.double(), brute_force_nt_xent(z_a, z_b, t, directions), rtol=1e-5, atol=1e-5)


def test_nt_xent_identical_views_and_no_negatives_limit():
    # With one image there are no negatives: the only candidate is the positive, loss is exactly 0.
    z = torch.randn(1, 8)
    assert nt_xent_per_sample(z, torch.randn(1, 8), 0.2).item() == pytest.approx(0.0, abs=1e-6)


def test_nt_xent_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature=0"):
        nt_xent_per_sample(torch.randn(2, 3), torch.randn(2, 3), 0)
    with pytest.raises(ValueError, match=r"\(B, D\)"):
        nt_xent_per_sample(torch.randn(2, 3), torch.randn(3, 3), 0.1)
    with pytest.raises(ValueError, match="directions='add' must be one of"):
        nt_xent_per_sample(torch.randn(2, 3), torch.randn(2, 3), 0.1, directions="add")


def _gathered_worker(rank, port, z_a, z_b, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    half = z_a.shape[0] // 2
    a = z_a[rank * half:(rank + 1) * half].clone().requires_grad_()
    b = z_b[rank * half:(rank + 1) * half].clone()
    loss = nt_xent_per_sample(a, b, 0.3, gather_negatives=True)
    loss.sum().backward()
    queue.put((rank, loss.detach().numpy(), a.grad.numpy()))   # numpy: a tensor's fd dies with this process
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_nt_xent_gathered_negatives_equal_one_big_batch(free_port):
    """Two processes with gathered negatives compute exactly the single-process loss of the whole batch,
    and the gradient reaching each process's own embeddings is that of the whole-batch loss."""
    torch.manual_seed(1)
    z_a, z_b = torch.randn(8, 4), torch.randn(8, 4)
    whole_a = z_a.clone().requires_grad_()
    expected = nt_xent_per_sample(whole_a, z_b, 0.3)
    expected.sum().backward()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_gathered_worker, args=(r, free_port, z_a, z_b, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (torch.from_numpy(l), torch.from_numpy(g))) for r, l, g in (queue.get() for _ in procs))
    for p in procs:
        p.join(60)
    losses = torch.cat([results[0][0], results[1][0]])
    torch.testing.assert_close(losses, expected.detach())
    # all_gather's backward sums gradients from every process, so the sum-of-losses gradient matches.
    grads = torch.cat([results[0][1], results[1][1]])
    torch.testing.assert_close(grads, whole_a.grad)


def test_negative_cosine_closed_form_and_stop_gradient():
    torch.manual_seed(0)
    p_a, p_b = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    z_a, z_b = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    got = negative_cosine_per_sample(p_a, z_a, p_b, z_b)
    with torch.no_grad():
        for i in range(4):
            cos_ab = float(p_a[i] @ z_b[i]) / (p_a[i].norm() * z_b[i].norm()).item()
            cos_ba = float(p_b[i] @ z_a[i]) / (p_b[i].norm() * z_a[i].norm()).item()
            assert got[i].item() == pytest.approx(-0.5 * (cos_ab + cos_ba), abs=1e-6)
    got.sum().backward()
    assert z_a.grad is None and z_b.grad is None          # stop-gradient on the projector outputs
    assert p_a.grad.abs().sum() > 0
    # identical directions give the minimum, -1
    same = negative_cosine_per_sample(z_b, z_a, 3 * z_a, 2 * z_b)  # p_a || z_b and p_b || z_a
    torch.testing.assert_close(same, torch.full((4,), -1.0))
