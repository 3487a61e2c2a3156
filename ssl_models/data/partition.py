"""Split a labelled training set between federated clients (and a server-held public split).

All functions are NumPy only, seeded and deterministic: the same arguments give the same split on
every machine, so the server and every client can recompute a client's share from the config
instead of shipping index lists around. Partitioners return ``list[np.ndarray]``: one sorted
``int64`` index array per client, indexing into the ``labels`` array they were given, pairwise
disjoint.

When a public split is carved first, partition the remaining part and map back::

    public_idx, rest = public_split(labels, 500, seed)
    parts = [rest[p] for p in partition_indices(labels[rest], "dirichlet", 10, seed, alpha=0.5)]
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

PARTITION_SCHEMES = ("iid", "dirichlet", "pathological")
# Keyword arguments each scheme reads in ``partition_indices``; None marks a required one.
_SCHEME_KWARGS: dict[str, dict[str, Any]] = {
    "iid": {},
    "dirichlet": {"alpha": None, "min_size": 10, "max_tries": 1000},
    "pathological": {"classes_per_client": None},
}


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _check_int(value: Any, arg_name: str, lowest: int) -> int:
    """Return ``value`` as an int, or raise ``ValueError`` naming ``arg_name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest:
        raise ValueError(f"{arg_name} must be an integer >= {lowest}, got {value!r}")
    return int(value)


def _check_labels(labels: Any) -> np.ndarray:
    """Return ``labels`` as a 1-D integer array, or raise ``ValueError``."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array of class ids, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must hold integer class ids, got dtype {labels.dtype}")
    return labels


def _sorted_int64(indices: np.ndarray) -> np.ndarray:
    """Canonical form of one client's share: sorted ``int64``."""
    return np.sort(np.asarray(indices, dtype=np.int64))


# --------------------------------------------------------------------------------------------------
# Stratified sampling (shared with ``ssl_models.data.datasets.subsample``)
# --------------------------------------------------------------------------------------------------


def stratified_allocation(class_counts: np.ndarray, total: int) -> np.ndarray:
    """How many items to take from each class so that shares follow class sizes.

    Largest-remainder rounding of ``total * count / sum(counts)``, with every class given at least
    one item when ``total`` >= number of classes, and never more than a class holds.
    """
    class_counts = np.asarray(class_counts, dtype=np.int64)
    num_items = int(class_counts.sum())
    if not 0 <= total <= num_items:
        raise ValueError(f"total must be between 0 and the number of items ({num_items}), got {total}")
    quota = total * class_counts / max(num_items, 1)
    alloc = np.floor(quota).astype(np.int64)
    if total >= len(class_counts):
        alloc = np.maximum(alloc, 1)
    alloc = np.minimum(alloc, class_counts)
    # Each loop runs fewer than len(class_counts) times: flooring loses < 1 item per class and the
    # minimum of one adds < 1 item per class.
    while alloc.sum() > total:
        excess = np.where(alloc > 1, alloc - quota, -np.inf)
        alloc[int(np.argmax(excess))] -= 1
    while alloc.sum() < total:
        shortfall = np.where(alloc < class_counts, quota - alloc, -np.inf)
        alloc[int(np.argmax(shortfall))] += 1
    return alloc


