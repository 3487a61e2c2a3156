"""Results of a run, written as they happen so nothing is lost if a run stops early.

- ``metrics.jsonl``: one JSON object per round (round, train_loss, bytes_up, bytes_down, wall_s,
  knn_acc when measured, per-client facts);
- ``progress.log``: the one-line-per-round progress log (also printed);
- ``summary.json``: final scores, totals and the resolved config;
- ``curves.png``: train loss and kNN accuracy against the round;
- ``tensorboard/`` (``logging.tensorboard: true``): the same per-round figures as TensorBoard scalars (``round/*``)
  and each client's (``client_<i>/*``), for a user who follows runs in TensorBoard.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


RUN_FILES = ("metrics.jsonl", "progress.log", "summary.json", "model.pt")


# ---------------------------------------------------------------------------------------------- clients' devices
def device_counts(clients: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Client records (metrics.jsonl's per-client entries) per ``device`` they trained on, by device name."""
    counts: dict[str, int] = {}
    for client in clients:
        if client.get("device"):
            counts[str(client["device"])] = counts.get(str(client["device"]), 0) + 1
    return dict(sorted(counts.items()))


def trained_on_cpu_beside_gpu(client: dict[str, Any]) -> bool:
    """The client trained on the CPU of a machine with an NVIDIA GPU (its ``device_reason`` says why)."""
    return client.get("device") == "cpu" and int(client.get("gpus_on_machine") or 0) > 0


