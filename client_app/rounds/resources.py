"""The resources of one local training step (FLOPs per sample, analytic memory), measured once per model shape,
optimiser and batch, and kept per process and on the node's disk."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ssl_models.accounting import analytic_training_memory, training_step_flops
from ssl_models.config import ExperimentConfig

# One measurement per process for each model structure, optimiser and batch: the figures depend on nothing else,
# and a simulation's actor (or a long-lived SuperNode process) trains the same model shape round after round.
_STEP_RESOURCES: dict[tuple, dict[str, float]] = {}
# A deployed SuperNode starts a new ClientApp process for every message, where that memo is always empty and every
# round measured again (forward and backward passes of their own: 0.5 s for the smoke config's model, 1.4 s for
# the FedEMA CPU comparison's, on a busy 2-core machine, against about 1 s of training per round). So the figures
# are also kept on the node's disk, one small JSON file per key, under a folder named by the accounting code's own
# digest (a changed way of counting never reads figures counted the old way).
RESOURCE_CACHE_VARIABLE = "FEDSSL_RESOURCE_CACHE"  # a folder, or "off"; default ~/.cache/fedssl/step-resources


def resource_cache_file(key: tuple) -> Path | None:
    """Where the figures of ``key`` are kept on this machine's disk (None: the disk cache is off)."""
    value = os.environ.get(RESOURCE_CACHE_VARIABLE, "")
    if value.strip().lower() == "off":
        return None
    root = Path(value).expanduser() if value.strip() else Path.home() / ".cache" / "fedssl" / "step-resources"
    return root / _accounting_digest() / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.json"


@functools.lru_cache(maxsize=1)
def _accounting_digest() -> str:
    from ssl_models import accounting

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(Path(accounting.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _read_cached_resources(path: Path | None) -> dict[str, float] | None:
    if path is None or not path.is_file():
        return None
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable (a torn write by another process): measure again
    ok = isinstance(figures, dict) and figures and all(isinstance(v, (int, float)) for v in figures.values())
    return {k: float(v) for k, v in figures.items()} if ok else None


def _write_cached_resources(path: Path | None, figures: dict[str, float]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only or full disk: the figures were measured, only not kept


def step_resources(
    method,
    *,
    optimizer: str,
    batch_size: int,
    sgd_momentum: float,
    device,
    image_shape: tuple[int, ...],
    context: str = "",
) -> dict[str, float]:
    """Per-step resources of local training (docs/methods/lwfedssl.md, Resource accounting), on deep copies of ``method``: FLOPs per sample
    (image, both views) of one step (``flops_forward``, ``flops_backward``, ``flops_total`` and the forward / 2
    ``flops_fvcore_equivalent`` that the LW-FedSSL paper tabulates), counted on a batch of at most 8, and the analytic
    memory of one step at ``batch_size`` (``mem_parameters``, ``mem_gradients``, ``mem_optimizer``,
    ``mem_activations``, ``mem_total``, bytes). Kept per process and on the node's disk (``$FEDSSL_RESOURCE_CACHE``),
    keyed by the model's parameter and buffer shapes, the optimiser, batch, device, image shape and ``context``
    (the caller's method and model settings: options such as a loss's symmetry change FLOPs, not shapes)."""
    structure = tuple((name, tuple(p.shape), p.requires_grad) for name, p in method.named_parameters())
    buffers = tuple((name, tuple(b.shape)) for name, b in method.named_buffers())
    key = (
        type(method).__name__,
        structure,
        buffers,
        optimizer,
        int(batch_size),
        float(sgd_momentum),
        str(device),
        tuple(image_shape),
        context,
    )
    if key not in _STEP_RESOURCES:
        cache = resource_cache_file(key)
        figures = _read_cached_resources(cache)
        if figures is None:
            flops = training_step_flops(method, image_shape, batch_size=max(2, min(int(batch_size), 8)), device=device)
            memory = analytic_training_memory(
                method, optimizer, int(batch_size), view_shape=image_shape, device=device, sgd_momentum=sgd_momentum
            )
            figures = {
                "flops_forward": float(flops["forward"]),
                "flops_backward": float(flops["backward"]),
                "flops_total": float(flops["total"]),
                "flops_fvcore_equivalent": float(flops["fvcore_equivalent"]),
                **{f"mem_{k}": float(v) for k, v in memory.items()},
            }
            _write_cached_resources(cache, figures)
        _STEP_RESOURCES[key] = figures
    return dict(_STEP_RESOURCES[key])


def local_step_resources(cfg: ExperimentConfig, method, images: np.ndarray, device) -> dict[str, float]:
    """``step_resources`` of one local step of this experiment's model, optimiser and batch on ``images``."""
    t = cfg.train
    return step_resources(
        method,
        optimizer=t.optimizer,
        batch_size=max(2, min(t.batch_size, len(images))),
        sgd_momentum=t.momentum,
        device=device,
        image_shape=(3, *np.shape(images)[1:3]),
        context=json.dumps(
            {"method": cfg.method.name, "options": cfg.method.options, "model": [cfg.model.arch, cfg.model.width]},
            sort_keys=True,
            default=str,
        ),
    )
