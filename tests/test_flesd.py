"""FLESD client and server pieces, FedProx's proximal term, and Min-Local, without a Flower run."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app.tasks import PublicSetMismatch, similarity_round, train_local_ssl
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.datasets import load_dataset
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.methods.losses import proximal_term
from ssl_models.federated.similarity import decode_similarity, topk_count
from ssl_models.data.splits import client_images, federated_split, images_digest, public_images
from strategies import FLESD, FedProx, Local
from fedssl_wire import from_array_record, to_array_record

TINY = {
    "rounds": 2,
    "data": {"dataset": "synthetic", "synthetic_train": 160, "synthetic_test": 40, "partition": "iid",
             "public_size": 40},
    "model": {"arch": "resnet18", "width": 0.125, "client_archs": ["resnet18", "resnet34"]},
    "method": {"name": "simclr", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16}},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False,
              "optimizer": "adam", "lr": 1e-3},
    "strategy": {"name": "flesd", "options": {"distill_iterations": 4, "distill_batch_size": 8, "queue_size": 16}},
}


@pytest.fixture()
def cfg():
    return ExperimentConfig.from_dict(TINY)


@pytest.fixture()
def identity():
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def global_shared(cfg):
    model = build_ssl_model(cfg, seed=7)
    return state_to_numpy(split_state(model, model.shared_prefixes())[0])


def test_public_set_is_disjoint_from_clients_and_hash_checked(cfg):
    data = load_dataset("synthetic", synthetic_sizes=(160, 40, 10))
    split = federated_split(cfg, data.y_train)
    assert len(split.public_idx) == 40
    assert not set(split.public_idx) & set(np.concatenate(split.client_idx))
    public = public_images(cfg)
    with pytest.raises(PublicSetMismatch, match="public set mismatch"):
        similarity_round(cfg, client_images(cfg, 0), public, global_shared(cfg), None, server_round=1,
                         partition_id=0, lr=1e-3, public_digest="0" * 64, similarity="topk", topk_fraction=0.1)


def test_similarity_round_uploads_topk_rows_and_keeps_a_foreign_architecture(cfg):
    public = public_images(cfg)
    digest = images_digest(public)
    r = similarity_round(cfg, client_images(cfg, 1), public, {}, None, server_round=1, partition_id=1, lr=1e-3,
                         public_digest=digest, similarity="topk", topk_fraction=0.1)
    n, k = len(public), topk_count(len(public), 0.1)
    assert r.payload["values"].shape == (n, k) and r.payload["values"].dtype == np.float16
    dense, mask = decode_similarity(r.payload, n)
    assert mask.sum() == n * k and torch.allclose(torch.diagonal(dense), torch.ones(n), atol=1e-2)  # self-sim
    # The ResNet-34 client keeps its own weights between rounds: its state holds a layer ResNet-18 lacks.
    assert "backbone.layer3.5.conv1.weight" in r.client_state
    r2 = similarity_round(cfg, client_images(cfg, 1), public, {}, r.client_state, server_round=2, partition_id=1,
                          lr=1e-3, public_digest=digest, similarity="dense-fp16")
    assert r2.payload["values"].shape == (n, n) and r2.payload["values"].dtype == np.float16


def reply(request, content):
    return Message(content, reply_to=request)


def test_flesd_server_ensembles_distils_and_counts_bytes(cfg, identity, tmp_path):
    data = load_dataset("synthetic", synthetic_sizes=(160, 40, 10))
    strategy = FLESD(clients={0: 10, 1: 11}, clients_per_round=2, options=cfg.strategy.options,
                     state_dir=str(tmp_path))
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    initial = to_array_record(global_shared(cfg))

    class Grid:
        def get_node_ids(self):
            return [10, 11]

    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, initial, ConfigRecord(), Grid())}
    assert msgs[10].metadata.message_type == "train.similarity"
    assert len(msgs[10].content["arrays"]) > 0 and len(msgs[11].content["arrays"]) == 0  # R34 keeps its own
    assert msgs[10].content["config"]["public-digest"] == images_digest(public_images(cfg))
    replies = []
    for node, pid in ((10, 0), (11, 1)):
        r = similarity_round(cfg, client_images(cfg, pid), public_images(cfg), from_array_record(
            msgs[node].content["arrays"]), None, server_round=1, partition_id=pid, lr=1e-3,
            public_digest=msgs[node].content["config"]["public-digest"], similarity="topk", topk_fraction=0.1)
        replies.append(reply(msgs[node], RecordDict({"similarity": to_array_record(r.payload), "metrics": MetricRecord(
            {"partition-id": pid, "num-examples": 60, "train_loss": 1.0, "train_s": 0.1})})))
    arrays, _ = strategy.aggregate_train(1, replies)
    new = from_array_record(arrays)
    old = from_array_record(initial)
    assert set(new) == set(old)
    assert any(not np.array_equal(new[k], old[k]) for k in new)  # the distillation trained the global model
    rec = strategy.round_records[1]
    assert rec["bytes_up"] == sum(r.content["similarity"].count_bytes() for r in replies)
    assert rec["distill_steps"] > 0 and np.isfinite(rec["distill_loss"])
    assert [c["arch"] for c in rec["clients"]] == ["resnet18", "resnet34"]
    bad = Message(Error(code=0, reason="PublicSetMismatch: public set mismatch on client 1"), reply_to=msgs[11])
    with pytest.raises(RuntimeError, match="public set mismatch"):
        strategy.aggregate_train(2, [replies[0], bad])


def test_mixed_architectures_need_a_strategy_that_supports_them(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.client_archs: strategy 'fedssl' averages weights"):
        load_experiment({"config": "configs/smoke-flesd.yaml", "data.dataset": "synthetic", "strategy.name": "fedssl"})
    with pytest.raises(ConfigError, match=r"^model.client_archs: unknown architecture"):
        cfg = load_experiment({"config": "configs/smoke-flesd.yaml", "data.dataset": "synthetic"})[0]
        raw = cfg.to_dict()
        raw["model"]["client_archs"] = ["resnet18", "resnet99"]
        import yaml
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        load_experiment({"config": str(path)})


def test_proximal_term_hand_computation():
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    g = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])}
    # ||w - g||^2 = 1 + 4 + 4 = 9
    assert float(proximal_term(w, g, 0.5)) == pytest.approx(0.5 / 2 * 9)
    assert float(proximal_term(w, g, 0.5, half=False)) == pytest.approx(0.5 * 9)


def test_fedprox_pulls_the_local_model_towards_the_global_one():
    cfg = ExperimentConfig.from_dict({**TINY, "model": {"arch": "resnet18", "width": 0.125},
                                      "train": {**TINY["train"], "max_steps_per_epoch": 3, "lr": 0.05,
                                                "optimizer": "sgd"}})
    g = global_shared(cfg)
    images = client_images(cfg, 0)

    def drift(mu):
        r = train_local_ssl(cfg, images, g, None, server_round=1, partition_id=0, lr=0.05, proximal_mu=mu)
        return sum(float(np.sum((r.shared_state[k] - g[k]) ** 2)) for k in g if "running" not in k
                   and "num_batches" not in k)

    assert drift(5.0) < drift(0.0)  # lr * mu = 0.25: a stable pull towards the global weights
    assert FedProx(clients={0: 1}, clients_per_round=1).client_config(1)["proximal-mu"] == 1e-4


def test_min_local_sends_the_initial_model_once_and_never_aggregates(tmp_path, identity):
    strategy = Local(clients={0: 10, 1: 11}, clients_per_round=2, state_dir=str(tmp_path))
    init = to_array_record({"backbone.w": np.zeros(3, np.float32)})
    assert len(strategy.arrays_for_client(1, 0, init)) == 1 and len(strategy.arrays_for_client(2, 0, init)) == 0
    req = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=10, message_type="train")
    rep = reply(req, RecordDict({"arrays": to_array_record({"backbone.w": np.ones(3, np.float32)}),
                                 "metrics": MetricRecord({"partition-id": 0, "num-examples": 5, "train_loss": 1.0,
                                                          "train_s": 0.1})}))
    arrays, _ = strategy.aggregate_train(1, [rep])
    assert arrays is None
    strategy.prepare(ExperimentConfig.from_dict({"model": {"arch": "resnet18", "client_archs": ["resnet34"]},
                                                 "federation": {"num_clients": 1}}), None, None)
    models = strategy.models_to_evaluate(init)
    assert list(models) == ["client_0"]
    np.testing.assert_array_equal(from_array_record(models["client_0"].arrays)["backbone.w"], np.ones(3))
    assert models["client_0"].arch == "resnet34"  # each client's own architecture, to rebuild it