def client_device_summary(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``client_devices`` (client rounds per device over the run's rounds) and ``cpu_despite_gpu``
    (true when any client round trained on the CPU of a machine with a GPU)."""
    clients = [client for record in records for client in record.get("clients") or []]
    return {
        "client_devices": device_counts(clients),
        "cpu_despite_gpu": any(trained_on_cpu_beside_gpu(client) for client in clients),
    }


def devices_note(clients: Iterable[dict[str, Any]]) -> str:
    """ " | on cpu" (or " | on cuda:0 (NVIDIA H100 80GB HBM3) x3, cpu x1") for a round's progress line, with a
    warning when a client trained on the CPU of a machine with a GPU; nothing for clients that did not say."""
    clients = list(clients)
    counts = device_counts(clients)
    if not counts:
        return ""
    note = " | on " + ", ".join(device if len(counts) == 1 else f"{device} x{n}" for device, n in counts.items())
    if any(trained_on_cpu_beside_gpu(client) for client in clients):
        note += " (the CPU of a machine with a GPU: device_reason in metrics.jsonl says why)"
    return note


def trained_client_sizes(records: Iterable[dict[str, Any]], split_sizes: list[int]) -> list[int]:
    """The images each client trained on, as its last reply reported them (``num_examples``); the server's split
    figure for a client that never replied. A node with a data file of its own (``data-path`` in its node config)
    holds what that file holds, not what the server's split of its own file gives it."""
    reported: dict[int, int] = {}
    for record in records:
        for client in record.get("clients") or []:
            if client.get("id") is not None and client.get("num_examples") is not None:
                reported[int(client["id"])] = int(client["num_examples"])
    return [reported.get(i, size) for i, size in enumerate(split_sizes)]


def client_size_notes(clients: Iterable[dict[str, Any]], split_sizes: list[int], noted: set[int]) -> list[str]:
    """One line for each client whose reported image count differs from the server's split (once per client:
    ``noted`` keeps who was named), so the progress log does not claim sizes the clients did not train on."""
    lines = []
    for client in clients:
        cid, n = client.get("id"), client.get("num_examples")
        if cid is None or n is None or int(cid) in noted or not 0 <= int(cid) < len(split_sizes):
            continue
        if int(n) != split_sizes[int(cid)]:
            noted.add(int(cid))
            lines.append(
                f"client {int(cid)} trains on {int(n)} images of its own data file, not the "
                f"{split_sizes[int(cid)]} of the server's split (its node's data-path)"
            )
    return lines


def unused_output_dir(path: Path) -> Path:
    """``path`` itself, or ``path-2``, ``path-3``, ... if ``path`` already holds a run (finished or partial): an
    earlier run's results are never overwritten."""
    path = Path(path)

    def holds_a_run(folder: Path) -> bool:
        return any((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in RUN_FILES)

    candidate, n = path, 1
    while holds_a_run(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


class TensorBoardUnavailable(RuntimeError):
    """``logging.tensorboard`` is on but the tensorboard package is not installed."""


# Per-round values written as TensorBoard scalars (``round/<key>``), and each client's (``client_<id>/<key>``).
ROUND_SCALARS = ("train_loss", "knn_acc", "bytes_up", "bytes_down", "wall_s", "num_clients", "num_failed", "eval_s")
CLIENT_SCALARS = (
    "loss",
    "train_s",
    "num_examples",
    "bytes_up",
    "mu",
    "divergence",
    "cka_start",
    "cka_end",
    "kernel_norm",
    "align_loss",
)


class TensorBoardLog:
    """A run's TensorBoard scalars (``<out_dir>/tensorboard``); a resumed run drops the events after its checkpoint."""

    def __init__(self, folder: Path, resume_round: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TensorBoardUnavailable(
                "logging.tensorboard: the tensorboard package is not installed (pip install 'fedssl[tensorboard]'), "
                f"or set logging.tensorboard: false ({exc})"
            ) from None
        self.writer = SummaryWriter(str(folder), purge_step=None if resume_round is None else resume_round + 1)

    def write_round(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        for key in ROUND_SCALARS:
            if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool):
                self.writer.add_scalar(f"round/{key}", float(record[key]), step)
        for client in record.get("clients", []):
            for key in CLIENT_SCALARS:
                value = client.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"client_{client['id']}/{key}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ResultsWriter:
    def __init__(self, out_dir: Path, resume_round: int | None = None, tensorboard: bool = False) -> None:
        """A new run empties its files; a resumed one (``resume_round``: its checkpoint's round) keeps the metrics of
        rounds up to that round (later lines came from the round that was cut off) and appends to the log.
        ``tensorboard``: also write each round as TensorBoard scalars (raises ``TensorBoardUnavailable``, naming
        the key, without the package)."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.progress_path = self.out_dir / "progress.log"
        self.summary_path = self.out_dir / "summary.json"
        self.plot_path = self.out_dir / "curves.png"
        self.model_path = self.out_dir / "model.pt"
        self.records: list[dict[str, Any]] = []
        self.stopped = False  # set once a "stopped: why" line is written
        self.finished = False  # set once summary.json is written
        self.tensorboard = TensorBoardLog(self.out_dir / "tensorboard", resume_round) if tensorboard else None
        if resume_round is None:
            self.metrics_path.write_text("")
            self.progress_path.write_text("")
            return
        kept = []
        if self.metrics_path.is_file():
            for line in self.metrics_path.read_text().splitlines():
                if line.strip() and json.loads(line).get("round", 0) <= resume_round:
                    kept.append(line)
        self.records = [json.loads(line) for line in kept]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)

    def progress(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        print(stamped, file=sys.stderr, flush=True)
        with self.progress_path.open("a") as fh:
            fh.write(stamped + "\n")

    def write_round(self, record: dict[str, Any]) -> None:
        record = _json_safe(record)
        self.records.append(record)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(record, sort_keys=False) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write_round(record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_json_safe(summary), indent=2, sort_keys=False) + "\n")
        tmp.replace(self.summary_path)

    def totals(self) -> dict[str, Any]:
        return {
            "rounds_completed": len(self.records),
            "bytes_up_total": int(sum(r.get("bytes_up") or 0 for r in self.records)),
            "bytes_down_total": int(sum(r.get("bytes_down") or 0 for r in self.records)),
            "wall_s_total": float(sum(r.get("wall_s") or 0.0 for r in self.records)),
        }

    def plot(self, title: str) -> Path | None:
        """Draw the train loss and the kNN accuracy against the round (matplotlib); a plotting failure is
        reported, never fatal to the run."""

        def series(key: str) -> tuple[list[float], list[float]]:
            pts = [(r["round"], r[key]) for r in self.records if r.get(key) is not None]
            return [float(x) for x, _ in pts], [float(y) for _, y in pts]

        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            from matplotlib.ticker import MaxNLocator

            fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
            for ax, (key, label, scale) in zip(
                axes, (("train_loss", "train loss", 1.0), ("knn_acc", "kNN accuracy (%)", 100.0))
            ):
                xs, ys = series(key)
                if xs:
                    ax.plot(xs, [scale * y for y in ys], marker="o", markersize=3)
                else:
                    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
                ax.set_xlabel("round")
                ax.set_ylabel(label)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
            fig.suptitle(title, fontsize=10)
            fig.tight_layout()
            fig.savefig(self.plot_path, dpi=110)
            plt.close(fig)
            return self.plot_path
        except Exception as exc:  # noqa: BLE001 - the numbers are already on disk
            self.progress(f"could not draw {self.plot_path.name}: {exc}")
            return None
