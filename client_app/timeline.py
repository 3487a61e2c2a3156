"""When a ClientApp process started, imported the app and handled a message: the client's points of a round's
timeline, sent with every training reply as ``t.*`` metrics (epoch seconds) so the server can say where a
deployed round's time goes (strategies/nodes.py ``client_timeline``).

Imported by client_app/app.py before torch, so ``IMPORT_STARTED_AT`` marks the end of the interpreter's and
Flower's start and the beginning of the app's own imports."""

from __future__ import annotations

import os
import time
from pathlib import Path

IMPORT_STARTED_AT = time.time()


def process_start_time() -> float | None:
    """This process's start as epoch seconds (10 ms resolution), from /proc; None where there is no /proc.
    /proc/self/stat's field 22 counts clock ticks from boot, /proc/uptime the seconds since boot: their
    difference is the process's age, which is subtracted from now (btime, whole seconds, would be too coarse)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22; the list starts at field 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - started_after_boot)


PROCESS_STARTED_AT = process_start_time()


def timeline_metrics(sent_at: float, handler_started_at: float, app_imported_at: float) -> dict[str, float]:
    """The ``t.*`` metrics of one reply: the server's message creation (``sent_at``, its metadata's created_at,
    server clock), this process's start, the app's imports, the handler's start and now (the reply is ready)."""
    out = {
        "t.sent": float(sent_at),
        "t.import_start": IMPORT_STARTED_AT,
        "t.app_imported": float(app_imported_at),
        "t.handler_start": float(handler_started_at),
        "t.reply_ready": time.time(),
    }
    if PROCESS_STARTED_AT is not None:
        out["t.process_start"] = PROCESS_STARTED_AT
    return out
