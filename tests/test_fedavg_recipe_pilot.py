"""The in-process FedAvg recipe pilot (benchmarks/fedavg_recipe_pilot.py): its average against a hand computation,
its learning-rate schedule against the app's, and a whole tiny pilot that prints the random-init point and the
final scores."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ssl_models.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fedavg_recipe_pilot  # noqa: E402


def test_fedavg_shared_is_the_size_weighted_mean_by_hand():
    states = [{"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)},
              {"w": torch.tensor([4.0, -1.0]), "n": torch.tensor(9)}]
    merged = fedavg_recipe_pilot.fedavg_shared(states, [1, 3])
    # weights 1/4 and 3/4: [1/4 + 3, 2/4 - 3/4]
    assert torch.allclose(merged["w"], torch.tensor([3.25, -0.25]))
    assert merged["w"].dtype == torch.float32
    assert merged["n"].dtype == torch.int64 and int(merged["n"]) == 7  # 0.75 + 6.75 = 7.5, truncated as torch casts


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_round_lr_matches_the_apps_schedule(schedule):
    cfg = ExperimentConfig.from_dict({"rounds": 8, "train": {"lr": 0.002, "lr_schedule": schedule}})
    for server_round in range(1, 9):
        assert fedavg_recipe_pilot.round_lr(0.002, schedule, server_round, 8) == pytest.approx(cfg.round_lr(server_round))


def test_a_tiny_pilot_prints_random_init_then_rounds_then_final_scores(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.npz"
    np.savez(path, x_train=rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8), y_train=np.arange(60) % 3,
             x_test=rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8), y_test=np.arange(30) % 3)
    assert fedavg_recipe_pilot.main([
        "--data", str(path), "--images", "48", "--clients", "2", "--rounds", "2", "--epochs", "1", "--every", "1",
        "--width", "0.125", "--options", '{"proj_hidden_dim": 16, "proj_out_dim": 8, "pred_hidden_dim": 16}',
        "--train", '{"batch_size": 8, "lr": 0.001, "optimizer": "adam", "max_steps_per_epoch": 1}',
        "--lr-schedule", "constant"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["round"] for line in lines] == [0, 1, 1, 2, 2]
    assert lines[0]["linear_probe_acc"] is not None  # the random-init reference, probe included
    assert lines[2]["linear_probe_acc"] is None and lines[2]["knn_acc"] is not None  # kNN only between
    assert lines[4]["linear_probe_acc"] is not None  # the final point
    assert lines[1]["lr"] == lines[3]["lr"] == 0.001
