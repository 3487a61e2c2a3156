"""Real `flwr run .` simulations on Flower's default local federation (2 SuperNodes)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from client_app.placement import physical_gpu_count
from conftest import skip_unless_required
from flwr_harness import REPO, SHORT_EVAL, data_overrides, flwr_run, read_jsonl

pytestmark = pytest.mark.e2e


def test_smoke_config_runs_end_to_end_and_fedssl_eval_scores_the_encoder(tmp_path):
    out = tmp_path / "out"
    proc = flwr_run(f"config='configs/smoke.yaml' output-dir='{out}' {data_overrides()}", tmp_path / "flwr")
    log = proc.stdout + proc.stderr
    assert (out / "summary.json").is_file(), log[-4000:]

    rounds = read_jsonl(out / "metrics.jsonl")
    gpus = physical_gpu_count()
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[1]["train_loss"] < rounds[0]["train_loss"]  # training works: the loss falls
    for r in rounds:
        assert math.isfinite(r["train_loss"]) and r["train_loss"] > 0
        assert r["bytes_up"] > 0 and r["bytes_down"] == r["bytes_up"]  # same parts both ways
        assert r["wall_s"] > 0 and 0 <= r["knn_acc"] <= 1
        assert sorted(c["id"] for c in r["clients"]) == [0, 1]
        for c in r["clients"]:  # the client's timeline, in seconds after the server created its message
            assert c["precision"] in ("fp32", "bf16")  # what its steps ran in (a CPU: no fp16)
            # where it trained: the CPU here; on a GPU machine the GPU that flwr_run's share made Ray assign it
            assert c["gpus_on_machine"] == gpus and c["device_reason"], c
            assert c["device"].startswith("cuda:") if gpus else c["device"] == "cpu", c
            t = c["timeline_s"]
            assert t["import_start"] <= t["app_imported"]
            assert 0 <= t["handler_start"] <= t["reply_ready"] <= t["received"]
            assert t["reply_ready"] - t["handler_start"] >= c["train_s"] - 0.002  # points rounded to 1 ms
    summary = json.loads((out / "summary.json").read_text())
    assert 0 <= summary["linear_probe_acc"] <= 1 and 0 <= summary["knn_acc"] <= 1
    assert summary["rounds_completed"] == 2 and summary["config"]["name"] == "smoke"
    # The random-init reference of the run's architecture, and the gains over it.
    rand = summary["random_init"]["resnet18"]
    assert 0 <= rand["linear_probe_acc"] <= 1 and 0 <= rand["knn_acc"] <= 1
    assert summary["linear_probe_gain_over_random"] == pytest.approx(
        summary["linear_probe_acc"] - rand["linear_probe_acc"]
    )
    assert summary["knn_gain_over_random"] == pytest.approx(summary["knn_acc"] - rand["knn_acc"])
    assert "gain over random init: linear probe" in (out / "progress.log").read_text().splitlines()[-1]
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in rounds)
    assert summary["cpu_despite_gpu"] is False and sum(summary["client_devices"].values()) == 4  # 2 clients x 2 rounds
    assert (
        all(d.startswith("cuda:") for d in summary["client_devices"])
        if gpus
        else summary["client_devices"] == {"cpu": 4}
    )
    # Resources per client and run: each client's per-step FLOPs are those of the run's model counted here
    # independently, and the run's FLOPs are per-sample FLOPs x images trained, summed over clients and rounds.
    res = summary["resources"]
    expected_flops = smoke_step_flops(summary["config"])
    assert sorted(res["per_client"]) == ["0", "1"]
    for pid, mine in res["per_client"].items():
        assert mine["rounds"] == 2 and mine["flops_total_max"] == pytest.approx(expected_flops, rel=1e-9)
        assert mine["bytes_up"] == sum(c["bytes_up"] for r in rounds for c in r["clients"] if c["id"] == int(pid))
        assert mine["mem_total_max"] > mine["mem_activations_max"] > 0 and mine["rss_peak_bytes_max"] > 2**20
        assert (
            mine["images_trained"]
            == sum(c["images_trained"] for r in rounds for c in r["clients"] if c["id"] == int(pid))
            > 0
        )
    assert res["run"]["flops_run"] == pytest.approx(
        expected_flops * sum(m["images_trained"] for m in res["per_client"].values())
    )
    assert (res["run"]["bytes_up"], res["run"]["bytes_down"]) == (
        summary["bytes_up_total"],
        summary["bytes_down_total"],
    )
    assert (out / "model.pt").stat().st_size > 0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round 2/2" in (out / "progress.log").read_text()
    assert gpus or "2 clients ok | on cpu\n" in (out / "progress.log").read_text()  # the round lines say where

    from conftest import cifar10_npz

    npz = cifar10_npz()
    if npz is None:
        skip_unless_required("fedssl-eval part needs the CIFAR-10 dev npz")
    feats = tmp_path / "feats.npz"
    script = Path(sys.executable).parent / "fedssl-eval"  # the installed console script
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "ssl_models.evaluation.cli"]
    # Same model, same data file, the protocol recorded in model.pt: the run's own numbers, exactly.
    ev = subprocess.run(
        cmd + [str(out / "model.pt"), str(npz), "--export-features", str(feats)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    line = json.loads(ev.stdout.strip().splitlines()[-1])
    assert line["protocol"]["source"] == "checkpoint" and line["num_train"] == summary["eval"]["num_train"]
    assert (line["knn_acc"], line["linear_probe_acc"]) == (summary["knn_acc"], summary["linear_probe_acc"])
    assert feats.is_file()
    # And the random-init reference for the same data: --random-init with the run's architecture and seed.
    ev = subprocess.run(
        cmd
        + [
            "--random-init",
            "resnet18",
            "--width",
            "0.125",
            "--init-seed",
            "0",
            str(npz),
            "--max-train",
            "400",
            "--max-test",
            "200",
            "--probe-epochs",
            "20",
            "--no-linear",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout.strip().splitlines()[-1])["random_init"] is True


def smoke_step_flops(config: dict) -> float:
    """FLOPs per sample of one local step of the run's model at its batch, counted in this process."""
    from ssl_models.accounting import training_step_flops
    from ssl_models.config import ExperimentConfig
    from ssl_models.factory import build_ssl_model

    cfg = ExperimentConfig.from_dict(config)
    method = build_ssl_model(cfg, seed=0)
    return training_step_flops(method, (3, 32, 32), batch_size=min(cfg.train.batch_size, 8))["total"]


