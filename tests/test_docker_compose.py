"""docker/'s compose files for real: images built, containers started, experiments run in them.

Where a Docker engine runs or can be started (root, dockerd installed), the images are built (docker/docker_engine.py:
Flower's official images or local stand-ins, and docker/app.Dockerfile unchanged apart from build arguments), then:

1. one host, ``docker/compose.yml`` + ``docker/compose.tls.yml``, as the README's compose section does it: TLS and
   SuperNode authentication, the keys registered with ``flwr supernode register``, ``configs/smoke.yaml`` on the
   CIFAR-10 dev copy mounted as data, to ``summary.json``, ``model.pt`` and client state in the mounted folders
   (owned by uid 49999, the images' ``app`` user); no container sees a secret it does not use;
2. ``docker/server/compose.yml`` and ``docker/client/compose.yml`` as separate compose projects on one host (one
   server, two clients dialling the server's published port at the host's address, TLS and authentication on, one
   client on its own data file): a client whose key is not registered is refused; client 2's containers are
   stopped after round 1 (round 2 finishes with client 1 and names the failed one) and started again for round 3.

Skipped with the reason where no engine can be had; ``FEDSSL_NO_SKIP=1`` (CI) turns that into a failure.
``FEDSSL_DOCKER_RECORD=<file>`` writes the measured figures (build times, image sizes, disk, round times) as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from compose_native import write_own_data
from conftest import cifar10_npz, skip_unless_required
from docker_engine import (
    APP_UID,
    CACHE,
    Cli,
    Engine,
    OneHost,
    Project,
    checkout,
    chown_app,
    docker_disk_mb,
    engine_unavailable,
    ensure_images,
    script,
    sh,
)
from flwr_harness import SHORT_EVAL, free_port, read_jsonl

pytestmark = pytest.mark.e2e

TAG = f"fedssl-t{os.getpid() % 100000}"
RECORD: dict = {}
# Two SuperNodes share this host's cores: one torch thread per ClientApp executor, as in the native tests.
THREADS = max(1, (os.cpu_count() or 2) // 2)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    reason = engine_unavailable()
    if reason:
        skip_unless_required(f"docker compose test skipped: {reason}")
    if shutil.which("openssl") is None or shutil.which("ssh-keygen") is None:
        skip_unless_required("docker compose test skipped: openssl and ssh-keygen are needed by docker/make-*.sh")
    if cifar10_npz() is None:
        skip_unless_required("docker compose test skipped: no CIFAR-10 dev copy (../shared/data/cifar10-dev.npz)")
    engine = Engine(CACHE / "dockerd.log").start()
    t0 = time.monotonic()
    try:
        built = ensure_images()
        RECORD.update(
            engine="started by the test" if engine.started_here else "already running",
            flwr_images=built.flwr,
            torch=built.torch,
            image_sizes_mb=built.sizes_mb,
            build_s=built.timings_s,
            images_s=time.monotonic() - t0,
        )
        print(
            f"\nFlower images: {built.flwr}; app image {built.app}: {built.torch}; sizes MB {built.sizes_mb}; "
            f"build s {built.timings_s}"
        )
        yield built
    finally:
        try:
            RECORD["docker_disk_mb"] = docker_disk_mb()
        except Exception as err:  # noqa: BLE001 - the figures are a record, not a check
            RECORD["docker_disk_mb"] = str(err)
        record = os.environ.get("FEDSSL_DOCKER_RECORD")
        if record:
            Path(record).write_text(json.dumps(RECORD, indent=2) + "\n")
        engine.stop()


def wait_for(what, timeout: float, message: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            got = what()
            if got:
                return got
            pytest.fail(f"the run ended before {message}:\n{log.read_text()[-4000:] if log else ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {message}:\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(2)


def progress_line(output_dir: Path, needle: str) -> str | None:
    for log in output_dir.glob("*/progress.log"):
        for line in log.read_text().splitlines():
            if needle in line:
                return line
    return None


def mounted_secrets(project: Project, service: str) -> list[str]:
    listing = sh("docker", "exec", project.container(service), "find", "/app/secrets", "-type", "f", check=False).stdout
    return sorted(line.rsplit("/", 1)[-1] for line in listing.split())


def test_one_host_tls_compose(images, tmp_path):
    """The README's one-host block: compose.yml + compose.tls.yml, keys registered with the CLI, smoke to its results."""
    one = OneHost(tmp_path, cifar10_npz(), f"{TAG}-one", free_port(), THREADS)
    project, cli, outputs = one.project, one.cli, one.outputs
    run = None
    try:
        one.up()
        # Only the secret files each container uses; the CA's private key in none.
        expected = {
            "superlink": ["ca.crt", "server.key", "server.pem", "superexec.secret"],
            "superexec-serverapp": ["ca.crt", "superexec.secret"],
            "supernode-1": ["ca.crt", "superexec.secret", "supernode.key"],
            "superexec-clientapp-1": ["superexec.secret"],
        }
        for service, files in expected.items():
            assert mounted_secrets(project, service) == files, service

        log = tmp_path / "run.log"
        rounds = 2  # configs/smoke.yaml's, run as the README's block does
        t0 = time.monotonic()
        run = cli.run("config='configs/smoke.yaml' data.path='/data/cifar10.npz'", log)
        run.wait(timeout=900)
        RECORD["one_host_run_s"] = time.monotonic() - t0
        summaries = list(outputs.glob("smoke-*/summary.json"))
        assert len(summaries) == 1, log.read_text()[-4000:]
        out = summaries[0].parent
        summary = json.loads(summaries[0].read_text())
        assert 0 <= summary["linear_probe_acc"] <= 1 and summary["output_dir"] == f"/app/outputs/{out.name}"
        assert (out / "model.pt").stat().st_size > 0
        metrics = read_jsonl(out / "metrics.jsonl")
        assert [r["num_clients"] for r in metrics] == [2] * rounds, metrics
        # Owned by the containers' user (README: how a host user gets them back), client state on the host.
        assert (out / "model.pt").stat().st_uid == APP_UID
        for n, folder in enumerate(one.client_state, 1):
            assert list(folder.glob("run-*/client_*.npz")), f"no client state in {folder}"
            text = project.logs(f"superexec-clientapp-{n}")
            assert "client state in /app/state" in text and "cannot write" not in text, text[-2000:]
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, 9)
        one.down()


