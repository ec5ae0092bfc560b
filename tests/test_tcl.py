"""SupCon and TCL (Animesh & Chandraker, "Tuned Contrastive Learning"): the losses against brute-force loops of
eqs. 1-3 and 9-11, their autograd gradients against Lemmas 1 and 2, the Figure-3 quantities, gathering across
processes, hard view selection over k-subsets, and tiny whole runs of both methods."""
import json
import math
import os
from itertools import combinations
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from pretrain.config import ConfigError, load_config
from pretrain.hvs import select_hard_views
from pretrain.losses.supcon import (
    _supcon_per_anchor,
    contrast_set,
    supcon_gradient_means,
    supcon_per_sample,
)
from pretrain.losses.tcl import _tcl_per_anchor, tcl_gradient_means, tcl_per_sample
from pretrain.methods import build_method

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs/pretrain"
T = 0.1


def unit_views(batch: int, k: int, dim: int = 5, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(batch, k, dim, generator=generator, dtype=torch.float64), dim=-1)


# ---- brute force: one anchor at a time, the sets P(i) and N(i) written out ----

def sets(batch: int, k: int, labels, i: int) -> tuple[list[int], list[int]]:
    """P(i), N(i) over the flat views a = b k + v: same image (or, with labels, same label) is positive."""
    def related(a):
        return a // k == i // k or (labels is not None and labels[a // k] == labels[i // k])
    positives = [a for a in range(batch * k) if a != i and related(a)]
    negatives = [a for a in range(batch * k) if a != i and not related(a)]
    return positives, negatives


def lemma_terms(z, labels, t, k1, k2, i):
    """For anchor i: (P, N, D, dots) with D of eq. 3 (k1 = 0, k2 = 1) or eqs. 10-11, dots[a] = z_i . z_a."""
    flat = z.reshape(-1, z.shape[-1])
    batch, k = z.shape[:2]
    positives, negatives = sets(batch, k, labels, i)
    dots = {a: float(flat[i] @ flat[a]) for a in positives + negatives}
    d = sum(math.exp(dots[p] / t) for p in positives) + k1 * sum(math.exp(-dots[p]) for p in positives) \
        + k2 * sum(math.exp(dots[n] / t) for n in negatives)
    return positives, negatives, d, dots


def brute_force_per_anchor(z, labels, t, k1=0.0, k2=1.0) -> torch.Tensor:
    """Eq. 2 (k1 = 0, k2 = 1: SupCon) or eq. 9 (TCL), anchor by anchor."""
    losses = []
    for i in range(z.shape[0] * z.shape[1]):
        positives, _, d, dots = lemma_terms(z, labels, t, k1, k2, i)
        losses.append(-sum(math.log(math.exp(dots[p] / t) / d) for p in positives) / len(positives))
    return torch.tensor(losses, dtype=torch.float64)


def brute_force_per_sample(z, labels, t, k1=0.0, k2=1.0) -> torch.Tensor:
    return brute_force_per_anchor(z, labels, t, k1, k2).view(z.shape[0], z.shape[1]).mean(1)


def brute_force_figure3(z, labels, t, k1=0.0, k2=1.0) -> tuple[float, float]:
    """Sec. 4.4: per anchor the mean over positives of |X - P + Y| (eq. 17) and over negatives of P_in (eqs. 7,
    16), averaged over anchors. k1 = 0, k2 = 1 gives Lemma 1's |X - P^s| and P^s_in."""
    pos, neg = [], []
    for i in range(z.shape[0] * z.shape[1]):
        positives, negatives, d, dots = lemma_terms(z, labels, t, k1, k2, i)
        x = 1 / len(positives)
        pos.append(sum(abs(x - math.exp(dots[p] / t) / d + t * k1 * math.exp(-dots[p]) / d) for p in positives)
                   / len(positives))
        if negatives:
            neg.append(sum(k2 * math.exp(dots[n] / t) / d for n in negatives) / len(negatives))
    return sum(pos) / len(pos), sum(neg) / len(neg)


