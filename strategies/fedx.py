"""FedX (Han et al., "FedX: Unsupervised Federated Learning with Cross Knowledge Distillation", ECCV 2022).

Server side FedX is FedAvg: the clients' backbone, projector and prediction head are averaged, weighted by
examples. The method is on the client: its local objective (method ``fedx``, ``ssl_models/methods/fedx.py``; the
relational losses in ``ssl_models/federated/fedx.py``) adds to SimCLR's contrastive loss a local relational loss
and the cross (global) contrastive and relational losses against the frozen global model it received at the
start of the round (client rule ``fedx``, ``client_app/rules/fedx.py``).

Each metrics.jsonl line carries the example-weighted mean of every loss term over the round's clients
(``fedx_loss_<term>``), and each client line its own means (``loss_<term>``).
"""

from __future__ import annotations

from ssl_models.methods.fedx import TERMS

from .aggregation import weighted_mean
from .fedssl import FedSSL


class FedX(FedSSL):
    name = "fedx"
    client_update = "fedx"
    target_options = False  # FedX's model has no target branch

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.method.name != "fedx":
            raise ValueError(
                f"method.name: strategy 'fedx' trains FedX's local objective (SimCLR's contrastive loss plus the "
                f"relational and cross-distillation terms): set method.name: fedx (got {cfg.method.name!r}); FedX "
                "added to BYOL, MoCo, ProtoCL or FedU (the paper's other rows) is not implemented"
            )

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.round_records.get(server_round)
        if record is not None:
            clients = record["clients"]
            for term in TERMS:
                values = [(c[f"loss_{term}"], c["num_examples"]) for c in clients if f"loss_{term}" in c]
                record[f"fedx_loss_{term}"] = (
                    weighted_mean([v for v, _ in values], [w for _, w in values]) if values else None
                )
            cfg = getattr(self, "cfg", None)  # set by prepare(); absent when a test drives the strategy directly
            if cfg is not None:
                record["relational_form"] = cfg.method.options.get("relational_form", "js")
        return arrays, metrics
