"""Orchestra: the clustering math against hand computations, the loss, the client rule and the strategy, and one
real `flwr run .` of configs/smoke-orchestra.yaml."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from client_app.rounds.weights import train_local_ssl
from client_app.rules.orchestra import orchestra_download, orchestra_upload
from fedssl_wire import from_array_record, to_array_record
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.factory import build_augment, build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.orchestra import (
    balanced_kmeans,
    cluster_size_summary,
    gradient_clustering,
    is_seeding_round,
    rotate_quarter_turns,
    seed_memory,
    sinkhorn_knopp,
)
from strategies import Orchestra as OrchestraStrategy

REPO = Path(__file__).resolve().parents[1]
METHOD_OPTIONS = {
    "proj_hidden_dim": 32,
    "proj_out_dim": 16,
    "num_global_clusters": 8,
    "num_local_clusters": 4,
    "memory_size": 16,
}
TINY = {
    "rounds": 2,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "orchestra", "options": METHOD_OPTIONS},
    "strategy": {"name": "orchestra"},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False},
}


def strategy_options(**kw):
    return {**OrchestraStrategy.default_options(), **kw}


# ------------------------------------------------------------------ clustering math


def test_sinkhorn_splits_points_that_prefer_one_cluster_equally():
    # Both points prefer cluster 0 alike: exp(S) = [[e, 1], [e, 1]]; columns to 1/2 -> every entry 1/4; rows to
    # 1/2 -> 1/4; x N=2 -> 1/2 everywhere. Equal sizes win over the preference.
    q = sinkhorn_knopp(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), inverse_epsilon=1.0, iterations=3)
    torch.testing.assert_close(q, torch.full((2, 2), 0.5))


def test_sinkhorn_keeps_an_already_balanced_preference():
    # lambda = ln 3: exp(lambda S) = [[3, 1], [1, 3]]: columns sum to 4 -> /4/2 = [[3/8, 1/8], [1/8, 3/8]], rows
    # already 1/2 each; x 2 -> [[3/4, 1/4], [1/4, 3/4]].
    q = sinkhorn_knopp(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), inverse_epsilon=math.log(3.0), iterations=5)
    torch.testing.assert_close(q, torch.tensor([[0.75, 0.25], [0.25, 0.75]]))


def test_sinkhorn_marginals_rows_one_columns_n_over_k():
    scores = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    q = sinkhorn_knopp(scores, inverse_epsilon=2.0, iterations=200)
    torch.testing.assert_close(q.sum(dim=1), torch.ones(12))
    torch.testing.assert_close(q.sum(dim=0), torch.full((3,), 4.0), atol=1e-4, rtol=0)


def test_balanced_kmeans_forces_equal_sizes_hand_computation():
    # Three points lean to centroid A = (1, 0), one to B = (0, 1). Plain K-means would make clusters of 3 and 1;
    # the equal-size assignment gives B the point with the least preference for A, p2 = (0.8, 0.6)
    # (score gap A - B: p0 1, p1 0.68, p2 0.2). Then A = normalise((1 + 0.96, 0 + 0.28) / 2) = (1.96, 0.28) /
    # sqrt(3.92) and B = normalise((0.8, 1.6)) = (0.8, 1.6) / sqrt(3.2).
    points = torch.tensor([[1.0, 0.0], [0.96, 0.28], [0.8, 0.6], [0.0, 1.0]])
    centroids, assignments = balanced_kmeans(points, 2, iterations=1, initial=torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert assignments.tolist() == [0, 0, 1, 1]
    expected = torch.tensor(
        [[1.96 / math.sqrt(3.92), 0.28 / math.sqrt(3.92)], [0.8 / math.sqrt(3.2), 1.6 / math.sqrt(3.2)]]
    )
    torch.testing.assert_close(centroids, expected)


def test_balanced_kmeans_seeds_from_distinct_points_and_refuses_too_few():
    points = torch.nn.functional.normalize(torch.randn(8, 3, generator=torch.Generator().manual_seed(1)), dim=1)
    centroids, assignments = balanced_kmeans(points, 4, iterations=3, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(centroids.norm(dim=1), torch.ones(4))
    assert torch.bincount(assignments, minlength=4).tolist() == [2, 2, 2, 2]  # 8 points, 4 equal clusters
    with pytest.raises(ValueError, match="3 points cannot seed 4"):
        balanced_kmeans(points[:3], 4)


def test_gradient_clustering_moves_centroids_onto_two_separated_groups():
    # Two tight groups around e0 and e1, centroids started half-way between: the authors' SGD clustering must end
    # with one centroid on each group (cosine > 0.9), unit norm.
    points = torch.tensor([[1.0, 0.05, 0.0], [1.0, -0.05, 0.0], [0.05, 1.0, 0.0], [-0.05, 1.0, 0.0]])
    start = torch.tensor([[0.8, 0.6, 0.1], [0.6, 0.8, -0.1]])
    c = gradient_clustering(points, start, steps=100, lr=0.1, temperature=0.1, sinkhorn_iterations=20)
    torch.testing.assert_close(c.norm(dim=1), torch.ones(2))
    assert c[0] @ torch.tensor([1.0, 0, 0]) > 0.9 and c[1] @ torch.tensor([0, 1.0, 0]) > 0.9, c


def test_rotate_quarter_turns_by_hand():
    # [[1, 2], [3, 4]] turned a quarter counter-clockwise is [[2, 4], [1, 3]]; half a turn [[4, 3], [2, 1]].
    image = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).reshape(1, 1, 2, 2).repeat(3, 1, 1, 1)
    out = rotate_quarter_turns(image, torch.tensor([0, 1, 2]))
    assert out[0, 0].tolist() == [[1, 2], [3, 4]]
    assert out[1, 0].tolist() == [[2, 4], [1, 3]]
    assert out[2, 0].tolist() == [[4, 3], [2, 1]]


def test_cluster_size_summary():
    s = cluster_size_summary(torch.tensor([0, 0, 0, 2]), 4)
    assert s == {"used": 2.0, "size_min": 0.0, "size_max": 3.0, "size_std": pytest.approx(math.sqrt(1.5))}


# ------------------------------------------------------------------ the model and its loss


@pytest.fixture()
def cfg():
    return ExperimentConfig.from_dict(TINY)


def test_cluster_loss_is_the_cross_entropy_of_target_and_online_assignments(cfg):
    method = build_ssl_model(cfg, seed=0)
    method.train()
    torch.manual_seed(0)
    view1, view2 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    cluster, target = method._cluster_loss(view2, view1)
    # Recomputed by hand from the parts: -mean_i sum_j p_target_ij log p_online_ij (T = 0.1).
    with torch.no_grad():
        c = method.global_centroids
        z = torch.nn.functional.normalize(method.projector(method.backbone(view2)), dim=1)
        t = torch.nn.functional.normalize(method.target_projector(method.target_backbone(view1)), dim=1)
        pt = torch.exp(t @ c.T / 0.1) / torch.exp(t @ c.T / 0.1).sum(dim=1, keepdim=True)
        po = torch.exp(z @ c.T / 0.1) / torch.exp(z @ c.T / 0.1).sum(dim=1, keepdim=True)
        expected = -(pt * torch.log(po)).sum(dim=1).mean()
    torch.testing.assert_close(cluster, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(target, t, rtol=1e-4, atol=1e-5)
    assert not target.requires_grad and cluster.requires_grad  # the target's assignment is a label


def test_training_step_fills_memory_fifo_and_logs_terms(cfg):
    method = build_ssl_model(cfg, seed=0)
    method.train()
    assert method.memory_bank().shape == (0, 16)
    for _ in range(3):  # 3 x 8 target representations into a memory of 16: the oldest 8 drop out
        loss = method.training_step(torch.randn(8, 3, 32, 32), torch.randn(8, 3, 32, 32))
    assert method.memory_bank().shape == (16, 16)
    torch.testing.assert_close(method.memory_bank().norm(dim=1), torch.ones(16))
    s = method.loss_summary()
    # Total = cluster + rotation (weight 1); the rotation term starts near ln 4 (a 4-way guess).
    assert s["loss_cluster"] > 0 and 0.5 < s["loss_degeneracy"] < 3.0 and 0 <= s["rotation_acc"] <= 1
    assert math.isfinite(float(loss.detach()))
    assert method.rotation_images == 24  # one rotated copy per image


def test_four_rotation_views_cost_four_rotated_copies(cfg):
    method = build_ssl_model(
        ExperimentConfig.from_dict(
            {**TINY, "method": {"name": "orchestra", "options": {**METHOD_OPTIONS, "rotation_views": 4}}}
        )
    )
    method.train()
    method.training_step(torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32))
    assert method.rotation_images == 16


def test_trainable_parts_sharing_and_bf16_step(cfg):
    method = build_ssl_model(cfg, seed=0)
    trained = (method.backbone, method.projector, method.rotation_head)
    assert {id(p) for p in method.trainable_parameters()} == {id(p) for m in trained for p in m.parameters()}
    assert method.shared_prefixes() == ("backbone.", "projector.", "rotation_head.")
    local = {k.split(".")[0] for k in method.state_dict() if not k.startswith(method.shared_prefixes(with_target=True))}
    assert local == {"global_centroids", "memory", "memory_count"}  # never averaged: centroids travel apart
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = method.training_step(torch.rand(4, 3, 32, 32), torch.rand(4, 3, 32, 32))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert method.rotation_head.weight.grad is not None and method.global_centroids.grad is None


def test_method_options_are_validated():
    for bad, key in (
        ({"rotation_views": 2}, "rotation_views"),
        ({"temperature": 0}, "temperature"),
        ({"memory_size": 2}, "memory_size"),
        ({"num_global_clusters": 0}, "num_global_clusters"),
        ({"degeneracy_weight": -1.0}, "degeneracy_weight"),
    ):
        raw = {**TINY, "method": {"name": "orchestra", "options": {**METHOD_OPTIONS, **bad}}}
        with pytest.raises(ValueError, match=rf"option '{key}'"):
            build_ssl_model(ExperimentConfig.from_dict(raw))


# ------------------------------------------------------------------ client rule


def global_payload(cfg, centroids):
    method = build_ssl_model(cfg, seed=3)
    shared, _ = split_state(method, method.shared_prefixes(with_target=True))
    return {**state_to_numpy(shared), "orchestra.global_centroids": centroids}


def test_download_loads_centroids_and_stateless_target(cfg):
    centroids = torch.nn.functional.normalize(torch.randn(8, 16), dim=1).numpy()
    payload = global_payload(cfg, centroids)
    method = build_ssl_model(cfg, seed=1)
    orchestra_download(method, payload, None, 1, {"aggregate_target": True})
    np.testing.assert_allclose(method.global_centroids.numpy(), centroids, rtol=1e-6)
    now = state_to_numpy(method.state_dict())
    for key in ("backbone.stem.0.weight", "target_backbone.stem.0.weight", "rotation_head.weight"):
        np.testing.assert_array_equal(now[key], payload[key])
    assert int(method.memory_count) == 0
    with pytest.raises(ValueError, match="global_centroids"):
        orchestra_download(method, {k: v for k, v in payload.items() if not k.startswith("orchestra.")}, None, 1, {})


def test_client_round_uploads_unit_local_centroids_and_reports_terms(cfg):
    centroids = torch.nn.functional.normalize(torch.randn(8, 16), dim=1).numpy()
    images = (np.random.default_rng(0).random((16, 32, 32, 3)) * 255).astype(np.uint8)
    result = train_local_ssl(
        cfg,
        images,
        global_payload(cfg, centroids),
        None,
        server_round=2,
        partition_id=0,
        lr=0.05,
        aggregate_target=True,
        rule="orchestra",
        rule_options=strategy_options(),
    )
    assert result.stats.steps == 1 and "seed_round" not in result.info  # round 2 trains (max_steps_per_epoch 1)
    local = result.shared_state["orchestra.local_centroids"]
    assert local.shape == (4, 16) and local.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(local, axis=1), 1.0, rtol=1e-5)
    assert "target_backbone.stem.0.weight" in result.shared_state  # stateless clients: the target goes up too
    info = result.info
    # 16 representations in 4 clusters: the equal-size assignment keeps every cluster near 4 (argmax of the
    # Sinkhorn-Knopp rows: close to, not exactly, equal).
    assert info["memory_filled"] == 16 and info["local_cluster_size_max"] <= 8
    assert info["loss_cluster"] > 0 and info["loss_degeneracy"] > 0 and 1 <= info["global_clusters_hit"] <= 8
    assert "orchestra.global_centroids" not in result.shared_state


def test_seed_memory_holds_the_target_projections_of_view_one_and_changes_nothing_else(cfg):
    images = (np.random.default_rng(1).random((20, 32, 32, 3)) * 255).astype(np.uint8)
    augment = build_augment(cfg, 32)
    method = build_ssl_model(cfg, seed=0)
    before = state_to_numpy(method.state_dict())
    seeded = seed_memory(method, images, augment, batch_size=16, seed=5, device="cpu")
    # By hand: the first M = 16 images of the seeded shuffle, their views drawn with the same generator, and the
    # target projections of view 1 of a fresh copy of the same model in training mode (batch statistics).
    picked = np.sort(torch.randperm(20, generator=torch.Generator().manual_seed(5)).numpy()[:16])
    view1, _ = augment.two_views(torch.from_numpy(images[picked]), generator=torch.Generator().manual_seed(5))
    fresh = build_ssl_model(cfg, seed=0)
    fresh.train()
    expected = fresh.target_representations(view1)
    assert int(method.memory_count) == 16 and seeded["images"] == 16
    np.testing.assert_allclose(method.memory_bank().numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)
    after = state_to_numpy(method.state_dict())
    for key, value in before.items():  # weights and BatchNorm statistics as received: nothing trained
        if key not in ("memory", "memory_count"):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
    summary = method.loss_summary()
    assert seeded["loss"] == pytest.approx(summary["loss_cluster"] + summary["loss_degeneracy"], rel=1e-5)


def test_only_round_1_with_seed_round_on_is_a_seeding_round():
    # the one test the server (keeps the model) and the client (fills its memory) both ask
    assert is_seeding_round({"seed_round": True}, 1) is True
    assert [is_seeding_round({"seed_round": True}, r) for r in (0, 2, 13)] == [False, False, False]
    assert is_seeding_round({"seed_round": False}, 1) is False
    assert is_seeding_round({}, 1) is False  # a client rule given no strategy options trains


def test_seed_round_trains_nothing_and_uploads_centroids_of_the_received_model(cfg):
    centroids = torch.nn.functional.normalize(torch.randn(8, 16), dim=1).numpy()
    images = (np.random.default_rng(0).random((24, 32, 32, 3)) * 255).astype(np.uint8)
    payload = global_payload(cfg, centroids)
    result = train_local_ssl(
        cfg,
        images,
        payload,
        None,
        server_round=1,
        partition_id=0,
        lr=0.05,
        aggregate_target=True,
        rule="orchestra",
        rule_options=strategy_options(),  # seed_round: true by default
    )
    assert result.info["seed_round"] == 1.0 and result.stats.steps == 0 and result.stats.num_examples == 24
    for key, value in payload.items():
        if not key.startswith("orchestra."):  # the weights go back exactly as they came
            np.testing.assert_array_equal(result.shared_state[key], value, err_msg=key)
    local = result.shared_state["orchestra.local_centroids"]
    assert local.shape == (4, 16) and result.info["memory_filled"] == 16
    np.testing.assert_allclose(np.linalg.norm(local, axis=1), 1.0, rtol=1e-5)
    res = result.stats.resources
    # No image trained; the seeding forwards (16 images) are the round's extra FLOPs.
    assert res["images_trained"] == 0 and res["flops_extra"] == pytest.approx(16 * res["flops_forward"])
    assert math.isfinite(result.stats.loss) and result.stats.loss > 0


def test_upload_refuses_a_memory_smaller_than_the_local_clusters(cfg):
    method = build_ssl_model(cfg, seed=0)
    method.update_memory(torch.nn.functional.normalize(torch.randn(3, 16), dim=1))  # 3 < N_L = 4
    with pytest.raises(ValueError, match="only 3 target representations"):
        orchestra_upload(method, None, cfg, strategy_options(), "cpu", {})


# ------------------------------------------------------------------ strategy


class FakeReply:
    def __init__(self, arrays):
        self.content = RecordDict({"arrays": to_array_record(arrays), "metrics": MetricRecord({})})


def prepared_strategy(cfg, **options):
    strategy = OrchestraStrategy(clients={0: 10, 1: 11}, clients_per_round=2, options=strategy_options(**options))
    strategy.prepare(cfg, None, None)
    return strategy


def test_strategy_averages_weights_and_clusters_centroids_globally(cfg):
    strategy = prepared_strategy(cfg, global_clustering="kmeans", seed_round=False)
    initial = strategy.global_centroids.copy()
    sent = from_array_record(strategy.arrays_for_round(1, to_array_record({"backbone.w": np.zeros(2, np.float32)})))
    np.testing.assert_array_equal(sent["orchestra.global_centroids"], initial)  # travels with the round's model
    rng = np.random.default_rng(0)
    local = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(2)]
    local = [x / np.linalg.norm(x, axis=1, keepdims=True) for x in local]
    replies = [
        FakeReply({"backbone.w": np.array([1.0, 3.0], np.float32), "orchestra.local_centroids": local[0]}),
        FakeReply({"backbone.w": np.array([4.0, 0.0], np.float32), "orchestra.local_centroids": local[1]}),
    ]
    clients = [{"num_examples": 1}, {"num_examples": 2}]
    averaged = from_array_record(strategy.aggregate(1, replies, clients))
    assert set(averaged) == {"backbone.w"}  # the centroids are not averaged into the model
    np.testing.assert_allclose(averaged["backbone.w"], [(1 + 8) / 3, 3 / 3])
    record = strategy._clustering_record
    # 8 local centroids into 8 equal-size global clusters: each global centroid is one local centroid.
    assert record["num_local_centroids"] == 8 and record["global_clusters_used"] == 8
    assert record["global_cluster_size_min"] == record["global_cluster_size_max"] == 1
    new = strategy.global_centroids
    assert new.shape == (8, 16) and not np.allclose(new, initial)
    all_local = np.concatenate(local)
    np.testing.assert_allclose(np.sort(np.abs(new @ all_local.T).max(axis=1)), np.ones(8), rtol=1e-5)
    # Checkpoints keep the global centroids.
    plain, arrays, stores = strategy.checkpoint_state()
    fresh = prepared_strategy(cfg)
    fresh.restore_state(plain, arrays, stores)
    np.testing.assert_array_equal(fresh.global_centroids, new)


def test_seed_round_keeps_the_model_and_clusters_by_the_code_form(cfg):
    strategy = prepared_strategy(cfg)  # the defaults: seed_round, global_clustering gradient
    assert strategy.options["seed_round"] is True and strategy.options["global_clustering"] == "gradient"
    start = {"backbone.w": np.array([2.0, -1.0], np.float32)}
    strategy.arrays_for_round(1, to_array_record(start))
    rng = np.random.default_rng(1)
    local = rng.standard_normal((8, 16)).astype(np.float32)
    local /= np.linalg.norm(local, axis=1, keepdims=True)
    replies = [
        FakeReply({"backbone.w": np.array([1.0, 3.0], np.float32), "orchestra.local_centroids": local[:4]}),
        FakeReply({"backbone.w": np.array([4.0, 0.0], np.float32), "orchestra.local_centroids": local[4:]}),
    ]
    clients = [{"num_examples": 1}, {"num_examples": 2}]
    initial = strategy.global_centroids.copy()
    kept = from_array_record(strategy.aggregate(1, replies, clients))
    np.testing.assert_array_equal(kept["backbone.w"], start["backbone.w"])  # the seeding round averages nothing
    assert strategy._clustering_record["seed_round"] is True
    assert strategy._clustering_record["global_clustering"] == "gradient"
    expected = gradient_clustering(
        torch.as_tensor(local),
        torch.as_tensor(initial),
        steps=500,
        lr=0.01,
        temperature=0.1,
        sinkhorn_iterations=100,
        inverse_epsilon=25.0,
    )
    np.testing.assert_allclose(strategy.global_centroids, expected.numpy(), rtol=1e-5, atol=1e-6)
    # Round 2 trains: FedAvg again.
    strategy.arrays_for_round(2, to_array_record(start))
    averaged = from_array_record(strategy.aggregate(2, replies, clients))
    np.testing.assert_allclose(averaged["backbone.w"], [(1 + 8) / 3, 3 / 3])
    assert "seed_round" not in strategy._clustering_record


def test_strategy_reply_spec_and_payload_check(cfg):
    strategy = prepared_strategy(cfg)
    strategy._upload_spec[1] = {"backbone.w": ((2,), "float32")}
    spec = strategy.expected_reply_arrays(1, 0)["arrays"]
    assert set(spec) == {"backbone.w", "orchestra.local_centroids"}
    not_unit = FakeReply({"orchestra.local_centroids": np.full((4, 16), 0.5, np.float32)})
    assert "unit vectors" in strategy.check_reply_payload(1, 0, not_unit)
    ok = FakeReply({"orchestra.local_centroids": np.eye(4, 16, dtype=np.float32)})
    assert strategy.check_reply_payload(1, 0, ok) is None
    assert isinstance(strategy.arrays_for_round(1, ArrayRecord()), ArrayRecord)


def test_strategy_options_and_method_requirement(tmp_path):
    for bad, key in (
        ({"global_clustering": "agglomerative"}, "global_clustering"),
        ({"kmeans_iters": 0}, "kmeans_iters"),
        ({"sinkhorn_inverse_epsilon": 0.0}, "sinkhorn_inverse_epsilon"),
        ({"seed_round": "yes"}, "seed_round"),
    ):
        with pytest.raises(ValueError, match=rf"^strategy.options.{key}:"):
            OrchestraStrategy.check_options(strategy_options(**bad))
    raw = yaml.safe_load((REPO / "configs/smoke-orchestra.yaml").read_text())
    for change, message in (
        (lambda r: r.update(method={"name": "byol"}), r"^method.name: strategy 'orchestra' .* needs method.name"),
        (
            lambda r: (
                r["method"]["options"].update(num_global_clusters=32),
                r["strategy"].update(options={"global_clustering": "kmeans"}),
            ),
            r"^method.options.num_global_clusters:",
        ),
        (
            lambda r: r.update(rounds=1),
            r"^rounds: 1 round\(s\) with strategy.options.seed_round true would train nothing",
        ),
    ):
        bad = json.loads(json.dumps(raw))
        change(bad)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=message):
            load_experiment({"config": str(path), "data.dataset": "synthetic"})


# ------------------------------------------------------------------ a real run


@pytest.mark.e2e
def test_orchestra_smoke_run_clusters_globally_and_records_it(tmp_path, monkeypatch):
    from flwr_harness import SHORT_EVAL, data_overrides, flwr_run, read_jsonl

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny encoders on 2 shared cores: one thread per process is faster
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke-orchestra.yaml' output-dir='{out}' {data_overrides()} train.max_steps_per_epoch=3 {SHORT_EVAL}",
        tmp_path / "flwr",
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    # Round 1 only seeds the global centroids (the clients train nothing); round 2 trains.
    assert rounds[0]["seed_round"] is True and "seed_round" not in rounds[1]
    for r in rounds:
        # Global clustering (the code's gradient form) of 2 clients x 8 local centroids into 4, recorded per round.
        assert r["global_clustering"] == "gradient" and r["num_local_centroids"] == 16 and r["num_global_clusters"] == 4
        assert 1 <= r["global_clusters_used"] <= 4 and r["global_cluster_size_max"] >= 4  # 16 centroids into 4
        assert r["loss_cluster"] > 0 and r["loss_degeneracy"] > 0 and 0 <= r["rotation_acc"] <= 1
        # the two terms are recorded apart from their sum: in fp32 they agree to rounding; under bf16 autocast (CPUs and
        # GPUs with native bf16 units) each carries bf16's 8-bit mantissa, about 0.4 % (seen: 3.7922 against 3.7883)
        bf16 = any(c.get("precision") == "bf16" for c in r["clients"])
        assert r["train_loss"] == pytest.approx(r["loss_cluster"] + r["loss_degeneracy"], rel=1e-2 if bf16 else 1e-4)
        assert 0 <= r["knn_acc"] <= 1
        # Down per client: the model (with the target) + 4 x 32 fp32 global centroids; up: the model + 8 x 32 local
        # centroids. Both clients: down - up = 2 x (512 - 1024) bytes, up to the records' headers (names, padding).
        assert abs((r["bytes_down"] - r["bytes_up"]) - 2 * (4 - 8) * 32 * 4) < 400, (r["bytes_down"], r["bytes_up"])
        for c in r["clients"]:  # every client trained against exactly the centroids the server sent
            assert c["global_centroids_sum"] == pytest.approx(r["global_centroids_sent_sum"], abs=1e-6)
            assert c["memory_filled"] == 64 and c["local_cluster_size_min"] <= 8 <= c["local_cluster_size_max"]
            assert c["flops_total"] > 0
            if r["round"] == 1:
                assert c["images_trained"] == 0 and c["flops_extra"] > 0 and c["seed_round"] == 1.0
            else:
                assert c["images_trained"] > 0
    # Round 2 trains against the global clustering of round 1's local centroids, not the initial random ones.
    assert rounds[1]["global_centroids_sent_sum"] != pytest.approx(rounds[0]["global_centroids_sent_sum"], abs=1e-3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and 0 <= summary["linear_probe_acc"] <= 1
    res = summary["resources"]
    assert res["run"]["bytes_up"] == sum(r["bytes_up"] for r in rounds)
    assert res["run"]["bytes_down"] == sum(r["bytes_down"] for r in rounds)
    assert all(mine["flops_total_max"] > 0 for mine in res["per_client"].values())
