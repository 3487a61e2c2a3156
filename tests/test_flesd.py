"""FLESD client and server pieces, FedProx's proximal term, and Min-Local, without a Flower run."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import strategies.flesd as flesd_module
from client_app.rounds.public_set import PublicSetMismatch
from client_app.rounds.similarity import similarity_round
from client_app.rounds.weights import train_local_ssl
from fedssl_wire import from_array_record, record_names, to_array_record
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.datasets import load_dataset
from ssl_models.data.splits import client_images, federated_split, images_digest, public_images
from ssl_models.factory import build_ssl_model, load_partial_state, split_state, state_to_numpy
from ssl_models.federated.similarity import topk_count
from ssl_models.methods.losses import proximal_term
from strategies import FLESD, FedProx, Local
from wire_bytes import hand_bytes

TINY = {
    "rounds": 2,
    "data": {
        "dataset": "synthetic",
        "synthetic_train": 160,
        "synthetic_test": 40,
        "partition": "iid",
        "public_size": 40,
    },
    "model": {"arch": "resnet18", "width": 0.125, "client_archs": ["resnet18", "resnet34"]},
    "method": {"name": "simclr", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16}},
    "federation": {"num_clients": 2},
    "train": {
        "local_epochs": 1,
        "batch_size": 16,
        "max_steps_per_epoch": 1,
        "fast_path": False,
        "optimizer": "adam",
        "lr": 1e-3,
    },
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
        similarity_round(
            cfg,
            client_images(cfg, 0),
            public,
            global_shared(cfg),
            None,
            server_round=1,
            partition_id=0,
            lr=1e-3,
            public_digest="0" * 64,
            similarity="topk",
            topk_fraction=0.1,
        )


def projector_similarities(cfg, partition_id, client_state, public):
    """Cosines of the client's projector outputs on the public images, recomputed here in float64 from the
    model the client kept: eval mode, no augmentation, projector(backbone(x)) (FLESD's representations)."""
    method = build_ssl_model(cfg, seed=0, arch=cfg.client_arch(partition_id))
    load_partial_state(method, {k: v for k, v in client_state.items() if not k.startswith("meta.")})
    method.eval()
    x = torch.from_numpy(public).permute(0, 3, 1, 2).float() / 255.0
    with torch.no_grad():
        z = method.projector(method.backbone(x)).double()
    assert z.shape[1] == cfg.method.options["proj_out_dim"]
    z = z / z.norm(dim=1, keepdim=True)
    return (z @ z.t()).numpy()


def test_similarity_round_uploads_the_topk_of_its_projector_cosines_and_keeps_a_foreign_architecture(cfg):
    public = public_images(cfg)
    digest = images_digest(public)
    r = similarity_round(
        cfg,
        client_images(cfg, 1),
        public,
        {},
        None,
        server_round=1,
        partition_id=1,
        lr=1e-3,
        public_digest=digest,
        similarity="topk",
        topk_fraction=0.1,
    )
    n, k = len(public), topk_count(len(public), 0.1)
    assert (n, k) == (40, 5)
    assert r.payload["values"].shape == (n, k) and r.payload["values"].dtype == np.float16
    assert r.payload["indices"].shape == (n, k) and r.payload["indices"].dtype == np.uint8
    sim = projector_similarities(cfg, 1, r.client_state, public)
    values, indices = r.payload["values"].astype(np.float64), r.payload["indices"].astype(np.int64)
    for i in range(n):
        row = sim[i]
        np.testing.assert_allclose(values[i], row[indices[i]], atol=1e-3)  # each kept value is that cosine
        assert len(set(indices[i].tolist())) == k
        kth_largest = np.sort(row)[::-1][k - 1]
        assert values[i].min() >= kth_largest - 1e-3  # and they are the row's k largest
    # The ResNet-34 client keeps its own weights between rounds: its state holds a layer ResNet-18 lacks, and
    # round 2 continues from it (learning rate 0: the weights stay exactly the kept ones).
    assert "backbone.layer3.5.conv1.weight" in r.client_state
    r2 = similarity_round(
        cfg,
        client_images(cfg, 1),
        public,
        {},
        r.client_state,
        server_round=2,
        partition_id=1,
        lr=0.0,
        public_digest=digest,
        similarity="dense-fp16",
    )
    for key in ("backbone.layer3.5.conv1.weight", "projector.0.weight"):
        np.testing.assert_array_equal(r2.client_state[key], r.client_state[key])
    assert r2.payload["values"].shape == (n, n) and r2.payload["values"].dtype == np.float16
    np.testing.assert_allclose(
        r2.payload["values"].astype(np.float64), projector_similarities(cfg, 1, r2.client_state, public), atol=1e-3
    )


def reply(request, content):
    return Message(content, reply_to=request)


def test_flesd_server_ensembles_distils_and_counts_bytes(cfg, identity, tmp_path, monkeypatch):
    data = load_dataset("synthetic", synthetic_sizes=(160, 40, 10))
    strategy = FLESD(clients={0: 10, 1: 11}, clients_per_round=2, options=cfg.strategy.options, state_dir=str(tmp_path))
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    initial = to_array_record(global_shared(cfg))

    class Grid:
        def get_node_ids(self):
            return [10, 11]

    ensembles = []

    def recording_distill(model, public, ensemble, **kwargs):
        ensembles.append(ensemble.clone())
        return real_distill(model, public, ensemble, **kwargs)

    real_distill = flesd_module.distill
    monkeypatch.setattr(flesd_module, "distill", recording_distill)
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, initial, ConfigRecord(), Grid())}
    # bytes down: the global arrays to the ResNet-18 client only, counted from shapes and dtypes
    assert strategy._bytes_down[1] == hand_bytes(global_shared(cfg))
    assert msgs[10].metadata.message_type == "train.similarity"
    assert len(msgs[10].content["arrays"]) > 0 and len(msgs[11].content["arrays"]) == 0  # R34 keeps its own
    assert msgs[10].content["config"]["public-digest"] == images_digest(public_images(cfg))
    replies = []
    for node, pid in ((10, 0), (11, 1)):
        r = similarity_round(
            cfg,
            client_images(cfg, pid),
            public_images(cfg),
            from_array_record(msgs[node].content["arrays"]),
            None,
            server_round=1,
            partition_id=pid,
            lr=1e-3,
            public_digest=msgs[node].content["config"]["public-digest"],
            similarity="topk",
            topk_fraction=0.1,
        )
        replies.append(
            reply(
                msgs[node],
                RecordDict(
                    {
                        "similarity": to_array_record(r.payload),
                        "metrics": MetricRecord(
                            {"partition-id": pid, "num-examples": 60, "train_loss": 1.0, "train_s": 0.1}
                        ),
                    }
                ),
            )
        )
    arrays, _ = strategy.aggregate_train(1, replies)
    new = from_array_record(arrays)
    old = from_array_record(initial)
    assert set(new) == set(old)
    assert any(not np.array_equal(new[k], old[k]) for k in new)  # the distillation trained the global model
    # the ensemble the server distilled: the mean over clients of exp((M - rowmax) / tau_T), M the dense matrix
    # with every dropped similarity set to 0 (zero_similarity), rebuilt here from the uploaded top-k rows
    tau = cfg.strategy.options.get("target_temperature", 0.1)
    expected = np.zeros((40, 40))
    for r in replies:
        payload = from_array_record(r.content["similarity"])
        dense = np.zeros((40, 40))
        for i in range(40):
            dense[i, payload["indices"][i].astype(np.int64)] = payload["values"][i].astype(np.float64)
        expected += np.exp((dense - dense.max(axis=1, keepdims=True)) / tau) / len(replies)
    assert len(ensembles) == 1
    np.testing.assert_allclose(ensembles[0].double().numpy(), expected, rtol=1e-5, atol=1e-6)
    rec = strategy.round_records[1]
    # bytes up, by hand: per client 40 x 5 float16 values and 40 x 5 uint8 indices (600), the manifest
    # "values\t<f2\t40,5\nindices\t|u1\t40,5" (32) and the packed record's frame (270): 902
    assert rec["bytes_up"] == 2 * 902 == sum(hand_bytes(from_array_record(r.content["similarity"])) for r in replies)
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
    cfg = ExperimentConfig.from_dict(
        {
            **TINY,
            "model": {"arch": "resnet18", "width": 0.125},
            "train": {**TINY["train"], "max_steps_per_epoch": 3, "lr": 0.05, "optimizer": "sgd"},
        }
    )
    g = global_shared(cfg)
    images = client_images(cfg, 0)

    def drift(mu):
        r = train_local_ssl(cfg, images, g, None, server_round=1, partition_id=0, lr=0.05, proximal_mu=mu)
        return sum(
            float(np.sum((r.shared_state[k] - g[k]) ** 2)) for k in g if "running" not in k and "num_batches" not in k
        )

    assert drift(5.0) < drift(0.0)  # lr * mu = 0.25: a stable pull towards the global weights
    assert FedProx(clients={0: 1}, clients_per_round=1).client_config(1)["proximal-mu"] == 1e-4


