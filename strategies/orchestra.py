"""Orchestra (Lubana et al., "Orchestra: Unsupervised Federated Learning via Globally Consistent Clustering",
ICML 2022, arXiv 2205.11506), the server side (the paper's Algorithm 2; Algorithm 1 is the clients').

Each round the sampled clients receive the global model (online model, rotation head and, by default, the
target model: the authors' code runs stateless clients) and the global centroids (``orchestra.global_centroids``,
N_G x D, sent with the round, not part of the averaged model). Each trains with the cluster-assignment loss against the
global centroids plus the rotation degeneracy term, clusters the memory of its target representations into N_L
equally sized local centroids and uploads its weights with ``orchestra.local_centroids`` (N_L x D). The server
averages the weights (FedAvg, weighted by examples) and clusters all uploaded local centroids into the next N_G
global centroids (``global_clustering``: ``gradient``, the authors' code's SGD form of Genevay et al.'s clustering,
warm-started at the last centroids, or ``kmeans``, the equal-size Sinkhorn-Knopp K-means the clients use).
Before the first global clustering the centroids are seeded random unit vectors. With ``seed_round`` (the authors'
code) round 1 trains nothing: the clients upload the local centroids of their received model's representations,
the server keeps the weights and clusters the centroids, and training starts in round 2 against centroids from data.

The math lives in ``ssl_models.federated.orchestra``; the client side in ``client_app/rules/orchestra.py``; the
model and loss in ``ssl_models/methods/orchestra.py``.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.common.logger import log

from fedssl_wire import from_array_record, to_array_record
from ssl_models.federated.orchestra import (
    balanced_kmeans,
    cluster_size_summary,
    gradient_clustering,
    is_seeding_round,
    random_unit_centroids,
)
from ssl_models.methods import method_default_options

from .aggregation import weighted_average
from .fedssl import FedSSL
from .options import check_bool, check_choice, check_positive
from .replies import array_spec

GLOBAL_CENTROIDS = "orchestra.global_centroids"
LOCAL_CENTROIDS = "orchestra.local_centroids"
GLOBAL_CLUSTERINGS = ("kmeans", "gradient")
UNIT_NORM_TOLERANCE = 1e-3


class Orchestra(FedSSL):
    name = "orchestra"
    client_update = "orchestra"
    _clustering_record: dict[str, Any]  # the last global clustering's figures, for the round's metrics.jsonl line

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            # true (the authors' code: stateless clients): the target model is averaged and sent like the online
            # one; false: each client keeps its own target (the code's stateful_client)
            "aggregate_target": True,
            # gradient: the authors' code (SGD on the centroids matching Sinkhorn-Knopp assignments, warm start);
            # kmeans: equal-size Sinkhorn-Knopp K-means over all local centroids (as the clients cluster)
            "global_clustering": "gradient",
            # true (the authors' code): round 1 only clusters, to seed the global centroids from data; training
            # starts in round 2. false: round 1 trains against the seeded random centroids
            "seed_round": True,
            "kmeans_iters": 5,  # K-means iterations, local and global (the authors' code: 5, local)
            "sinkhorn_iters": 10,  # Sinkhorn-Knopp iterations per K-means assignment (the authors' code: 10)
            "sinkhorn_inverse_epsilon": 25.0,  # 1 / epsilon: the scores' scale before exp (the authors' code: 25)
            "gradient_steps": 500,  # global_clustering gradient: SGD steps (the authors' code: 500)
            "gradient_lr": 0.01,  # global_clustering gradient: SGD learning rate (the authors' code: 0.01)
            "gradient_sinkhorn_iters": 100,  # global_clustering gradient: Sinkhorn-Knopp iterations (code: 100)
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "global_clustering", GLOBAL_CLUSTERINGS)
        check_bool(options, "seed_round")
        for key in ("kmeans_iters", "sinkhorn_iters", "gradient_steps", "gradient_sinkhorn_iters"):
            if isinstance(options[key], bool) or not isinstance(options[key], int) or options[key] < 1:
                raise ValueError(f"strategy.options.{key}: must be an integer >= 1 (got {options[key]!r})")
        check_positive(options, "sinkhorn_inverse_epsilon")
        check_positive(options, "gradient_lr")

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.method.name != "orchestra":
            raise ValueError(
                f"method.name: strategy 'orchestra' trains the Orchestra model (global centroids, rotation head, "
                f"memory), so it needs method.name: orchestra (got {cfg.method.name!r})"
            )
        if cfg.strategy.options.get("seed_round", True) and int(cfg.rounds) < 2:
            raise ValueError(
                f"rounds: {cfg.rounds} round(s) with strategy.options.seed_round true would train nothing (round 1 "
                "only clusters, to seed the global centroids); set rounds >= 2, or seed_round: false"
            )
        method = {**method_default_options("orchestra"), **cfg.method.options}
        per_round = int(cfg.federation.clients_per_round or cfg.federation.num_clients)
        if cfg.strategy.options.get("global_clustering", "gradient") == "kmeans":
            uploaded = per_round * int(method["num_local_clusters"])
            if uploaded < int(method["num_global_clusters"]):
                raise ValueError(
                    f"method.options.num_global_clusters: {method['num_global_clusters']} global clusters need at "
                    f"least as many local centroids per round, but {per_round} clients x num_local_clusters "
                    f"{method['num_local_clusters']} upload {uploaded}"
                )

    def prepare(self, cfg, data, split) -> None:
        super().prepare(cfg, data, split)
        self.method_options = {**method_default_options("orchestra"), **cfg.method.options}
        self.num_global = int(self.method_options["num_global_clusters"])
        self.num_local = int(self.method_options["num_local_clusters"])
        self.dim = int(self.method_options["proj_out_dim"])
        # Before the first global clustering: seeded random unit centroids (the model's centroid layer at init).
        self.global_centroids = random_unit_centroids(self.num_global, self.dim, cfg.seed).numpy().astype(np.float32)
        self._sent_centroids_sum: dict[int, float] = {}  # round -> checksum of the centroids sent with it
        self._seed_round_model: ArrayRecord | None = None  # round 1's model with seed_round: kept, not averaged
        self.local_centroids_spec = array_spec(
            to_array_record({LOCAL_CENTROIDS: np.zeros((self.num_local, self.dim), dtype=np.float32)})
        )

    # ------------------------------------------------------------------ what travels
    def arrays_for_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The global model plus the round's global centroids."""
        self._sent_centroids_sum[server_round] = float(self.global_centroids.astype(np.float64).sum())
        if self.seeding(server_round):
            self._seed_round_model = arrays
        return to_array_record({**from_array_record(arrays), GLOBAL_CENTROIDS: self.global_centroids})

    def expected_reply_arrays(self, server_round: int, partition_id: int):
        """The model's arrays back, plus exactly one (N_L, D) float32 array of local centroids."""
        expected = super().expected_reply_arrays(server_round, partition_id)
        if expected is None:
            return None
        return {"arrays": {**expected["arrays"], **self.local_centroids_spec}}

    def check_reply_payload(self, server_round: int, partition_id: int, reply: Message) -> str | None:
        record = cast(ArrayRecord, reply.content["arrays"])
        centroids = from_array_record(record).get(LOCAL_CENTROIDS)
        if centroids is None:
            return f"no {LOCAL_CENTROIDS!r} array"
        norms = np.linalg.norm(centroids.astype(np.float64), axis=1)
        if not np.all(np.abs(norms - 1.0) <= UNIT_NORM_TOLERANCE):
            return f"{LOCAL_CENTROIDS!r}: rows must be unit vectors (norms {norms.min():.4f}..{norms.max():.4f})"
        return None

    def traffic(self, model_bytes: int) -> str:
        centroid_bytes = 4 * self.dim
        return (
            f"down per client and round: the model, {model_bytes / 2**20:.2f} MiB, + {self.num_global} global "
            f"centroids ({self.num_global * centroid_bytes / 2**10:.1f} KiB); up: the model + {self.num_local} "
            f"local centroids ({self.num_local * centroid_bytes / 2**10:.1f} KiB)"
        )

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> ArrayRecord:
        """FedAvg of the weights (the local centroids are left out), then the global clustering of all local
        centroids (Algorithm 2). In the seeding round nothing trained: the model sent is kept as it was."""
        states = [from_array_record(cast(ArrayRecord, r.content["arrays"])) for r in replies]
        local = [state.pop(LOCAL_CENTROIDS) for state in states]
        self._clustering_record = self.cluster_globally(server_round, np.concatenate(local, axis=0))
        if self.seeding(server_round) and self._seed_round_model is not None:
            self._clustering_record["seed_round"] = True
            kept, self._seed_round_model = self._seed_round_model, None
            return kept
        return to_array_record(weighted_average(states, [c["num_examples"] for c in clients]))

    def seeding(self, server_round: int) -> bool:
        """Whether ``server_round`` only seeds the global centroids (``seed_round``: round 1)."""
        return is_seeding_round(self.options, server_round)

    def cluster_globally(self, server_round: int, local_centroids: np.ndarray) -> dict[str, Any]:
        """The next global centroids from the round's local centroids; returns what metrics.jsonl records."""
        points = torch.as_tensor(local_centroids, dtype=torch.float32)
        previous = torch.as_tensor(self.global_centroids)
        options = self.options
        record: dict[str, Any] = {
            "global_clustering": options["global_clustering"],
            "num_local_centroids": int(points.shape[0]),
            "num_global_clusters": self.num_global,
        }
        if options["global_clustering"] == "kmeans":
            if points.shape[0] < self.num_global:
                log(
                    WARNING,
                    "round %d: %d local centroids cannot form %d global clusters; the global centroids stay",
                    server_round,
                    points.shape[0],
                    self.num_global,
                )
                record["global_clustering_skipped"] = True
                new = previous
            else:
                generator = torch.Generator().manual_seed(int(self.seed) * 100_003 + server_round)
                new, _ = balanced_kmeans(
                    points,
                    self.num_global,
                    iterations=int(options["kmeans_iters"]),
                    sinkhorn_iterations=int(options["sinkhorn_iters"]),
                    inverse_epsilon=float(options["sinkhorn_inverse_epsilon"]),
                    generator=generator,
                )
        else:
            new = gradient_clustering(
                points,
                previous,
                steps=int(options["gradient_steps"]),
                lr=float(options["gradient_lr"]),
                temperature=float(self.method_options["temperature"]),
                sinkhorn_iterations=int(options["gradient_sinkhorn_iters"]),
                inverse_epsilon=float(options["sinkhorn_inverse_epsilon"]),
            )
        # How the local centroids fall into the new global clusters (nearest centroid): a collapse shows as few
        # clusters used and a large spread of sizes.
        sizes = cluster_size_summary((points @ new.T).argmax(dim=1), self.num_global)
        record.update({f"global_clusters_{k}" if k == "used" else f"global_cluster_{k}": v for k, v in sizes.items()})
        self.global_centroids = new.numpy().astype(np.float32)
        return record

    def aggregate_train(self, server_round, replies):
        self._clustering_record = {}
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.round_records.get(server_round)
        if record is not None:
            record.update(self._clustering_record)
            record["global_centroids_sent_sum"] = self._sent_centroids_sum.pop(server_round, None)
            clients = record["clients"]
            weights = [c["num_examples"] for c in clients]
            for key in ("loss_cluster", "loss_degeneracy", "rotation_acc"):
                values = [(c[key], w) for c, w in zip(clients, weights) if key in c]
                if values:
                    record[key] = sum(v * w for v, w in values) / sum(w for _, w in values)
        return arrays, metrics

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self):
        plain, arrays, stores = super().checkpoint_state()
        return plain, {**arrays, GLOBAL_CENTROIDS: np.asarray(self.global_centroids)}, stores

    def restore_state(self, plain, arrays, stores) -> None:
        super().restore_state(plain, arrays, stores)
        if GLOBAL_CENTROIDS in arrays:
            self.global_centroids = np.asarray(arrays[GLOBAL_CENTROIDS], dtype=np.float32)
