"""FedU (Zhuang et al., ICCV 2021), the divergence-aware predictor update FedEMA compares against.

Server side it is FedBYOL. On the client, at download: the online encoder takes the global one; the
predictor takes the global one only when the divergence is below ``threshold`` (0.4), else the client keeps
its own; the target encoder stays local (client_app/rules/fedssl_family.py, ``fedu_download``).

The divergence defaults to ``easyfl``, the one the 0.4 threshold was tuned on: the mean per-layer L2 distance
of the backbone's conv weights between the start and the end of the client's previous local training (the
size of its last local update). ``divergence: paper`` is the paper-form ||W_g - W_k|| over the online
encoder's parameters, 3-4x larger on the same models, so 0.4 on it is a different rule; a run records which
it used (``divergence_form`` in every metrics.jsonl line, and the resolved config in summary.json).
"""

from __future__ import annotations

from typing import Any

from .fedema import DIVERGENCES
from .fedssl import FedSSL
from .options import check_choice, check_positive


class FedU(FedSSL):
    name = "fedu"
    client_update = "fedu"
    target_options = False  # the target always stays the client's own

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        # threshold: the client's predictor takes the global one only when the divergence is below this (> 0).
        # divergence: easyfl, the mean per-layer L2 distance of the backbone's conv weights between the start and
        #   end of the client's previous local training (the 0.4 was tuned on it); paper, ||W_g - W_k|| over the
        #   online encoder's parameters (3-4x larger on the same models).
        return {**super().default_options(), "threshold": 0.4, "divergence": "easyfl"}

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        if server_round in self.round_records:
            self.round_records[server_round]["divergence_form"] = self.options["divergence"]
        return arrays, metrics

    def client_record(self, reply) -> dict[str, Any]:
        record = super().client_record(reply)
        record.setdefault("divergence", None)
        record["predictor_updated"] = bool(record.get("predictor_updated", 1))
        return record

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "divergence", DIVERGENCES)
        check_positive(options, "threshold")