LABELS = torch.tensor([0, 1, 0, 2, 1])       # images 0 and 2 share a class, so do 1 and 4; 3 is alone


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("supervised", [False, True])
def test_supcon_matches_brute_force(k, supervised):
    z = unit_views(5, k, seed=k)
    labels = LABELS if supervised else None
    for t in (0.1, 0.5):
        got = supcon_per_sample(z, labels, t)
        assert got.shape == (5,)
        torch.testing.assert_close(got, brute_force_per_sample(z, labels, t))
    # float32 inputs give the same values to float32 precision
    torch.testing.assert_close(supcon_per_sample(z.float(), labels, T).double(),
                               brute_force_per_sample(z, labels, T), rtol=1e-5, atol=1e-5)


def test_supcon_with_a_base_temperature_scales_its_loss_as_supcontrast_and_its_preset_sets_it():
    """SupContrast's loss is -(t / base_temperature) x the mean log-probability of the positives (losses.py:103; base
    0.07): method.base_temperature gives that factor on the loss, not on the Lemma-1 means (the coefficients the
    scalars report); null (the TCL authors' SupCon, the Fashion-MNIST and digits presets) gives none. The CIFAR preset
    follows SupContrast."""
    z, labels = unit_views(5, 2, seed=7), LABELS
    for base, factor in ((None, 1.0), (0.07, T / 0.07)):
        cfg = load_config(CONFIGS / "supcon_digits.yaml", ["model.proj_hidden_dim=32", "model.proj_out_dim=16",
                                                        f"method.temperature={T}", f"method.base_temperature={base}"
                                                        if base else "method.base_temperature=null"])
        method = build_method(cfg)
        torch.testing.assert_close(method.per_sample(z, labels, False), factor * brute_force_per_sample(z, labels, T))
        loss, means = method.loss_and_gradient_means(z, labels, False)
        torch.testing.assert_close(loss, factor * brute_force_per_sample(z, labels, T))
        for got, want in zip(means, brute_force_figure3(z, labels, T)):
            assert float(got) == pytest.approx(want, rel=1e-6)
    assert load_config(CONFIGS / "supcon_cifar_folder.yaml").method.base_temperature == 0.07
    assert load_config(CONFIGS / "supcon_fashion_mnist.yaml").method.base_temperature is None
    with pytest.raises(ConfigError, match="method.base_temperature=0.0 must be positive"):
        load_config(CONFIGS / "supcon_digits.yaml", ["method.base_temperature=0"])


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("supervised", [False, True])
def test_tcl_matches_brute_force(k, supervised):
    z = unit_views(5, k, seed=10 + k)
    labels = LABELS if supervised else None
    for k1, k2 in ((1.0, 1.0), (5000.0, 1.0), (50000.0, 3.0)):
        torch.testing.assert_close(tcl_per_sample(z, labels, T, k1, k2), brute_force_per_sample(z, labels, T, k1, k2))


def test_tcl_with_k1_0_and_k2_1_is_supcon():
    for k, labels in ((2, None), (3, None), (3, LABELS)):
        z = unit_views(5, k, seed=20 + k)
        contrast = contrast_set(z, labels)
        torch.testing.assert_close(contrast.per_sample(_tcl_per_anchor(contrast, T, 0.0, 1.0)),
                                   supcon_per_sample(z, labels, T), rtol=1e-12, atol=1e-12)


