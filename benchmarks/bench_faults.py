"""Faults injected into whole runs and what survived: writes benchmarks/results/faults.{md,json}.

Each scenario runs ``server_app.main`` in this process on a tiny synthetic federation (2 clients, 3 rounds), its grid
handing every message to the real ClientApp and injecting one fault into client 1's round-2 reply: no reply (a
timeout), a ClientApp that raises, NaN weights, a wrong shape, a missing array, an oversized reply, another client's
partition id. For every scenario it checks that the run finished all rounds, that the faulty client is named in the
round's ``failed_clients`` with a reason, and that the global model after round 2 is exactly client 0's upload (the
only valid one): a corrupted model would differ. The kill-and-resume fault (a ServerApp killed mid-round and resumed)
is a real `flwr run` and lives in tests/test_e2e_resume.py.

Usage: python benchmarks/bench_faults.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import server_app.app as server_module
import server_app.results as results_module
import strategies.fedssl as fedssl_module
from client_app.app import app as client_app
from fedssl_wire import from_array_record, to_array_record

RESULTS = REPO / "benchmarks" / "results"
CONFIG = {
    "name": "faults",
    "seed": 0,
    "rounds": 3,
    "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "simclr", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8}},
    "strategy": {"name": "fedssl"},
    "federation": {"num_clients": 2, "node_wait_s": 0.0, "max_reply_mb": 1.0},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False, "device": "cpu"},
    "eval": {
        "knn_every": 1,
        "knn_k": 5,
        "linear_probe": False,
        "max_train": 40,
        "max_test": 20,
        "device": "cpu",
        "random_init_reference": False,
    },
}
FAULTS = (
    "no reply",
    "ClientApp raises",
    "NaN weights",
    "wrong shape",
    "missing array",
    "oversized reply",
    "another client's id",
)


class FaultGrid:
    """Every message to the real ClientApp of its node; client 1's round-2 training reply gets ``fault``."""

    def __init__(self, fault: str):
        self.fault = fault
        self.contexts = {
            100 + pid: Context(
                run_id=1,
                node_id=100 + pid,
                state=RecordDict(),
                run_config={},
                node_config={"partition-id": pid, "num-partitions": 2},
            )
            for pid in (0, 1)
        }
        self.good_upload_round2 = None

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for m in messages:
            target = m.metadata.message_type == "train" and int(m.content["config"]["server-round"]) == 2
            if target and m.metadata.dst_node_id == 101 and self.fault == "no reply":
                continue
            try:
                if target and m.metadata.dst_node_id == 101 and self.fault == "ClientApp raises":
                    raise RuntimeError("injected: the ClientApp crashed")
                reply = client_app(m, self.contexts[m.metadata.dst_node_id])
            except Exception as exc:  # noqa: BLE001 - Flower's runtime turns a raising ClientApp into an error reply
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=m)
            if target and not reply.has_error():
                if m.metadata.dst_node_id == 100:
                    self.good_upload_round2 = from_array_record(reply.content["arrays"])
                else:
                    reply = self.corrupt(reply)
            replies.append(reply)
        return replies

    def corrupt(self, reply):
        arrays = from_array_record(reply.content["arrays"])
        key = next(k for k in arrays if arrays[k].dtype == np.float32 and arrays[k].ndim == 4)
        if self.fault == "NaN weights":
            arrays[key] = np.full_like(arrays[key], np.nan)
        elif self.fault == "wrong shape":
            arrays[key] = arrays[key][:1]
        elif self.fault == "missing array":
            del arrays[key]
        elif self.fault == "oversized reply":
            arrays["padding"] = np.zeros(2**19, np.float32)  # 2 MiB against federation.max_reply_mb = 1
        elif self.fault == "another client's id":
            reply.content["metrics"]["partition-id"] = 0
        reply.content["arrays"] = to_array_record(arrays)
        return reply


def scenario(fault: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(CONFIG))
        grid = FaultGrid(fault)
        round2_global = {}
        real_aggregate = fedssl_module.FedSSL.aggregate_train

        def aggregate_train(self, server_round, replies):
            arrays, metrics = real_aggregate(self, server_round, replies)
            if server_round == 2 and arrays is not None:
                round2_global.update(from_array_record(arrays))
            return arrays, metrics

        fedssl_module.FedSSL.aggregate_train = aggregate_train
        try:
            server_module.main(
                grid,
                Context(
                    run_id=1,
                    node_id=0,
                    node_config={},
                    state=RecordDict(),
                    run_config={"config": str(tmp / "cfg.yaml"), "output-dir": str(tmp / "out")},
                ),
            )
        finally:
            fedssl_module.FedSSL.aggregate_train = real_aggregate
        rounds = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
        failed = rounds[1]["failed_clients"] if len(rounds) > 1 else []
        good = grid.good_upload_round2 or {}
        clean = (
            bool(good)
            and set(good) == set(round2_global)
            and all(np.array_equal(good[k], round2_global[k]) for k in good)
        )
        return {
            "fault": fault,
            "injected": 1,
            "rounds_completed": len(rounds),
            "rounds_lost": 3 - len(rounds),
            "named": [f"client {f['id']}: {f['reason']}" for f in failed],
            "models_corrupted": 0 if clean else 1,
            "summary_written": (tmp / "out" / "summary.json").is_file(),
        }


def main() -> int:
    import os

    os.environ["RAY_RAYLET_PID"] = "0"  # in-process runs stand for a simulation (client state in the run's folder)
    os.environ["FEDSSL_ALLOWED_ROOTS"] = tempfile.gettempdir()  # a fake grid: paths are confined as if deployed
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    results_module.ResultsWriter.plot = lambda self, title: None
    started = time.strftime("%Y-%m-%d %H:%M")
    rows = [scenario(f) for f in FAULTS]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "faults.json").write_text(
        json.dumps({"command": "python benchmarks/bench_faults.py", "rows": rows}, indent=2)
    )
    lines = [
        f"# Faults injected and survived ({started})",
        "",
        (
            "Command: `python benchmarks/bench_faults.py` (in-process runs of the real ServerApp and ClientApp: 2 "
            "clients, 3 rounds, synthetic data; one fault in client 1's round-2 reply per row). `models corrupted`: "
            "1 if the global model after round 2 differs from client 0's upload, the only valid one. The "
            "kill-and-resume fault is `tests/test_e2e_resume.py` (a real `flwr run` killed in round 3 of 3, resumed "
            "to the same final metrics as the run left alone: 0 rounds lost, 0 repeated)."
        ),
        "",
        "| fault | injected | rounds completed | rounds lost | named in failed_clients | models corrupted |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['fault']} | {r['injected']} | {r['rounds_completed']} / 3 | {r['rounds_lost']} | "
            f"{'; '.join(r['named']) or '-'} | {r['models_corrupted']} |"
        )
    (RESULTS / "faults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["models_corrupted"] == 0 and r["rounds_lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
