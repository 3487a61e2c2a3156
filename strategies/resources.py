"""The clients' resource book of a run: per client and per run, rounds, bytes up, FLOPs and the maxima of the
per-step figures that the clients report as ``res.*`` metrics (summary.json's "resources").

Kept incrementally, round by round, so that a resumed run restores it from its checkpoint and goes on adding.
Plain dictionaries and numbers: no Flower type in here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

# Per-step client figures whose maxima per client and per run go to summary.json.
RESOURCE_MAXIMA = ("flops_total", "flops_fvcore_equivalent", "mem_total", "mem_activations", "rss_peak_bytes")

RESOURCE_UNITS = (
    "bytes; flops_* of one local step per sample (image, both views; fvcore_equivalent = forward / 2); flops_run = "
    "per-sample FLOPs x images trained + flops_extra (a round's passes besides its SSL steps: Hetero-SSFL's "
    "alignment term and kernel forward; also summed alone as flops_extra_run), summed over rounds; mem_* analytic "
    "bytes of one fp32 step at the training batch; rss_peak_bytes the client process's peak during local training"
)


class ClientResourceBook:
    """Per-client and per-run totals and maxima of the clients' resource figures."""

    def __init__(self, totals: dict[str, Any] | None = None) -> None:
        """``totals``: a book's ``totals`` from a checkpoint (copied), or None for an empty book."""
        self.totals: dict[str, Any] = (
            copy.deepcopy(totals) if totals is not None else {"per_client": {}, "run": {"flops_run": 0.0}}
        )

    def add_round(self, clients: Iterable[dict[str, Any]]) -> None:
        """Add one round's client records (the strategy's ``client_record``: ``id``, ``bytes_up`` and, from the
        client's ``res.*`` metrics, ``flops_total`` per sample, ``images_trained``, ``flops_extra`` and the
        per-step figures): per client the rounds, bytes up, FLOPs of the round (per-sample FLOPs of a step x images
        trained, plus the round's ``flops_extra``, summed) and the maxima of the per-step figures."""
        run = self.totals["run"]
        for c in clients:
            mine = self.totals["per_client"].setdefault(
                str(c["id"]), {"rounds": 0, "bytes_up": 0, "images_trained": 0.0, "flops_run": 0.0}
            )
            mine["rounds"] += 1
            mine["bytes_up"] += int(c.get("bytes_up", 0))
            if c.get("flops_total") is None:
                continue
            images = float(c.get("images_trained", 0.0))
            mine["images_trained"] += images
            # flops_extra: what the round ran besides its SSL steps (Hetero-SSFL: the alignment term's RAD passes
            # and the kernel's forward), already a whole round's figure
            round_flops = float(c["flops_total"]) * images + float(c.get("flops_extra", 0.0))
            mine["flops_run"] += round_flops
            run["flops_run"] += round_flops
            if c.get("flops_extra") is not None:
                for where in (mine, run):
                    where["flops_extra_run"] = where.get("flops_extra_run", 0.0) + float(c["flops_extra"])
            for key in RESOURCE_MAXIMA:
                if c.get(key) is not None:
                    value = float(c[key])
                    for where in (mine, run):
                        where[f"{key}_max"] = max(where.get(f"{key}_max", value), value)

    def summary(self, bytes_up: int, bytes_down: int) -> dict[str, Any]:
        """summary.json's "resources": a copy of the book with the run's bytes both ways and the units."""
        out = copy.deepcopy(self.totals)
        out["run"]["bytes_up"], out["run"]["bytes_down"] = int(bytes_up), int(bytes_down)
        out["units"] = RESOURCE_UNITS
        return out
