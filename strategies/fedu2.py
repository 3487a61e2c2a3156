"""FedU2 (Liao et al., "Rethinking the Representation in Federated Unsupervised Learning with Non-IID Data",
CVPR 2024, arXiv 2403.16398): FUR on the clients, EUA on the server.

Clients (``client_app/rules/fedu2.py``) train their SSL method with the flexible uniform regulariser added to the
loss and upload the exchanged parts as in FedSSL; nothing else travels. The server replaces example-weighted
averaging by the efficient unified aggregator (``ssl_models.federated.fedu2.eua_aggregate``): each client's
objective ||theta_g - theta_k||^2 at the round's start model, the min-norm (MGDA) weights of their gradients from
the K x K dual problem, one step of the global parameters along that common direction. EUA needs the model the
clients started from: the global arrays of the round, kept from ``configure_train`` until the round's
aggregation; nothing else is kept across rounds (a resumed run restarts from the checkpoint's global model, which
is exactly that start model), so the checkpoint holds no extra state.

Per round, metrics.jsonl gets each client's ``eua_weight`` (lambda_k), ``eua_init_weight`` (its sharpened example
share), ``eua_update_norm`` (||theta_g - theta_k||) and, from the client, ``fur_mean``; the round gets
``eua_weights`` (partition id -> lambda), ``eua_gram`` (the K x K Gram matrix of the gradients, in the order of
``clients``: lambda can be checked against it), ``eua_direction_norm``, ``eua_step_norm`` (server_lr x direction
norm) and ``fur_mean`` (example-weighted over the clients).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, Message

from fedssl_wire import from_array_record, to_array_record
from ssl_models.federated.fedu2 import FUR_FORMS, eua_aggregate

from .aggregation import weighted_mean
from .fedssl import FedSSL
from .options import check_bool, check_choice, check_positive

AGGREGATORS = ("eua", "fedavg")


class FedU2(FedSSL):
    name = "fedu2"
    client_update = "fedu2"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            # the client's FUR: its weight in the local loss (>= 0; 0 turns FUR off: EUA alone). The code's: 0.01
            "fur_weight": 0.01,
            # uot: unbalanced OT to uniform samples on the sphere (the paper); sliced_tangent: the released
            #   code's sliced Wasserstein distance in random tangent spaces of the sphere.
            "fur_form": "uot",
            "fur_epsilon": 0.05,  # uot: entropic regularisation of the plan (> 0)
            "fur_rho": 0.1,  # uot: weight of the KL penalties on the marginals (> 0; larger: closer to balanced)
            "fur_iterations": 50,  # uot: scaling iterations per term (>= 1)
            "fur_tangent_points": 6,  # sliced_tangent: random tangent points per term (>= 1)
            "fur_projections": 6,  # sliced_tangent: random projection directions (>= 1)
            "fur_normalize": True,  # L2-normalise the representations onto the sphere before FUR
            # eua: the efficient unified aggregator; fedavg: FedSSL's example-weighted average (the "FUR only"
            #   ablation; EUA alone is fur_weight 0)
            "aggregator": "eua",
            # EUA: the step of the global parameters along the common direction (> 0); the code's main.py: 8
            "server_lr": 8.0,
            # divide each client's gradient 2 (theta_g - theta_k) by its norm (the authors' code) before the
            # min-norm problem; false: the raw gradients (server_lr 0.5 with FedAvg's weights would be FedAvg)
            "normalize_updates": True,
            # T of the example shares p_k^(1/T) / sum p^(1/T): the solver's start and the BN statistics' weights
            "sharpen_temperature": 1.0,
            # true: with fewer than 3 clients lambda is the start point (what the authors' solver returns)
            "two_client_shortcut": False,
            "solver_iterations": 2000,  # projected-gradient iterations of the min-norm problem (>= 1)
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "fur_form", FUR_FORMS)
        check_choice(options, "aggregator", AGGREGATORS)
        if not options["fur_weight"] >= 0:
            raise ValueError(f"strategy.options.fur_weight: must be >= 0 (got {options['fur_weight']!r})")
        for key in ("fur_epsilon", "fur_rho", "server_lr", "sharpen_temperature"):
            check_positive(options, key)
        for key in ("fur_iterations", "fur_tangent_points", "fur_projections", "solver_iterations"):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"strategy.options.{key}: must be an integer >= 1 (got {value!r})")
        for key in ("fur_normalize", "normalize_updates", "two_client_shortcut"):
            check_bool(options, key)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._round_start_state: dict[int, dict[str, np.ndarray]] = {}  # the model each round's clients started from
        self._eua_round: dict[str, Any] = {}  # this round's EUA figures, for its metrics.jsonl line

    def arrays_for_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        self._round_start_state = {server_round: from_array_record(arrays)}  # only the running round's
        return super().arrays_for_round(server_round, arrays)

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> ArrayRecord:
        start = self._round_start_state.pop(server_round)
        if self.options["aggregator"] == "fedavg":
            return cast(ArrayRecord, super().aggregate(server_round, replies, clients))
        states = [from_array_record(cast(ArrayRecord, r.content["arrays"])) for r in replies]
        o = self.options
        result = eua_aggregate(
            start,
            states,
            [c["num_examples"] for c in clients],
            server_lr=float(o["server_lr"]),
            normalize=bool(o["normalize_updates"]),
            sharpen_temperature=float(o["sharpen_temperature"]),
            two_client_shortcut=bool(o["two_client_shortcut"]),
            iterations=int(o["solver_iterations"]),
        )
        for client, weight, init, norm in zip(clients, result.weights, result.init_weights, result.update_norms):
            client["eua_weight"] = float(weight)
            client["eua_init_weight"] = float(init)
            client["eua_update_norm"] = float(norm)
        self._eua_round = {
            "eua_weights": {str(c["id"]): float(w) for c, w in zip(clients, result.weights)},
            "eua_direction_norm": result.direction_norm,
            "eua_step_norm": float(o["server_lr"]) * result.direction_norm,
            "eua_gram": result.gram.tolist(),  # in the clients' order of "clients"
        }
        return to_array_record(result.state)

    def aggregate_train(self, server_round, replies):
        self._eua_round = {}
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.round_records.get(server_round)
        if record is not None:
            record.update(self._eua_round)
            fur = [(c["fur_mean"], c["num_examples"]) for c in record["clients"] if "fur_mean" in c]
            record["fur_mean"] = weighted_mean([f for f, _ in fur], [n for _, n in fur]) if fur else None
        return arrays, metrics
