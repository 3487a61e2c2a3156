"""The references every result is read against: the random-init encoder (same architecture, seed and protocol as
the run) and the centralized strategy (the union of the clients' data, one trainer); and `fedssl-eval` scoring a
run's model with the run's own protocol."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from client_app.rounds.weights import local_images
from conftest import NodeGrid
from fedssl_wire import to_array_record
from server_app.app import ServerEvaluator, random_init_entries
from ssl_models.config import ExperimentConfig
from ssl_models.data.datasets import subsample
from ssl_models.data.splits import client_images, federated_split, load_experiment_data, union_images
from ssl_models.evaluation import cli
from ssl_models.evaluation.checkpoint import save_encoder_checkpoint
from ssl_models.evaluation.protocol import evaluate_backbone
from ssl_models.networks import build_backbone
from strategies import get_strategy_class


def tiny_cfg(**overrides) -> ExperimentConfig:
    raw = {
        "name": "t",
        "seed": 3,
        "rounds": 2,
        "data": {
            "dataset": "synthetic",
            "synthetic_train": 120,
            "synthetic_test": 60,
            "synthetic_classes": 4,
            "partition": "iid",
        },
        "model": {"arch": "resnet18", "width": 0.125},
        "method": {"name": "simclr", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16}},
        "federation": {"num_clients": 3},
        "eval": {"max_train": 80, "max_test": 40, "probe_epochs": 3, "knn_k": 10},
    }
    for key, value in overrides.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return ExperimentConfig.from_dict(raw)


# ---------------------------------------------------------------------- random-init reference


def test_random_init_reference_is_the_runs_own_initial_encoder_scored_with_the_runs_protocol():
    cfg = tiny_cfg()
    evaluator = ServerEvaluator(cfg)
    got = evaluator.random_init("resnet18", linear=True)
    # Independently: torch seeded with the run's seed, the backbone built first (as the run's initial model is),
    # scored on the run's evaluation subsets (seeds seed+3 / seed+4) with the run's kNN k and probe epochs.
    data = load_experiment_data(cfg)
    tr = subsample(data.y_train, 80, seed=cfg.seed + 3)
    te = subsample(data.y_test, 40, seed=cfg.seed + 4)
    torch.manual_seed(cfg.seed)
    backbone, _ = build_backbone("resnet18", 0.125)
    want = evaluate_backbone(
        backbone,
        data.x_train[tr],
        data.y_train[tr],
        data.x_test[te],
        data.y_test[te],
        data.num_classes,
        knn_k=10,
        probe_epochs=3,
        seed=cfg.seed,
    )
    assert got == {"knn_acc": want["knn_acc"], "linear_probe_acc": want["linear_probe_acc"]}
    # The seed decides the network: another run seed gives another reference network (and its own scores).
    other = ServerEvaluator(tiny_cfg(**{"eval.max_train": 80})).random_init("resnet18", linear=False)
    assert set(other) == {"knn_acc", "linear_probe_acc"} and other["linear_probe_acc"] is None


def test_random_init_entries_gains_by_hand():
    reference = {
        "resnet18": {"knn_acc": 0.30, "linear_probe_acc": 0.33},
        "resnet34": {"knn_acc": 0.28, "linear_probe_acc": 0.31},
    }
    # One global model.
    single = random_init_entries({"knn_acc": 0.36, "linear_probe_acc": 0.41}, {}, {"global": "resnet18"}, reference)
    assert single["linear_probe_gain_over_random"] == pytest.approx(0.08)
    assert single["knn_gain_over_random"] == pytest.approx(0.06)
    assert single["random_init"] is reference
    # Per-client models of two architectures: each against its own architecture; headline = the smallest gain.
    by_model = {
        "client_0": {"knn_acc": 0.35, "linear_probe_acc": 0.40},
        "client_1": {"knn_acc": 0.29, "linear_probe_acc": 0.36},
    }
    entries = random_init_entries(
        {"knn_acc": 0.29, "linear_probe_acc": 0.36},
        by_model,
        {"client_0": "resnet18", "client_1": "resnet34"},
        reference,
    )
    assert by_model["client_0"]["linear_probe_gain_over_random"] == pytest.approx(0.07)
    assert by_model["client_1"]["linear_probe_gain_over_random"] == pytest.approx(0.05)
    assert by_model["client_1"]["knn_gain_over_random"] == pytest.approx(0.01)
    assert entries["linear_probe_gain_over_random"] == pytest.approx(0.05)
    assert entries["knn_gain_over_random"] == pytest.approx(0.01)
    # No linear probe: no gain for it.
    none = random_init_entries(
        {"knn_acc": 0.3, "linear_probe_acc": None},
        {},
        {"global": "resnet18"},
        {"resnet18": {"knn_acc": 0.3, "linear_probe_acc": None}},
    )
    assert none["linear_probe_gain_over_random"] is None and none["knn_gain_over_random"] == pytest.approx(0.0)


def test_random_init_reference_can_be_switched_off():
    assert tiny_cfg().eval.random_init_reference is True
    assert tiny_cfg(**{"eval.random_init_reference": False}).eval.random_init_reference is False


# ---------------------------------------------------------------------- fedssl-eval reproduces the run's protocol


def write_npz(path, cfg):
    data = load_experiment_data(cfg)
    np.savez(path, x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test)
    return data


def test_fedssl_eval_uses_the_protocol_recorded_in_the_checkpoint(tmp_path, capsys):
    cfg = tiny_cfg(**{"data.dataset": "npz", "data.path": str(tmp_path / "d.npz")})
    write_npz(tmp_path / "d.npz", tiny_cfg())
    evaluator = ServerEvaluator(cfg)
    torch.manual_seed(11)
    backbone, _ = build_backbone("resnet18", 0.125)
    run_scores = evaluator._score(backbone, knn=True, linear=True)
    save_encoder_checkpoint(
        tmp_path / "model.pt", backbone, "resnet18", 0.125, extra={"eval_protocol": evaluator.protocol()}
    )
    assert cli.main([str(tmp_path / "model.pt"), str(tmp_path / "d.npz"), "--device", "cpu"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["protocol"]["source"] == "checkpoint"
    assert (line["protocol"]["train_subset_seed"], line["protocol"]["test_subset_seed"]) == (cfg.seed + 3, cfg.seed + 4)
    assert (line["num_train"], line["num_test"]) == (80, 40)
    assert line["knn_acc"] == run_scores["knn_acc"] and line["linear_probe_acc"] == run_scores["linear_probe_acc"]
    # A command-line option wins over the recorded one.
    assert cli.main([str(tmp_path / "model.pt"), str(tmp_path / "d.npz"), "--knn-k", "5", "--no-linear"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["protocol"]["knn_k"] == 5 and line["protocol"]["source"] == "mixed"


def test_fedssl_eval_random_init_gives_the_runs_reference(tmp_path, capsys):
    cfg = tiny_cfg(**{"data.dataset": "npz", "data.path": str(tmp_path / "d.npz")})
    write_npz(tmp_path / "d.npz", tiny_cfg())
    want = ServerEvaluator(cfg).random_init("resnet18", linear=True)
    # The run scored the subsets it drew with seeds seed+3 / seed+4: cut them into a file, and score the random
    # init of the run's architecture, width and seed on it.
    data = load_experiment_data(cfg)
    tr = subsample(data.y_train, 80, seed=cfg.seed + 3)
    te = subsample(data.y_test, 40, seed=cfg.seed + 4)
    np.savez(
        tmp_path / "cut.npz",
        x_train=data.x_train[tr],
        y_train=data.y_train[tr],
        x_test=data.x_test[te],
        y_test=data.y_test[te],
    )
    assert (
        cli.main(
            [
                "--random-init",
                "resnet18",
                "--width",
                "0.125",
                "--seed",
                str(cfg.seed),
                "--knn-k",
                "10",
                "--probe-epochs",
                "3",
                str(tmp_path / "cut.npz"),
            ]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["random_init"] is True and line["arch"] == "resnet18"
    assert line["knn_acc"] == want["knn_acc"] and line["linear_probe_acc"] == want["linear_probe_acc"]
    # Another init seed is another network: its features differ.
    assert (
        cli.main(
            [
                "--random-init",
                "resnet18",
                "--width",
                "0.125",
                "--init-seed",
                str(cfg.seed + 1),
                "--no-linear",
                "--knn-k",
                "10",
                "--export-features",
                str(tmp_path / "f2.npz"),
                str(tmp_path / "cut.npz"),
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "--random-init",
                "resnet18",
                "--width",
                "0.125",
                "--init-seed",
                str(cfg.seed),
                "--no-linear",
                "--knn-k",
                "10",
                "--export-features",
                str(tmp_path / "f1.npz"),
                str(tmp_path / "cut.npz"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert not np.allclose(np.load(tmp_path / "f1.npz")["test_features"], np.load(tmp_path / "f2.npz")["test_features"])


def test_fedssl_eval_random_init_errors_name_the_input(tmp_path, capsys):
    cfg = tiny_cfg()
    write_npz(tmp_path / "d.npz", cfg)
    assert cli.main(["--random-init", "resnet999", str(tmp_path / "d.npz")]) == 2
    assert "--random-init" in capsys.readouterr().err
    assert cli.main(["--random-init", "resnet18", str(tmp_path / "m.pt"), str(tmp_path / "d.npz")]) == 2
    assert "only the data file" in capsys.readouterr().err
    assert cli.main(["--random-init", "resnet18", "--input-mean", "0.5,0.5,0.5", str(tmp_path / "d.npz")]) == 2
    assert "--input-mean and --input-std go together" in capsys.readouterr().err


# ---------------------------------------------------------------------- centralized reference


def test_union_images_are_every_clients_partition():
    cfg = tiny_cfg()
    data = load_experiment_data(cfg)
    union = union_images(cfg)
    parts = [client_images(cfg, pid) for pid in range(3)]
    assert len(union) == sum(len(p) for p in parts) == len(data.x_train)
    split = federated_split(cfg, data.y_train)
    np.testing.assert_array_equal(union, data.x_train[np.sort(np.concatenate(split.client_idx))])
    np.testing.assert_array_equal(local_images(cfg, 1, None, "union"), union)
    np.testing.assert_array_equal(local_images(cfg, 1, None), parts[1])


def test_union_scope_refuses_a_node_with_its_own_data_file(tmp_path):
    with pytest.raises(ValueError, match="union of the experiment's partitions.*own data file"):
        local_images(tiny_cfg(), 0, str(tmp_path / "site.npz"), "union")
    with pytest.raises(ValueError, match="data-scope: must be 'partition' or 'union'"):
        local_images(tiny_cfg(), 0, None, "everything")


def test_central_trains_one_client_on_the_union(task_identity):
    cfg = tiny_cfg(**{"strategy.name": "central"})
    central = get_strategy_class("central")(
        clients={0: 100, 1: 101, 2: 102}, clients_per_round=3, seed=0, node_wait_s=0.0
    )
    data = load_experiment_data(cfg)
    central.prepare(cfg, data, federated_split(cfg, data.y_train))
    arrays = to_array_record({"backbone.w": np.ones(3, np.float32)})
    msgs = list(central.configure_train(1, arrays, ConfigRecord({"experiment": "{}"}), NodeGrid([100, 101, 102])))
    assert [m.metadata.dst_node_id for m in msgs] == [100]
    assert msgs[0].content["config"]["data-scope"] == "union"
    # Client 0's node gone: the lowest connected client trains instead.
    msgs = list(central.configure_train(2, arrays, ConfigRecord({"experiment": "{}"}), NodeGrid([102, 101])))
    assert [m.metadata.dst_node_id for m in msgs] == [101]
    extras = central.summary_extras({})
    assert extras["central"]["train_images"] == len(data.x_train)


def test_central_refuses_mixed_architectures(tmp_path):
    import yaml

    from server_app.experiment import load_experiment
    from ssl_models.config import ConfigError

    raw = {
        "name": "m",
        "rounds": 1,
        "data": {"dataset": "synthetic"},
        "strategy": {"name": "central"},
        "federation": {"num_clients": 2},
        "model": {"arch": "resnet18", "width": 0.125, "client_archs": ["resnet18", "resnet34"]},
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="model.client_archs: strategy 'central' averages weights"):
        load_experiment({"config": str(tmp_path / "m.yaml")})
