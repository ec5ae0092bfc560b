"""The class-aware batch designs of paper 001 (p-random, (m, n)-group): the importance weights of eqs. 24-25
against the empirical pair frequencies of the samplers, seeded and resumable order, each process its share,
the config and data checks, and the real FFCV loader reading a design's batches."""
import itertools

import numpy as np
import pytest
import torch

from pretrain.data import DatasetError
from pretrain.data.batch_designs import BatchDesign, ClassAwareBatches, dataset_labels
from pretrain.data.loader import ViewLoader
from pretrain.data.views import ViewGroup
from pretrain.losses.weighted_contrastive import group_importance_weights, p_random_importance_weights

# Unequal classes (N_c = 3, 5, 3, 4; N = 15), so that the weights differ between class pairs.
LABELS = np.array([0, 1, 1, 0, 2, 1, 3, 0, 1, 3, 2, 3, 1, 3, 2])
COUNTS = torch.as_tensor(np.bincount(LABELS))
N = len(LABELS)


def ordered_pair_frequencies(batches: ClassAwareBatches, count: int) -> np.ndarray:
    """Q^(i, j): how often a pair drawn uniformly from a mini-batch is the ordered pair (i, j), over `count`
    batches. p-random: the batch's sampled pairs (2t, 2t+1) and their reverses; group: every ordered pair."""
    drawn = np.stack([batches.batch(0, b) for b in range(count)])                  # (count, global batch)
    if batches.design.name == "p_random":
        first, second = drawn[:, 0::2], drawn[:, 1::2]
        firsts, seconds = np.concatenate([first, second], 1), np.concatenate([second, first], 1)
    else:
        i, j = np.nonzero(~np.eye(drawn.shape[1], dtype=bool))
        firsts, seconds = drawn[:, i], drawn[:, j]
    # Every batch has the same number of pairs: the pair frequency is the count over all pairs drawn.
    return np.bincount((firsts * N + seconds).ravel(), minlength=N * N).reshape(N, N) / firsts.size


@pytest.mark.parametrize("design, weights", [
    (BatchDesign("p_random", positive_fraction=0.3),
     lambda y: p_random_importance_weights(y, y, COUNTS, 0.3)),
    (BatchDesign("group", images_per_class=3), lambda y: group_importance_weights(y, y, COUNTS, 3, 3)),
])
def test_importance_weights_are_p_uniform_over_the_empirical_pair_frequencies(design, weights):
    """W_ij = P_U(i, j) / Q(i, j) (eq. 21) with Q measured on the sampler: per class pair (every (i, j) of
    two classes has the same W), and per single pair on the diagonal-free N x N table."""
    global_batch = 9 if design.name == "group" else 30                 # group: 3 classes x 3; p-random: 15 pairs
    batches = ClassAwareBatches(design, LABELS, global_batch, seed=0)
    frequency = ordered_pair_frequencies(batches, 12000 if design.name == "group" else 6000)
    labels = torch.as_tensor(LABELS)
    expected = weights(labels).double().numpy()                        # eqs. 24 / 25 for every (i, j)
    distinct = ~np.eye(N, dtype=bool)
    assert frequency[~distinct].sum() == 0                             # never an image with itself
    uniform = 1.0 / (N * (N - 1))
    for a, b in itertools.product(range(4), repeat=2):
        block = np.outer(LABELS == a, LABELS == b) & distinct
        measured_w = uniform * block.sum() / frequency[block].sum()   # P_U over Q of the class pair
        assert measured_w == pytest.approx(expected[block][0], rel=0.03), (a, b)
        assert np.allclose(expected[block], expected[block][0])
    # Pair by pair: every distinct pair is drawn, at the frequency eq. 8 / eq. 9 gives (within sampling noise).
    assert (frequency[distinct] > 0).all()
    assert np.median(np.abs(uniform / frequency[distinct] / expected[distinct] - 1)) < 0.08


@pytest.mark.parametrize("design, batch", [(BatchDesign("p_random", 0.5), 4),               # 2 pairs
                                           (BatchDesign("group", images_per_class=2), 6)])  # 3 classes x 2
