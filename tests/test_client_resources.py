"""Resource accounting of every strategy's clients (issue 11, item 6): the per-step figures a client measures once per
model shape, and the server's per-client and per-run totals and maxima, against hand computations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from client_app.rounds import resources
from client_app.rounds.weights import local_training
from ssl_models.accounting import analytic_training_memory, training_step_flops
from ssl_models.config import ExperimentConfig
from ssl_models.factory import build_ssl_model
from strategies import FedSSL


def tiny_cfg(**train) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "model": {"arch": "resnet18", "width": 0.125},
            "method": {"name": "simclr", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16}},
            "train": {
                "local_epochs": 1,
                "batch_size": 16,
                "optimizer": "adam",
                "lr": 1e-3,
                "fast_path": False,
                **train,
            },
        }
    )


def images(n: int = 40) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    """Every test here counts measurements: none may be served from figures an earlier run left on this disk."""
    monkeypatch.setenv(resources.RESOURCE_CACHE_VARIABLE, "off")


def test_local_training_reports_the_step_figures_of_its_model(monkeypatch):
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})
    cfg = tiny_cfg()
    method = build_ssl_model(cfg, seed=0)
    expected_flops = training_step_flops(method, (3, 32, 32), batch_size=8)
    expected_memory = analytic_training_memory(method, "adam", 16, view_shape=(3, 32, 32))
    stats = local_training(cfg, method, images(40), lr=1e-3, seed=0, device=torch.device("cpu"))
    r = stats.resources
    assert r["flops_total"] == pytest.approx(expected_flops["total"], rel=1e-12)
    assert r["flops_fvcore_equivalent"] == pytest.approx(expected_flops["forward"] / 2, rel=1e-12)
    for key, value in expected_memory.items():
        assert r[f"mem_{key}"] == value
    assert r["images_trained"] == 2 * 16  # 40 images, batch 16, drop_last: 2 steps
    assert r["rss_peak_bytes"] > 2**20
    # the reply's metrics carry them as res.*
    from client_app.app import train_metrics

    metrics = train_metrics(3, stats)
    assert metrics["res.flops_total"] == r["flops_total"] and metrics["res.mem_total"] == r["mem_total"]


def test_the_figures_are_measured_once_per_model_shape_and_batch(monkeypatch):
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})
    counted = []
    real = resources.training_step_flops

    def counting(method, *args, **kwargs):
        counted.append(kwargs.get("batch_size"))
        return real(method, *args, **kwargs)

    monkeypatch.setattr(resources, "training_step_flops", counting)
    cfg = tiny_cfg()
    for seed in (0, 1):  # a new model object of the same shape (the next round): no new measurement
        local_training(cfg, build_ssl_model(cfg, seed=seed), images(40), lr=1e-3, seed=0, device="cpu")
    assert counted == [8]
    small = tiny_cfg(batch_size=4)  # another batch: another memory figure, measured again
    stats = local_training(small, build_ssl_model(small, seed=0), images(40), lr=1e-3, seed=0, device="cpu")
    assert counted == [8, 4] and stats.resources["images_trained"] == 10 * 4


def test_the_figures_are_kept_on_the_nodes_disk_for_the_next_process(monkeypatch, tmp_path):
    """A deployed SuperNode runs every message in a new process: the second process reads the first one's figures."""
    monkeypatch.setenv(resources.RESOURCE_CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})
    counted = []
    real = resources.training_step_flops
    monkeypatch.setattr(resources, "training_step_flops", lambda *a, **k: counted.append(1) or real(*a, **k))
    cfg = tiny_cfg()
    first = local_training(cfg, build_ssl_model(cfg, seed=0), images(40), lr=1e-3, seed=0, device="cpu")
    files = list((tmp_path / "cache").rglob("*.json"))
    assert counted == [1] and len(files) == 1
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})  # the next message's new process
    second = local_training(cfg, build_ssl_model(cfg, seed=1), images(40), lr=1e-3, seed=0, device="cpu")
    assert counted == [1]
    for key in ("flops_total", "flops_fvcore_equivalent", "mem_total", "mem_activations"):
        assert second.resources[key] == first.resources[key]
    # another method option (same shapes) is another key: measured again, kept beside the first
    other = tiny_cfg()
    other.method.options["temperature"] = 0.2
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})
    local_training(other, build_ssl_model(other, seed=0), images(40), lr=1e-3, seed=0, device="cpu")
    assert counted == [1, 1] and len(list((tmp_path / "cache").rglob("*.json"))) == 2
    # a torn file is measured again and rewritten, never read as figures
    files[0].write_text('{"flops_tot')
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})
    third = local_training(cfg, build_ssl_model(cfg, seed=0), images(40), lr=1e-3, seed=0, device="cpu")
    assert counted == [1, 1, 1] and third.resources["flops_total"] == first.resources["flops_total"]
    assert json.loads(files[0].read_text())["flops_total"] == first.resources["flops_total"]


