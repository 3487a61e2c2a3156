"""The ServerApp's own logic without a real federation: finding the clients (``discover_clients`` against a fake
grid), Min-Local's headline (minimum and mean over the clients' models), and a whole in-process Min-Local run
whose grid hands every message to the real ClientApp, to check the per-client model files and summary.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

import server_app.app as server_module
import server_app.results as results_module
from client_app.app import app as client_app
from fedssl_wire import from_array_record
from server_app.app import FederationMismatch, ServerEvaluator, discover_clients
from ssl_models.config import ExperimentConfig
from ssl_models.evaluation.checkpoint import load_encoder_checkpoint
from strategies.fedssl import ModelToEvaluate


@pytest.fixture(autouse=True)
def simulated_clientapps(monkeypatch, tmp_path):
    """The in-process runs here stand for a simulation: the ClientApps keep their state in the run's folder, as
    simulated ClientApps (in Ray workers) do, not in a deployed node's default folder. Their grid is not Flower's
    simulation grid, so the ServerApp confines paths as deployed: the test's folder is the operator's root."""
    monkeypatch.setenv("RAY_RAYLET_PID", "0")
    monkeypatch.setenv("FEDSSL_ALLOWED_ROOTS", str(tmp_path))


pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


class InfoGrid:
    """Answers ``query.info`` from a table node -> (partition-id, num-partitions), or an error for a node."""

    def __init__(self, table: dict[int, tuple[int, int] | str]):
        self.table = table

    def get_node_ids(self):
        return list(self.table)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"info-{i}"  # Flower stamps an id when it pushes a message
            entry = self.table[m.metadata.dst_node_id]
            if isinstance(entry, str):
                replies.append(Message(Error(code=0, reason=entry), reply_to=m))
                continue
            pid, num = entry
            replies.append(
                Message(
                    RecordDict(
                        {
                            "metrics": MetricRecord({"partition-id": pid, "num-partitions": num}),
                            "info": ConfigRecord({"host": "a" if pid % 2 else "b"}),
                        }
                    ),
                    reply_to=m,
                )
            )
        return replies


def federation_cfg(n: int = 3) -> ExperimentConfig:
    return ExperimentConfig.from_dict({"federation": {"num_clients": n, "node_wait_s": 0.0}})


# ---------------------------------------------------------------------------------------------- discover_clients
def test_discover_clients_maps_partition_ids_to_node_ids():
    said = []
    clients = discover_clients(InfoGrid({17: (2, 3), 3: (0, 3), 5: (1, 3)}), federation_cfg(), said.append)
    assert clients == {0: 3, 1: 5, 2: 17}
    assert said[-1] == "3 clients found on 2 host(s): a (1), b (2)"


def test_two_nodes_claiming_one_partition_id_are_refused():
    with pytest.raises(FederationMismatch, match=r"^two nodes claim partition-id 0: give every node its own"):
        discover_clients(InfoGrid({3: (0, 3), 5: (0, 3), 7: (2, 3)}), federation_cfg(), lambda _: None)


def test_a_node_with_another_num_partitions_is_refused():
    with pytest.raises(
        FederationMismatch,
        match=r"^node 5 holds partition 1 of 4, but the experiment has "
        r"federation.num_clients=3",
    ):
        discover_clients(InfoGrid({3: (0, 3), 5: (1, 4), 7: (2, 3)}), federation_cfg(), lambda _: None)


def test_partition_ids_outside_the_range_are_refused():
    with pytest.raises(FederationMismatch, match=r"^nodes reported partitions \[0, 1, 5\], expected 0\.\.2"):
        discover_clients(InfoGrid({3: (0, 3), 5: (1, 3), 7: (5, 3)}), federation_cfg(), lambda _: None)


def test_a_federation_of_another_size_is_refused():
    with pytest.raises(
        FederationMismatch,
        match=r"^the experiment has federation.num_clients=3 but the federation "
        r"has 2 nodes",
    ):
        discover_clients(InfoGrid({3: (0, 3), 5: (1, 3)}), federation_cfg(), lambda _: None)


def test_a_node_that_fails_to_report_stops_the_run():
    with pytest.raises(RuntimeError, match=r"^node 5 failed to report its partition: boom"):
        discover_clients(InfoGrid({3: (0, 3), 5: "boom", 7: (2, 3)}), federation_cfg(), lambda _: None)


# ---------------------------------------------------------------------------------------------- Min-Local headline
def test_several_models_report_the_minimum_as_headline_and_the_mean_beside_it():
    evaluator = ServerEvaluator.__new__(ServerEvaluator)  # no data needed: the scoring is replaced below
    scores = {
        "m0": {"knn_acc": 0.5, "linear_probe_acc": 0.25, "num_train": 40},
        "m1": {"knn_acc": 0.25, "linear_probe_acc": 0.75, "num_train": 40},
        "m2": {"knn_acc": 0.375, "linear_probe_acc": 0.5, "num_train": 40},
    }
    evaluator.evaluate = lambda model, knn, linear: dict(scores[model.arch])
    models = {f"client_{i}": ModelToEvaluate(f"m{i}", None) for i in range(3)}
    headline, by_model = evaluator.evaluate_models(models, knn=True, linear=True)
    assert headline["knn_acc"] == 0.25 and headline["linear_probe_acc"] == 0.25  # each the minimum over models
    assert headline["knn_acc_mean"] == pytest.approx(0.375) and headline["linear_probe_acc_mean"] == pytest.approx(0.5)
    assert headline["num_train"] == 40
    assert by_model == {
        "client_0": {"knn_acc": 0.5, "linear_probe_acc": 0.25},
        "client_1": {"knn_acc": 0.25, "linear_probe_acc": 0.75},
        "client_2": {"knn_acc": 0.375, "linear_probe_acc": 0.5},
    }
    one, none = evaluator.evaluate_models({"global": ModelToEvaluate("m1", None)}, knn=True, linear=True)
    assert one == scores["m1"] and none == {}  # a single model is its own headline, without a by-model table


# ---------------------------------------------------------------------------------------------- in-process run
class ClientAppGrid:
    """Delivers every message to the real ClientApp of its node, in this process (one Context per node)."""

    def __init__(self, n: int):
        self.contexts = {
            100 + pid: Context(
                run_id=1,
                node_id=100 + pid,
                state=RecordDict(),
                run_config={},
                node_config={"partition-id": pid, "num-partitions": n},
            )
            for pid in range(n)
        }
        self.uploads: dict[int, dict[str, np.ndarray]] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = [client_app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]
        for m, r in zip(messages, replies):  # each client's latest upload, to compare with what the server saved
            if m.metadata.message_type == "train" and not r.has_error():
                self.uploads[m.metadata.dst_node_id - 100] = from_array_record(r.content["arrays"])
        return replies


MIN_LOCAL = {
    "name": "min-local-inprocess",
    "seed": 0,
    "rounds": 2,
    "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "simclr", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8}},
    "strategy": {"name": "local"},
    "federation": {"num_clients": 2, "node_wait_s": 0.0},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False, "device": "cpu"},
    "eval": {"knn_every": 1, "knn_k": 5, "probe_epochs": 2, "max_train": 40, "max_test": 20, "device": "cpu"},
}


def test_min_local_run_writes_one_model_file_per_client_and_a_minimum_headline(tmp_path, monkeypatch):
    config = tmp_path / "min-local.yaml"
    config.write_text(yaml.safe_dump(MIN_LOCAL))
    out = tmp_path / "out"
    monkeypatch.setattr(results_module.ResultsWriter, "plot", lambda self, title: None)  # no figure needed
    # Distinct, decreasing accuracies per scored model (real scores of two tiny random models can tie): the
    # final scoring sees client_0 before client_1, so minimum, mean, first and maximum all differ.
    real_evaluate = ServerEvaluator.evaluate
    given = iter(np.arange(0.95, 0.0, -0.05))

    def evaluate(self, model, *, knn, linear):
        scores = real_evaluate(self, model, knn=knn, linear=linear)
        value = float(next(given))
        scores["knn_acc"] = value if knn else None
        scores["linear_probe_acc"] = value - 0.5 if linear else None
        return scores

    monkeypatch.setattr(ServerEvaluator, "evaluate", evaluate)
    grid = ClientAppGrid(2)
    server_module.main(
        grid,
        Context(
            run_id=1,
            node_id=0,
            node_config={},
            state=RecordDict(),
            run_config={"config": str(config), "output-dir": str(out)},
        ),
    )

    assert sorted(p.name for p in out.glob("*.pt")) == ["model_client_0.pt", "model_client_1.pt"]
    saved = {}
    for pid in (0, 1):  # each file holds that client's own final encoder (what it uploaded last)
        backbone, info = load_encoder_checkpoint(out / f"model_client_{pid}.pt")
        assert info["extra"]["model"] == f"client_{pid}" and info["arch"] == "resnet18"
        upload = {k[len("backbone.") :]: v for k, v in grid.uploads[pid].items() if k.startswith("backbone.")}
        state = backbone.state_dict()
        assert set(state) == set(upload)
        for key, value in upload.items():
            np.testing.assert_array_equal(state[key].numpy(), value.reshape(state[key].shape))
        saved[pid] = state["stem.0.weight"]
    assert not torch.equal(saved[0], saved[1])  # two different models, not one written twice

    summary = json.loads((out / "summary.json").read_text())
    by_model = summary["scores_by_model"]
    knn = {name: by_model[name]["knn_acc"] for name in ("client_0", "client_1")}
    lp = {name: by_model[name]["linear_probe_acc"] for name in ("client_0", "client_1")}
    assert knn["client_0"] > knn["client_1"] and len(set(knn.values())) == 2
    assert summary["headline"] == "minimum over the models"
    assert summary["knn_acc"] == pytest.approx(min(knn.values()))
    assert summary["knn_acc_mean"] == pytest.approx(sum(knn.values()) / 2)
    assert summary["linear_probe_acc"] == pytest.approx(min(lp.values()))
    assert summary["linear_probe_acc_mean"] == pytest.approx(sum(lp.values()) / 2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]
    assert all(set(line["knn_acc_by_model"]) == {"client_0", "client_1"} for line in lines)
    assert all(line["knn_acc"] == min(line["knn_acc_by_model"].values()) for line in lines)


def test_a_simulation_with_too_few_nodes_fails_at_once_not_after_node_wait_s():
    """In a simulation every node exists when the ServerApp starts: with fewer nodes than federation.num_clients the
    run stops within seconds, not after node_wait_s (300 s by default)."""
    import time

    class InMemoryGrid(InfoGrid):  # the name of Flower's simulation grid
        pass

    cfg = ExperimentConfig.from_dict({"federation": {"num_clients": 3, "node_wait_s": 300.0}})
    t0 = time.monotonic()
    with pytest.raises(FederationMismatch, match=r"federation.num_clients=3 but the federation has 2 nodes"):
        discover_clients(InMemoryGrid({100: (0, 3), 101: (1, 3)}), cfg, lambda line: None)
    assert time.monotonic() - t0 < 30
