"""FedU (Zhuang et al., ICCV 2021), the divergence-aware predictor update FedEMA compares against.

Server side it is FedBYOL. On the client, at download: the online encoder takes the global one; the
predictor takes the global one only when the divergence ||W_g - W_k|| is below ``threshold`` (0.4), else the
client keeps its own; the target encoder stays local (client_app/tasks.py, ``fedu_download``).
"""

from __future__ import annotations

from typing import Any

from .fedema import DIVERGENCES
from .options import check_choice, check_positive
from .fedssl import FedSSL


class FedU(FedSSL):
    name = "fedu"
    client_update = "fedu"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {**super().default_options(), "threshold": 0.4, "divergence": "paper"}

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
