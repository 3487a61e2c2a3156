"""The newer methods (L-DAWA, FedX, Orchestra, FedU2) deployed: a SuperLink and two SuperNodes on loopback, each
method's smoke config submitted with `flwr run . fed` in turn (one round each). Every run finishes with its own
strategy on the server and its own client rule on the nodes (the FAB each node installs), and counts its bytes and
FLOPs as in simulation (each method's simulated end-to-end test is in its own test file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_harness import REPO, read_jsonl

pytestmark = pytest.mark.e2e

NEWER = ("ldawa", "fedx", "orchestra", "fedu2")


def test_each_newer_method_runs_in_a_loopback_deployment(tmp_path):
    from fedssl_gpu.deploy import LoopbackDeployment

    deployment = LoopbackDeployment(
        tmp_path / "deployment", 2, allowed_roots=[tmp_path], name="fed", threads_per_node=1
    )
    procs, outs = {}, {}
    with deployment:
        for name in NEWER:
            outs[name] = tmp_path / f"out-{name}"
            run_config = (
                f"config='configs/smoke-{name}.yaml' data.dataset='synthetic' rounds=1 output-dir='{outs[name]}' "
                "train.max_steps_per_epoch=2 eval.linear_probe=false eval.random_init_reference=false checkpoint.every=0"
            )
            if name == "orchestra":  # one round that trains: no seeding round (the simulated test runs that one)
                run_config += " strategy.options.seed_round=false"
            procs[name] = subprocess.run(
                [str(Path(sys.executable).parent / "flwr"), "run", ".", "fed", "--stream", "--run-config", run_config],
                cwd=REPO,
                env=deployment.cli_env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        logs = deployment.logs_tail()
    for name in NEWER:
        out, proc = outs[name], procs[name]
        assert (out / "summary.json").is_file(), name + ": " + (proc.stdout + proc.stderr)[-3000:] + logs
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["strategy"]["name"] == name and summary["rounds_completed"] == 1
        (round_1,) = read_jsonl(out / "metrics.jsonl")
        assert round_1["num_clients"] == 2 and round_1["num_failed"] == 0, name
        assert round_1["bytes_up"] > 0 and round_1["bytes_down"] > 0, name
        assert all(c["flops_total"] > 0 and c["images_trained"] > 0 for c in round_1["clients"]), name
