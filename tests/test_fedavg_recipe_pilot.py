"""The in-process FedAvg recipe pilot (benchmarks/fedavg_recipe_pilot.py, over the server's ``weighted_average``
and the app's ``round_lr``): a whole tiny pilot prints the random-init point, every round with the app's learning
rate for it, kNN between and the final scores."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fedavg_recipe_pilot


@pytest.mark.parametrize("schedule, lrs", [("constant", [0.001, 0.001]), ("cosine", [0.001, 0.0005])])
def test_a_tiny_pilot_prints_random_init_then_rounds_then_final_scores(tmp_path, capsys, schedule, lrs):
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.npz"
    np.savez(
        path,
        x_train=rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8),
        y_train=np.arange(60) % 3,
        x_test=rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8),
        y_test=np.arange(30) % 3,
    )
    assert (
        fedavg_recipe_pilot.main(
            [
                "--data",
                str(path),
                "--images",
                "48",
                "--clients",
                "2",
                "--rounds",
                "2",
                "--epochs",
                "1",
                "--every",
                "1",
                "--width",
                "0.125",
                "--options",
                '{"proj_hidden_dim": 16, "proj_out_dim": 8, "pred_hidden_dim": 16}',
                "--train",
                '{"batch_size": 8, "lr": 0.001, "optimizer": "adam", "max_steps_per_epoch": 1}',
                "--lr-schedule",
                schedule,
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["round"] for line in lines] == [0, 1, 1, 2, 2]
    assert lines[0]["linear_probe_acc"] is not None  # the random-init reference, probe included
    assert lines[2]["linear_probe_acc"] is None and lines[2]["knn_acc"] is not None  # kNN only between
    assert lines[4]["linear_probe_acc"] is not None  # the final point
    assert [lines[1]["lr"], lines[3]["lr"]] == pytest.approx(lrs)


def test_a_vit_pilot_builds_the_encoder_at_the_depth_asked(tmp_path, capsys, monkeypatch):
    """--arch / --arch-options reach the registry: a 2-block ViT with MoCo v3 (the layer-wise comparison's recipe
    pilots) is built, trained for a round and scored."""
    built = []
    real = fedavg_recipe_pilot.build_ssl_model

    def spy(cfg, seed=None, **options):
        model = real(cfg, seed=seed, **options)
        built.append((cfg.model.arch, options, len(model.backbone.blocks)))
        return model

    monkeypatch.setattr(fedavg_recipe_pilot, "build_ssl_model", spy)
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.npz"
    np.savez(
        path,
        x_train=rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8),
        y_train=np.arange(40) % 2,
        x_test=rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
        y_test=np.arange(20) % 2,
    )
    assert (
        fedavg_recipe_pilot.main(
            [
                "--data",
                str(path),
                "--images",
                "32",
                "--clients",
                "1",
                "--rounds",
                "1",
                "--epochs",
                "1",
                "--arch",
                "vit_tiny",
                "--arch-options",
                '{"depth": 2}',
                "--width",
                "0.125",
                "--method",
                "mocov3",
                "--options",
                '{"proj_hidden_dim": 16, "proj_out_dim": 8, "pred_hidden_dim": 16}',
                "--train",
                '{"batch_size": 8, "lr": 0.001, "optimizer": "adamw", "max_steps_per_epoch": 1}',
            ]
        )
        == 0
    )
    assert built == [("vit_tiny", {"depth": 2}, 2)]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["round"] for line in lines] == [0, 1, 1]
    assert lines[-1]["linear_probe_acc"] is not None