def test_min_local_sends_the_initial_model_once_and_never_aggregates(tmp_path, identity):
    strategy = Local(clients={0: 10, 1: 11}, clients_per_round=2, state_dir=str(tmp_path))
    init = to_array_record({"backbone.w": np.zeros(3, np.float32)})
    assert record_names(strategy.arrays_for_client(1, 0, init)) == ["backbone.w"]
    assert len(strategy.arrays_for_client(2, 0, init)) == 0
    req = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=10, message_type="train")
    rep = reply(
        req,
        RecordDict(
            {
                "arrays": to_array_record({"backbone.w": np.ones(3, np.float32)}),
                "metrics": MetricRecord({"partition-id": 0, "num-examples": 5, "train_loss": 1.0, "train_s": 0.1}),
            }
        ),
    )
    arrays, _ = strategy.aggregate_train(1, [rep])
    assert arrays is None
    strategy.prepare(
        ExperimentConfig.from_dict(
            {"model": {"arch": "resnet18", "client_archs": ["resnet34"]}, "federation": {"num_clients": 1}}
        ),
        None,
        None,
    )
    models = strategy.models_to_evaluate(init)
    assert list(models) == ["client_0"]
    np.testing.assert_array_equal(from_array_record(models["client_0"].arrays)["backbone.w"], np.ones(3))
    assert models["client_0"].arch == "resnet34"  # each client's own architecture, to rebuild it


