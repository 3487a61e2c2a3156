"""FedProx (Li et al., 2020) over SSL: FedAvg of the online parts, with a proximal term on every client,
(mu/2) * ||w - w_g||^2 towards the received global weights (``proximal_form: code`` drops the 1/2, as the
FLESD code's FedProx baseline does). A baseline of the FLESD paper."""

from __future__ import annotations

from typing import Any

from .fedssl import FedSSL
from .options import check_choice

PROXIMAL_FORMS = ("paper", "code")


class FedProx(FedSSL):
    name = "fedprox"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        # proximal_mu: weight mu of the proximal term towards the received global weights (>= 0; 0 turns it off).
        # proximal_form: paper, (mu/2) ||w - w_g||^2; code, mu ||w - w_g||^2 (the FLESD code's FedProx baseline).
        return {**super().default_options(), "proximal_mu": 1e-4, "proximal_form": "paper"}

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "proximal_form", PROXIMAL_FORMS)
        if not options["proximal_mu"] >= 0:
            raise ValueError(f"strategy.options.proximal_mu: must be >= 0 (got {options['proximal_mu']!r})")

    def client_config(self, server_round: int) -> dict[str, Any]:
        return {
            **super().client_config(server_round),
            "proximal-mu": float(self.options["proximal_mu"]),
            "proximal-form": str(self.options["proximal_form"]),
        }
