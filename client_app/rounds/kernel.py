"""Hetero-SSFL's client round: local SSL on the client's own encoder plus the alignment of its RAD kernel to the
server's (``ssl_models/federated/kernel_alignment.py``), then its kernel in transport form; and K_k(0), the
kernel of its initial model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ssl_models.config import ExperimentConfig
from ssl_models.factory import load_partial_state, state_to_numpy
from ssl_models.federated.kernel_alignment import (
    KernelAligner,
    centred_kernel_norm,
    client_kernel,
    decode_kernel,
    encode_kernel,
    kernel_cka,
    normalize_kernel,
    rad_representations,
    rad_term_flops,
)
from ssl_models.training import TrainStats, fast_path_for, resolve_device

from ..rules.base import META
from ..rules.base import model_entries as _model_entries
from .public_set import check_public_set
from .weights import initial_client_model, local_training, round_seed


@dataclass
class KernelRoundResult:
    payload: dict[str, np.ndarray]  # the client's RAD kernel in transport form
    client_state: dict[str, np.ndarray]
    stats: TrainStats
    info: dict[str, Any] = field(default_factory=dict)  # alignment figures (CKA to K_bar before/after, ...)


def _client_model(cfg: ExperimentConfig, partition_id: int, client_state: Mapping[str, np.ndarray] | None):
    """The client's own model: its initial one, overlaid with its kept state (if any)."""
    method = initial_client_model(cfg, partition_id)
    own = _model_entries(client_state)
    if own:
        load_partial_state(method, own)
    return method