def test_public_source_client0_uses_client_0s_partition_and_client_0_does_not_train(identity, tmp_path):
    from flwr.app import Context

    from client_app.app import app

    cfg = ExperimentConfig.from_dict(
        {
            **TINY,
            "data": {**TINY["data"], "public_size": 0},
            "model": {"arch": "resnet18", "width": 0.125},
            "federation": {"num_clients": 3},
            "strategy": {"name": "flesd", "options": {**TINY["strategy"]["options"], "public_source": "client0"}},
        }
    )
    data = load_dataset("synthetic", synthetic_sizes=(160, 40, 10))
    strategy = FLESD(
        clients={0: 10, 1: 11, 2: 12}, clients_per_round=3, options=cfg.strategy.options, state_dir=str(tmp_path)
    )
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    np.testing.assert_array_equal(strategy.public, client_images(cfg, 0))  # the public set is client 0's data

    class Grid:
        def get_node_ids(self):
            return [10, 11, 12]

    initial = to_array_record(global_shared(cfg))
    msgs = list(strategy.configure_train(1, initial, ConfigRecord({"experiment": cfg.to_json()}), Grid()))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 12]  # client 0 holds the public set: no training
    for m in msgs:
        assert m.content["config"]["public-source"] == "client0"
        assert m.content["config"]["public-digest"] == images_digest(client_images(cfg, 0))
    # The ClientApp follows the message: it loads client 0's partition as the public set (the digest matches) and
    # uploads the similarities of that set, 1 x N x k for N = client 0's size.
    m = msgs[0]
    pid = m.metadata.dst_node_id - 10
    ctx = Context(
        run_id=1,
        node_id=m.metadata.dst_node_id,
        state=RecordDict(),
        run_config={},
        node_config={"partition-id": pid, "num-partitions": 3},
    )
    m.content["config"]["lr"] = 1e-3
    m.content["config"]["client-state"] = "memory"
    out = app(m, ctx)
    assert not out.has_error(), out.error
    n = len(client_images(cfg, 0))
    assert from_array_record(out.content["similarity"])["values"].shape == (n, topk_count(n, 0.1))
    assert out.content["metrics"]["num-examples"] == len(client_images(cfg, pid))
