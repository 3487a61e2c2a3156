"""A real multi-machine deployment on one machine: three network namespaces linked by veth pairs.

The SuperLink machine runs the services of ``docker/server/compose.yml`` and each client machine those of
``docker/client/compose.yml``, started natively with the commands the compose files give the containers
(``docker/compose_native.py``), TLS and SuperNode authentication on. The ``flwr`` CLI runs on a client
machine, as a user's laptop would, and dials the SuperLink by name across the veth link.

Checked: ``configs/smoke.yaml`` runs to the end and writes its results in the ServerApp's output folder; a
SuperNode whose key is not registered is refused; a SuperNode killed during the run does not stop it (that
round finishes with the client that answered, and the restarted node is back for the next round); the
ClientApp's log says where its output went; a node with its own data (``data-path``) trains on it. Needs
root; skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from compose_native import DOCKER_DIR, REPO, NativeMachine, kill_group, load_compose, wait_for, write_own_data
from conftest import skip_unless_required
from flwr_harness import SHORT_EVAL, kill_processes_with_env, read_jsonl
from netns import Network, namespaces_unavailable

pytestmark = pytest.mark.e2e

ROUNDS = 3
MARKER = "FEDSSL_MULTIHOST_TEST"  # every process of the test carries it, so teardown finds them all


@pytest.fixture(scope="module")
def network():
    reason = namespaces_unavailable()
    if reason:
        skip_unless_required(f"multi-host test skipped: {reason}")
    for tool in ("openssl", "ssh-keygen"):
        if shutil.which(tool) is None:
            skip_unless_required(f"multi-host test skipped: {tool} is not installed (needed by docker/make-*.sh)")
    net = Network(
        tag=str(os.getpid() % 100000),
        spokes=["n1", "n2"],
        hub="link",
        hub_names=["superlink"],
        local_names={"link": ["superlink"], "n1": ["supernode"], "n2": ["supernode"]},
    )
    with net:
        yield net


def base_env(tag: str) -> dict[str, str]:
    return {
        MARKER: tag,
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def script(name: str, *args: str) -> None:
    proc = subprocess.run(
        ["bash", str(DOCKER_DIR / name), *map(str, args)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def data_run_config() -> tuple[str, Path | None]:
    from conftest import cifar10_npz

    npz = cifar10_npz()
    return (f"data.path='{npz}'", npz.parent) if npz else ("data.dataset='synthetic'", None)


class Deployment:
    """The machines of the test: ``server`` in the hub namespace, ``client-<i>`` in the spokes."""

    def __init__(self, net: Network, tmp: Path, data_dir: Path | None) -> None:
        self.net, self.tmp = net, tmp
        self.env = base_env(net.tag)
        # The operator's roots for the paths a `flwr run` user names (server_app/paths.py): the data and outputs.
        self.env["FEDSSL_ALLOWED_ROOTS"] = os.pathsep.join(str(p) for p in (data_dir, tmp / "server" / "outputs") if p)
        self.logs = tmp / "logs"
        self.data_dir = data_dir or tmp / "data"
        self.server_secrets = tmp / "server" / "secrets"
        self.output_dir = tmp / "server" / "outputs"
        self.machines: dict[str, NativeMachine] = {}
        self.cli_home = tmp / "cli-home"

    def make_server_secrets(self) -> None:
        ips = [self.net.hub_ip(s) for s in self.net.spokes]
        script("make-certs.sh", self.server_secrets, "superlink", "localhost", "127.0.0.1", *ips)

    def make_client_secrets(self, name: str) -> Path:
        folder = self.tmp / name / "secrets"
        script("make-supernode-key.sh", folder)
        shutil.copy(self.server_secrets / "ca.crt", folder / "ca.crt")  # the operator hands out the CA
        return folder

    def start_server(self) -> NativeMachine:
        compose = load_compose(
            [DOCKER_DIR / "server" / "compose.yml"],
            {
                "SECRETS_DIR": str(self.server_secrets),
                "OUTPUT_DIR": str(self.output_dir),
                "DATA_DIR": str(self.data_dir),
                "SUPERLINK_STATE_DIR": str(self.tmp / "server" / "state"),
            },
        )
        machine = NativeMachine(compose, self.tmp / "roots" / "server", netns=self.net.ns("link"), env=self.env)
        machine.start("superlink", self.logs / "server")
        machine.start("superexec-serverapp", self.logs / "server")
        self.machines["server"] = machine
        return machine

    def client_machine(
        self, name: str, host: str, partition_id: int, secrets: Path, own_data: Path | None = None
    ) -> NativeMachine:
        """A client machine; with ``own_data`` (a file there), the node trains on it instead of a partition."""
        env = {
            "SUPERLINK_ADDRESS": "superlink:8000",
            "PARTITION_ID": str(partition_id),
            "NUM_PARTITIONS": "2",
            "SECRETS_DIR": str(secrets),
            "DATA_DIR": str(own_data.parent if own_data else self.data_dir),
            "STATE_DIR": str(self.tmp / name / "state"),
        }
        if own_data:
            env["NODE_CONFIG"] = f"data-path='/data/{own_data.name}'"
        compose = load_compose([DOCKER_DIR / "client" / "compose.yml"], env)
        # The "machines" share this machine's cores: one torch thread each keeps them from oversubscribing.
        machine = NativeMachine(
            compose, self.tmp / "roots" / name, netns=self.net.ns(host), env={**self.env, "OMP_NUM_THREADS": "1"}
        )
        self.machines[name] = machine
        return machine

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The `flwr` CLI on client machine n1 (the user's laptop), with a TLS connection named `fed`."""
        return self.net.run(
            "n1",
            [str(Path(sys.executable).parent / "flwr"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env, "FLWR_HOME": str(self.cli_home)},
            cwd=REPO,
        )

    def write_cli_config(self) -> None:
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            '[superlink]\ndefault = "fed"\n\n[superlink.fed]\naddress = "superlink:8000"\n'
            f'root-certificates = "{self.server_secrets / "ca.crt"}"\n'
        )

    def teardown(self) -> None:
        for machine in self.machines.values():
            machine.stop_all()
        kill_processes_with_env(MARKER, self.net.tag)


