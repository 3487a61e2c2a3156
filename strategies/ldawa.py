"""L-DAWA (Rehman et al., "L-DAWA: Layer-wise Divergence Aware Weight Aggregation in Federated Self-Supervised
Visual Representation Learning", ICCV 2023, arXiv 2307.07393).

Client side it is the generalized FedSSL round (any Siamese method: SimCLR, MoCo, BYOL, SimSiam; the ``fedssl``
client rule). Server side the example-weighted average is replaced by the layer-wise divergence-aware one: every
layer of every client is scaled by the cosine between it and the same layer of the global model that client
started the round from, and the scaled layers are averaged with weight 1/K (``ssl_models.federated.ldawa``).

The round's global model is kept from ``configure_train`` (what every client of the round received) until that
round is aggregated, so a resumed run measures against the same model as an uninterrupted one. With
``warmup_rounds`` > 0 the first rounds use FedSSL's example-weighted average (the authors' code does so for its
first three rounds; the paper does not).

Per round, metrics.jsonl records which aggregation ran, the number of layers, the coefficient sums per layer (one
for FedAvg, the mean cosine for the paper's unnormalised form) and, per client, its cosine mean / min / max and
the mean per layer group (``ldawa_cos_by_group``: "backbone.layer1", "projector.0", ...).
"""

from __future__ import annotations

from typing import Any, cast

from flwr.app import ArrayRecord, Message

from fedssl_wire import from_array_record, to_array_record
from ssl_models.federated.ldawa import (
    BN_STATS_MODES,
    CLIENT_WEIGHTS,
    GRANULARITIES,
    LAYER_UNITS,
    client_base_weights,
    cosine_summary,
    ldawa_aggregate,
)

from .fedssl import FedSSL
from .options import check_choice


class LDAWA(FedSSL):
    name = "ldawa"
    # client_update stays "fedssl": the clients train as in the generalized FedSSL framework.

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            # layer: one cosine per layer (L-DAWA); model: one cosine over the whole exchanged model.
            "granularity": "layer",
            # tensor: a layer is one state-dict array (the authors' code); module: a module's arrays together.
            "layer_unit": "tensor",
            # cosine: BatchNorm running statistics are scaled by their own cosine like the weights (the authors'
            #   code); mean: they take the plain client-weighted mean. Integer buffers always take the mean.
            "bn_stats": "cosine",
            # uniform: each client's base weight is 1/K (the paper); examples: n_k / n (FedAvg's).
            "client_weights": "uniform",
            # false: sum_k b_k delta_k^l w_k^l as the paper has it; true: coefficients divided by their sum.
            "normalize": False,
            # rounds at the start aggregated with FedSSL's example-weighted average (the authors' code: 3).
            "warmup_rounds": 0,
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "granularity", GRANULARITIES)
        check_choice(options, "layer_unit", LAYER_UNITS)
        check_choice(options, "bn_stats", BN_STATS_MODES)
        check_choice(options, "client_weights", CLIENT_WEIGHTS)
        # Types are checked against the defaults by the config loader; a direct caller gets the same one line.
        warmup = options["warmup_rounds"]
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"strategy.options.warmup_rounds: must be an integer >= 0 (got {warmup!r})")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._round_global: dict[int, dict] = {}  # round -> the global arrays its clients received
        self._round_info: dict[int, dict[str, Any]] = {}  # round -> what the aggregation did, for metrics.jsonl

    def arrays_for_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        self._round_global = {server_round: from_array_record(arrays)}  # only the round under way is needed
        return super().arrays_for_round(server_round, arrays)

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]):
        if server_round <= int(self.options["warmup_rounds"]):
            self._round_info[server_round] = {"aggregation": "fedavg_warmup"}
            return super().aggregate(server_round, replies, clients)
        global_state = self._round_global.get(server_round)
        if global_state is None:
            raise RuntimeError(f"round {server_round}: L-DAWA has no record of the global model its clients received")
        states = [from_array_record(cast(ArrayRecord, r.content["arrays"])) for r in replies]
        weights = client_base_weights([c["num_examples"] for c in clients], str(self.options["client_weights"]))
        result = ldawa_aggregate(
            states,
            global_state,
            weights,
            layer_unit=str(self.options["layer_unit"]),
            granularity=str(self.options["granularity"]),
            bn_stats=str(self.options["bn_stats"]),
            normalize=bool(self.options["normalize"]),
        )
        for client, base, per_layer in zip(clients, weights, result.cosines):
            client.update({f"ldawa_{k}": v for k, v in cosine_summary(per_layer).items()})
            client["ldawa_base_weight"] = float(base)
        sums = [sum(c) for c in result.coefficients.values()]
        self._round_info[server_round] = {
            "aggregation": "ldawa",
            "ldawa_layers": len(result.groups),
            "ldawa_scaled_arrays": sum(len(keys) for keys in result.groups.values()),
            "ldawa_coef_sum_mean": sum(sums) / len(sums) if sums else None,
            "ldawa_coef_sum_min": min(sums) if sums else None,
            "ldawa_coef_sum_max": max(sums) if sums else None,
            "ldawa_undefined_cosines": result.undefined,
        }
        return to_array_record(result.state)

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        self._round_global.pop(server_round, None)
        record = self.round_records.get(server_round)
        info = self._round_info.pop(server_round, {"aggregation": None})  # None: no reply, nothing aggregated
        if record is not None:
            record.update(info)
        return arrays, metrics
