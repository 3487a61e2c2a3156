"""Merging a client's model with the global one: the math of FedEMA and FedU (Zhuang et al., ICLR 2022).

Pure functions over named arrays (state-dict entries as NumPy arrays or tensors); no Flower.

- ``l2_divergence``: the paper's divergence ||W_g - W_k||, one L2 norm over the named *parameters* of the
  online encoder (weights and biases, BatchNorm affine included; BatchNorm running statistics and counters
  are not parameters and are left out).
- ``easyfl_divergence``: the official code's variant: the mean, over the online encoder's convolution weights that
  EasyFL counts, of the per-tensor L2 distance between two states, used there between the start and the end of
  the client's previous local training (the size of its last local update). EasyFL selects parameters whose name
  contains ``conv`` and ``weight``; its CIFAR ResNet names the stem and every residual-branch convolution
  ``conv*`` and its 1x1 projection shortcuts ``shortcut.0``, so the shortcuts are left out (17 tensors in a
  ResNet-18, 33 in a ResNet-34). Here the same set is chosen by role (``easyfl_conv_keys``): every 4-D backbone
  weight except those of a shortcut, whatever the layers are called.
- ``ema_merge``: W <- mu * W_local + (1 - mu) * W_global over the parameters; BatchNorm running statistics take
  the global model's (``bn_stats="global"``, as EasyFL, whose EMA runs over ``parameters()`` of the received
  model) or the same EMA (``"ema"``); integer entries (``num_batches_tracked``) take the global value.
- ``fedema_mu``: mu = min(lambda * d, 1); ``autoscaler_lambda``: lambda = tau / d, set once per client (by the
  FedEMA server from the client's first upload, Algorithm 1), so a mu at that same divergence is tau.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np

BN_STAT_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def is_parameter_key(key: str) -> bool:
    """True for parameters, False for BatchNorm statistics (buffers)."""
    return not key.endswith(BN_STAT_SUFFIXES)


def _np(value) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def select(state: Mapping[str, object], prefixes: Iterable[str]) -> list[str]:
    prefixes = tuple(prefixes)
    return [k for k in state if k.startswith(prefixes)]


def l2_divergence(
    global_state: Mapping[str, object], local_state: Mapping[str, object], prefixes: Iterable[str]
) -> float:
    """||W_g - W_k||: one L2 norm over all parameters under ``prefixes`` (BN statistics excluded)."""
    keys = [k for k in select(global_state, prefixes) if is_parameter_key(k)]
    if not keys:
        raise ValueError(f"l2_divergence: no parameters under prefixes {tuple(prefixes)}")
    total = 0.0
    for key in keys:
        if key not in local_state:
            raise KeyError(f"l2_divergence: {key} missing from the local state")
        diff = _np(global_state[key]).astype(np.float64) - _np(local_state[key]).astype(np.float64).reshape(
            _np(global_state[key]).shape
        )
        total += float(np.sum(diff * diff))
    return math.sqrt(total)


def easyfl_conv_keys(state: Mapping[str, object], backbone_prefix: str = "backbone.") -> list[str]:
    """The convolution weights EasyFL's divergence averages over: every 4-D weight of the backbone except the 1x1
    projection shortcuts (EasyFL's ``'conv' in name`` leaves ``shortcut.0`` out)."""
    return [
        k
        for k in state
        if k.startswith(backbone_prefix) and k.endswith("weight") and ".shortcut." not in k and _np(state[k]).ndim == 4
    ]


def easyfl_divergence(
    start_state: Mapping[str, object], end_state: Mapping[str, object], backbone_prefix: str = "backbone."
) -> float:
    """Mean per-tensor L2 distance over the backbone's convolution weights as EasyFL selects them
    (``easyfl_conv_keys``): EasyFL's FedEMA / FedU divergence."""
    keys = easyfl_conv_keys(start_state, backbone_prefix)
    if not keys:
        raise ValueError(f"easyfl_divergence: no convolution weights under {backbone_prefix!r}")
    dists = [
        float(np.linalg.norm(_np(start_state[k]).astype(np.float64) - _np(end_state[k]).astype(np.float64)))
        for k in keys
    ]
    return float(np.mean(dists))


BN_STATS_MODES = ("global", "ema")


def ema_merge(
    local_state: Mapping[str, object],
    global_state: Mapping[str, object],
    mu: float,
    prefixes: Iterable[str],
    bn_stats: str = "global",
) -> OrderedDict:
    """mu * local + (1 - mu) * global for the parameters under ``prefixes`` (returns only those entries); BatchNorm
    running statistics take the global values (``bn_stats="global"``) or the same EMA (``"ema"``)."""
    if not 0.0 <= mu <= 1.0:
        raise ValueError(f"ema_merge: mu must be in [0, 1], got {mu}")
    if bn_stats not in BN_STATS_MODES:
        raise ValueError(f"ema_merge: bn_stats must be one of {BN_STATS_MODES}, got {bn_stats!r}")
    out = OrderedDict()
    for key in select(global_state, prefixes):
        g = _np(global_state[key])
        if (
            np.issubdtype(g.dtype, np.integer)
            or np.issubdtype(g.dtype, np.bool_)
            or (bn_stats == "global" and not is_parameter_key(key))
        ):
            out[key] = g.copy()
            continue
        loc = _np(local_state[key]).reshape(g.shape)
        out[key] = (mu * loc.astype(np.float64) + (1.0 - mu) * g.astype(np.float64)).astype(g.dtype)
    return out


def autoscaler_lambda(tau: float, divergence: float) -> float:
    """lambda = tau / d, computed once per client so that a mu at that divergence equals tau exactly."""
    if divergence <= 0 or not math.isfinite(divergence):
        # Identical models: any lambda gives mu = 0; use tau so later rounds still scale sensibly.
        return float(tau)
    return float(tau) / float(divergence)


def fedema_mu(lam: float, divergence: float) -> float:
    """mu = min(lambda * d, 1)."""
    return float(min(lam * divergence, 1.0))