def reachable(net: Network, host: str, name: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({name!r}, {port}), timeout=2).close()"
    return net.run(host, [sys.executable, "-c", code], capture_output=True).returncode == 0


def progress_line(output_dir: Path, needle: str) -> str | None:
    for log in output_dir.glob("*/progress.log"):
        for line in log.read_text().splitlines():
            if needle in line:
                return line
    return None


def test_three_hosts_tls_auth_unregistered_node_refused_and_killed_node_survived(network, tmp_path):
    data_config, data_dir = data_run_config()
    dep = Deployment(network, tmp_path, data_dir)
    run = None
    try:
        dep.make_server_secrets()
        dep.start_server()
        # Across the veth link, by the name in the certificate: client machines reach the SuperLink.
        wait_for(
            lambda: reachable(network, "n1", "superlink", 8000) and reachable(network, "n2", "superlink", 8000),
            60,
            "the SuperLink to listen on port 8000 of its host",
        )

        dep.write_cli_config()
        secrets = {name: dep.make_client_secrets(name) for name in ("client-1", "client-2", "rogue")}
        for name in ("client-1", "client-2"):  # the operator registers the two legitimate nodes only
            reg = dep.cli("supernode", "register", str(secrets[name] / "supernode.key.pub"), "fed")
            assert reg.returncode == 0 and "registered" in reg.stdout, reg.stdout + reg.stderr

        # A node with an unregistered key is refused and stops.
        rogue = dep.client_machine("rogue", "n2", 1, secrets["rogue"])
        proc = rogue.start("supernode", dep.logs / "rogue").proc
        proc.wait(timeout=90)
        rogue_log = rogue.services["supernode"].log()
        assert proc.returncode != 0 and "Failed to activate SuperNode" in rogue_log, rogue_log[-2000:]

        # Client machine 2 trains on its own data (NODE_CONFIG data-path), not on a partition.
        own = write_own_data(tmp_path / "site-2" / "site-2.npz", num_train=96)
        clients = {
            "client-1": dep.client_machine("client-1", "n1", 0, secrets["client-1"]),
            "client-2": dep.client_machine("client-2", "n2", 1, secrets["client-2"], own_data=own),
        }
        for name, machine in clients.items():
            machine.start("supernode", dep.logs / name)
            machine.start("superexec-clientapp", dep.logs / name)

        run_log = tmp_path / "flwr-run.log"
        run_config = (
            f"config='configs/smoke.yaml' rounds={ROUNDS} {data_config} "
            "federation.round_timeout_s=300 federation.node_wait_s=300 "
            f"{SHORT_EVAL}"  # the run's course is the check, not its scores
        )
        with open(run_log, "w") as log:
            run = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    network.ns("n1"),
                    str(Path(sys.executable).parent / "flwr"),
                    "run",
                    str(REPO),
                    "fed",
                    "--stream",
                    "--run-config",
                    run_config,
                ],
                cwd=REPO,
                env={**os.environ, **dep.env, "FLWR_HOME": str(dep.cli_home)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

        # Kill client machine 2 (both of its services) once round 1 is done, restart it once round 2 is.
        wait_for(lambda: progress_line(dep.output_dir, f"round 1/{ROUNDS}"), 400, "round 1 to finish")
        for service in ("superexec-clientapp", "supernode"):
            clients["client-2"].stop(service, sig=signal.SIGKILL)
        round2 = wait_for(
            lambda: progress_line(dep.output_dir, f"round 2/{ROUNDS}"), 400, "round 2 to finish without client 2"
        )
        for service in ("supernode", "superexec-clientapp"):
            clients["client-2"].start(service, dep.logs / "client-2", log_name=f"{service}.restarted.log")
        run.wait(timeout=600)
        out_log = run_log.read_text()

        # Results in the ServerApp's output folder (OUTPUT_DIR, the executor's /app/outputs).
        summaries = list(dep.output_dir.glob("smoke-*/summary.json"))
        assert len(summaries) == 1, out_log[-4000:]
        out = summaries[0].parent
        summary = json.loads(summaries[0].read_text())
        assert 0 <= summary["linear_probe_acc"] <= 1 and summary["output_dir"] == str(out)
        assert (out / "model.pt").stat().st_size > 0
        rounds = read_jsonl(out / "metrics.jsonl")
        assert [r["num_clients"] for r in rounds] == [2, 1, 2], rounds
        assert [f["id"] for f in rounds[1]["failed_clients"]] == [1], rounds[1]
        assert "1 clients ok, 1 failed (client 1:" in round2
        assert sorted(c["id"] for c in rounds[2]["clients"]) == [0, 1]  # the restarted node is back
        for c in (c for r in rounds for c in r["clients"]):
            # Deployed, every message gets a new ClientApp process, started after the server created the message
            # (clock ticks of 10 ms), and the timeline's points follow each other.
            t = c["timeline_s"]
            points = [
                t[k]
                for k in ("process_start", "import_start", "app_imported", "handler_start", "reply_ready", "received")
            ]
            assert points[0] >= -0.02 and points == sorted(points), t
        own_examples = {c["id"]: c["num_examples"] for c in rounds[0]["clients"]}[1]
        assert own_examples == 96, rounds[0]  # its own file's 96 images, not a partition of the data set
        assert f"results in {out}" in out_log  # the CLI's stream tells the user where they are

        # The ClientApp's log (its executor's, on each client machine) says where its output went.
        for name in ("client-1", "client-2"):
            executor_log = clients[name].services["superexec-clientapp"].log_path.parent
            text = "".join(p.read_text() for p in executor_log.glob("superexec-clientapp*.log"))
            state = (tmp_path / name / "state").resolve()
            assert f"client state in {state}" in text, text[-2000:]
            if name == "client-2":
                assert f"96 images from {dep.machines[name].root}/data/site-2.npz" in text, text[-2000:]
            assert list(state.glob("run-*/client_*.npz")), f"no client state under {state}"
    finally:
        if run is not None and run.poll() is None:
            kill_group(run, signal.SIGKILL)
        dep.teardown()
