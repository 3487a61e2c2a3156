"""FedEMA (Zhuang et al., "Divergence-aware Federated Self-Supervised Learning", ICLR 2022).

Server side it is FedBYOL: the online encoder and predictor are averaged weighted by examples, the target
encoder stays on each client. The difference is on the client at download: instead of replacing its model
by the global one, a client that trained in the previous round takes an EMA,
W_k <- mu W_k + (1 - mu) W_g with mu = min(lambda ||W_g - W_k||, 1) (see client_app/tasks.py,
``fedema_download``, and ssl_models/federated/model_merge.py for the math). Each client's last model and lambda
persist between rounds in its client state (on disk by default, so memory stays flat with many clients).
"""

from __future__ import annotations

from typing import Any

from .fedssl import FedSSL
from .options import check_choice, check_positive, check_unit

MU_MODES = ("autoscaler", "lambda", "constant")
EMA_SCOPES = ("both", "encoder", "predictor")
DIVERGENCES = ("paper", "easyfl")


class FedEMA(FedSSL):
    name = "fedema"
    client_update = "fedema"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            # autoscaler: lambda = tau / d at a client's first EMA (its first mu is tau); lambda: fixed
            # lambda; constant: fixed mu_encoder / mu_predictor.
            "mu_mode": "autoscaler",
            "tau": 0.7,
            "lambda": 1.0,
            "mu_encoder": 0.5,
            "mu_predictor": 0.5,
            "ema_scope": "both",
            # paper: ||W_g - W_k|| over the online encoder's parameters; easyfl: the official code's mean
            # per-layer distance of conv weights between the start and end of the previous local training.
            "divergence": "paper",
        }

    def client_record(self, reply) -> dict[str, Any]:
        """Every client line carries mu and divergence (null at a first participation or after a skip)."""
        record = super().client_record(reply)
        for key in ("mu", "mu_predictor", "divergence", "lambda"):
            record.setdefault(key, None)
        record["ema"] = bool(record.get("ema", 0))
        return record

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "mu_mode", MU_MODES)
        check_choice(options, "ema_scope", EMA_SCOPES)
        check_choice(options, "divergence", DIVERGENCES)
        check_positive(options, "tau")
        check_positive(options, "lambda")
        check_unit(options, "mu_encoder")
        check_unit(options, "mu_predictor")
