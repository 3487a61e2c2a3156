"""Whole runs of ``server_app.main`` in this process, its grid handing each message to the real ClientApp: the kNN
monitor with ``knn_every > 1`` still scoring after the last round, ``round_timeout_s`` reaching the grid and a
missing reply ending the round, injected faults (a ClientApp that raises, a reply with NaN, with a wrong shape,
with a missing array) that the run survives with its global model untouched by them, resuming a finished run, and
FedMoCoV3 on the whole ViT."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from flwr.app import Context, Error, Message, RecordDict

import server_app.app as server_module
import server_app.results as results_module
from client_app.app import app as client_app
from conftest import REPO
from fedssl_wire import from_array_record, to_array_record
from test_server_app import ClientAppGrid, simulated_clientapps  # noqa: F401 - an autouse fixture

pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run

BASE = {
    "name": "inprocess",
    "seed": 0,
    "rounds": 3,
    "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "simclr", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8}},
    "strategy": {"name": "fedssl"},
    "federation": {"num_clients": 2, "node_wait_s": 0.0, "round_timeout_s": 123.0},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False, "device": "cpu"},
    "eval": {
        "knn_every": 2,
        "knn_k": 5,
        "linear_probe": False,
        "max_train": 40,
        "max_test": 20,
        "device": "cpu",
        "random_init_reference": False,
    },
}


def run(tmp_path, monkeypatch, grid, **changes):
    raw = json.loads(json.dumps(BASE))
    for key, value in changes.items():
        section, name = key.split(".")
        raw[section][name] = value
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    monkeypatch.setattr(results_module.ResultsWriter, "plot", lambda self, title: None)
    server_module.main(
        grid,
        Context(
            run_id=1,
            node_id=0,
            node_config={},
            state=RecordDict(),
            run_config={"config": str(tmp_path / "cfg.yaml"), "output-dir": str(out)},
        ),
    )
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_knn_every_two_scores_rounds_two_and_three(tmp_path, monkeypatch):
    out, rounds = run(tmp_path, monkeypatch, ClientAppGrid(2))
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert [r.get("knn_acc") is not None for r in rounds] == [False, True, True]  # 3 is the last round
    assert json.loads((out / "summary.json").read_text())["knn_acc"] == rounds[-1]["knn_acc"]


def test_resuming_a_finished_run_says_so_and_changes_no_file(tmp_path, monkeypatch):
    """``resume=<output-dir>`` of a run whose last round is checkpointed and summary.json written: the ServerApp says
    there is nothing to do and leaves every file as it was, whatever else the run config says (tests/test_e2e_resume.py
    resumes a run cut in the middle, under `flwr run`)."""
    out, rounds = run(tmp_path, monkeypatch, ClientAppGrid(2))
    assert [r["round"] for r in rounds] == [1, 2, 3] and (out / "summary.json").is_file()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    said: list[str] = []
    monkeypatch.setattr(server_module, "log", lambda level, msg, *args: said.append(msg % args))
    grid = ClientAppGrid(2)
    server_module.main(
        grid,
        Context(
            run_id=2,
            node_id=0,
            node_config={},
            state=RecordDict(),
            run_config={"resume": str(out), "config": "configs/smoke.yaml", "train.lr": 0.5},
        ),
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert any("finished (round 3 of 3, summary.json written): nothing to do, nothing changed" in s for s in said), said
    assert grid.uploads == {}  # no client trained


def test_fedmocov3_is_fedssl_on_the_whole_vit(tmp_path, monkeypatch):
    """FedMoCoV3, the layer-wise methods' end-to-end baseline: strategy fedssl with MoCo v3 on the 12-block ViT of
    configs/smoke-lwfedssl.yaml, the whole model both ways every round, and model.pt holding all 12 blocks (what
    fedssl-eval reads)."""
    from ssl_models.evaluation.checkpoint import load_encoder_checkpoint

    raw = yaml.safe_load((REPO / "configs" / "smoke-lwfedssl.yaml").read_text())
    raw["name"] = "fedmocov3-inprocess"
    raw["strategy"] = {"name": "fedssl"}  # no stages: the whole model
    raw["rounds"] = 2
    raw["data"] = {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"}
    raw["federation"] = {"num_clients": 2, "node_wait_s": 0.0}
    raw["train"].update(max_steps_per_epoch=2, batch_size=16, device="cpu")
    raw["eval"] = {"knn_every": 0, "linear_probe": False, "random_init_reference": False, "device": "cpu"}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    monkeypatch.setattr(results_module.ResultsWriter, "plot", lambda self, title: None)
    server_module.main(
        ClientAppGrid(2),
        Context(
            run_id=1,
            node_id=0,
            node_config={},
            state=RecordDict(),
            run_config={"config": str(tmp_path / "cfg.yaml"), "output-dir": str(out)},
        ),
    )
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["bytes_down"] == r["bytes_up"] > 0 and np.isfinite(r["train_loss"]) for r in rounds)
    backbone, info = load_encoder_checkpoint(out / "model.pt")
    assert info["arch_options"] == {"depth": 12} and len(backbone.blocks) == 12
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedssl" and summary["method"] == "mocov3"


class FaultyGrid(ClientAppGrid):
    """Client 1's node misbehaves in round 2 in the way ``fault`` says; records the timeout each call was given."""

    def __init__(self, fault: str):
        super().__init__(2)
        self.fault, self.timeouts = fault, []

    def send_and_receive(self, messages, timeout=None):
        messages = list(messages)
        if any(m.metadata.message_type == "train" for m in messages):
            self.timeouts.append(timeout)  # what a training round waits for its replies
        kept = [m for m in messages if not (self.fault == "no reply" and self.is_target(m))]
        replies = []
        for m in kept:
            try:
                reply = client_app(m, self.contexts[m.metadata.dst_node_id])
            except Exception as exc:  # noqa: BLE001 - what Flower's runtime makes of a ClientApp that raises: an error reply
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=m)
            replies.append(self.corrupt(reply) if self.is_target(m) else reply)
        return replies

    @staticmethod
    def is_target(m) -> bool:
        return (
            m.metadata.message_type == "train"
            and m.metadata.dst_node_id == 101
            and int(m.content["config"]["server-round"]) == 2
        )

    def corrupt(self, reply):
        if self.fault in ("no reply", "raises") or reply.has_error():
            return reply
        arrays = from_array_record(reply.content["arrays"])
        key = next(k for k in arrays if arrays[k].dtype == np.float32 and arrays[k].ndim == 4)
        if self.fault == "nan":
            arrays[key] = np.full_like(arrays[key], np.nan)
        elif self.fault == "wrong shape":
            arrays[key] = arrays[key][:1]
        elif self.fault == "missing array":
            del arrays[key]
        reply.content["arrays"] = to_array_record(arrays)
        return reply


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("no reply", "no reply before the round timeout (federation.round_timeout_s)"),
        ("raises", "client 1 refuses to train"),
        ("nan", "reply rejected: record 'arrays': array"),
        ("wrong shape", "reply rejected: record 'arrays': array"),
        ("missing array", "reply rejected: record 'arrays': missing arrays"),
    ],
)
def test_a_faulty_client_round_goes_on_with_the_other_and_the_model_stays_clean(tmp_path, monkeypatch, fault, reason):
    grid = FaultyGrid(fault)
    if fault == "raises":
        import client_app.app as client_module

        real = client_module.train_local_ssl

        def raising(*args, partition_id, server_round, **kwargs):
            if partition_id == 1 and server_round == 2:
                raise RuntimeError("client 1 refuses to train")
            return real(*args, partition_id=partition_id, server_round=server_round, **kwargs)

        monkeypatch.setattr(client_module, "train_local_ssl", raising)
    out, rounds = run(tmp_path, monkeypatch, grid)
    assert [r["round"] for r in rounds] == [1, 2, 3]  # the run went on
    second = rounds[1]
    assert second["num_clients"] == 1 and [c["id"] for c in second["clients"]] == [0]
    (failed,) = second["failed_clients"]
    assert failed["id"] == 1 and reason in failed["reason"]
    assert all(r["num_failed"] == 0 for r in (rounds[0], rounds[2]))
    assert grid.timeouts == [123.0] * 3  # every training round waits federation.round_timeout_s for its replies
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_train_loss"] is not None and np.isfinite(summary["knn_acc"])