def host_address() -> str:
    """An address of this host that containers on any bridge network reach (the default bridge's gateway)."""
    out = sh("docker", "network", "inspect", "bridge", "--format", "{{range .IPAM.Config}}{{.Gateway}} {{end}}").stdout
    ips = [ip for ip in out.split() if "." in ip]
    if not ips:  # engines that leave the gateway out of IPAM: the docker0 interface
        ips = [
            subprocess.run(
                ["sh", "-c", "ip -4 -o addr show docker0 | awk '{print $4}' | cut -d/ -f1"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
        ]
    assert ips and ips[0], "no address of the default bridge network"
    return ips[0]


def test_separate_machines_node_refused_stopped_and_back(images, tmp_path):
    """docker/server and docker/client as separate projects: refused key, a client stopped and started mid-run."""
    root = checkout(tmp_path / "checkout")
    server_dir, client_dir = root / "docker" / "server", root / "docker" / "client"
    host = host_address()
    port = free_port()
    server_secrets = tmp_path / "server-secrets"
    script("make-certs.sh", server_secrets, "superlink", "localhost", "127.0.0.1", host)
    outputs, sl_state = tmp_path / "outputs", tmp_path / "superlink-state"
    for d in (outputs, sl_state):
        d.mkdir()
    chown_app(outputs, sl_state, server_secrets / "server.key", server_secrets / "superexec.secret")
    data_dir = cifar10_npz().parent
    server = Project(
        f"{TAG}-server",
        [server_dir / "compose.yml"],
        {
            "SECRETS_DIR": str(server_secrets),
            "OUTPUT_DIR": str(outputs),
            "DATA_DIR": str(data_dir),
            "SUPERLINK_STATE_DIR": str(sl_state),
            "SUPERLINK_PORT": str(port),
        },
        cwd=server_dir,
    )
    cli = Cli(tmp_path / "cli", "fed", f"127.0.0.1:{port}", server_secrets / "ca.crt")

    def client(name: str, partition: int, data: Path, node_config: str = "") -> Project:
        secrets, state = tmp_path / name / "secrets", tmp_path / name / "state"
        if not secrets.exists():
            script("make-supernode-key.sh", secrets)
            shutil.copy(server_secrets / "ca.crt", secrets / "ca.crt")  # the operator hands out the CA
            state.mkdir(parents=True)
            chown_app(state, secrets / "supernode.key", secrets / "superexec.secret")
        return Project(
            f"{TAG}-{name}",
            [client_dir / "compose.yml"],
            {
                "SUPERLINK_ADDRESS": f"{host}:{port}",
                "PARTITION_ID": str(partition),
                "NUM_PARTITIONS": "2",
                "SECRETS_DIR": str(secrets),
                "DATA_DIR": str(data),
                "STATE_DIR": str(state),
                "NODE_CONFIG": node_config,
                "OMP_NUM_THREADS": str(THREADS),
            },
            cwd=client_dir,
        )

    site = write_own_data(tmp_path / "site-2" / "site-2.npz", num_train=96)
    clients = {
        "client-1": client("client-1", 0, data_dir),
        "client-2": client("client-2", 1, site.parent, "data-path='/data/site-2.npz'"),
    }
    rogue = client("rogue", 1, data_dir)
    projects = [server, *clients.values(), rogue]
    run = None
    try:
        server.up()
        for name in clients:
            cli.register(tmp_path / name / "secrets" / "supernode.key.pub")

        # Not registered: refused. Run alone (no restart policy), the container's exit status is the command's:
        # 1 (Flower logs "[code: 2004] Failed to activate SuperNode" and "exit code 305"); under `up` compose
        # restarts it until its key is registered.
        refused = rogue("run", "--rm", "--no-deps", "supernode", timeout=300, check=False)
        RECORD["unregistered_exit_status"] = refused.returncode
        assert refused.returncode == 1 and "Failed to activate SuperNode" in refused.stdout + refused.stderr, (
            refused.returncode,
            (refused.stdout + refused.stderr)[-3000:],
        )
        rogue.down()

        for project in clients.values():
            project.up()
        log = tmp_path / "run.log"
        rounds = 3
        run = cli.run(
            f"config='configs/smoke.yaml' rounds={rounds} data.path='/data/{cifar10_npz().name}' "
            "federation.round_timeout_s=300 federation.node_wait_s=300 "
            f"{SHORT_EVAL}",  # the run's course is the check
            log,
        )
        wait_for(lambda: progress_line(outputs, f"round 1/{rounds}"), 600, "round 1 to finish", run, log)
        clients["client-2"]("stop", "--timeout", "1")  # both containers of client machine 2
        round2 = wait_for(
            lambda: progress_line(outputs, f"round 2/{rounds}"), 600, "round 2 to finish without client 2", run, log
        )
        clients["client-2"]("start")
        run.wait(timeout=900)
        text = log.read_text()

        summaries = list(outputs.glob("smoke-*/summary.json"))
        assert len(summaries) == 1, text[-4000:]
        out = summaries[0].parent
        assert (out / "model.pt").stat().st_size > 0
        metrics = read_jsonl(out / "metrics.jsonl")
        assert [r["num_clients"] for r in metrics] == [2, 1, 2], metrics
        assert [f["id"] for f in metrics[1]["failed_clients"]] == [1], metrics[1]
        assert "1 clients ok, 1 failed (client 1:" in round2
        assert sorted(c["id"] for c in metrics[2]["clients"]) == [0, 1]  # back for round 3
        assert {c["id"]: c["num_examples"] for c in metrics[0]["clients"]}[1] == 96  # its own file
        assert f"results in /app/outputs/{out.name}" in text
        assert "96 images from /data/site-2.npz" in clients["client-2"].logs("superexec-clientapp")
        for name in clients:
            assert list((tmp_path / name / "state").glob("run-*/client_*.npz")), f"{name}: no client state"
        assert mounted_secrets(clients["client-1"], "superexec-clientapp") == ["superexec.secret"]
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, 9)
        for project in projects:
            project.down()
