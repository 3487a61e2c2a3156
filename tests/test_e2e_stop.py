"""`flwr stop` on a running simulation: the progress log says where the run stopped (the `stopped:` line the docs
promise), no round is recorded after it, and no client trains on or writes state for the stopped run."""

from __future__ import annotations

import time

import pytest

from fedssl_study.launcher import Launcher
from fedssl_wire import RUN_STOPPED_MARKER

pytestmark = pytest.mark.e2e


def test_flwr_stop_leaves_a_stopped_line_and_no_client_writes_after_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    launcher = Launcher(flwr_home=tmp_path / "flwr")
    try:
        run_id = launcher.submit(
            f"config='configs/smoke.yaml' output-dir='{out}' data.dataset='synthetic' rounds=4 train.local_epochs=3",
            num_supernodes=2,
        )
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline, "no round finished"
            time.sleep(0.2)
        launcher.stop(run_id)
        stopped_at = time.time()
        while launcher.status(run_id) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert launcher.status(run_id) == "finished:stopped"
        time.sleep(8)  # a client that kept training would write its next state in this time
    finally:
        launcher.close()
    lines = (out / "progress.log").read_text().splitlines()
    stopped = [i for i, line in enumerate(lines) if " stopped: " in line]
    assert len(stopped) == 1, lines
    assert "flwr stop" in lines[stopped[0]] and "resume with resume=" in lines[stopped[0]]
    assert not any(" round " in line for line in lines[stopped[0] + 1 :]), lines  # nothing recorded after it
    marker = out / "client_state" / RUN_STOPPED_MARKER
    assert marker.is_file()
    late = [p.name for p in (out / "client_state").rglob("client_*.npz") if p.stat().st_mtime > stopped_at + 1.0]
    assert late == [], f"client state written after the stop: {late}"
    assert not (out / "summary.json").exists()