def test_client_count_mismatch_stops_with_instructions(tmp_path):
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke.yaml' output-dir='{out}' data.dataset='synthetic'",
        tmp_path / "flwr",
        federation_config="num-supernodes=3",
    )
    progress = (out / "progress.log").read_text()
    assert "federation.num_clients=2" in progress and "num-supernodes=2" in progress, proc.stdout[-3000:]
    assert not (out / "summary.json").exists()


def test_fedema_smoke_keeps_client_state_across_rounds(tmp_path):
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke-fedema.yaml' output-dir='{out}' {data_overrides()} {SHORT_EVAL}", tmp_path / "flwr"
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]  # training works: the loss falls
    by_round = [{c["id"]: c for c in r["clients"]} for r in rounds]
    assert all(r["lambda_from"] == "server_first_round" and r["divergence_form"] == "paper" for r in rounds)
    for pid in (0, 1):
        first, second, third = (by_round[i][pid] for i in range(3))
        assert first["mu"] is None and first["ema"] is False  # first participation: takes the global model
        # Algorithm 1: the server sets lambda = tau / ||W_g - W_k|| from the client's first upload, once.
        assert first["lambda_set"] > 0 and first["lambda_set_divergence"] > 0
        assert abs(first["lambda_set"] * first["lambda_set_divergence"] - 0.7) < 1e-9
        assert "lambda_set" not in second and "lambda_set" not in third
        # Every client in every round: the client's first divergence is the server's, so its first mu is tau.
        assert second["ema"] and abs(second["mu"] - 0.7) < 1e-9 and second["lambda_from_server"] is True
        assert second["lambda"] == first["lambda_set"] == third["lambda"]
        assert abs(second["divergence"] - first["lambda_set_divergence"]) < 1e-9 * first["lambda_set_divergence"]
        assert abs(third["mu"] - min(1.0, third["lambda"] * third["divergence"])) < 1e-9
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["augment"]["jitter_p"] == 0.8  # the recipe is recorded with the run
    assert summary["config"]["strategy"]["options"]["lambda_from"] == "server_first_round"
    files = sorted(p.name for p in (out / "client_state").glob("run-*/client_*.npz"))
    # One version per round trained, the last two kept (RoundStateStore): rounds 2 and 3.
    assert files == ["client_0.r000002.npz", "client_0.r000003.npz", "client_1.r000002.npz", "client_1.r000003.npz"]


def test_flesd_smoke_mixed_resnet18_resnet34_federation(tmp_path):
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke-flesd.yaml' output-dir='{out}' {data_overrides()} {SHORT_EVAL}", tmp_path / "flwr"
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert sorted((c["id"], c["arch"]) for c in r["clients"]) == [(0, "resnet18"), (1, "resnet34")]
        assert math.isfinite(r["distill_loss"]) and r["distill_steps"] > 0 and r["public_size"] == 200
        # The student fits the ensembled similarities: the distillation loss falls within the round.
        assert r["distill_loss_last_quarter"] < r["distill_loss_first_quarter"]
        # Up: two top-10% similarity matrices (fp16 values + uint8 indices), far below the model bytes down,
        # which only the ResNet-18 client receives.
        assert 0 < r["bytes_up"] < r["bytes_down"]
    summary = json.loads((out / "summary.json").read_text())
    assert 0 <= summary["linear_probe_acc"] <= 1 and summary["data"]["public_size"] == 200
    # Per-client resources follow each client's own architecture: the ResNet-34 client's step costs more.
    per_client = summary["resources"]["per_client"]
    assert per_client["1"]["flops_total_max"] > 1.5 * per_client["0"]["flops_total_max"] > 0
    assert per_client["1"]["mem_total_max"] > per_client["0"]["mem_total_max"]


def test_central_strategy_trains_one_client_on_the_union(tmp_path):
    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke.yaml' strategy.name='central' output-dir='{out}' {data_overrides()}", tmp_path / "flwr"
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    union = sum(summary["data"]["client_sizes"])
    assert summary["central"]["train_images"] == union
    losses = []
    for r in rounds:
        # One trainer, on every client's images: client 0's node, with the union.
        assert [(c["id"], c["num_examples"]) for c in r["clients"]] == [(0, union)]
        losses.append(r["train_loss"])
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert summary["strategy"] == "central" and "linear_probe_gain_over_random" in summary