def _rad_kernel(method, rad: np.ndarray, options: Mapping[str, Any], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(RAD representations, the client's raw kernel of them) with the strategy's options."""
    features = rad_representations(
        method,
        rad,
        str(options["representation"]),
        device=device,
        batch_size=int(options["rad_forward_batch"]),
        bn_mode=str(options["bn_mode"]),
    )
    return features, client_kernel(features, str(options["kernel"]), float(options["rbf_threshold"]))


def rad_precision(cfg: ExperimentConfig, options: Mapping[str, Any], device) -> dict[str, Any]:
    """The aligner's ``forward_dtype`` and ``channels_last`` for ``strategy.options.rad_precision``: ``train`` the
    local step's own (bf16 autocast and channels-last on the fast path; float32 where the step runs fp32 or fp16,
    since the term's gradient does not pass the fp16 gradient scaler), ``fp32`` float32 always."""
    if str(options.get("rad_precision", "train")) == "fp32":
        return {"forward_dtype": None, "channels_last": False}
    fp = fast_path_for(torch.device(device), cfg.train.fast_path)
    return {
        "forward_dtype": torch.bfloat16 if fp.autocast_dtype == torch.bfloat16 else None,
        "channels_last": fp.channels_last,
    }


def _kernel_payload(kernel: torch.Tensor, options: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], float]:
    """(the transport form of the normalised kernel, the raw kernel's ||H K H||_F)."""
    norm = centred_kernel_norm(kernel)
    k = normalize_kernel(kernel, str(options["kernel_normalization"]))
    encoding = str(options["kernel_encoding"])
    return encode_kernel(k, encoding, float(options["topk_fraction"]) if encoding == "topk" else None), norm


_RAD_PASS_FLOPS: dict[tuple, dict[str, float]] = {}


def _rad_pass_flops(method, representation: str, image_shape: tuple[int, ...]) -> dict[str, float]:
    """``rad_term_flops`` of this model, kept per process (keyed by its parameter shapes)."""
    shapes = tuple((name, tuple(p.shape), p.requires_grad) for name, p in method.named_parameters())
    key = (type(method).__name__, shapes, representation, tuple(image_shape))
    if key not in _RAD_PASS_FLOPS:
        _RAD_PASS_FLOPS[key] = rad_term_flops(method, representation, image_shape)
    return _RAD_PASS_FLOPS[key]


def initial_kernel(
    cfg: ExperimentConfig,
    rad: np.ndarray,
    client_state: Mapping[str, np.ndarray] | None,
    *,
    partition_id: int,
    rad_digest: str,
    options: Mapping[str, Any],
) -> tuple[dict[str, np.ndarray], float]:
    """Hetero-SSFL's K_k(0) (Algorithm 1 forms K_bar(0) from the initial models before round 1): the kernel of the
    client's current model (its initial one when it has no state) on the RAD, in transport form, and its raw
    ``||H K H||_F``. Nothing trains and nothing is kept."""
    check_public_set(rad, rad_digest, partition_id, "RAD")
    method = _client_model(cfg, partition_id, client_state)
    _, kernel = _rad_kernel(method, rad, options, resolve_device(cfg.train.device))
    return _kernel_payload(kernel, options)


def kernel_round(
    cfg: ExperimentConfig,
    images: np.ndarray,
    rad: np.ndarray,
    target_payload: Mapping[str, np.ndarray] | None,
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    rad_digest: str,
    options: Mapping[str, Any],
    log: Callable[[str], None] | None = None,
) -> KernelRoundResult:
    """One Hetero-SSFL client round: local SSL on the client's own encoder (its own architecture, its own weights
    kept between rounds) plus ``mu * (1 - CKA(K_k, K_bar))`` when the server sent a K_bar, then the kernel
    ``K_k = A_k A_k^T`` of its RAD representations in transport form.

    ``target_payload`` is the server's K_bar (an ``encode_kernel`` payload) or empty (no kernel yet: the round is
    local SSL only). ``options`` are the strategy options (``strategies/heterossfl.py``). With a K_bar the client
    reports its CKA to it on the whole RAD before and after local training (``cka_start``, ``cka_end``; also at
    ``mu: 0``, the no-alignment reference), and always its raw kernel's ``||H K H||_F`` (``kernel_norm``).
    """
    check_public_set(rad, rad_digest, partition_id, "RAD")
    seed = round_seed(cfg, server_round, partition_id)
    method = _client_model(cfg, partition_id, client_state)
    device = resolve_device(cfg.train.device)
    n = len(rad)
    aligner = None
    info: dict[str, Any] = {"aligned": False}
    target = None
    if target_payload:
        target = decode_kernel(target_payload, n)
        _, start_kernel = _rad_kernel(method, rad, options, device)
        info["cka_start"] = kernel_cka(start_kernel, target)
        del start_kernel
        if float(options["mu"]) > 0:
            aligner = KernelAligner(
                rad,
                target,
                mu=float(options["mu"]),
                representation=str(options["representation"]),
                kernel=str(options["kernel"]),
                rbf_threshold=float(options["rbf_threshold"]),
                refresh=str(options["refresh"]),
                refresh_steps=int(options["refresh_steps"]),
                rad_batch_size=int(options["rad_batch_size"]),
                forward_batch_size=int(options["rad_forward_batch"]),
                bn_mode=str(options["bn_mode"]),
                **rad_precision(cfg, options, device),
                device=device,
                seed=seed,
            )
    stats = local_training(
        cfg,
        method,
        images,
        lr=lr,
        seed=seed,
        device=device,
        loss_hook=aligner.loss if aligner else None,
        epoch_hook=aligner.on_epoch_start if aligner else None,
        log=log,
    )
    _, k = _rad_kernel(method, rad, options, device)
    if target is not None:
        info["cka_end"] = kernel_cka(k, target)
    if aligner is not None:
        info.update(aligned=True, align_loss=aligner.stats.mean_value, refreshes=aligner.stats.refreshes)
    if stats.resources:
        # What the round cost besides the SSL steps: the term's RAD passes and the forward of the kernel sent up
        # (the cka_start forward is a measurement, like the server's kNN monitor, and is left out).
        per_image = _rad_pass_flops(method, str(options["representation"]), (3, *np.shape(rad)[1:3]))
        extra = n * per_image["forward"] + (aligner.stats.flops(per_image) if aligner is not None else 0.0)
        stats.resources["flops_extra"] = float(extra)
    payload, info["kernel_norm"] = _kernel_payload(k, options)
    kept = state_to_numpy(method.cpu().state_dict())
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    return KernelRoundResult(payload, kept, stats, info)


def client_encoder_state(client_state: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """The online backbone entries of a client's state: what the server needs to score the client's encoder."""
    return {k: v for k, v in (client_state or {}).items() if k.startswith("backbone.")}