def test_designs_are_seeded_resumable_and_split_disjointly_between_processes(design, batch):
    def loader(rank, world, seed=0):
        view_loader = ViewLoader(N, [ViewGroup(count=1)], batch // world, device=torch.device("cpu"),
                                 mean=(0, 0, 0), std=(1, 1, 1), seed=seed, rank=rank, world_size=world,
                                 drop_last=True)
        view_loader.use_batch_design(ClassAwareBatches(design, LABELS, batch, seed))
        return view_loader

    single = loader(0, 1)
    assert len(single) == N // batch
    order = single.epoch_indices(3)
    assert len(order) == len(single) * batch
    assert np.array_equal(order, loader(0, 1).epoch_indices(3))                      # seeded
    assert np.array_equal(single.epoch_indices(3, start_batch=1), order[batch:])      # resumable at any batch
    assert not np.array_equal(order, single.epoch_indices(4))                         # another epoch
    assert not np.array_equal(order, loader(0, 1, seed=1).epoch_indices(3))           # another seed
    half = batch // 2
    shares = [loader(rank, 2).epoch_indices(3) for rank in range(2)]
    for b in range(len(single)):                      # each batch: rank 0's half, then rank 1's, nothing else
        assert np.array_equal(np.concatenate([s[b * half:(b + 1) * half] for s in shares]),
                              order[b * batch:(b + 1) * batch])
    if design.name == "group":                        # class-major: m images of each of n distinct classes
        labels = LABELS[order[:batch]]
        assert (labels[0::2] == labels[1::2]).all() and len(set(labels)) == 3
    else:                                             # pairs (2t, 2t+1) of distinct images, whole on each rank
        assert (order[0::2] != order[1::2]).all()
        with pytest.raises(ValueError, match="must be even"):
            ViewLoader(N, [ViewGroup(count=1)], 3, device=torch.device("cpu"), mean=(0, 0, 0), std=(1, 1, 1),
                       seed=0, rank=0, world_size=2, drop_last=True).use_batch_design(
                ClassAwareBatches(design, LABELS, 6, 0))


def test_p_random_pairs_are_positive_at_rate_p():
    batches = ClassAwareBatches(BatchDesign("p_random", 0.2), LABELS, 100, seed=3)
    batch = np.concatenate([batches.batch(0, b) for b in range(200)])
    positive = LABELS[batch[0::2]] == LABELS[batch[1::2]]
    assert positive.mean() == pytest.approx(0.2, abs=0.01)


@pytest.mark.parametrize("design, global_batch, match", [
    (BatchDesign("group", images_per_class=4), 12, "class 0 has 3 images"),
    (BatchDesign("group", images_per_class=2), 10, r"it needs 2 <= n <= 4"),
    (BatchDesign("group", images_per_class=4), 10, "multiple of data.batch_design.images_per_class=4"),
    (BatchDesign("p_random", 0.5), 7, "must be even"),
])
def test_designs_that_cannot_be_drawn_are_refused_by_name(design, global_batch, match):
    with pytest.raises(ValueError, match=match):
        ClassAwareBatches(design, LABELS, global_batch, seed=0)


def test_unlabelled_images_are_refused():
    with pytest.raises(ValueError, match="label -1"):
        ClassAwareBatches(BatchDesign("p_random"), np.array([0, 1, -1, 1]), 2, seed=0)


def test_config_checks_the_design(tmp_path):
    from pretrain.config import ConfigError, load_config

    config = "configs/pretrain/weighted_contrastive_digits.yaml"
    assert load_config(config).data.batch_design.name == "group"
    with pytest.raises(ConfigError, match="data.batch_design.name='pairs' is not one of"):
        load_config(config, ["data.batch_design.name=pairs"])
    with pytest.raises(ConfigError, match=r"positive_fraction=0.0 must lie in \(0, 1\)"):
        load_config(config, ["data.batch_design.name=p_random", "data.batch_design.positive_fraction=0"])


def test_the_ffcv_loader_reads_the_designs_batches_with_their_labels(digits_dml):
    """Through the real loader (FFCV, digits): labels follow the design (class-major (m, n)-groups; pairs that
    repeat images), the batch indices are the design's, and a design that does not fit the data is refused
    in one line (DatasetError)."""
    from pretrain.data.loader import build_view_loader

    train = digits_dml / "train.beton"
    labels = dataset_labels(train)
    assert len(labels) == 901 and set(labels.tolist()) == {0, 1, 2, 3, 4}
    assert set(dataset_labels(digits_dml / "test.beton").tolist()) == {5, 6, 7, 8, 9}
    group = [ViewGroup(count=1, size=8)]
    loader = build_view_loader(train, group, 16, num_workers=1, batch_design=BatchDesign("group", images_per_class=4))
    expected = loader.epoch_indices(0, start_batch=2)
    for b, batch in zip(range(2), loader.epoch(0, start_batch=2)):
        assert batch.indices.tolist() == expected[b * 16:(b + 1) * 16].tolist()
        assert batch.labels.tolist() == labels[expected[b * 16:(b + 1) * 16]].tolist()
        classes = batch.labels.view(4, 4)                          # (16, 4)-group: 4 classes x 4 images
        assert (classes == classes[:, :1]).all() and len(set(classes[:, 0].tolist())) == 4
    with pytest.raises(DatasetError, match="data.batch_design.name=group on .*it needs 2 <= n <= 5"):
        build_view_loader(train, group, 16, num_workers=1, batch_design=BatchDesign("group", images_per_class=2))
