"""A ServerApp killed in the middle of a round of a real `flwr run`, then resumed with `resume=<output-dir>`: no
round lost, none repeated, and the same final metrics as the same run left alone. (Resuming a finished run, which
changes nothing: tests/test_run_inprocess.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flwr_harness import REPO, flwr_env, flwr_run, kill_flwr_home_processes, read_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch):
    """Tiny models on a 2-core machine: one torch thread per process runs faster than threads fighting over the
    cores (the runs inherit this environment)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


ROUNDS = 3


def overrides() -> str:
    from conftest import cifar10_npz

    npz = cifar10_npz()
    data = f"data.path='{npz}'" if npz else "data.dataset='synthetic'"
    # Two local epochs make a round last long enough to be cut in the middle.
    return f"config='configs/smoke.yaml' rounds={ROUNDS} train.local_epochs=2 {data}"


def comparable(rounds: list[dict]) -> list[dict]:
    keep = ("round", "train_loss", "knn_acc", "bytes_up", "bytes_down", "num_examples")
    return [
        {**{k: r.get(k) for k in keep}, "clients": sorted((c["id"], c["loss"]) for c in r["clients"])} for r in rounds
    ]


def test_a_serverapp_killed_mid_round_resumes_to_the_same_final_metrics(tmp_path):
    alone = tmp_path / "alone"
    proc = flwr_run(f"{overrides()} output-dir='{alone}'", tmp_path / "flwr-alone")
    assert (alone / "summary.json").is_file(), (proc.stdout + proc.stderr)[-3000:]

    cut = tmp_path / "cut"
    home = tmp_path / "flwr-cut"
    flwr = Path(sys.executable).parent / "flwr"
    cmd = [
        str(flwr) if flwr.exists() else "flwr",
        "run",
        str(REPO),
        "--stream",
        "--run-config",
        f"{overrides()} output-dir='{cut}'",
    ]
    run = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=flwr_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not (cut / "checkpoints" / "round-000002" / "meta.json").is_file():
            assert time.monotonic() < deadline and run.poll() is None, "the run never checkpointed round 2"
            time.sleep(0.05)
        time.sleep(0.3)  # round 3 is under way
    finally:
        kill_flwr_home_processes(home)  # the SuperLink, the ServerApp and every ClientApp: a dead server
        run.kill()
        run.wait()
    assert not (cut / "summary.json").exists(), "the run finished before it could be cut"
    assert max(r["round"] for r in read_jsonl(cut / "metrics.jsonl")) == 2  # round 3 was lost with the server

    proc = flwr_run(f"resume='{cut}'", tmp_path / "flwr-resume")
    assert (cut / "summary.json").is_file(), (proc.stdout + proc.stderr)[-3000:]
    progress = (cut / "progress.log").read_text()
    assert "resuming 'smoke'" in progress and "after round 2 of 3" in progress

    resumed, reference = read_jsonl(cut / "metrics.jsonl"), read_jsonl(alone / "metrics.jsonl")
    assert [r["round"] for r in resumed] == [1, 2, 3]  # none lost, none repeated
    assert comparable(resumed) == comparable(reference)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (alone, cut))
    for key in ("linear_probe_acc", "knn_acc", "final_train_loss", "bytes_up_total", "rounds_completed"):
        assert b[key] == a[key], key
    # The books of the whole run, not of the resumed part: bytes of every round, the time before the cut too
    for key in ("bytes_up", "bytes_down"):
        assert b["resources"]["run"][key] == a["resources"]["run"][key] == a[f"{key}_total"], key
    assert b["resumed_after_round"] == 2 and b["run_s"] > b["run_s_this_process"] > 0
    meta = (
        json.loads((cut / "checkpoints" / "round-000002" / "meta.json").read_text())
        if (cut / "checkpoints" / "round-000002").is_dir()
        else None
    )
    assert meta is None or b["run_s"] >= meta["elapsed_s"] + b["run_s_this_process"] - 1e-6


def test_a_resume_names_what_it_ignores_and_refuses_a_checkpoint_of_another_model(tmp_path, monkeypatch):
    """In process: the ServerApp's resume checks, without a federation."""
    import numpy as np

    from server_app.app import check_checkpoint_fits, ignored_on_resume
    from server_app.experiment import load_experiment
    from ssl_models.config import ConfigError
    from ssl_models.factory import build_ssl_model, state_to_numpy

    cfg, _ = load_experiment({"config": "configs/smoke.yaml", "data.dataset": "synthetic"})
    note = ignored_on_resume(
        {"config": "configs/smoke-fedema.yaml", "data.dataset": "synthetic", "rounds": 9, "resume": "x"}, cfg
    )
    assert "run-config keys ['data.dataset', 'rounds'] ignored" in note
    assert "the given config's" in note and "strategy.name ('fedema'; the run's 'fedssl')" in note
    state = state_to_numpy(build_ssl_model(cfg, seed=0).state_dict())
    check_checkpoint_fits(cfg, state)  # its own model fits
    wrong = dict(state)
    wrong["backbone.stem.0.weight"] = np.zeros((3, 3, 3, 3), np.float32)
    wrong["backbone.extra"] = np.zeros(2, np.float32)
    with pytest.raises(
        ConfigError,
        match=r"^resume: the checkpoint's global model does not fit .*"
        r"backbone.stem.0.weight is \(3, 3, 3, 3\) in the checkpoint, \(\d+, 3, 3, 3\) in "
        r"the model; backbone.extra is not in the model",
    ):
        check_checkpoint_fits(cfg, wrong)
