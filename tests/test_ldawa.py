"""L-DAWA: the layer-wise divergence-aware aggregation against hand computations, the strategy's orchestration with
hand-built replies, option checks, and one real `flwr run .` of configs/smoke-ldawa.yaml."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from conftest import NodeGrid
from fedssl_wire import from_array_record, to_array_record
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError
from ssl_models.federated.ldawa import (
    client_base_weights,
    cosine,
    cosine_summary,
    layer_groups,
    ldawa_aggregate,
)
from strategies import LDAWA, get_strategy_class

REPO = Path(__file__).resolve().parents[1]
HALF = [0.5, 0.5]


def f32(*values):
    return np.array(values, dtype=np.float32)


# ------------------------------------------------------------------ pure math


def test_cosine_by_hand_and_undefined_for_a_zero_vector():
    assert cosine(f32(3, 4), f32(4, 3)) == pytest.approx(24 / 25)  # (12 + 12) / (5 * 5)
    assert cosine(f32(1, 0), f32(-2, 0)) == pytest.approx(-1.0)
    assert cosine(np.ones((2, 2)), np.ones(4)) == pytest.approx(1.0)  # flat vectors, whatever the shape
    assert cosine(f32(0, 0), f32(1, 2)) is None and cosine(f32(1, 2), f32(0, 0)) is None


def test_ldawa_scales_each_layer_by_its_cosine_with_weight_one_over_k():
    glob = {"l1.weight": f32(3, 4), "l2.weight": f32(1, 0)}
    a = {"l1.weight": f32(3, 4), "l2.weight": f32(2, 0)}  # cosines 1 and 1
    b = {"l1.weight": f32(4, 3), "l2.weight": f32(-2, 0)}  # cosines 24/25 = 0.96 and -1 (kept, not clipped to 0)
    res = ldawa_aggregate([a, b], glob, HALF)
    # l1: 1/2 * 1 * [3, 4] + 1/2 * 0.96 * [4, 3] = [1.5 + 1.92, 2 + 1.44]
    np.testing.assert_allclose(res.state["l1.weight"], [3.42, 3.44], rtol=1e-6)
    # l2: 1/2 * 1 * [2, 0] + 1/2 * (-1) * [-2, 0] = [2, 0]
    np.testing.assert_allclose(res.state["l2.weight"], [2.0, 0.0], rtol=1e-6)
    assert res.state["l1.weight"].dtype == np.float32
    assert res.cosines[0] == {"l1.weight": pytest.approx(1.0), "l2.weight": pytest.approx(1.0)}
    assert res.cosines[1] == {"l1.weight": pytest.approx(0.96), "l2.weight": pytest.approx(-1.0)}
    # Not renormalised: the coefficients of l1 sum to (1 + 0.96) / 2, not to one.
    assert res.coefficients["l1.weight"] == pytest.approx([0.5, 0.48])
    assert res.undefined == 0


def test_normalize_and_example_weights_variants():
    glob = {"l1.weight": f32(3, 4)}
    a, b = {"l1.weight": f32(3, 4)}, {"l1.weight": f32(4, 3)}
    # normalize: coefficients 0.5 / 0.98 and 0.48 / 0.98
    res = ldawa_aggregate([a, b], glob, HALF, normalize=True)
    np.testing.assert_allclose(res.state["l1.weight"], [3.42 / 0.98, 3.44 / 0.98], rtol=1e-6)
    assert sum(res.coefficients["l1.weight"]) == pytest.approx(1.0)
    # client_weights examples: n = (1, 3) gives b = (1/4, 3/4): 0.25 * [3, 4] + 0.75 * 0.96 * [4, 3]
    weights = client_base_weights([1, 3], "examples")
    np.testing.assert_allclose(weights, [0.25, 0.75])
    np.testing.assert_allclose(client_base_weights([1, 3], "uniform"), HALF)
    res = ldawa_aggregate([a, b], glob, weights)
    np.testing.assert_allclose(res.state["l1.weight"], [0.75 + 2.88, 1.0 + 2.16], rtol=1e-6)


def test_batchnorm_statistics_integer_buffers_and_zero_vectors():
    glob = {
        "bn.bias": f32(0, 0),  # a zero-initialised bias: its cosine is undefined
        "bn.running_var": f32(1, 1),
        "bn.num_batches_tracked": np.array(3, dtype=np.int64),
    }
    a = {"bn.bias": f32(1, 2), "bn.running_var": f32(2, 2), "bn.num_batches_tracked": np.array(4, dtype=np.int64)}
    b = {"bn.bias": f32(3, 4), "bn.running_var": f32(1, 0), "bn.num_batches_tracked": np.array(8, dtype=np.int64)}
    res = ldawa_aggregate([a, b], glob, HALF)  # bn_stats "cosine" (the authors' code)
    np.testing.assert_allclose(res.state["bn.bias"], [2.0, 3.0])  # delta = 1 for both: the plain mean
    # running_var: cos(a) = 1, cos(b) = 1 / sqrt(2): 0.5 * [2, 2] + 0.5 * 0.70710678 * [1, 0]
    np.testing.assert_allclose(res.state["bn.running_var"], [1.0 + 0.5 / math.sqrt(2), 1.0], rtol=1e-6)
    assert res.state["bn.num_batches_tracked"].dtype == np.int64 and int(res.state["bn.num_batches_tracked"]) == 6
    assert res.undefined == 2 and res.cosines[0]["bn.bias"] is None
    assert "bn.num_batches_tracked" not in res.coefficients  # never scaled
    # bn_stats "mean": the running statistics take the plain client-weighted mean and have no cosine.
    res = ldawa_aggregate([a, b], glob, HALF, bn_stats="mean")
    np.testing.assert_allclose(res.state["bn.running_var"], [1.5, 1.0])
    assert set(res.coefficients) == {"bn.bias"}


def test_layer_unit_module_and_model_granularity():
    glob = {"m.weight": f32(1, 0), "m.bias": f32(1), "n.weight": f32(2)}
    a = {"m.weight": f32(1, 0), "m.bias": f32(1), "n.weight": f32(2)}  # every cosine 1
    b = {"m.weight": f32(0, 1), "m.bias": f32(1), "n.weight": f32(-2)}
    # tensor: b's cosines are 0 (m.weight), 1 (m.bias), -1 (n.weight)
    res = ldawa_aggregate([a, b], glob, HALF)
    np.testing.assert_allclose(res.state["m.weight"], [0.5, 0.0])
    np.testing.assert_allclose(res.state["m.bias"], [1.0])
    np.testing.assert_allclose(res.state["n.weight"], [2.0])  # 0.5 * 2 + 0.5 * (-1) * (-2)
    # module: m = [weight, bias]; b's [0, 1, 1] against [1, 0, 1]: 1 / (sqrt 2 * sqrt 2) = 0.5
    res = ldawa_aggregate([a, b], glob, HALF, layer_unit="module")
    assert res.groups == {"m": ["m.weight", "m.bias"], "n": ["n.weight"]}
    np.testing.assert_allclose(res.state["m.weight"], [0.5, 0.25])  # 0.5 * [1, 0] + 0.25 * [0, 1]
    np.testing.assert_allclose(res.state["m.bias"], [0.75])
    # model: one vector [1, 0, 1, 2]; b's [0, 1, 1, -2]: (1 - 4) / (sqrt 6 * sqrt 6) = -0.5
    res = ldawa_aggregate([a, b], glob, HALF, granularity="model")
    assert list(res.groups) == ["model"] and res.cosines[1]["model"] == pytest.approx(-0.5)
    np.testing.assert_allclose(res.state["m.weight"], [0.5, -0.25])
    np.testing.assert_allclose(res.state["m.bias"], [0.25])
    np.testing.assert_allclose(res.state["n.weight"], [1.5])  # 0.5 * 2 + (-0.25) * (-2)


def test_groups_summary_and_input_errors():
    assert list(layer_groups(["a.b.w", "a.b.b", "a.c"], "module", "layer")) == ["a.b", "a"]
    summary = cosine_summary(
        {
            "backbone.layer1.0.conv1.weight": 0.9,
            "backbone.layer1.0.bn1.bias": None,
            "backbone.conv1.weight": 0.5,
            "projector.0.weight": 0.7,
        }
    )
    assert summary["cos_mean"] == pytest.approx(0.7) and summary["cos_min"] == 0.5 and summary["cos_max"] == 0.9
    assert summary["cos_by_group"] == {"backbone.layer1": 0.9, "backbone.conv1": 0.5, "projector.0": 0.7}
    assert summary["cos_undefined"] == 1
    with pytest.raises(ValueError, match="different keys"):
        ldawa_aggregate([{"a": f32(1)}, {"b": f32(1)}], {"a": f32(1)}, HALF)
    with pytest.raises(ValueError, match="global state lacks"):
        ldawa_aggregate([{"a": f32(1)}], {}, [1.0])
    with pytest.raises(ValueError, match="shapes"):
        ldawa_aggregate([{"a": f32(1)}], {"a": f32(1, 2)}, [1.0])


# ------------------------------------------------------------------ the strategy, with hand-built replies


def reply(node, arrays, pid, n):
    request = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
    metrics = MetricRecord({"partition-id": pid, "num-examples": n, "train_loss": 1.0, "train_s": 0.5})
    return Message(RecordDict({"arrays": to_array_record(arrays), "metrics": metrics}), reply_to=request)


def run_round(strategy, server_round, glob, uploads):
    messages = list(strategy.configure_train(server_round, to_array_record(glob), ConfigRecord(), NodeGrid([100, 101])))
    assert len(messages) == 2
    replies = [reply(100 + pid, arrays, pid, n) for pid, (arrays, n) in enumerate(uploads)]
    arrays, _ = strategy.aggregate_train(server_round, iter(replies))
    return from_array_record(arrays), strategy.round_records[server_round]


def test_strategy_measures_against_the_global_model_its_clients_received(task_identity):
    strategy = LDAWA(clients={0: 100, 1: 101}, clients_per_round=2, seed=0)
    glob = {"backbone.conv.weight": f32(3, 4), "backbone.bn.num_batches_tracked": np.array(0, np.int64)}
    uploads = [
        ({"backbone.conv.weight": f32(3, 4), "backbone.bn.num_batches_tracked": np.array(2, np.int64)}, 10),
        ({"backbone.conv.weight": f32(4, 3), "backbone.bn.num_batches_tracked": np.array(4, np.int64)}, 30),
    ]
    out, record = run_round(strategy, 1, glob, uploads)
    # 1/K, not n_k / n: the example counts (10, 30) do not enter.
    np.testing.assert_allclose(out["backbone.conv.weight"], [3.42, 3.44], rtol=1e-6)
    assert out["backbone.bn.num_batches_tracked"].dtype == np.int64
    assert out["backbone.bn.num_batches_tracked"].ravel().tolist() == [3]
    assert record["aggregation"] == "ldawa" and record["ldawa_layers"] == 1 and record["ldawa_undefined_cosines"] == 0
    assert record["ldawa_coef_sum_mean"] == pytest.approx(0.98)
    by_id = {c["id"]: c for c in record["clients"]}
    assert by_id[0]["ldawa_cos_mean"] == pytest.approx(1.0) and by_id[1]["ldawa_cos_mean"] == pytest.approx(0.96)
    assert by_id[1]["ldawa_cos_by_group"] == {"backbone.conv": pytest.approx(0.96)}
    assert by_id[1]["ldawa_base_weight"] == 0.5
    # Round 2 measures against round 2's global model (what its clients received), not round 1's.
    glob2 = {"backbone.conv.weight": f32(4, 3), "backbone.bn.num_batches_tracked": np.array(3, np.int64)}
    out, record = run_round(strategy, 2, glob2, uploads)
    np.testing.assert_allclose(out["backbone.conv.weight"], [0.5 * 0.96 * 3 + 2.0, 0.5 * 0.96 * 4 + 1.5], rtol=1e-6)
    assert not strategy._round_global  # nothing kept after the round


def test_warmup_rounds_use_the_example_weighted_average(task_identity):
    strategy = LDAWA(clients={0: 100, 1: 101}, clients_per_round=2, seed=0, options={"warmup_rounds": 1})
    glob = {"backbone.conv.weight": f32(3, 4)}
    uploads = [({"backbone.conv.weight": f32(0, 4)}, 10), ({"backbone.conv.weight": f32(4, 0)}, 30)]
    out, record = run_round(strategy, 1, glob, uploads)
    np.testing.assert_allclose(out["backbone.conv.weight"], [3.0, 1.0])  # 0.25 * [0, 4] + 0.75 * [4, 0]
    assert record["aggregation"] == "fedavg_warmup" and "ldawa_cos_mean" not in record["clients"][0]
    _, record = run_round(strategy, 2, glob, uploads)
    assert record["aggregation"] == "ldawa"
    assert [c["ldawa_cos_mean"] for c in record["clients"]] == pytest.approx([0.8, 0.6])  # 16/20 and 12/20


def test_strategy_options_are_validated(tmp_path):
    assert get_strategy_class("ldawa") is LDAWA and LDAWA.client_update == "fedssl"
    for bad, key in (
        ({"granularity": "block"}, "granularity"),
        ({"layer_unit": "param"}, "layer_unit"),
        ({"bn_stats": "global"}, "bn_stats"),
        ({"client_weights": "loss"}, "client_weights"),
        ({"warmup_rounds": -1}, "warmup_rounds"),
        ({"warmup_rounds": 1.5}, "warmup_rounds"),
    ):
        with pytest.raises(ValueError, match=rf"^strategy.options.{key}:"):
            LDAWA.check_options({**LDAWA.default_options(), **bad})
    raw = yaml.safe_load((REPO / "configs/smoke-ldawa.yaml").read_text())
    raw["strategy"]["options"]["normalize"] = 1  # types: checked against the defaults by the loader
    path = tmp_path / "bad-type.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^strategy.options.normalize: expected bool"):
        load_experiment({"config": str(path), "data.dataset": "synthetic"})
    raw["strategy"]["options"]["normalize"] = False
    raw["strategy"]["options"]["granularity"] = "block"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^strategy.options.granularity: must be one of layer, model"):
        load_experiment({"config": str(path), "data.dataset": "synthetic"})


def test_paper_study_resolves_to_the_paper_setting():
    from conftest import study_experiments

    runs = study_experiments("paper/ldawa-cross-silo")
    for name, cfg in runs.items():
        assert cfg.federation.num_clients == 10 and cfg.clients_per_round == 10 and cfg.rounds == 200, name
        assert cfg.data.partition == "dirichlet" and cfg.data.alpha == 0.1, name
        assert cfg.model.arch == "resnet18" and cfg.method.name == "simclr", name
    assert len(runs) == 13 and {cfg.train.local_epochs for cfg in runs.values()} == {1, 5, 10}
    assert {cfg.data.dataset for cfg in runs.values()} == {"cifar10", "cifar100"}
    warmup = {name: cfg.strategy.options["warmup_rounds"] for name, cfg in runs.items() if cfg.strategy.name == "ldawa"}
    assert warmup.pop("cifar10-e1-ldawa-code-warmup3") == 3 and len(warmup) == 6 and set(warmup.values()) == {0}
    assert sum(cfg.strategy.name == "fedssl" for cfg in runs.values()) == 6


# ------------------------------------------------------------------ a real `flwr run .`


@pytest.mark.e2e
def test_ldawa_smoke_run_records_the_cosines_and_resources(tmp_path, monkeypatch):
    from flwr_harness import SHORT_EVAL, data_overrides, flwr_run, read_jsonl
    from ssl_models.config import ExperimentConfig
    from ssl_models.factory import build_ssl_model

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny encoders on 2 shared cores: one torch thread per process
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke-ldawa.yaml' output-dir='{out}' {data_overrides()} train.max_steps_per_epoch=3 {SHORT_EVAL}",
        tmp_path / "flwr",
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in rounds] == [1, 2]

    # The layers: every floating array of at least one dimension that travels (online encoder + projector of
    # SimCLR, BatchNorm statistics included: bn_stats cosine), counted here from the model itself.
    cfg = ExperimentConfig.from_dict(summary["config"])
    model = build_ssl_model(cfg, seed=0)
    prefixes = model.shared_prefixes()
    layers = [
        k for k, v in model.state_dict().items() if k.startswith(prefixes) and v.is_floating_point() and v.dim() > 0
    ]
    for r in rounds:
        assert r["aggregation"] == "ldawa" and r["ldawa_layers"] == r["ldawa_scaled_arrays"] == len(layers)
        assert sorted(c["id"] for c in r["clients"]) == [0, 1]
        for c in r["clients"]:
            assert -1.0 <= c["ldawa_cos_min"] <= c["ldawa_cos_mean"] <= c["ldawa_cos_max"] <= 1.0
            assert c["ldawa_base_weight"] == 0.5
            assert {g.split(".")[0] for g in c["ldawa_cos_by_group"]} == {"backbone", "projector"}
            assert "backbone.layer4" in c["ldawa_cos_by_group"]
        # Unnormalised: each layer's coefficients sum to its mean cosine over the clients, below one after training.
        assert 0 < r["ldawa_coef_sum_min"] <= r["ldawa_coef_sum_mean"] < 1.0
    # Round 1's global model is the initial one: its zero BatchNorm biases and running means have no cosine
    # (2 clients x the same layers); after a round of training every layer has one, and then the coefficient sums
    # average to the clients' mean cosine (1/K sum_k delta_k^l, averaged over l).
    assert rounds[0]["ldawa_undefined_cosines"] > 0 and rounds[0]["ldawa_undefined_cosines"] % 2 == 0
    last = rounds[1]
    assert last["ldawa_undefined_cosines"] == 0
    assert last["ldawa_coef_sum_mean"] == pytest.approx(sum(c["ldawa_cos_mean"] for c in last["clients"]) / 2, abs=1e-5)
    # Resource figures: bytes both ways (the exchanged model: same parts down and up), the clients' FLOPs.
    for r in rounds:
        assert r["bytes_up"] > 0 and r["bytes_down"] == r["bytes_up"]
        assert all(c["bytes_up"] > 0 and c["flops_total"] > 0 for c in r["clients"])
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in rounds)
    res = summary["resources"]
    assert sorted(res["per_client"]) == ["0", "1"] and res["run"]["flops_run"] > 0
    assert (res["run"]["bytes_up"], res["run"]["bytes_down"]) == (
        summary["bytes_up_total"],
        summary["bytes_down_total"],
    )
    assert summary["config"]["strategy"]["name"] == "ldawa" and 0 <= summary["knn_acc"] <= 1
