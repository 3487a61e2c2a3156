"""Tests for ssl_models.data.partition: disjoint, covering, deterministic client splits."""

from __future__ import annotations

import numpy as np
import pytest

from ssl_models.data.partition import (
    dirichlet_partition,
    iid_partition,
    partition_indices,
    partition_summary,
    pathological_classes,
    pathological_partition,
    public_split,
    stratified_allocation,
)

NUM_CLASSES = 10


def balanced_labels(per_class: int = 60, num_classes: int = NUM_CLASSES, seed: int = 0) -> np.ndarray:
    """Shuffled labels with ``per_class`` items of each class."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def assert_valid_parts(parts: list[np.ndarray], num_items: int, must_cover: bool = True) -> None:
    """Sorted int64 parts, pairwise disjoint, within range, covering everything if asked."""
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "each part must be sorted without duplicates"
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "parts must be disjoint"
    assert joined.min() >= 0 and joined.max() < num_items
    if must_cover:
        assert len(joined) == num_items


def mean_class_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Average over clients of the entropy (nats) of the client's label histogram."""
    entropies = []
    for part in parts:
        p = np.bincount(labels[part], minlength=NUM_CLASSES) / len(part)
        p = p[p > 0]
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


# ------------------------------------------------------------------------------------------ IID


def test_iid_sizes_differ_by_at_most_one_and_cover_everything():
    parts = iid_partition(103, 10, seed=1)
    assert_valid_parts(parts, 103)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(sizes) == [10] * 7 + [11] * 3  # 103 = 7*10 + 3*11


