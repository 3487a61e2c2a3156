"""Run `flwr run .` against a private, auto-started local SuperLink and clean up after it (the tests' name for
``fedssl_study.launcher``'s helpers, which the study runner and the benchmarks use too).

Each call gets its own FLWR_HOME and ports, and every process that inherited that FLWR_HOME (the SuperLink, its
SuperExec, the simulation and Ray workers) is killed afterwards, so no daemon outlives the test or holds CI's output
open.
"""

from __future__ import annotations

from pathlib import Path

from fedssl_study.launcher import flwr_env, flwr_run, free_port, kill_processes_with_env, processes_with_env, read_jsonl  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

# For runs whose test checks the training, not the final scores: a short probe and no random-init reference (the
# smoke and central tests check those).
SHORT_EVAL = "eval.probe_epochs=5 eval.random_init_reference=false"


def data_overrides() -> str:
    """The run-config override for the tests' data: the CIFAR-10 dev copy where there is one, else synthetic."""
    from conftest import cifar10_npz

    npz = cifar10_npz()
    return f"data.path='{npz}'" if npz else "data.dataset='synthetic'"


def kill_flwr_home_processes(flwr_home: Path, grace_s: float = 5.0) -> None:
    kill_processes_with_env("FLWR_HOME", str(flwr_home), grace_s)
