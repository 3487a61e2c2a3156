"""Tests of encoder checkpoints (ssl_models.evaluation.checkpoint) and the ``fedssl-eval`` CLI (ssl_models.evaluation.cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ssl_models.data.datasets import synthetic_dataset
from ssl_models.evaluation.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    load_encoder_checkpoint,
    save_encoder_checkpoint,
)
from ssl_models.evaluation.cli import main
from ssl_models.evaluation.protocol import evaluate_backbone
from ssl_models.networks import build_backbone

REPO = Path(__file__).resolve().parents[1]
ARCH, WIDTH = "resnet18", 0.125


def _trained_looking_backbone(seed: int = 0) -> torch.nn.Module:
    """A tiny backbone whose BN buffers differ from a fresh build, so a round trip is actually checked."""
    torch.manual_seed(seed)
    backbone, _ = build_backbone(ARCH, WIDTH)
    backbone.train()
    with torch.no_grad():
        backbone(torch.rand(8, 3, 32, 32))  # updates running_mean/var and num_batches_tracked
    return backbone.eval()


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    save_encoder_checkpoint(path, _trained_looking_backbone(), ARCH, WIDTH, extra={"method": "byol", "round": 3})
    return path


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> Path:
    data = synthetic_dataset(num_train=120, num_test=60, num_classes=6, seed=1)
    path = tmp_path_factory.mktemp("data") / "toy.npz"
    np.savez(path, x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test)
    return path


# ----------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------


def test_checkpoint_round_trip_restores_weights_buffers_and_metadata(tmp_path):
    original = _trained_looking_backbone(seed=3)
    extra = {
        "method": "simclr",
        "round": np.int64(7),
        "lr": np.float32(0.5),
        "history": [1.0, None, (2, "x")],
        "mask": np.array([1, 2]),
    }
    path = save_encoder_checkpoint(tmp_path / "nested" / "dir" / "model.pt", original, ARCH, WIDTH, extra=extra)
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temporary file left behind

    loaded, info = load_encoder_checkpoint(path)
    assert info == {
        "format": CHECKPOINT_FORMAT,
        "arch": ARCH,
        "width": WIDTH,
        "feature_dim": 64,
        "path": str(path),
        "input_normalization": None,
        "extra": {"method": "simclr", "round": 7, "lr": 0.5, "history": [1.0, None, (2, "x")], "mask": [1, 2]},
    }
    assert not loaded.training
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), original(images))


def test_checkpoint_file_is_plain_data_readable_with_weights_only(checkpoint_path):
    payload = torch.load(checkpoint_path, weights_only=True)
    assert payload["format"] == "fedssl-encoder/1"
    assert (payload["arch"], payload["width"], payload["feature_dim"]) == (ARCH, WIDTH, 64)
    assert payload["extra"] == {"method": "byol", "round": 3}
    assert all(isinstance(t, torch.Tensor) for t in payload["state_dict"].values())


def test_save_rejects_a_backbone_that_does_not_match_arch_or_width(tmp_path):
    backbone, _ = build_backbone(ARCH, WIDTH)
    with pytest.raises(ValueError, match="does not match arch='resnet18' width=0.25"):
        save_encoder_checkpoint(tmp_path / "m.pt", backbone, ARCH, 0.25)
    with pytest.raises(ValueError, match="does not match arch='resnet34'"):
        save_encoder_checkpoint(tmp_path / "m.pt", backbone, "resnet34", WIDTH)
    assert not (tmp_path / "m.pt").exists()


def test_save_rejects_extra_values_that_weights_only_loading_would_refuse(tmp_path):
    backbone, _ = build_backbone(ARCH, WIDTH)
    with pytest.raises(ValueError, match=r"extra\['cfg'\]\['opt'\]"):
        save_encoder_checkpoint(tmp_path / "m.pt", backbone, ARCH, WIDTH, extra={"cfg": {"opt": object()}})
    with pytest.raises(ValueError, match="extra must be a dict"):
        save_encoder_checkpoint(tmp_path / "m.pt", backbone, ARCH, WIDTH, extra=[1, 2])


def test_load_reports_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_encoder_checkpoint(tmp_path / "absent.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load_encoder_checkpoint(garbage)
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, foreign)  # some other project's checkpoint
    with pytest.raises(CheckpointError, match="not a fedssl-encoder/1 encoder checkpoint"):
        load_encoder_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="not a file"):
        load_encoder_checkpoint(tmp_path)


def test_load_rejects_weights_that_do_not_fit_the_declared_architecture(tmp_path, checkpoint_path):
    payload = torch.load(checkpoint_path, weights_only=True)
    payload["width"] = 0.25  # the stored tensors are width-0.125 shaped
    tampered = tmp_path / "tampered.pt"
    torch.save(payload, tampered)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_encoder_checkpoint(tampered)
    payload = torch.load(checkpoint_path, weights_only=True)
    del payload["state_dict"]
    torch.save(payload, tampered)
    with pytest.raises(CheckpointError, match="state_dict"):
        load_encoder_checkpoint(tampered)


# ----------------------------------------------------------------------------------------------------------
# fedssl-eval
# ----------------------------------------------------------------------------------------------------------


def _run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_prints_one_json_line_matching_the_library_result(capsys, checkpoint_path, data_path):
    code, out, err = _run_cli(capsys, checkpoint_path, data_path, "--probe-epochs", "5", "--knn-k", "20")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["model_path"] == str(checkpoint_path) and record["data_path"] == str(data_path)
    assert (record["arch"], record["width"], record["feature_dim"]) == (ARCH, WIDTH, 64)
    assert (record["num_train"], record["num_test"], record["num_classes"]) == (120, 60, 6)
    assert record["protocol"]["knn_k"] == 20 and record["protocol"]["probe_epochs"] == 5
    assert record["protocol"]["knn_temperature"] == 0.1 and record["protocol"]["seed"] == 0
    assert record["seconds"] > 0 and record["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "knn_acc" in err  # progress goes to stderr

    backbone, _ = load_encoder_checkpoint(checkpoint_path)
    with np.load(data_path) as arrays:
        expected = evaluate_backbone(
            backbone,
            arrays["x_train"],
            arrays["y_train"],
            arrays["x_test"],
            arrays["y_test"],
            6,
            device=record["device"],
            knn_k=20,
            probe_epochs=5,
        )
    assert record["knn_acc"] == expected["knn_acc"]
    assert record["linear_probe_acc"] == expected["linear_probe_acc"]


def test_cli_subsamples_per_class_and_exports_features(capsys, tmp_path, checkpoint_path, data_path):
    export = tmp_path / "out" / "features.npz"
    code, out, _ = _run_cli(
        capsys,
        checkpoint_path,
        data_path,
        "--max-train",
        "60",
        "--max-test",
        "30",
        "--no-linear",
        "--export-features",
        export,
        "--seed",
        "3",
    )
    assert code == 0
    record = json.loads(out)
    assert (record["num_train"], record["num_test"]) == (60, 30)
    assert record["linear_probe_acc"] is None and 0.0 <= record["knn_acc"] <= 1.0
    with np.load(export) as features:
        assert sorted(features.files) == ["test_features", "test_labels", "train_features", "train_labels"]
        assert features["train_features"].shape == (60, 64) and features["test_features"].shape == (30, 64)
        # the toy set is balanced (20 per class in train): a stratified half keeps 10 of each of the 6 classes
        assert np.bincount(features["train_labels"], minlength=6).tolist() == [10] * 6
        assert np.bincount(features["test_labels"], minlength=6).tolist() == [5] * 6


@pytest.mark.parametrize(
    "case", ["missing_model", "missing_data", "model_is_not_a_checkpoint", "data_is_not_an_npz", "npz_without_arrays"]
)
def test_cli_input_errors_exit_2_with_one_message_and_no_traceback(capsys, tmp_path, checkpoint_path, data_path, case):
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    wrong_npz = tmp_path / "wrong.npz"
    np.savez(wrong_npz, images=np.zeros((2, 32, 32, 3), np.uint8))
    model, data = {
        "missing_model": (tmp_path / "absent.pt", data_path),
        "missing_data": (checkpoint_path, tmp_path / "absent.npz"),
        "model_is_not_a_checkpoint": (data_path, data_path),
        "data_is_not_an_npz": (checkpoint_path, text_file),
        "npz_without_arrays": (checkpoint_path, wrong_npz),
    }[case]
    code, out, err = _run_cli(capsys, model, data)
    assert code == 2
    assert out == ""
    assert "fedssl-eval: error:" in err and "Traceback" not in err


def test_cli_rejects_bad_flags_with_exit_2(capsys, checkpoint_path, data_path):
    code, _, err = _run_cli(capsys, checkpoint_path, data_path, "--max-train", "0")
    assert code == 2 and "--max-train" in err
    code, _, err = _run_cli(capsys, checkpoint_path, data_path, "--device", "tpu")
    assert code == 2 and "--device" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cli_cuda_without_gpu_is_a_usage_error(capsys, checkpoint_path, data_path):
    code, out, err = _run_cli(capsys, checkpoint_path, data_path, "--device", "cuda")
    assert code == 2 and out == "" and "no CUDA device" in err


def test_cli_on_a_file_with_one_class_is_a_usage_error(capsys, checkpoint_path, tmp_path):
    data = synthetic_dataset(num_train=40, num_test=20, num_classes=2, seed=1)
    path = tmp_path / "one-class.npz"
    np.savez(
        path, x_train=data.x_train, y_train=np.zeros(40, np.int64), x_test=data.x_test, y_test=np.zeros(20, np.int64)
    )
    code, out, err = _run_cli(capsys, checkpoint_path, path, "--no-linear")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        f"fedssl-eval: error: data file {path}: its training labels hold 1 "
        "class(es) (1 in the file); scoring an encoder needs labelled images of "
        "at least 2"
    )


def test_cli_as_a_process_keeps_stdout_to_the_json_line(checkpoint_path, data_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssl_models.evaluation.cli",
            str(checkpoint_path),
            str(data_path),
            "--no-linear",
            "--max-train",
            "30",
            "--max-test",
            "12",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["num_test"] == 12


def test_cli_on_the_cifar10_dev_copy(capsys, cifar_npz, checkpoint_path):
    code, out, _ = _run_cli(
        capsys, checkpoint_path, cifar_npz, "--max-train", "500", "--max-test", "200", "--probe-epochs", "3"
    )
    assert code == 0
    record = json.loads(out)
    assert (record["num_train"], record["num_test"], record["num_classes"]) == (500, 200, 10)
    assert 0.0 <= record["knn_acc"] <= 1.0 and 0.0 <= record["linear_probe_acc"] <= 1.0
