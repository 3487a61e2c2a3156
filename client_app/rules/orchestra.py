"""Orchestra's client rule (Lubana et al., ICML 2022, Algorithm 1, client side).

- ``download``: the global model as FedSSL's rule loads it (with the strategy's default ``aggregate_target`` the
  averaged target model too: the authors' code's stateless clients), plus the round's global centroids, which arrive
  next to the weights as ``orchestra.global_centroids``; the memory starts empty every round;
- local training: the method's loss (cluster assignment to the global centroids + rotation degeneracy term);
  with the strategy's ``seed_round`` (the authors' code) round 1 trains nothing instead: the memory is filled with
  the target projections of the first M images (``replaces_training``), so that the first centroids come from data;
- ``upload_extra``: the local clustering of the memory of target representations into N_L equally sized clusters
  (Sinkhorn-Knopp K-means), uploaded as ``orchestra.local_centroids`` (N_L, D).

The rule's numbers (mean loss terms, rotation accuracy, local cluster sizes, how many global clusters the memory's
target assignments use) travel as ``rule.*`` metrics to metrics.jsonl.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ssl_models.factory import build_augment
from ssl_models.federated.orchestra import balanced_kmeans, cluster_size_summary, is_seeding_round, seed_memory
from ssl_models.training import TrainStats

from ..rounds.resources import local_step_resources
from .base import ClientRule, register
from .fedssl_family import fedssl_download

PREFIX = "orchestra."
GLOBAL_CENTROIDS = PREFIX + "global_centroids"
LOCAL_CENTROIDS = PREFIX + "local_centroids"


def orchestra_download(method, global_state, client_state, server_round, options) -> dict[str, Any]:
    weights = {k: v for k, v in global_state.items() if not k.startswith(PREFIX)}
    info = fedssl_download(method, weights, client_state, server_round, options)
    if GLOBAL_CENTROIDS not in global_state:
        raise ValueError(f"orchestra: the server sent no {GLOBAL_CENTROIDS!r} with the round's model")
    received = np.asarray(global_state[GLOBAL_CENTROIDS])
    method.set_global_centroids(torch.as_tensor(received))
    method.reset_memory()  # the memory holds this round's target representations only
    method.reset_loss_log()
    # A checksum of the centroids trained against, which the server compares with those it sent (metrics.jsonl).
    info = {**info, "global_centroids_sum": float(received.astype(np.float64).sum())}
    if is_seeding_round(options, server_round):
        info["seed_round"] = 1.0  # this round trains nothing (orchestra_seed_round)
    return info


def orchestra_seed_round(method, images, cfg, options, device, *, server_round: int, seed: int) -> TrainStats | None:
    """Round 1 with ``seed_round``: no training step, the memory filled from the first M images (``seed_memory``);
    the round's stats say so (steps 0, no image trained; the seeding forwards counted as the round's extra FLOPs).
    Every other round: None (local training as usual)."""
    if not is_seeding_round(options, server_round):
        return None
    per_step = local_step_resources(cfg, method, images, device)
    seeded = seed_memory(
        method,
        images,
        build_augment(cfg, int(np.shape(images)[1])),
        batch_size=cfg.train.batch_size,
        seed=seed,
        device=device,
    )
    resources = {**per_step, "images_trained": 0.0}
    if per_step.get("flops_forward") is not None:
        resources["flops_extra"] = float(per_step["flops_forward"]) * seeded["images"]
    return TrainStats(
        loss=seeded["loss"],
        num_examples=int(np.shape(images)[0]),
        steps=0,
        seconds=seeded["seconds"],
        images_per_s=seeded["images"] / max(seeded["seconds"], 1e-9),
        precision="fp32",
        resources=resources,
    )


def orchestra_upload(method, images, cfg, options, device, info) -> dict[str, np.ndarray]:
    """Local clustering after training: N_L equal-size clusters of the memory; the centroids are the upload."""
    bank = method.memory_bank()
    num_local = int(method.options["num_local_clusters"])
    if bank.shape[0] < num_local:
        raise ValueError(
            f"orchestra: only {bank.shape[0]} target representations in the memory after local training, fewer "
            f"than num_local_clusters ({num_local}); train more steps or lower num_local_clusters"
        )
    # The draw of the initial centroids follows the round's seeded RNG (local training seeds it).
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    centroids, assignments = balanced_kmeans(
        bank,
        num_local,
        iterations=int(options["kmeans_iters"]),
        sinkhorn_iterations=int(options["sinkhorn_iters"]),
        inverse_epsilon=float(options["sinkhorn_inverse_epsilon"]),
        generator=generator,
    )
    local = cluster_size_summary(assignments, num_local)
    global_assignments = (bank @ method.global_centroids.T.to(bank)).argmax(dim=1)
    info.update(method.loss_summary())
    info.update(
        memory_filled=int(bank.shape[0]),
        local_cluster_size_min=local["size_min"],
        local_cluster_size_max=local["size_max"],
        global_clusters_hit=cluster_size_summary(global_assignments, method.global_centroids.shape[0])["used"],
    )
    return {LOCAL_CENTROIDS: centroids.detach().cpu().numpy().astype(np.float32)}


register(
    ClientRule(
        "orchestra",
        orchestra_download,
        keeps="own",
        upload_extra=orchestra_upload,
        replaces_training=orchestra_seed_round,
    )
)
