"""Centralized reference (the papers' "Non-FL" / "Central BYOL" rows): the same method, model and augmentations
trained on the **union of the clients' data** by one trainer, for the same total number of local epochs.

A federated run of R rounds x E local epochs passes every client image R x E times; this strategy passes the
union of the clients' partitions R x E times too, in R rounds of E epochs with the same per-round learning rate,
so a results table can read random init < federated <= centralized at equal compute. It runs in the same app
and writes the same results (``metrics.jsonl`` per round, kNN monitor, ``summary.json``, ``model.pt``).

Who trains: one node of the federation (the lowest connected partition id, 0 unless that node is gone), with
the config key ``data-scope: union`` so its ClientApp loads the union of all partitions instead of its own. Its
target branch (BYOL target, MoCo key encoder and queue) stays in its client state between rounds, as in a
single centralized run; the server "averages" one upload, i.e. takes it. A node that trains on its own data
file (``data-path``) cannot serve the union and refuses the round.
"""

from __future__ import annotations

from typing import Any

from .fedssl import FedSSL

UNION_SCOPE = "union"


class Central(FedSSL):
    name = "central"
    target_options = False  # one trainer: its target branch is simply its own, as in a centralized run

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "clients_per_round": 1, "min_available": 1})

    def trainable(self, available: list[int]) -> list[int]:
        return [min(available)] if available else []

    def client_config(self, server_round: int) -> dict[str, Any]:
        return {**super().client_config(server_round), "data-scope": UNION_SCOPE}

    def traffic(self, model_bytes: int) -> str:
        return (
            f"one trainer (the lowest connected client, on the union of every client's data): the model, "
            f"{model_bytes / 2**20:.2f} MiB, down and up each round"
        )

    def prepare(self, cfg, data, split) -> None:
        super().prepare(cfg, data, split)
        self.union_size = int(sum(len(idx) for idx in split.client_idx))

    def summary_extras(self, scores_by_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {
            **super().summary_extras(scores_by_model),
            "central": {
                "train_images": getattr(self, "union_size", None),
                "what": "one trainer on the union of the clients' partitions, rounds x local_epochs "
                "epochs (the same number of passes over every image as the federated run)",
            },
        }
