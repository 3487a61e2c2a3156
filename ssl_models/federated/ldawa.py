"""L-DAWA: layer-wise divergence-aware weight aggregation (Rehman et al., ICCV 2023, arXiv 2307.07393).

Pure functions over named NumPy arrays (no Flower, no torch). For each layer l and client k the server measures the
angular divergence of the client's layer from the global model the client started from, the cosine

    delta_k^l = <w_g^l, w_k^l> / (||w_g^l|| ||w_k^l||),

and aggregates w_g^l <- (1/K) sum_k delta_k^l w_k^l: the cosine takes the place of FedAvg's n_k / n and the
coefficients are not renormalised, so a layer whose clients turned away from the global model shrinks. The
choices the paper leaves open are arguments (the strategy's options, docs/methods/ldawa.md):

- ``layer_unit``: a "layer" is one state-dict tensor (``tensor``; the authors' code scales every array of the
  model's weight list on its own) or one module, its tensors concatenated (``module``: a conv's weight, a linear
  layer's weight and bias, a BatchNorm's affine parameters (and statistics, see ``bn_stats``)).
- ``granularity``: ``layer`` (L-DAWA) or ``model`` (one cosine over all scaled arrays of the model: the model-level
  form the layer-wise one refines).
- ``bn_stats``: BatchNorm running statistics are scaled by their own cosine like any other array (``cosine``: the
  authors' code, which scales every array with at least one dimension) or averaged with the client weights
  (``mean``). Integer buffers (``num_batches_tracked``) and 0-d arrays are never scaled: they take the weighted
  mean, rounded back for integers (the code averages them unscaled too).
- ``client_weights``: each client's base weight, ``1/K`` (the paper) or ``n_k / n``.
- ``normalize``: divide each layer's coefficients by their sum (not in the paper; the sum is then one).

A cosine of a zero vector is undefined (a zero-initialised bias of the first global model); such a layer takes
delta = 1 for that client, i.e. the plain weighted mean, and is counted. A cosine above one (rounding) is clipped
to one, as the authors' code does; a negative cosine is kept, as the paper's formula and the code have it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

LAYER_UNITS = ("tensor", "module")
GRANULARITIES = ("layer", "model")
BN_STATS_MODES = ("cosine", "mean")
CLIENT_WEIGHTS = ("uniform", "examples")
BN_RUNNING_SUFFIXES = ("running_mean", "running_var")


def cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    """Cosine of the angle between two arrays taken as flat vectors (float64); None when either is zero."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    if nx == 0.0 or ny == 0.0:
        return None
    return float(np.dot(x, y)) / (nx * ny)


def is_scaled(key: str, value: np.ndarray, bn_stats: str) -> bool:
    """Whether an array is scaled by its cosine: floating, at least one dimension, and not a BatchNorm running
    statistic when ``bn_stats`` is ``mean``."""
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.floating) or value.ndim == 0:
        return False
    return bn_stats == "cosine" or not key.endswith(BN_RUNNING_SUFFIXES)


def layer_groups(keys: Sequence[str], layer_unit: str, granularity: str) -> OrderedDict[str, list[str]]:
    """The layers the cosines are measured over, by name, each a list of state-dict keys (in ``keys`` order):
    one per key (``tensor``), one per module (``module``: keys sharing everything before the last dot), or one
    for the whole model (granularity ``model``, named "model")."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"layer_groups: granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if layer_unit not in LAYER_UNITS:
        raise ValueError(f"layer_groups: layer_unit must be one of {', '.join(LAYER_UNITS)}, got {layer_unit!r}")
    groups: OrderedDict[str, list[str]] = OrderedDict()
    if not keys:
        return groups
    if granularity == "model":
        groups["model"] = list(keys)
        return groups
    for key in keys:
        name = key if layer_unit == "tensor" else key.rsplit(".", 1)[0]
        groups.setdefault(name, []).append(key)
    return groups


@dataclass
class LDAWAResult:
    """What one aggregation did: the new global arrays, each client's cosine per layer (its own value, before the
    zero-vector fallback: None where undefined), the coefficients per layer (client order) and the layers' keys."""

    state: OrderedDict
    cosines: list[dict[str, float | None]] = field(default_factory=list)
    coefficients: dict[str, list[float]] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)

    @property
    def undefined(self) -> int:
        """How many (client, layer) cosines were undefined (a zero vector) and took delta = 1."""
        return sum(1 for per_client in self.cosines for value in per_client.values() if value is None)


def client_base_weights(num_examples: Sequence[float], mode: str) -> np.ndarray:
    """Each client's base weight, summing to one: 1/K (``uniform``) or n_k / n (``examples``)."""
    if mode not in CLIENT_WEIGHTS:
        raise ValueError(f"client_base_weights: mode must be one of {', '.join(CLIENT_WEIGHTS)}, got {mode!r}")
    n = np.asarray(num_examples, dtype=np.float64)
    if n.size == 0:
        raise ValueError("client_base_weights: no clients")
    if mode == "uniform":
        return np.full(n.size, 1.0 / n.size)
    if np.any(n < 0) or not np.all(np.isfinite(n)) or n.sum() <= 0:
        raise ValueError(f"client_base_weights: example counts must be finite, >= 0 and not all zero, got {list(n)}")
    return n / n.sum()


