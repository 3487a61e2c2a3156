"""Aggregation as pure functions over named NumPy arrays (no Flower, no torch).

Kept apart from the Strategy classes so the math can be tested against hand computations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np


def weighted_average(states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> OrderedDict:
    """Average named arrays weighted by ``weights`` (e.g. each client's number of examples).

    Every state must hold the same keys with the same shapes. Sums run in float64; floating arrays are
    cast back to their dtype; integer arrays (BatchNorm's ``num_batches_tracked``) are rounded back.
    """
    if not states:
        raise ValueError("weighted_average: no states to average")
    if len(states) != len(weights):
        raise ValueError(f"weighted_average: {len(states)} states but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
        raise ValueError(f"weighted_average: weights must be finite, >= 0 and not all zero, got {list(weights)}")
    w = w / w.sum()
    keys = list(states[0].keys())
    for i, state in enumerate(states[1:], start=1):
        if list(state.keys()) != keys:
            missing = sorted(set(keys) ^ set(state.keys()))
            raise ValueError(f"weighted_average: state {i} has different keys than state 0: {missing[:5]}")
    out = OrderedDict()
    for key in keys:
        first = np.asarray(states[0][key])
        acc = np.zeros(first.shape, dtype=np.float64)
        for wi, state in zip(w, states):
            arr = np.asarray(state[key])
            if arr.shape != first.shape:
                raise ValueError(
                    f"weighted_average: {key} has shape {arr.shape} in one state and {first.shape} in another"
                )
            acc += wi * arr
        if np.issubdtype(first.dtype, np.integer):
            out[key] = np.rint(acc).astype(first.dtype)
        else:
            out[key] = acc.astype(first.dtype)
    return out


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """Weighted mean of scalars (e.g. client losses weighted by examples)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(values) == 0 or w.sum() <= 0:
        return float("nan")
    return float(np.dot(np.asarray(values, dtype=np.float64), w) / w.sum())


def sample_clients(client_ids: Sequence[int], k: int, seed: int, server_round: int) -> list[int]:
    """Seeded partial participation: ``k`` of the sorted ``client_ids``, the same for the same seed and round."""
    ids = sorted(client_ids)
    if k > len(ids):
        raise ValueError(f"sample_clients: cannot pick {k} of {len(ids)} clients")
    if k == len(ids):
        return ids
    rng = np.random.default_rng([seed, server_round])
    return sorted(int(ids[i]) for i in rng.choice(len(ids), size=k, replace=False))
