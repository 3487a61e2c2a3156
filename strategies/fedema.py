"""FedEMA (Zhuang et al., "Divergence-aware Federated Self-Supervised Learning", ICLR 2022), Algorithm 1.

Server side it is FedBYOL: the online encoder and predictor are averaged weighted by examples, the target
encoder stays on each client. The difference is on the client at download: instead of replacing its model
by the global one, a client that trained in the previous round takes an EMA,
W_k <- mu W_k + (1 - mu) W_g with mu = min(lambda ||W_g - W_k||, 1); a client seen for the first time or not
selected in the previous round takes the global model for its online encoder, predictor and target
(see client_app/rules/fedssl_family.py, ``fedema_download``, and ssl_models/federated/model_merge.py for the math).

The autoscaler's lambda_k = tau / d (Algorithm 1, lines 9-10) is computed here, by the server, once per
client, right after the client's first training round: with ``divergence: paper`` d = ||W_g^{r+1} - W_k^r||,
the new aggregate against that client's upload (online encoder + projector parameters, BatchNorm statistics
excluded); with ``divergence: easyfl`` d is the size of that client's first local update, the quantity the
official code divides by (reported by the client, which alone saw its start and end states). The server keeps
lambda per partition id (``autoscaler_lambdas``, a plain dict of floats) and sends it with every later round
(``rule-input.server_lambda``). ``lambda_from: client_first_ema`` keeps the earlier behaviour, lambda = tau / d
computed by the client at its first EMA (under partial participation that can be many rounds later, against
a different global model). Each client's last model persists between rounds in its client state (on disk by
default, so memory stays flat with many clients).
"""

from __future__ import annotations

from typing import Any, cast

from flwr.app import ArrayRecord, Message

from fedssl_wire import from_array_record
from ssl_models.federated.model_merge import BN_STATS_MODES, autoscaler_lambda, l2_divergence
from ssl_models.methods.base import ONLINE_PREFIXES

from .fedssl import FedSSL
from .options import check_choice, check_positive, check_unit

MU_MODES = ("autoscaler", "lambda", "constant")
EMA_SCOPES = ("both", "encoder", "predictor")
DIVERGENCES = ("paper", "easyfl")
LAMBDA_FROM = ("server_first_round", "client_first_ema")


class FedEMA(FedSSL):
    name = "fedema"
    client_update = "fedema"
    target_options = False  # Algorithm 1 decides: global at a (re)start, the client's own otherwise

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            # autoscaler: lambda = tau / d once per client (its first mu is tau under full participation);
            # lambda: fixed lambda; constant: fixed mu_encoder / mu_predictor.
            "mu_mode": "autoscaler",
            "tau": 0.7,  # autoscaler: a client's lambda = tau / d, d its divergence at its first update (> 0)
            "lambda": 1.0,  # mu_mode lambda: the fixed lambda of mu = min(lambda d, 1) (> 0)
            "mu_encoder": 0.5,  # mu_mode constant: mu of the online encoder and projector, in [0, 1]
            "mu_predictor": 0.5,  # mu_mode constant: mu of the predictor, in [0, 1]
            # which parts take the EMA W_k <- mu W_k + (1 - mu) W_g: both, encoder (online encoder and projector)
            # or predictor; the other parts take the global weights
            "ema_scope": "both",
            # paper: ||W_g - W_k|| over the online encoder's parameters; easyfl: the official code's mean
            # per-layer distance of conv weights between the start and end of the previous local training.
            "divergence": "paper",
            # server_first_round: the server sets lambda from the client's first upload (Algorithm 1);
            # client_first_ema: the client sets it at its first EMA (the earlier behaviour).
            "lambda_from": "server_first_round",
            # global: BatchNorm running statistics take the global model's values and the EMA moves parameters
            # only (the paper's EMA is over the weights W; EasyFL's over parameters()); ema: them too.
            "ema_bn_stats": "global",
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "mu_mode", MU_MODES)
        check_choice(options, "ema_scope", EMA_SCOPES)
        check_choice(options, "divergence", DIVERGENCES)
        check_choice(options, "lambda_from", LAMBDA_FROM)
        check_choice(options, "ema_bn_stats", BN_STATS_MODES)
        check_positive(options, "tau")
        check_positive(options, "lambda")
        check_unit(options, "mu_encoder")
        check_unit(options, "mu_predictor")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # partition id -> the autoscaler's lambda, set once from the client's first upload. Plain floats, so
        # the dict can be written to a server checkpoint as it is.
        self.autoscaler_lambdas: dict[int, float] = {}

    @property
    def server_sets_lambda(self) -> bool:
        return self.options["mu_mode"] == "autoscaler" and self.options["lambda_from"] == "server_first_round"

    def config_for_client(self, server_round: int, partition_id: int) -> dict[str, Any]:
        lam = self.autoscaler_lambdas.get(partition_id)
        return {"rule-input.server_lambda": lam} if self.server_sets_lambda and lam is not None else {}

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]):
        arrays = cast(ArrayRecord, super().aggregate(server_round, replies, clients))  # FedSSL's average: not None
        if self.server_sets_lambda:
            new_global = None
            for reply, client in zip(replies, clients):
                pid = client["id"]
                if pid in self.autoscaler_lambdas:
                    continue  # once per client
                if self.options["divergence"] == "paper":
                    if new_global is None:
                        new_global = from_array_record(arrays)
                    d = l2_divergence(
                        new_global, from_array_record(cast(ArrayRecord, reply.content["arrays"])), ONLINE_PREFIXES
                    )
                else:
                    d = float(client["update_size"])  # the size of this first local update (EasyFL's d)
                self.autoscaler_lambdas[pid] = autoscaler_lambda(float(self.options["tau"]), d)
                client["lambda_set"] = self.autoscaler_lambdas[pid]
                client["lambda_set_divergence"] = d
        return arrays

    def checkpoint_state(self):
        plain, arrays, stores = super().checkpoint_state()
        return {**plain, "autoscaler_lambdas": {str(k): v for k, v in self.autoscaler_lambdas.items()}}, arrays, stores

    def restore_state(self, plain, arrays, stores) -> None:
        super().restore_state(plain, arrays, stores)
        self.autoscaler_lambdas = {int(k): float(v) for k, v in plain.get("autoscaler_lambdas", {}).items()}

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.round_records.get(server_round)
        if record is not None:  # which variants this round used, next to their values
            record["divergence_form"] = self.options["divergence"]
            record["lambda_from"] = self.options["lambda_from"] if self.options["mu_mode"] == "autoscaler" else None
        return arrays, metrics

    def client_record(self, reply) -> dict[str, Any]:
        """Every client line carries mu and divergence (null at a first participation or after a skip)."""
        record = super().client_record(reply)
        for key in ("mu", "mu_predictor", "divergence", "lambda"):
            record.setdefault(key, None)
        record["ema"] = bool(record.get("ema", 0))
        if "lambda_from_server" in record:
            record["lambda_from_server"] = bool(record["lambda_from_server"])
        return record