def ldawa_aggregate(
    states: Sequence[Mapping[str, np.ndarray]],
    global_state: Mapping[str, np.ndarray],
    base_weights: Sequence[float] | np.ndarray,
    *,
    layer_unit: str = "tensor",
    granularity: str = "layer",
    bn_stats: str = "cosine",
    normalize: bool = False,
) -> LDAWAResult:
    """w_g^l <- sum_k c_k^l w_k^l with c_k^l = b_k delta_k^l (``base_weights`` b_k: 1/K in the paper), or
    c_k^l = b_k delta_k^l / sum_j b_j delta_j^l with ``normalize``; delta_k^l the cosine between client k's layer
    l and the global model's (``global_state``: the model the clients started the round from). Arrays that are
    not scaled (``is_scaled``) take sum_k b_k w_k. Sums run in float64; each array is cast back to its dtype
    (integers rounded)."""
    if not states:
        raise ValueError("ldawa_aggregate: no client states")
    b = np.asarray(base_weights, dtype=np.float64)
    if b.shape != (len(states),):
        raise ValueError(f"ldawa_aggregate: {len(states)} states but {b.size} base weights")
    keys = list(states[0].keys())
    for i, state in enumerate(states):
        if list(state.keys()) != keys:
            missing = sorted(set(keys) ^ set(state.keys()))
            raise ValueError(f"ldawa_aggregate: state {i} has different keys than state 0: {missing[:5]}")
    missing_global = [k for k in keys if k not in global_state]
    if missing_global:
        raise ValueError(f"ldawa_aggregate: the global state lacks {missing_global[:5]}")
    for key in keys:
        shapes = {np.shape(state[key]) for state in states} | {np.shape(global_state[key])}
        if len(shapes) > 1:
            raise ValueError(f"ldawa_aggregate: {key} has shapes {sorted(shapes)} across the states")

    scaled = [k for k in keys if is_scaled(k, states[0][k], bn_stats)]
    groups = layer_groups(scaled, layer_unit, granularity)
    glob_vec = {name: _flat(global_state, ks) for name, ks in groups.items()}
    cosines: list[dict[str, float | None]] = []
    for state in states:
        per_layer: dict[str, float | None] = {}
        for name, ks in groups.items():
            value = cosine(_flat(state, ks), glob_vec[name])
            per_layer[name] = None if value is None else min(value, 1.0)  # rounding can pass one
        cosines.append(per_layer)

    coefficients: dict[str, list[float]] = {}
    for name in groups:
        deltas = np.array([1.0 if c[name] is None else c[name] for c in cosines], dtype=np.float64)
        coef = b * deltas
        if normalize:
            total = float(coef.sum())
            # All-negative or zero-sum cosines have no normalised form: the plain weighted mean instead.
            coef = coef / total if total > 0 else b.copy()
        coefficients[name] = [float(v) for v in coef]

    coef_of_key = {k: np.asarray(coefficients[name]) for name, ks in groups.items() for k in ks}
    out: OrderedDict = OrderedDict()
    for key in keys:
        first = np.asarray(states[0][key])
        weights = coef_of_key.get(key, b)
        acc = np.zeros(first.shape, dtype=np.float64)
        for w, state in zip(weights, states):
            acc += w * np.asarray(state[key], dtype=np.float64)
        out[key] = (
            np.rint(acc).astype(first.dtype) if np.issubdtype(first.dtype, np.integer) else acc.astype(first.dtype)
        )
    return LDAWAResult(state=out, cosines=cosines, coefficients=coefficients, groups=dict(groups))


def _flat(state: Mapping[str, np.ndarray], keys: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(state[k], dtype=np.float64).ravel() for k in keys])


def group_of(layer: str) -> str:
    """The part of the model a layer belongs to, for the per-round record: its first two name components
    ("backbone.layer1", "projector.0"); "model" stays "model"."""
    return ".".join(layer.split(".")[:2])


def cosine_summary(per_layer: Mapping[str, float | None]) -> dict[str, object]:
    """One client's cosines in brief: mean, min and max over its defined layers, and the mean per layer group
    (``group_of``), each rounded to 6 decimals; the number of undefined ones."""
    values = [v for v in per_layer.values() if v is not None]
    by_group: dict[str, list[float]] = {}
    for name, value in per_layer.items():
        if value is not None:
            by_group.setdefault(group_of(name), []).append(value)
    return {
        "cos_mean": _r(sum(values) / len(values)) if values else None,
        "cos_min": _r(min(values)) if values else None,
        "cos_max": _r(max(values)) if values else None,
        "cos_by_group": {g: _r(sum(v) / len(v)) for g, v in by_group.items()},
        "cos_undefined": len(per_layer) - len(values),
    }


def _r(value: float) -> float:
    return round(float(value), 6) if math.isfinite(value) else float(value)