def stratified_choice(labels: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of ``count`` items drawn per class in proportion to class sizes."""
    labels = _check_labels(labels)
    classes, class_counts = np.unique(labels, return_counts=True)
    alloc = stratified_allocation(class_counts, count)
    chosen = [
        rng.choice(np.flatnonzero(labels == cls), size=int(take), replace=False) for cls, take in zip(classes, alloc)
    ]
    return _sorted_int64(np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64))


# --------------------------------------------------------------------------------------------------
# Partitioners
# --------------------------------------------------------------------------------------------------


def iid_partition(num_items: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(num_items)`` and cut it into ``num_clients`` parts (sizes differ by <= 1)."""
    num_items = _check_int(num_items, "num_items", 0)
    num_clients = _check_int(num_clients, "num_clients", 1)
    if num_items < num_clients:
        raise ValueError(f"num_items ({num_items}) must be >= num_clients ({num_clients}): a client would be empty")
    order = np.random.default_rng(seed).permutation(num_items)
    return [_sorted_int64(part) for part in np.array_split(order, num_clients)]


def _dirichlet_draw(
    labels: np.ndarray, classes: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """One attempt: each class is shuffled and cut at ``cumsum(p) * n_c`` with ``p ~ Dir(alpha)``."""
    shares: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in classes:
        class_idx = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(proportions) * len(class_idx)).astype(np.int64)[:-1]
        for client, piece in enumerate(np.split(class_idx, cuts)):
            shares[client].append(piece)
    return [_sorted_int64(np.concatenate(pieces)) for pieces in shares]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 10, max_tries: int = 1000
) -> list[np.ndarray]:
    """Label-skewed split: per class, client shares ``p ~ Dir(alpha)`` (small alpha -> more skew).

    The whole draw is repeated until every client holds at least ``min_size`` items; after
    ``max_tries`` failed draws a ``ValueError`` explains which knob to turn.
    """
    labels = _check_labels(labels)
    num_clients = _check_int(num_clients, "num_clients", 1)
    min_size = _check_int(min_size, "min_size", 0)
    max_tries = _check_int(max_tries, "max_tries", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
        raise ValueError(f"alpha must be a number > 0 (Dirichlet concentration), got {alpha!r}")
    if labels.shape[0] < num_clients * min_size:
        raise ValueError(
            f"cannot give each of num_clients={num_clients} clients min_size={min_size} items: "
            f"the data set has only {labels.shape[0]} items"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts = _dirichlet_draw(labels, classes, num_clients, float(alpha), rng)
        if min(len(part) for part in parts) >= min_size:
            return parts
    raise ValueError(
        f"no Dirichlet split with every client holding >= min_size={min_size} items in max_tries={max_tries} "
        f"draws (alpha={alpha}, num_clients={num_clients}, dataset size {labels.shape[0]}); "
        f"raise alpha, lower min_size or num_clients, or use more data"
    )


def pathological_classes(num_clients: int, classes_per_client: int, num_classes: int) -> list[list[int]]:
    """Class ids (positions in the sorted class list) of each client: ``(i*C + j) mod K`` for j < C.

    Consecutive clients take consecutive blocks of classes, wrapping around, so every class is owned
    by someone as soon as ``num_clients * C >= K``.
    """
    return [
        [(client * classes_per_client + j) % num_classes for j in range(classes_per_client)]
        for client in range(num_clients)
    ]


def pathological_partition(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` classes; every class is assigned.

    Client ``i`` gets classes ``(i*C + j) mod K`` (``j < C``, K classes present in ``labels``); the
    shuffled indices of each class are split equally among the clients owning it.
    """
    labels = _check_labels(labels)
    num_clients = _check_int(num_clients, "num_clients", 1)
    classes_per_client = _check_int(classes_per_client, "classes_per_client", 1)
    classes = np.unique(labels)
    num_classes = len(classes)
    if classes_per_client > num_classes:
        raise ValueError(
            f"classes_per_client ({classes_per_client}) exceeds the number of classes in labels ({num_classes})"
        )
    if num_clients * classes_per_client < num_classes:
        raise ValueError(
            f"num_clients * classes_per_client = {num_clients * classes_per_client} < {num_classes} classes: "
            f"some classes would be assigned to no client; raise num_clients or classes_per_client"
        )
    assignment = pathological_classes(num_clients, classes_per_client, num_classes)
    owners: list[list[int]] = [[] for _ in range(num_classes)]
    for client, client_classes in enumerate(assignment):
        for k in client_classes:
            owners[k].append(client)
    rng = np.random.default_rng(seed)
    shares: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, cls in enumerate(classes):
        class_idx = rng.permutation(np.flatnonzero(labels == cls))
        if len(class_idx) < len(owners[k]):
            raise ValueError(
                f"class {cls} has {len(class_idx)} items but {len(owners[k])} clients own it: "
                f"lower num_clients or classes_per_client, or use more data"
            )
        for client, piece in zip(owners[k], np.array_split(class_idx, len(owners[k]))):
            shares[client].append(piece)
    return [_sorted_int64(np.concatenate(pieces)) for pieces in shares]


def _public_count(size: float, num_items: int) -> int:
    """Turn ``public_split``'s ``size`` (count or fraction) into a count, validating it."""
    if isinstance(size, bool) or not isinstance(size, numbers.Real) or size < 0:
        raise ValueError(f"size must be a count (int >= 0) or a fraction in (0, 1), got {size!r}")
    if isinstance(size, numbers.Integral) or float(size).is_integer():
        count = int(size)  # whole floats (e.g. 500.0 from a YAML config) are counts
    elif size < 1:
        count = max(1, round(float(size) * num_items))
    else:
        raise ValueError(f"size must be a whole count or a fraction below 1, got {size!r}")
    if count >= num_items and count > 0:
        raise ValueError(
            f"size ({size!r} -> {count} items) must leave items for the clients (dataset size {num_items})"
        )
    return count


def public_split(labels: np.ndarray, size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Carve a class-stratified server-held split: returns sorted ``(public_idx, remaining_idx)``.

    ``size`` is a count (int, or a whole float) or a fraction in (0, 1) of ``len(labels)``; 0 gives
    an empty public split. The two index arrays are disjoint and cover ``range(len(labels))``.
    """
    labels = _check_labels(labels)
    count = _public_count(size, labels.shape[0])
    public_idx = stratified_choice(labels, count, np.random.default_rng(seed))
    remaining_mask = np.ones(labels.shape[0], dtype=bool)
    remaining_mask[public_idx] = False
    return public_idx, np.flatnonzero(remaining_mask).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# Dispatch and logging
# --------------------------------------------------------------------------------------------------


def _scheme_arguments(scheme: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pick the keyword arguments ``scheme`` reads.

    Arguments meant for another scheme (e.g. ``alpha`` with ``iid``) are ignored so one config can
    carry all knobs; names no scheme knows raise ``ValueError``.
    """
    known = {name for defaults in _SCHEME_KWARGS.values() for name in defaults}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown partition arguments {unknown}; known: {sorted(known)}")
    chosen = {}
    for name, default in _SCHEME_KWARGS[scheme].items():
        if name in kwargs:
            chosen[name] = kwargs[name]
        elif default is None:
            raise ValueError(f"scheme {scheme!r} needs the argument {name!r}")
        else:
            chosen[name] = default
    return chosen


def partition_indices(labels: np.ndarray, scheme: str, num_clients: int, seed: int, **kwargs: Any) -> list[np.ndarray]:
    """Split ``labels`` between clients with ``scheme`` in ``iid``, ``dirichlet``, ``pathological``.

    ``dirichlet`` reads ``alpha`` (required), ``min_size``, ``max_tries``; ``pathological`` reads
    ``classes_per_client`` (required).
    """
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(f"scheme must be one of {list(PARTITION_SCHEMES)}, got {scheme!r}")
    labels = _check_labels(labels)
    arguments = _scheme_arguments(scheme, kwargs)
    if scheme == "iid":
        return iid_partition(labels.shape[0], num_clients, seed)
    if scheme == "dirichlet":
        return dirichlet_partition(labels, num_clients, seed=seed, **arguments)
    return pathological_partition(labels, num_clients, seed=seed, **arguments)


def partition_summary(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> list[dict[str, Any]]:
    """Per-client size and class histogram, for logs: ``[{client, size, class_counts, classes_present}]``."""
    labels = _check_labels(labels)
    num_classes = _check_int(num_classes, "num_classes", 1)
    summary = []
    for client, part in enumerate(parts):
        counts = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
        if counts.shape[0] > num_classes:
            raise ValueError(f"labels go up to {counts.shape[0] - 1} but num_classes is {num_classes}")
        summary.append(
            {
                "client": client,
                "size": len(part),
                "class_counts": [int(c) for c in counts],
                "classes_present": int(np.count_nonzero(counts)),
            }
        )
    return summary