def test_iid_is_deterministic_and_seed_dependent():
    first = iid_partition(200, 4, seed=3)
    again = iid_partition(200, 4, seed=3)
    other = iid_partition(200, 4, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_iid_rejects_more_clients_than_items():
    with pytest.raises(ValueError, match="num_items"):
        iid_partition(3, 5, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        iid_partition(10, 0, seed=0)


# ------------------------------------------------------------------------------------ Dirichlet


def test_dirichlet_disjoint_covering_and_min_size():
    labels = balanced_labels()
    parts = dirichlet_partition(labels, num_clients=8, alpha=0.3, seed=0, min_size=15)
    assert_valid_parts(parts, len(labels))
    assert min(len(p) for p in parts) >= 15


def test_dirichlet_deterministic_and_seed_dependent():
    labels = balanced_labels()
    first = dirichlet_partition(labels, 5, alpha=0.5, seed=7)
    again = dirichlet_partition(labels, 5, alpha=0.5, seed=7)
    other = dirichlet_partition(labels, 5, alpha=0.5, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_dirichlet_small_alpha_is_more_skewed_than_large_alpha():
    labels = balanced_labels(per_class=100)
    skewed = dirichlet_partition(labels, 10, alpha=0.1, seed=0, min_size=5)
    nearly_iid = dirichlet_partition(labels, 10, alpha=100.0, seed=0, min_size=5)
    # Large alpha: every client sees ~all 10 classes (entropy near log 10 = 2.30).
    assert mean_class_entropy(labels, nearly_iid) > 2.1
    assert mean_class_entropy(labels, skewed) < mean_class_entropy(labels, nearly_iid) - 0.8


def test_dirichlet_bad_arguments():
    labels = balanced_labels(per_class=5)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(labels, 3, alpha=0.0, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(labels, 3, alpha=-1.0, seed=0)
    # 50 items cannot give 10 clients 10 items each... only 5 each: rejected up front.
    with pytest.raises(ValueError, match="min_size=10"):
        dirichlet_partition(labels, 10, alpha=1.0, seed=0, min_size=10)


def test_dirichlet_gives_up_after_max_tries_with_explanation():
    labels = balanced_labels(per_class=10)  # 100 items
    # 10 clients x 10 items needs a perfectly even split, hopeless with alpha=0.01.
    with pytest.raises(ValueError, match=r"max_tries=20.*alpha=0.01.*dataset size 100"):
        dirichlet_partition(labels, 10, alpha=0.01, seed=0, min_size=10, max_tries=20)


# ---------------------------------------------------------------------------------- Pathological


def test_pathological_class_assignment_matches_formula():
    # Hand computation: K=5, C=2 -> client i gets (2i, 2i+1) mod 5.
    assert pathological_classes(4, 2, 5) == [[0, 1], [2, 3], [4, 0], [1, 2]]


def test_pathological_each_client_exactly_c_classes_and_all_classes_covered():
    labels = balanced_labels()
    parts = pathological_partition(labels, num_clients=7, classes_per_client=3, seed=0)
    assert_valid_parts(parts, len(labels))  # 21 >= 10 slots: every class owned, so all items used
    for part in parts:
        assert len(np.unique(labels[part])) == 3
    covered = np.unique(np.concatenate([labels[p] for p in parts]))
    assert np.array_equal(covered, np.arange(NUM_CLASSES))


def test_pathological_splits_each_class_equally_among_owners():
    labels = balanced_labels(per_class=60)
    # K=10, C=2, 10 clients: each class has exactly 2 owners -> 30 items each, 60 per client.
    parts = pathological_partition(labels, num_clients=10, classes_per_client=2, seed=5)
    assert [len(p) for p in parts] == [60] * 10
    summary = partition_summary(labels, parts, NUM_CLASSES)
    assert summary[0]["class_counts"] == [30, 30] + [0] * 8
    assert summary[4]["class_counts"][8:] == [30, 30]


def test_pathological_uses_label_values_not_positions():
    labels = balanced_labels(per_class=20, num_classes=4) * 10 + 3  # classes 3, 13, 23, 33
    parts = pathological_partition(labels, num_clients=2, classes_per_client=2, seed=0)
    assert set(labels[parts[0]]) == {3, 13}
    assert set(labels[parts[1]]) == {23, 33}


def test_pathological_deterministic_and_seed_dependent():
    labels = balanced_labels()
    first = pathological_partition(labels, 10, 2, seed=1)
    again = pathological_partition(labels, 10, 2, seed=1)
    other = pathological_partition(labels, 10, 2, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_pathological_errors():
    labels = balanced_labels()
    with pytest.raises(ValueError, match="exceeds the number of classes"):
        pathological_partition(labels, 10, classes_per_client=11, seed=0)
    with pytest.raises(ValueError, match="assigned to no client"):
        pathological_partition(labels, num_clients=4, classes_per_client=2, seed=0)  # 8 slots < 10 classes
    tiny = np.array([0, 0, 0, 1])
    with pytest.raises(ValueError, match="class 1 has 1 items but 2 clients"):
        pathological_partition(tiny, num_clients=2, classes_per_client=2, seed=0)


# ---------------------------------------------------------------------------------- Public split


def test_public_split_count_is_stratified_disjoint_and_complete():
    labels = balanced_labels(per_class=50)  # 500 items
    public_idx, rest = public_split(labels, 100, seed=0)
    assert len(public_idx) == 100 and len(rest) == 400
    assert_valid_parts([public_idx, rest], len(labels))
    assert np.array_equal(np.bincount(labels[public_idx]), [10] * NUM_CLASSES)


def test_public_split_fraction_and_whole_float():
    labels = balanced_labels(per_class=50)
    by_fraction, _ = public_split(labels, 0.2, seed=0)
    by_whole_float, _ = public_split(labels, 100.0, seed=0)
    assert len(by_fraction) == 100
    assert np.array_equal(by_fraction, by_whole_float)
    empty, everything = public_split(labels, 0, seed=0)
    assert len(empty) == 0 and len(everything) == len(labels)


def test_public_split_uneven_classes_keeps_proportions():
    labels = np.concatenate([np.zeros(300, int), np.ones(100, int)])
    public_idx, _ = public_split(labels, 40, seed=3)
    assert np.array_equal(np.bincount(labels[public_idx]), [30, 10])


def test_public_split_deterministic_and_errors():
    labels = balanced_labels()
    assert np.array_equal(public_split(labels, 50, 1)[0], public_split(labels, 50, 1)[0])
    assert not np.array_equal(public_split(labels, 50, 1)[0], public_split(labels, 50, 2)[0])
    with pytest.raises(ValueError, match="size"):
        public_split(labels, 1.5, seed=0)
    with pytest.raises(ValueError, match="size"):
        public_split(labels, -3, seed=0)
    with pytest.raises(ValueError, match="leave items for the clients"):
        public_split(labels, len(labels), seed=0)


def test_stratified_allocation_hand_computed():
    # 7 items from sizes (5, 3, 2): quotas 3.5, 2.1, 1.4 -> floors 3, 2, 1; the spare goes to 3.5.
    assert stratified_allocation(np.array([5, 3, 2]), 7).tolist() == [4, 2, 1]
    # 3 items from (97, 2, 1): every class keeps one although quotas round to (2.91, .06, .03).
    assert stratified_allocation(np.array([97, 2, 1]), 3).tolist() == [1, 1, 1]


# ------------------------------------------------------------------------------ Dispatch / summary


def test_partition_indices_dispatches_and_ignores_other_schemes_knobs():
    labels = balanced_labels()
    knobs = {"alpha": 0.5, "min_size": 5, "classes_per_client": 2}
    iid = partition_indices(labels, "iid", 6, seed=0, **knobs)
    assert all(np.array_equal(a, b) for a, b in zip(iid, iid_partition(len(labels), 6, 0)))
    dirichlet = partition_indices(labels, "dirichlet", 6, seed=0, **knobs)
    expected = dirichlet_partition(labels, 6, alpha=0.5, seed=0, min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(dirichlet, expected))
    patho = partition_indices(labels, "pathological", 5, seed=0, **knobs)
    assert all(np.array_equal(a, b) for a, b in zip(patho, pathological_partition(labels, 5, 2, 0)))


def test_partition_indices_errors():
    labels = balanced_labels()
    with pytest.raises(ValueError, match="iid.*dirichlet.*pathological"):
        partition_indices(labels, "shards", 5, seed=0)
    with pytest.raises(ValueError, match="needs the argument 'alpha'"):
        partition_indices(labels, "dirichlet", 5, seed=0)
    with pytest.raises(ValueError, match="unknown partition arguments"):
        partition_indices(labels, "iid", 5, seed=0, alpah=0.5)
    with pytest.raises(ValueError, match="1-D"):
        partition_indices(labels.reshape(2, -1), "iid", 5, seed=0)


def test_partition_summary_histograms():
    labels = np.array([0, 1, 1, 2, 2, 2])
    summary = partition_summary(labels, [np.array([0, 1]), np.array([2, 3, 4, 5])], num_classes=4)
    assert summary == [
        {"client": 0, "size": 2, "class_counts": [1, 1, 0, 0], "classes_present": 2},
        {"client": 1, "size": 4, "class_counts": [0, 1, 3, 0], "classes_present": 2},
    ]
    with pytest.raises(ValueError, match="num_classes"):
        partition_summary(labels, [np.array([5])], num_classes=2)
