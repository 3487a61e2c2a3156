"""The client round of the layer-wise strategies (LW-FedSSL, Prog-FedSSL, FedMoCo-LW, FLL+DD): assemble the stage's
sub-model from the download and the client's own blocks, train its active part, upload that part. The server side
(``strategies/layerwise.py``) and this round share the rules of ``ssl_models/federated/layerwise.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ssl_models.accounting import process_peak_rss_bytes, reset_peak_rss
from ssl_models.config import ExperimentConfig
from ssl_models.factory import load_partial_state, reset_target_from_online, state_to_numpy
from ssl_models.federated.layerwise import (
    RepresentationAligner,
    build_layerwise_model,
    configure_local_model,
    head_prefixes,
    resource_account,
    select,
    trained_prefixes,
)
from ssl_models.methods.base import TARGET_PREFIXES
from ssl_models.training import resolve_device

from ..rules.base import META
from ..rules.base import model_entries as _model_entries
from .weights import LocalRoundResult, local_training, round_seed


def layerwise_round(
    cfg: ExperimentConfig,
    images: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    plan: Mapping[str, Any],
    log: Callable[[str], None] | None = None,
) -> LocalRoundResult:
    """One client round of a layer-wise strategy (``strategies/layerwise.py``) at stage ``plan["stage"]``.

    The client builds the method with a ViT of s = stage blocks and fills it from its own last sub-model (the
    blocks it already holds) overlaid with what the server sent (the entries it trains, and every entry whose
    global version it lacks); an entry found in neither is an error (the server then sends the whole sub-model
    next time). ``plan`` (the round's ``lw-*`` config keys, prefix removed): ``trainable`` (``last_block``: block
    s + final norm + heads train, blocks 1..s-1 and the embeddings run frozen under no_grad; ``all``), ``alpha``
    and ``align-temperature`` (> 0: LW-FedSSL's representation alignment to the assembled global model, a frozen
    copy; ``align-symmetric``: both views' terms, Algorithm 2 line 12), ``depth-dropout`` (FLL+DD), ``client-target`` (``reset``: the momentum encoder starts as a copy of the
    assembled model; ``keep``: the client's own, new blocks from the received ones), ``progress-start/-end`` (this
    round's window of MoCo v3's momentum schedule), ``accounting`` (per-step FLOPs, analytic memory; the peak RSS
    and CUDA peak of local training are always measured). Uploads exactly the trained entries.
    """
    stage = int(plan["stage"])
    mode = str(plan.get("trainable", "last_block"))
    seed = round_seed(cfg, server_round, partition_id)
    method = build_layerwise_model(cfg, stage, seed=seed)
    heads = head_prefixes(method)
    model_state = method.state_dict()
    online_keys = [k for k in model_state if k.startswith(method.shared_prefixes())]
    own = _model_entries(client_state)
    merged = {k: v for k, v in own.items() if k in online_keys and tuple(np.shape(v)) == tuple(model_state[k].shape)}
    merged.update(global_state)
    missing = [k for k in online_keys if k not in merged]
    if missing:
        raise RuntimeError(
            f"client {partition_id}: the stage-{stage} sub-model lacks {len(missing)} entries "
            f"({', '.join(missing[:3])}...): neither the download nor this client's stored state holds "
            "them (state lost?); the server sends the whole sub-model next round"
        )
    load_partial_state(method, merged)
    reset_target_from_online(method)
    if str(plan.get("client-target", "reset")) == "keep":
        kept_target = {
            k: v
            for k, v in own.items()
            if k.startswith(TARGET_PREFIXES) and k in model_state and tuple(np.shape(v)) == tuple(model_state[k].shape)
        }
        load_partial_state(method, kept_target)
    method.on_new_global()
    configure_local_model(method, mode, float(plan.get("depth-dropout", 0.0)), dropout_seed=seed)
    if hasattr(method, "set_progress_range"):
        method.set_progress_range(float(plan.get("progress-start", 0.0)), float(plan.get("progress-end", 1.0)))
    alpha = float(plan.get("alpha", 0.0))
    aligner = (
        RepresentationAligner(
            method.backbone,
            alpha,
            float(plan.get("align-temperature", 0.2)),
            symmetric=bool(plan.get("align-symmetric", True)),
        )
        if alpha > 0
        else None
    )
    device = resolve_device(cfg.train.device)
    t = cfg.train
    batch = max(2, min(t.batch_size, len(images)))
    info: dict[str, Any] = {"stage": stage}
    if bool(plan.get("accounting", True)):
        info.update(
            resource_account(
                method, optimizer=t.optimizer, batch_size=batch, sgd_momentum=t.momentum, device=device, aligner=aligner
            )
        )
    rss_reset = reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if aligner is not None:
        aligner.attach(method)
    try:
        stats = local_training(
            cfg,
            method,
            images,
            lr=lr,
            seed=seed,
            device=device,
            loss_hook=aligner.loss if aligner else None,
            log=log,
            account=False,
        )
    finally:
        if aligner is not None:
            aligner.detach()
    if device.type == "cuda":
        info["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
    rss = process_peak_rss_bytes()
    if rss is not None:
        info["rss_peak_bytes"] = float(rss)
        info["rss_peak_reset"] = bool(rss_reset)  # False: the process's lifetime peak
    info["images_trained"] = float(stats.steps * min(t.batch_size, len(images)))
    if aligner is not None and aligner.mean_value is not None:
        info["align_loss"] = aligner.mean_value
    if getattr(method.backbone, "depth_dropout", 0.0):
        info["depth_dropout"] = float(method.backbone.depth_dropout)
    method.cpu()
    state = method.state_dict()
    shared = state_to_numpy(select(state, trained_prefixes(stage, mode, heads)))
    kept_prefixes = method.shared_prefixes() + (TARGET_PREFIXES if str(plan.get("client-target")) == "keep" else ())
    kept = state_to_numpy(select(state, kept_prefixes))
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    kept[META + "depth"] = np.array([stage], dtype=np.int64)
    return LocalRoundResult(shared, kept, stats, info)
