import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "docker"))  # compose_native, docker_engine: shared with benchmarks/bench_deployment.py
sys.path.insert(0, str(Path(__file__).resolve().parent))


NO_SKIP_VARIABLE = "FEDSSL_NO_SKIP"
STUDIES = REPO / "configs" / "studies"


def experiment_config_files(folder: Path = REPO / "configs") -> list[Path]:
    """Every shipped experiment config under ``folder`` (study files, under configs/studies/, are not configs)."""
    return sorted(p for p in Path(folder).rglob("*.yaml") if STUDIES not in p.parents)


def study_files() -> list[Path]:
    return sorted(STUDIES.rglob("*.yaml"))


def study_experiments(name: str) -> dict:
    """variant -> validated ExperimentConfig of ``configs/studies/<name>.yaml`` (its first seed)."""
    from fedssl_study.spec import load_study

    study = load_study(STUDIES / f"{name}.yaml", validate=False)
    return {variant: study.experiment(variant) for variant in study.variants}


def skip_unless_required(reason: str) -> None:
    """Skip for a missing tool, file or privilege, unless ``$FEDSSL_NO_SKIP`` is set (``.ci/run`` sets it: CI is
    meant to have the data copy, docker-compose, openssl and root), in which case the test fails, naming what
    is missing. Skips for what CI never has (a CUDA device) stay plain skips."""
    if os.environ.get(NO_SKIP_VARIABLE, "") not in ("", "0"):
        pytest.fail(
            f"{reason} (not skipped: ${NO_SKIP_VARIABLE} is set, so this machine is expected to have it)", pytrace=False
        )
    pytest.skip(reason)


def cifar10_npz() -> Path | None:
    """The shared CIFAR-10 dev copy: $FEDSSL_CIFAR10_NPZ, or ../shared/data beside the checkout."""
    env = os.environ.get("FEDSSL_CIFAR10_NPZ")
    candidates = [Path(env)] if env else []
    candidates.append(REPO.parent / "shared" / "data" / "cifar10-dev.npz")
    for path in candidates:
        if path.is_file():
            return path.resolve()
    return None


@pytest.fixture(scope="session")
def cifar_npz() -> Path:
    path = cifar10_npz()
    if path is None:
        skip_unless_required(
            "CIFAR-10 dev npz not found (set FEDSSL_CIFAR10_NPZ or place ../shared/data/cifar10-dev.npz)"
        )
    return path


@pytest.fixture
def task_identity():
    """Flower builds a Message only inside a run (it stamps the run's ids): give a test outside one a fake run,
    and take it away after. A module whose every test builds messages sets
    ``pytestmark = pytest.mark.usefixtures("task_identity")``."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


class NodeGrid:
    """The part of a Flower Grid a strategy's configure_* reads: the connected node ids, in the given order."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread_in_this_process():
    """The tests train tiny models in this process too: on 2 cores one intra-op thread is faster than two (their
    parallel regions are too small to pay for the second thread, and a second process busy on one core stalls
    every one of them), and it leaves the other core to the processes an e2e test starts."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_torch_thread_in_e2e_runs(request, monkeypatch):
    """The real `flwr run .` tests use tiny models: on a 2-core machine one torch thread per process (the
    ServerApp's evaluation, the ClientApps' training) runs faster than threads fighting over the cores, and
    keeps the suite's time down. The runs inherit this environment."""
    if request.node.get_closest_marker("e2e") is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
