"""FLESD's client round: local SSL on the client's own encoder, then the similarity matrix of its representations
of the public set (``ssl_models/federated/similarity.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ssl_models.config import ExperimentConfig
from ssl_models.factory import build_ssl_model, load_partial_state, state_to_numpy
from ssl_models.federated.similarity import client_similarity_payload, public_representations
from ssl_models.training import TrainStats, resolve_device

from ..rules.base import META
from ..rules.base import model_entries as _model_entries
from ..rules.fedssl_family import fedssl_download
from .public_set import check_public_set
from .weights import local_training, round_seed


@dataclass
class SimilarityRoundResult:
    payload: dict[str, np.ndarray]  # the similarity matrix in transport form
    client_state: dict[str, np.ndarray]
    stats: TrainStats


def similarity_round(
    cfg: ExperimentConfig,
    images: np.ndarray,
    public: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    public_digest: str,
    similarity: str,
    topk_fraction: float | None = None,
    log: Callable[[str], None] | None = None,
) -> SimilarityRoundResult:
    """One FLESD client round: local SSL on the client's own encoder, then the similarity matrix of its
    representations of the public set. ``global_state`` is empty for a client whose architecture differs
    from the global model's: it continues from its own weights."""
    check_public_set(public, public_digest, partition_id, "public")
    seed = round_seed(cfg, server_round, partition_id)
    method = build_ssl_model(cfg, seed=seed, arch=cfg.client_arch(partition_id))
    own = _model_entries(client_state)
    if global_state:
        fedssl_download(method, global_state, client_state, server_round, {})
    elif own:
        load_partial_state(method, own)
    device = resolve_device(cfg.train.device)
    stats = local_training(cfg, method, images, lr=lr, seed=seed, device=device, log=log)
    z = public_representations(method, public, device=device)
    payload = client_similarity_payload(z, similarity, topk_fraction if similarity == "topk" else None)
    kept = state_to_numpy(method.cpu().state_dict())
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    return SimilarityRoundResult(payload, kept, stats)