def test_tcl_is_stable_at_large_k1_and_small_temperature():
    z = unit_views(4, 3, seed=3).float()
    z[0, 1] = z[0, 0]                               # an exact positive: exp(1 / t) at t = 0.01 overflows float32
    loss = tcl_per_sample(z.requires_grad_(), None, 0.01, 50000.0, 3.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(z.grad).all()


def anchor_gradient(per_anchor, z_fixed, labels, i):
    """d L_i / d z_i by autograd, with z_i a free leaf vector and every other embedding fixed."""
    k = z_fixed.shape[1]
    z_i = z_fixed[i // k, i % k].clone().requires_grad_()
    z = z_fixed.clone()
    z[i // k, i % k] = z_i
    per_anchor(contrast_set(z, labels))[i].backward()
    return z_i.grad


@pytest.mark.parametrize("supervised", [False, True])
def test_supcon_gradient_is_lemma_1(supervised):
    """Eq. 4 with eqs. 5-7: (1/t) (sum_p z_p (P^s_ip - X_ip) + sum_n z_n P^s_in)."""
    z, labels = unit_views(5, 3, dim=6, seed=30), (LABELS if supervised else None)
    flat = z.reshape(-1, 6)
    for i in (0, 4, 8, 14):
        positives, negatives, d, dots = lemma_terms(z, labels, T, 0.0, 1.0, i)
        x = 1 / len(positives)
        closed = sum(flat[p] * (math.exp(dots[p] / T) / d - x) for p in positives) \
            + sum(flat[n] * math.exp(dots[n] / T) / d for n in negatives)
        torch.testing.assert_close(anchor_gradient(lambda c: _supcon_per_anchor(c, T), z, labels, i), closed / T)


@pytest.mark.parametrize("supervised", [False, True])
def test_tcl_gradient_is_lemma_2(supervised):
    """Eq. 12 with eqs. 13-16: (1/t) (sum_p z_p (P^t_ip - X_ip - Y^t_ip) + sum_n z_n P^t_in)."""
    z, labels = unit_views(5, 3, dim=6, seed=31), (LABELS if supervised else None)
    flat = z.reshape(-1, 6)
    for k1, k2 in ((5000.0, 1.0), (3.0, 2.0)):
        for i in (1, 5, 9, 13):
            positives, negatives, d, dots = lemma_terms(z, labels, T, k1, k2, i)
            x = 1 / len(positives)
            closed = sum(flat[p] * (math.exp(dots[p] / T) / d - x - T * k1 * math.exp(-dots[p]) / d)
                         for p in positives) + sum(flat[n] * k2 * math.exp(dots[n] / T) / d for n in negatives)
            got = anchor_gradient(lambda c, k1=k1, k2=k2: _tcl_per_anchor(c, T, k1, k2), z, labels, i)
            torch.testing.assert_close(got, closed / T)


@pytest.mark.parametrize("supervised", [False, True])
def test_figure3_quantities_match_brute_force_and_theorem_1(supervised):
    z, labels = unit_views(6, 3, dim=8, seed=40), (torch.tensor([0, 1, 0, 2, 1, 2]) if supervised else None)
    supcon = [v.item() for v in supcon_gradient_means(z, labels, T)]
    assert supcon == pytest.approx(brute_force_figure3(z, labels, T), rel=1e-10)
    tcl = [v.item() for v in tcl_gradient_means(z, labels, T, 5000.0, 1.0)]
    assert tcl == pytest.approx(brute_force_figure3(z, labels, T, 5000.0, 1.0), rel=1e-10)
    assert tcl[0] > supcon[0]                      # Theorem 1, on the Figure-3 mean
    # Theorem 1 per positive: wherever SupCon still pulls (X > P^s, a hard positive), TCL pulls harder.
    for i in range(18):
        positives, _, d_sup, dots = lemma_terms(z, labels, T, 0.0, 1.0, i)
        _, _, d_tcl, _ = lemma_terms(z, labels, T, 5000.0, 1.0, i)
        x = 1 / len(positives)
        for p in positives:
            supcon_coefficient = x - math.exp(dots[p] / T) / d_sup
            if supcon_coefficient > 0:
                assert x - math.exp(dots[p] / T) / d_tcl + T * 5000.0 * math.exp(-dots[p]) / d_tcl > supcon_coefficient


def test_bad_arguments_are_refused_with_the_value():
    z = unit_views(3, 2)
    with pytest.raises(ValueError, match=r"k1=0\.5 .*k1 >= 1 and k2 >= 1"):
        tcl_per_sample(z, None, T, 0.5, 1.0)
    with pytest.raises(ValueError, match=r"k2=0\.0 .*k1 >= 1 and k2 >= 1"):
        tcl_per_sample(z, None, T, 5000.0, 0.0)
    with pytest.raises(ValueError, match="k1=-1"):
        tcl_gradient_means(z, None, T, -1, 1)
    with pytest.raises(ValueError, match="temperature=0"):
        supcon_per_sample(z, None, 0)
    with pytest.raises(ValueError, match=r"\(B, k, D\) with k >= 2"):
        supcon_per_sample(z[:, :1], None, T)
    with pytest.raises(RuntimeError, match="L2-normalised"):
        tcl_per_sample(3 * z, None, T, 5000.0, 1.0)
    with pytest.raises(RuntimeError, match="labels=None"):
        supcon_per_sample(z, torch.tensor([0, -1, 2]), T)
    with pytest.raises(ValueError, match=r"labels must be \(B,\)"):
        supcon_per_sample(z, torch.tensor([0, 1]), T)


def test_config_refuses_k_below_1_and_single_views():
    config = CONFIGS / "tcl_digits.yaml"
    with pytest.raises(ConfigError, match=r"method\.k1=0\.5 must be >= 1"):
        load_config(config, ["method.k1=0.5"])
    with pytest.raises(ConfigError, match=r"method\.k2=0\.9 must be >= 1"):
        load_config(config, ["method.k2=0.9"])
    with pytest.raises(ConfigError, match="at least 2 views"):
        load_config(CONFIGS / "supcon_digits.yaml", ["data.views.0.count=1"])
    with pytest.raises(ConfigError, match="method.k1"):           # SupCon has no k1
        load_config(CONFIGS / "supcon_digits.yaml", ["method.k1=5"])
    for name in ("tcl_digits", "tcl_supervised_digits", "supcon_digits", "tcl_cifar_folder", "supcon_cifar_folder"):
        load_config(CONFIGS / f"{name}.yaml")


LOSSES = (lambda z, labels, gather: supcon_per_sample(z, labels, 0.2, gather),
          lambda z, labels, gather: tcl_per_sample(z, labels, 0.2, 5000.0, 2.0, gather))


def _gathered_worker(rank, port, z, labels, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    half = z.shape[0] // 2
    results = []
    for loss_fn in LOSSES:
        for use_labels in (False, True):
            local = z[rank * half:(rank + 1) * half].clone().requires_grad_()
            local_labels = labels[rank * half:(rank + 1) * half] if use_labels else None
            loss = loss_fn(local, local_labels, True)
            loss.sum().backward()
            results.append((loss.detach().numpy(), local.grad.numpy()))
    # Hard view selection scores its candidates as training scores them: with the negatives of every process.
    for config in SELECTION_CONFIGS:
        method = tiny_method(config)
        local_labels = labels[rank * half:(rank + 1) * half]
        scores = method.candidate_losses({"z": z[rank * half:(rank + 1) * half]}, PAIRS, local_labels)
        results.append((scores.detach().numpy(),))
    queue.put((rank, results))   # numpy: a tensor is passed as a file descriptor that dies with this process
    dist.barrier()
    dist.destroy_process_group()


SELECTION_CONFIGS = ("simclr_digits.yaml", "tcl_supervised_digits.yaml")
PAIRS = [(0, 1), (0, 2), (1, 2)]


@pytest.mark.slow
def test_gathered_negatives_equal_one_big_batch(free_port):
    """Two processes with gathered negatives compute the single-process losses of the whole batch, labels
    gathered too, and the gradient reaching each process's embeddings is that of the whole-batch loss; hard view
    selection's candidate scores (SimCLR pairs, supervised TCL pairs) are those of the whole batch too."""
    z, labels = unit_views(8, 3, dim=4, seed=50).float(), torch.tensor([0, 1, 2, 0, 1, 1, 3, 0])
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_gathered_worker, args=(r, free_port, z, labels, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join(60)
    index = 0
    for loss_fn in LOSSES:
        for use_labels in (False, True):
            whole = z.clone().requires_grad_()
            expected = loss_fn(whole, labels if use_labels else None, False)
            expected.sum().backward()
            got = [[torch.from_numpy(array) for array in results[rank][index]] for rank in (0, 1)]
            torch.testing.assert_close(torch.cat([got[0][0], got[1][0]]), expected.detach())
            torch.testing.assert_close(torch.cat([got[0][1], got[1][1]]), whole.grad)
            index += 1
    for config in SELECTION_CONFIGS:
        expected = tiny_method(config).candidate_losses({"z": z}, PAIRS, labels)        # one process, whole batch
        got = torch.cat([torch.from_numpy(results[rank][index][0]) for rank in (0, 1)])
        torch.testing.assert_close(got, expected.detach())
        index += 1


def tiny_method(config: str, *overrides: str):
    cfg = load_config(CONFIGS / config, ["model.proj_hidden_dim=32", "model.proj_out_dim=16", *overrides])
    return build_method(cfg)


@pytest.mark.parametrize("supervised", [False, True])
def test_hard_view_selection_picks_the_highest_loss_triplet(supervised):
    torch.manual_seed(0)
    method = tiny_method("tcl_digits.yaml", "hvs.enabled=true", f"method.supervised={supervised}")
    batch, pool = 6, 5
    views = [torch.randn(batch, pool, 3, 16, 16)]
    boxes = [torch.rand(batch, pool, 4).sort(dim=-1).values]
    labels = torch.tensor([0, 1, 0, 1, 2, 2])
    method.train()             # as the engine: BatchNorm on the pool's batch statistics, the same in both passes
    selection = select_hard_views(method, method, views, boxes, labels, method.train_counts)
    with torch.no_grad():
        z = method(views)["z"].double()
    # brute force: every 3-subset of the 5 views, each image's loss against the batch's same-position views
    subsets = list(combinations(range(pool), 3))
    losses = torch.stack([brute_force_per_sample(z[:, list(s)], labels if supervised else None, T, 5000.0, 1.0)
                          for s in subsets], dim=1)                     # (B, 10)
    hardest = [subsets[i] for i in losses.argmax(dim=1)]
    assert selection.chosen.tolist() == [list(s) for s in hardest]
    torch.testing.assert_close(selection.scores.double(), losses, rtol=1e-4, atol=1e-4)
    for b, chosen in enumerate(hardest):
        assert torch.equal(selection.views[0][b], views[0][b, list(chosen)])


def test_supervised_method_refuses_unknown_labels():
    method = tiny_method("supcon_digits.yaml")
    outputs = method([torch.randn(4, 2, 3, 16, 16)])
    with pytest.raises(ConfigError, match="method.supervised=false"):
        method.loss(outputs, torch.tensor([0, -1, 1, 2]))
    loss = method.loss(outputs, torch.tensor([0, 1, 1, 2]))
    assert torch.isfinite(loss) and set(method.scalars()) == {"tcl/grad_pos", "tcl/grad_neg"}


# ---- whole runs ----

# grad_pos is a mean of |X_ip - P_ip + Y_ip| (TCL eq. 17; SupCon: |X_ip - P_ip|, Lemma 1) with X_ip = 1/|P(i)|,
# 0 <= P_ip <= 1 and 0 <= Y_ip = t k1 exp(-z_i.z_p) / D <= t, because D >= k1 exp(-z_i.z_p) (eq. 10). So it is
# at most 1/|P(i)| + t for TCL (|P(i)| = 2 for self-supervised triplets, >= 1 with labels) and 1 for SupCon.
GRAD_POS_BOUND = {"tcl_digits.yaml": 1 / 2 + 0.1, "tcl_supervised_digits.yaml": 1 + 0.1, "supcon_digits.yaml": 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("config, overrides", [
    ("tcl_digits.yaml", ["hvs.enabled=true"]),                          # self-supervised, 5 views -> 10 triplets
    ("tcl_supervised_digits.yaml", []),
    ("supcon_digits.yaml", []),
])
def test_tiny_runs_log_figure3_quantities(digits, tmp_path, config, overrides):
    run_dir = tmp_path / "run"
    from tests import forked_runs

    forked_runs.run("pretrain", [       # `python -m pretrain ...`, forked from a server that imported torch
        "--config", CONFIGS / config, f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
        f"data.val={digits / 'val.beton'}", "data.batch_size=32", "data.num_workers=1", "model.proj_hidden_dim=64",
        "model.proj_out_dim=32", "engine.max_steps=3", "engine.image_grid_every_steps=0", "engine.log_every_steps=1",
        *overrides])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert math.isfinite(line["train/loss"]) and line["train/loss"] > 0
        assert 0 < line["tcl/grad_pos"] <= GRAD_POS_BOUND[config] and 0 < line["tcl/grad_neg"] < 1
    export = torch.load(run_dir / "backbone.pth", weights_only=True)
    assert export["step"] == 3 and "conv1.weight" in export["state_dict"]
