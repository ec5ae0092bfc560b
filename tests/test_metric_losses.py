"""The contrastive losses of papers 000-002 against brute-force loops over pairs in float64, values and
gradients: the balanced margin loss and InfoNCE (000), NT-Xent with balance weights, the weighted / balanced
contrastive loss with importance weights (001), and the Table 1 / HLL pair weighting of s-MoCo (002)."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.losses.contrastive_margin_balance import global_average_lambdas, margin_balance_per_sample
from pretrain.losses.infonce_balance import infonce_balance_per_sample
from pretrain.losses.ntxent import nt_xent_per_sample
from pretrain.losses.pair_weighting import (NEGATIVE_WEIGHTINGS, POSITIVE_WEIGHTINGS, PairWeighting,
                                            pair_weighting_per_anchor)
from pretrain.losses.weighted_contrastive import (balanced_eta, group_importance_weights, minibatch_loss_per_anchor,
                                                  p_random_importance_weights, pair_terms, weighted_contrastive_sum)


def unit(shape, seed):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def gradient(function, z):
    z = z.detach().clone().requires_grad_(True)
    value = function(z)
    value.backward()
    return value.detach(), z.grad


# ==== paper 000: the contrastive margin loss, eqs. 1-2, 5, 7 ====

def brute_force_margin(z, labels, margin, lambda_p, lambda_e, averaging):
    """Eq. 5 with eq. 7 (or the global average) by explicit loops over every ordered pair of distinct views."""
    views = [(b, v) for b in range(z.shape[0]) for v in range(z.shape[1])]
    positive, negative = [], []
    for (b1, v1), (b2, v2) in itertools.permutations(views, 2):
        d = torch.sqrt(((z[b1, v1] - z[b2, v2]) ** 2).sum())
        if b1 == b2 or labels[b1] == labels[b2]:
            positive.append(d)
        else:
            negative.append(torch.clamp(margin - d, min=0))
    if averaging == "global":
        return (lambda_p * sum(positive) + lambda_e * sum(negative)) / (len(positive) + len(negative))
    return lambda_p * sum(positive) / len(positive) + lambda_e * sum(negative) / len(negative)


@pytest.mark.parametrize("views, averaging, lambdas", [(1, "separate", (1.0, 1.0)), (1, "separate", (0.3, 4.0)),
                                                       (2, "global", (1.0, 1.0)), (2, "global", (2.0, 0.5))])
def test_margin_balance_matches_brute_force_value_and_gradient(views, averaging, lambdas):
    z = unit((6, views, 5), 0)
    labels = torch.tensor([0, 1, 0, 2, 1, 0])
    margin = 1.3                         # most negative pairs of random unit vectors (d ~ 1.4) cross it either way

    def ours(z):
        return margin_balance_per_sample(F.normalize(z, dim=-1), labels, margin, *lambdas, averaging)[0].mean()

    def brute(z):
        return brute_force_margin(F.normalize(z, dim=-1), labels, margin, *lambdas, averaging)

    value, grad = gradient(ours, z)
    expected_value, expected_grad = gradient(brute, z)
    assert expected_value > 0
    torch.testing.assert_close(value, expected_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_global_average_is_the_lambdas_of_section_4_1_for_a_two_per_class_batch():
    """Section 4.1: with b/2 classes of 2, the global average is eq. 5 with lambda_p = 1/(b-1), lambda_e =
    1 - 1/(b-1); the separate average is lambda_p = lambda_e = 1."""
    b = 8
    z = unit((b, 1, 4), 1)
    labels = torch.arange(b) // 2                                     # 2 per class: |P| = b, |E| = b^2 - 2b
    assert global_average_lambdas(b, b * b - 2 * b) == pytest.approx((1 / (b - 1), 1 - 1 / (b - 1)))
    global_loss, sub = margin_balance_per_sample(z, labels, 1.2, averaging="global")
    paper = margin_balance_per_sample(z, labels, 1.2, 1 / (b - 1), 1 - 1 / (b - 1), averaging="separate")[0]
    torch.testing.assert_close(global_loss.mean(), paper.mean(), rtol=1e-12, atol=0)
    separate = margin_balance_per_sample(z, labels, 1.2, averaging="separate")[0].mean()
    torch.testing.assert_close(separate, sub[0] + sub[1], rtol=1e-12, atol=0)   # lambda_p = lambda_e = 1
    assert not torch.isclose(separate, global_loss.mean())


def test_margin_sub_losses_are_the_pair_means():
    z = unit((5, 2, 3), 2)
    labels = torch.tensor([0, 0, 1, 1, 2])
    _, (positive, entropy) = margin_balance_per_sample(z, labels, 1.5, 3.0, 0.1)
    torch.testing.assert_close(positive, brute_force_margin(z, labels, 1.5, 1.0, 0.0, "separate"))
    torch.testing.assert_close(entropy, brute_force_margin(z, labels, 1.5, 0.0, 1.0, "separate"))


# ==== paper 000: InfoNCE, eqs. 3-5, 8 ====

def brute_force_infonce(z, labels, t, lambda_p, lambda_e):
    views = [(b, v) for b in range(z.shape[0]) for v in range(z.shape[1])]
    positive, entropy = [], []
    for (b1, v1), (b2, v2) in itertools.permutations(views, 2):
        if not (b1 == b2 or labels[b1] == labels[b2]):
            continue
        d = lambda a, c: 1 - z[a[0], a[1]] @ z[c[0], c[1]]            # noqa: E731  cosine distance
        negatives = [k for k in views if k[0] != b1 and labels[k[0]] != labels[b1]]
        positive.append(d((b1, v1), (b2, v2)) / t)
        entropy.append(torch.log(sum(torch.exp(-d((b1, v1), k) / t) for k in [(b2, v2), *negatives])))
    return lambda_p * sum(positive) / len(positive) + lambda_e * sum(entropy) / len(entropy)


@pytest.mark.parametrize("views, lambdas", [(1, (1.0, 1.0)), (2, (0.5, 2.0)), (3, (1.0, 0.25))])
def test_infonce_balance_matches_brute_force_value_and_gradient(views, lambdas):
    z = unit((5, views, 4), 3)
    labels = torch.tensor([0, 1, 0, 2, 1])

    def ours(z):
        return infonce_balance_per_sample(F.normalize(z, dim=-1), labels, 0.2, *lambdas)[0].mean()

    def brute(z):
        return brute_force_infonce(F.normalize(z, dim=-1), labels, 0.2, *lambdas)

    value, grad = gradient(ours, z)
    expected_value, expected_grad = gradient(brute, z)
    torch.testing.assert_close(value, expected_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_infonce_with_unit_lambdas_is_the_usual_infonce_over_positive_pairs():
    z = unit((6, 2, 4), 4)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    flat, flat_labels = z.flatten(0, 1), labels.repeat_interleave(2)
    terms = []
    for i, j in itertools.permutations(range(12), 2):
        if flat_labels[i] != flat_labels[j]:
            continue
        candidates = [j] + [k for k in range(12) if flat_labels[k] != flat_labels[i]]
        logits = torch.stack([flat[i] @ flat[k] for k in candidates]) / 0.1
        terms.append(-torch.log_softmax(logits, dim=0)[0])
    torch.testing.assert_close(infonce_balance_per_sample(z, labels, 0.1)[0].mean(), torch.stack(terms).mean())


# ==== NT-Xent with (lambda_p, lambda_e) ====

def brute_force_balanced_nt_xent(z_a, z_b, t, lambda_p, lambda_e):
    z = [v / v.norm() for v in torch.cat([z_a, z_b]).double()]
    n = len(z_a)

    def l(i, j):
        positive = (1 - z[i] @ z[j]) / t
        entropy = torch.log(sum(torch.exp(-(1 - z[i] @ z[k]) / t) for k in range(2 * n) if k != i))
        return lambda_p * positive + lambda_e * entropy

    return torch.stack([0.5 * (l(i, i + n) + l(i + n, i)) for i in range(n)])


def todays_nt_xent(z_a, z_b, t):
    """NT-Xent as pretrain/losses/ntxent.py computed it before the balance option (one process)."""
    z_a, z_b = F.normalize(z_a, dim=1), F.normalize(z_b, dim=1)
    candidates, own = torch.cat([z_a, z_b]), torch.arange(len(z_a))

    def one_direction(anchors, self_index, positive_index):
        logits = (anchors @ candidates.T / t).scatter(1, self_index[:, None], float("-inf"))
        return F.cross_entropy(logits, positive_index, reduction="none")

    return 0.5 * (one_direction(z_a, own, own + len(z_a)) + one_direction(z_b, own + len(z_a), own))


def test_nt_xent_with_unit_lambdas_is_exactly_todays_nt_xent():
    z_a, z_b = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(5)).unbind(0)
    today = todays_nt_xent(z_a, z_b, 0.2)
    assert torch.equal(nt_xent_per_sample(z_a, z_b, 0.2), today)                           # bit for bit
    assert torch.equal(nt_xent_per_sample(z_a, z_b, 0.2, lambda_p=1.0, lambda_e=1.0), today)
    # ... and l_p + l_e is the cross-entropy: the brute-force split with (1, 1) gives the same numbers.
    torch.testing.assert_close(today.double(), brute_force_balanced_nt_xent(z_a, z_b, 0.2, 1.0, 1.0),
                               rtol=1e-5, atol=1e-5)


def test_nt_xent_with_other_lambdas_matches_brute_force_value_and_gradient():
    z_a, z_b = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64).unbind(0)
    value, grad = gradient(lambda a: nt_xent_per_sample(a, z_b, 0.3, lambda_p=0.5, lambda_e=2.0).sum(), z_a)
    expected_value, expected_grad = gradient(lambda a: brute_force_balanced_nt_xent(a, z_b, 0.3, 0.5, 2.0).sum(), z_a)
    torch.testing.assert_close(value, expected_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_simclr_method_with_unit_lambdas_trains_on_nt_xent():
    from pretrain.config import load_config
    from pretrain.methods import build_method

    overrides = ["model.proj_hidden_dim=16", "model.proj_out_dim=8"]
    method = build_method(load_config("configs/pretrain/simclr_digits.yaml", overrides))
    z = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(method.loss({"z": z}, torch.zeros(4)), nt_xent_per_sample(z[:, 0], z[:, 1], 0.2, True).mean())
    balanced = build_method(load_config("configs/pretrain/simclr_digits.yaml",
                                        [*overrides, "method.lambda_p=0.5", "method.lambda_e=2"]))
    torch.testing.assert_close(balanced.loss({"z": z}, torch.zeros(4)).double(),
                               brute_force_balanced_nt_xent(z[:, 0], z[:, 1], 0.2, 0.5, 2.0).mean(),
                               rtol=1e-5, atol=1e-5)


# ==== paper 001: the weighted contrastive loss, eqs. 10, 15, 23-25 ====

COUNTS = torch.tensor([5, 3, 0, 7])          # N_c: class 2 has no image (L = 3), N = 15


def brute_force_eta(y_i, y_j, lam):
    classes = sum(1 for n in COUNTS.tolist() if n > 0)
    return lam / (classes - 1) * (COUNTS[y_i].item() - 1) / COUNTS[y_j].item()          # eq. 15: N_{y_j}


def brute_force_pair(f_i, f_j, same, eta, alpha):
    d = torch.sqrt(((f_i - f_j) ** 2).sum())
    return d ** 2 if same else eta * torch.clamp(alpha - d, min=0) ** 2                 # eqs. 5, 10


def test_balanced_eta_is_eq_15_with_n_yj_in_the_denominator():
    labels = torch.tensor([0, 1, 3, 3])
    eta = balanced_eta(labels, labels, COUNTS, 256.0)
    for a, b in itertools.product(range(4), repeat=2):
        assert eta[a, b].item() == pytest.approx(brute_force_eta(labels[a].item(), labels[b].item(), 256.0), rel=1e-6)
    assert eta[0, 1].item() == pytest.approx(256 / 2 * 4 / 3, rel=1e-6)     # eq. 16's misprint would give 4 / 5


def test_importance_weights_are_eqs_24_and_25():
    labels = torch.tensor([0, 1, 3])
    n, classes = 15, 3
    p_random = p_random_importance_weights(labels, labels, COUNTS, 0.3)
    group = group_importance_weights(labels, labels, COUNTS, 4, 2)
    for a, b in itertools.product(range(3), repeat=2):
        n_i, n_j = COUNTS[labels[a]].item(), COUNTS[labels[b]].item()
        if a == b:
            expected_p = classes * n_i * (n_i - 1) / (0.3 * n * (n - 1))
            expected_g = classes * 7 * n_i * (n_i - 1) / (3 * n * (n - 1))
        else:
            expected_p = classes * (classes - 1) * n_i * n_j / (0.7 * n * (n - 1))
            expected_g = classes * (classes - 1) * 7 * n_i * n_j / (4 * 1 * n * (n - 1))
        assert p_random[a, b].item() == pytest.approx(expected_p, rel=1e-6)
        assert group[a, b].item() == pytest.approx(expected_g, rel=1e-6)


@pytest.mark.parametrize("eta_kind", ["contrastive", "balanced"])
def test_minibatch_loss_matches_brute_force_value_and_gradient(eta_kind):
    """Eq. 23 on a set of sampled pairs, each with its own W, against the loop over those pairs."""
    f = unit((6, 4), 8)
    labels = torch.tensor([0, 3, 1, 3, 0, 0])
    pairs = torch.zeros(6, 6, dtype=torch.bool)
    chosen = [(0, 1), (1, 0), (2, 3), (3, 2), (4, 5), (5, 4), (0, 4), (3, 1)]
    for i, j in chosen:
        pairs[i, j] = True
    weights = p_random_importance_weights(labels, labels, COUNTS, 0.4).double()
    eta = (balanced_eta(labels, labels, COUNTS, 8.0) if eta_kind == "balanced" else torch.ones(6, 6)).double()

    def ours(f):
        terms = pair_terms(f, f, labels[:, None] == labels[None, :], eta, 1.1)
        return minibatch_loss_per_anchor(terms, pairs, weights).mean()

    def brute(f):
        return sum(weights[i, j] * brute_force_pair(f[i], f[j], labels[i] == labels[j], eta[i, j], 1.1)
                   for i, j in chosen) / len(chosen)

    value, grad = gradient(ours, f)
    expected_value, expected_grad = gradient(brute, f)
    assert expected_value > 0
    torch.testing.assert_close(value, expected_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_minibatch_loss_with_unit_weights_over_every_pair_is_eq_10_over_n_n_minus_1():
    f = unit((7, 3), 9)
    labels = torch.tensor([0, 3, 1, 3, 0, 1, 3])
    eta = balanced_eta(labels, labels, COUNTS, 5.0).double()
    full = weighted_contrastive_sum(f, labels, eta, 1.2)                                   # eq. 10
    brute = sum(brute_force_pair(f[i], f[j], labels[i] == labels[j], eta[i, j], 1.2)
                for i, j in itertools.permutations(range(7), 2))
    torch.testing.assert_close(full, brute, rtol=1e-12, atol=0)
    pairs = ~torch.eye(7, dtype=torch.bool)
    terms = pair_terms(f, f, labels[:, None] == labels[None, :], eta, 1.2)
    minibatch = minibatch_loss_per_anchor(terms, pairs, torch.ones(7, 7, dtype=torch.float64)).mean()   # eq. 23
    torch.testing.assert_close(minibatch, full / (7 * 6), rtol=1e-12, atol=0)


def test_equal_embeddings_give_a_finite_gradient():
    f = torch.zeros(3, 4, dtype=torch.float64)
    f[:, 0] = 1
    labels = torch.tensor([0, 0, 1])
    value, grad = gradient(lambda f: pair_terms(f, f, labels[:, None] == labels[None, :],
                                                torch.ones(3, 3, dtype=torch.float64), 1.0).sum(), f)
    assert torch.isfinite(grad).all() and value > 0


# ==== paper 002: Table 1 pair weights and HLL ====

def brute_force_weights(s, positives, negatives, w: PairWeighting):
    """Table 1 (and HLL) by loops: dL_i/dS_ij = -w+ for positives, +w- for negatives."""
    expected = torch.zeros_like(s)
    for i in range(s.shape[0]):
        pos = [j for j in range(s.shape[1]) if positives[i, j]]
        neg = [j for j in range(s.shape[1]) if negatives[i, j]]
        denominators = {p: math.exp(s[i, p] / w.temperature) + sum(math.exp(s[i, n] / w.temperature) for n in neg)
                        for p in pos}
        for j in pos:
            x = s[i, j].item()
            weight = {"contrastive": 1.0,
                      "binomial": math.exp(w.alpha * (w.threshold - x)) / (1 + math.exp(w.alpha * (w.threshold - x))),
                      "ms": math.exp(w.alpha * (w.threshold - x))
                      / (1 + sum(math.exp(w.alpha * (w.threshold - s[i, k].item())) for k in pos)),
                      "infonce": (1 - math.exp(x / w.temperature) / denominators[j]) / w.temperature}[w.positive]
            expected[i, j] = -weight
        for j in neg:
            x = s[i, j].item()
            hll = 0.0 if x < w.hll_a else 1.0 if x > w.hll_b else (x - w.hll_a) / (w.hll_b - w.hll_a)
            weight = {"hll": hll,
                      "binomial": math.exp(w.beta * (x - w.threshold)) / (1 + math.exp(w.beta * (x - w.threshold))),
                      "ms": math.exp(w.beta * (x - w.threshold))
                      / (1 + sum(math.exp(w.beta * (s[i, k].item() - w.threshold)) for k in neg)),
                      "infonce": sum(math.exp(x / w.temperature) / denominators[p] for p in pos) / w.temperature
                      }[w.negative]
            expected[i, j] = weight
    return expected


def brute_force_pair_loss(s, positives, negatives, w: PairWeighting):
    """The loss whose gradient is the weight, by loops (see the docstring of pretrain/losses/pair_weighting.py)."""
    total = 0.0
    tau = w.temperature
    for i in range(s.shape[0]):
        pos = [s[i, j].item() for j in range(s.shape[1]) if positives[i, j]]
        neg = [s[i, j].item() for j in range(s.shape[1]) if negatives[i, j]]
        infonce = sum(-math.log(math.exp(p / tau) / (math.exp(p / tau) + sum(math.exp(n / tau) for n in neg)))
                      for p in pos)
        if w.positive == w.negative == "infonce":
            total += infonce
            continue
        total += {"contrastive": sum(1 - p for p in pos),
                  "binomial": sum(math.log1p(math.exp(w.alpha * (w.threshold - p))) for p in pos) / w.alpha,
                  "ms": math.log1p(sum(math.exp(w.alpha * (w.threshold - p)) for p in pos)) / w.alpha,
                  "infonce": infonce}[w.positive]
        hll = 0.0
        for n in neg:
            if w.hll_b > w.hll_a:
                width = w.hll_b - w.hll_a
                hll += min(max(n - w.hll_a, 0), width) ** 2 / (2 * width) + max(n - w.hll_b, 0)
            else:
                hll += max(n - w.hll_a, 0)
        total += {"hll": hll,
                  "binomial": sum(math.log1p(math.exp(w.beta * (n - w.threshold))) for n in neg) / w.beta,
                  "ms": math.log1p(sum(math.exp(w.beta * (n - w.threshold)) for n in neg)) / w.beta,
                  "infonce": infonce}[w.negative]
    return total


def planted_similarities():
    g = torch.Generator().manual_seed(10)
    s = (torch.rand(4, 9, generator=g, dtype=torch.float64) * 1.8 - 0.9)
    memory_labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    labels = torch.tensor([0, 1, 2, 1])
    positives = labels[:, None] == memory_labels[None, :]
    positives[3] = False                                 # an anchor without positives
    negatives = labels[:, None] != memory_labels[None, :]
    negatives[1, 2] = False                              # a pair in neither set (e.g. the anchor itself)
    return s, positives, negatives


@pytest.mark.parametrize("positive, negative", list(itertools.product(POSITIVE_WEIGHTINGS, NEGATIVE_WEIGHTINGS)))
def test_every_weighting_has_the_table_1_weights_as_gradient_and_the_brute_force_value(positive, negative):
    s, positives, negatives = planted_similarities()
    w = PairWeighting(positive=positive, negative=negative, hll_a=-0.2, hll_b=0.4, threshold=0.3, alpha=3.0,
                      beta=7.0, temperature=0.5)
    value, grad = gradient(lambda s: pair_weighting_per_anchor(s, positives, negatives, w).sum(), s)
    torch.testing.assert_close(grad, brute_force_weights(s, positives, negatives, w), rtol=1e-9, atol=1e-12)
    assert value.item() == pytest.approx(brute_force_pair_loss(s, positives, negatives, w), rel=1e-10)


def test_hll_with_a_equal_b_is_the_contrastive_loss_with_that_margin_on_the_negatives():
    s, positives, negatives = planted_similarities()

    def contrastive(s):        # XBM's contrastive loss: sum_P (1 - S) + sum_N max(0, S - margin), per anchor
        return sum(sum(1 - s[i, j] for j in range(9) if positives[i, j])
                   + sum(torch.clamp(s[i, j] - 0.25, min=0) for j in range(9) if negatives[i, j]) for i in range(4)) / 4

    hll = PairWeighting(negative="hll", hll_a=0.25, hll_b=0.25)
    value, grad = gradient(lambda s: pair_weighting_per_anchor(s, positives, negatives, hll).mean(), s)
    expected_value, expected_grad = gradient(contrastive, s)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=0)


def test_rows_without_negatives_or_positives_keep_finite_gradients():
    s = torch.rand(2, 3, dtype=torch.float64)
    positives = torch.tensor([[True, True, True], [False, False, False]])
    negatives = ~positives
    for positive, negative in itertools.product(POSITIVE_WEIGHTINGS, NEGATIVE_WEIGHTINGS):
        w = PairWeighting(positive=positive, negative=negative)
        _, grad = gradient(lambda s: pair_weighting_per_anchor(s, positives, negatives, w).sum(), s)
        assert torch.isfinite(grad).all(), (positive, negative)


@pytest.mark.parametrize("weighting, match", [
    (PairWeighting(positive="focal"), "positive weighting 'focal' is not one of"),
    (PairWeighting(negative="contrastive"), "negative weighting 'contrastive' is not one of"),
    (PairWeighting(hll_a=0.6, hll_b=0.4), "a <= b"),
    (PairWeighting(temperature=0.0), "must be positive"),
])
def test_bad_weightings_are_refused_by_name(weighting, match):
    with pytest.raises(ValueError, match=match):
        pair_weighting_per_anchor(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool),
                                  torch.zeros(1, 1, dtype=torch.bool), weighting)


def test_bad_loss_arguments_are_refused_by_name():
    z = unit((3, 1, 2), 11)
    with pytest.raises(ValueError, match="margin=0 must be positive"):
        margin_balance_per_sample(z, torch.tensor([0, 0, 1]), margin=0)
    with pytest.raises(ValueError, match="averaging='mean' is not one of"):
        margin_balance_per_sample(z, torch.tensor([0, 0, 1]), averaging="mean")
    with pytest.raises(ValueError, match="lambda_p=-1"):
        infonce_balance_per_sample(z, torch.tensor([0, 0, 1]), lambda_p=-1)
    with pytest.raises(ValueError, match="k >= 2 views per image"):
        infonce_balance_per_sample(z, None)                      # one view and no labels: no positives
    with pytest.raises(ValueError, match=r"positive_fraction=1.0 must lie in \(0, 1\)"):
        p_random_importance_weights(torch.tensor([0]), torch.tensor([0]), COUNTS, 1.0)
    with pytest.raises(ValueError, match="m >= 2 and n >= 2"):
        group_importance_weights(torch.tensor([0]), torch.tensor([0]), COUNTS, 1, 4)