def test_without_account_the_loop_measures_nothing(monkeypatch):
    # what layer-wise rounds use: they account their sub-models themselves (lw.* metrics)
    monkeypatch.setattr(resources, "_STEP_RESOURCES", {})
    monkeypatch.setattr(resources, "training_step_flops", lambda *a, **k: pytest.fail("measured without account"))
    cfg = tiny_cfg()
    stats = local_training(cfg, build_ssl_model(cfg, seed=0), images(20), lr=1e-3, seed=0, device="cpu", account=False)
    assert stats.resources == {}


def client(pid: int, flops: float, images: float, mem: float, rss: float, up: int) -> dict:
    return {
        "id": pid,
        "flops_total": flops,
        "flops_fvcore_equivalent": flops / 6,
        "images_trained": images,
        "mem_total": mem,
        "mem_activations": mem / 2,
        "rss_peak_bytes": rss,
        "bytes_up": up,
    }


def test_server_totals_and_maxima_by_hand():
    s = FedSSL(clients={0: 10, 1: 11}, clients_per_round=2, seed=0)
    s.account_resources([client(0, 100.0, 32, 1000, 5e8, 7), client(1, 300.0, 16, 3000, 4e8, 9)])
    s.account_resources([client(0, 100.0, 64, 1200, 6e8, 7)])  # round 2: client 1 missed it
    s.round_records = {1: {"bytes_up": 16, "bytes_down": 20}, 2: {"bytes_up": 7, "bytes_down": 10}}
    out = s.resource_summary()
    c0, c1, run = out["per_client"]["0"], out["per_client"]["1"], out["run"]
    assert (c0["rounds"], c1["rounds"]) == (2, 1)
    assert c0["flops_run"] == 100 * 32 + 100 * 64 and c1["flops_run"] == 300 * 16
    assert run["flops_run"] == 100 * 32 + 100 * 64 + 300 * 16
    assert (c0["mem_total_max"], c0["rss_peak_bytes_max"], c0["bytes_up"]) == (1200, 6e8, 14)
    assert (run["mem_total_max"], run["rss_peak_bytes_max"], run["flops_total_max"]) == (3000, 6e8, 300)
    assert (run["bytes_up"], run["bytes_down"]) == (23, 30)
    assert "flops_run" in out["units"]


def test_a_rounds_extra_flops_add_to_the_run_and_are_kept_apart():
    s = FedSSL(clients={0: 10, 1: 11}, clients_per_round=2, seed=0)
    s.account_resources(
        [{**client(0, 100.0, 32, 1000, 5e8, 7), "flops_extra": 500.0}, client(1, 300.0, 16, 3000, 4e8, 9)]
    )
    s.account_resources([{**client(0, 100.0, 32, 1000, 5e8, 7), "flops_extra": 250.0}])
    c0, c1, run = (
        s.client_resources["per_client"]["0"],
        s.client_resources["per_client"]["1"],
        s.client_resources["run"],
    )
    assert c0["flops_run"] == 2 * 100 * 32 + 500 + 250 and c0["flops_extra_run"] == 750
    assert c1["flops_run"] == 300 * 16 and "flops_extra_run" not in c1
    assert run["flops_run"] == 2 * 100 * 32 + 300 * 16 + 750 and run["flops_extra_run"] == 750


def test_a_client_without_figures_counts_its_rounds_and_bytes_only():
    s = FedSSL(clients={0: 10}, clients_per_round=1, seed=0)
    s.account_resources([{"id": 0, "bytes_up": 5}])
    assert s.client_resources["per_client"]["0"] == {
        "rounds": 1,
        "bytes_up": 5,
        "images_trained": 0.0,
        "flops_run": 0.0,
    }


def test_the_totals_survive_a_checkpoint():
    s = FedSSL(clients={0: 10, 1: 11}, clients_per_round=2, seed=0)
    s.account_resources([client(0, 100.0, 32, 1000, 5e8, 7)])
    plain, arrays, stores = s.checkpoint_state()
    resumed = FedSSL(clients={0: 10, 1: 11}, clients_per_round=2, seed=0)
    resumed.restore_state(plain, arrays, stores)
    resumed.account_resources([client(0, 100.0, 32, 1000, 5e8, 7)])
    assert resumed.client_resources["per_client"]["0"]["rounds"] == 2
    assert resumed.client_resources["run"]["flops_run"] == 2 * 100 * 32
    s.account_resources([client(0, 100.0, 32, 1000, 5e8, 7)])  # the original is not shared with the copy
    assert plain["client_resources"]["run"]["flops_run"] == 100 * 32
