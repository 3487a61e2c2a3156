"""One code everywhere: the ServerApp sends its code digest and wire version with every message, a ClientApp
running other code refuses it naming both digests and where its code was loaded from, and the run stops with that
reason (in a simulation, the clients import the ClientApp from the local SuperLink's folder, not from the
submitted app: a SuperLink started in another checkout is the case this guards against)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict

from fedssl_wire import (
    APP_DIGEST_KEY,
    CODE_MISMATCH,
    WIRE_VERSION,
    WIRE_VERSION_KEY,
    CodeMismatch,
    app_code_digest,
    check_same_code,
    code_identity,
)
from flwr_harness import REPO, flwr_env, kill_processes_with_env, read_jsonl
from strategies.fedssl import FedSSL
from strategies.replies import CodeMismatchStop


def test_the_same_code_passes_and_other_code_is_refused_naming_both():
    check_same_code(ConfigRecord(code_identity()))
    check_same_code(ConfigRecord({}))  # a hand-made message without the server's identity is not checked
    other = "f" * 64
    with pytest.raises(CodeMismatch) as caught:
        check_same_code(ConfigRecord({APP_DIGEST_KEY: other, WIRE_VERSION_KEY: WIRE_VERSION}))
    text = str(caught.value)
    assert text.startswith(CODE_MISMATCH) and app_code_digest()[:16] in text and other[:16] in text
    assert str(REPO) in text  # where this ClientApp's code was loaded from
    with pytest.raises(CodeMismatch, match=f"wire format v{WIRE_VERSION + 1}"):
        check_same_code(ConfigRecord({APP_DIGEST_KEY: app_code_digest(), WIRE_VERSION_KEY: WIRE_VERSION + 1}))


def test_the_digest_covers_the_apps_code_only(tmp_path):
    for rel in ("fedssl_wire.py", "client_app/app.py", "strategies/fedssl.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    before = app_code_digest(tmp_path)
    (tmp_path / "README.md").write_text("not code")
    (tmp_path / "client_app" / "__pycache__").mkdir()
    (tmp_path / "client_app" / "__pycache__" / "x.py").write_text("cache")
    app_code_digest.cache_clear()
    assert app_code_digest(tmp_path) == before
    with (tmp_path / "client_app" / "app.py").open("a") as fh:
        fh.write("# one more line\n")
    app_code_digest.cache_clear()
    assert app_code_digest(tmp_path) != before


def test_a_clientapp_refuses_a_message_from_other_code():
    from flwr.supercore.task_identity import TaskIdentity

    from client_app.app import app

    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    try:
        ctx = Context(
            run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(), run_config={}
        )
        ok = app(
            Message(RecordDict({"config": ConfigRecord(code_identity())}), dst_node_id=5, message_type="query.info"),
            ctx,
        )
        assert int(ok.content["metrics"]["partition-id"]) == 0
        bad = Message(
            RecordDict({"config": ConfigRecord({**code_identity(), APP_DIGEST_KEY: "0" * 64})}),
            dst_node_id=5,
            message_type="query.info",
        )
        with pytest.raises(CodeMismatch, match=CODE_MISMATCH):  # an error reply in a real run
            app(bad, ctx)
    finally:
        TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def test_a_refusal_stops_the_run_on_the_server():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    try:
        strategy = FedSSL(clients={0: 10, 1: 11}, clients_per_round=2)
        request = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=10, message_type="train")
        refusal = Message(
            Error(code=0, reason=f"ClientApp raised: {CODE_MISMATCH}: this ClientApp runs code 1234"), reply_to=request
        )
        with pytest.raises(CodeMismatchStop, match="round 3: a client refused the round: .*code mismatch"):
            strategy.screen_replies(3, [refusal])
    finally:
        TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def copy_app(dst: Path) -> None:
    """The tracked files of this checkout: a second checkout."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)


@pytest.mark.e2e
def test_a_run_on_a_superlink_started_in_another_checkout_stops_naming_both_digests(tmp_path):
    """The local SuperLink is first started from checkout A (whose client code differs by one comment); a run
    submitted from this checkout then gets A's ClientApps, which refuse its messages: the run stops at once with
    the reason in progress.log, not after a timeout, and nothing trains."""
    other = tmp_path / "other-checkout"
    copy_app(other)
    with (other / "client_app" / "rounds" / "weights.py").open("a") as fh:
        fh.write("# a local edit in the other checkout\n")
    home = tmp_path / "flwr"
    env = {**flwr_env(home), "OMP_NUM_THREADS": "1"}  # one FLWR_HOME and one pair of ports for both submissions
    flwr = str(Path(sys.executable).parent / "flwr")
    try:
        # The first `flwr run` starts the local SuperLink in the other checkout (its run fails at once: no config).
        subprocess.run(
            [flwr, "run", str(other), "--run-config", "config='no-such.yaml'"],
            cwd=other,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        out = tmp_path / "out"
        proc = subprocess.run(
            [
                flwr,
                "run",
                str(REPO),
                "--stream",
                "--run-config",
                f"config='configs/smoke.yaml' data.dataset='synthetic' output-dir='{out}'",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        log = (out / "progress.log").read_text() if (out / "progress.log").is_file() else ""
        stopped = [line for line in log.splitlines() if "stopped:" in line]
        assert stopped, (proc.stdout + proc.stderr)[-3000:]
        line = stopped[-1]
        assert CODE_MISMATCH in line and app_code_digest()[:16] in line and str(other) in line, line
        assert not (out / "summary.json").exists()
        assert not (out / "metrics.jsonl").exists() or read_jsonl(out / "metrics.jsonl") == []
    finally:
        kill_processes_with_env("FLWR_HOME", str(home))
    # the other checkout's digest is the one named as the ClientApp's
    app_code_digest.cache_clear()
    assert app_code_digest(other)[:16] in line and app_code_digest(other) != app_code_digest(REPO)
    app_code_digest.cache_clear()


@pytest.mark.e2e
def test_a_deployed_run_runs_the_submitted_code_on_supernodes_started_in_another_checkout(tmp_path):
    """Loopback deployment (a SuperLink and two SuperNodes on this machine): the SuperNodes are started in another
    checkout whose client code differs, with that checkout first on their PYTHONPATH. Deployed, the code travels
    with the run (the FAB each node installs), so the guard finds the same digest on both sides and the run
    finishes; had a node imported the other checkout, its ClientApp would have refused (its digest differs)."""
    import os
    import socket
    import time

    other = tmp_path / "other-checkout"
    copy_app(other)
    with (other / "client_app" / "rounds" / "weights.py").open("a") as fh:
        fh.write("# a local edit in the other checkout\n")
    app_code_digest.cache_clear()
    assert app_code_digest(other) != app_code_digest(REPO)
    app_code_digest.cache_clear()
    bin_dir = Path(sys.executable).parent
    marker = f"FEDSSL_CODE_GUARD_DEPLOY_{os.getpid()}"
    base = {
        **os.environ,
        marker: "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # The SuperLink and SuperNodes start their SuperExec from PATH: this environment's, not another one's.
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    from flwr_harness import free_port

    port, out, logs = free_port(), tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "server").mkdir()
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    str(bin_dir / "flower-superlink"),
                    "--insecure",
                    "--disable-runtime-dependency-installation",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                cwd=tmp_path / "server",
                env={**base, "FLWR_HOME": str(tmp_path / "server-home"), "FEDSSL_ALLOWED_ROOTS": str(tmp_path)},
                stdout=(logs / "superlink.log").open("w"),
                stderr=subprocess.STDOUT,
            )
        )
        deadline = time.monotonic() + 120  # the SuperLink's Fleet API listens: the nodes can dial it
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and procs[0].poll() is None, (logs / "superlink.log").read_text()
                time.sleep(0.2)
        for pid in (0, 1):
            procs.append(
                subprocess.Popen(
                    [
                        str(bin_dir / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{port}",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        f"partition-id={pid} num-partitions=2",
                    ],
                    cwd=other,
                    env={**base, "FLWR_HOME": str(tmp_path / f"node-{pid}-home"), "PYTHONPATH": str(other)},
                    stdout=(logs / f"node-{pid}.log").open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
        cli_home = tmp_path / "cli-home"
        cli_home.mkdir()
        (cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "dev"\n\n[superlink.dev]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        proc = subprocess.run(
            [
                str(bin_dir / "flwr"),
                "run",
                str(REPO),
                "dev",
                "--stream",
                "--run-config",
                # the run finishing is the check: no final probe, no random-init reference
                (
                    f"config='configs/smoke.yaml' data.dataset='synthetic' output-dir='{out}' rounds=1 "
                    "eval.linear_probe=false eval.random_init_reference=false"
                ),
            ],
            cwd=REPO,
            env={**base, "FLWR_HOME": str(cli_home)},
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        kill_processes_with_env(marker, "1")
    node_log = (logs / "node-0.log").read_text()
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-3000:] + node_log[-3000:]
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert summary["provenance"]["app_digest"] == app_code_digest(REPO)
    assert CODE_MISMATCH not in node_log
    assert f"installed fedssl to {tmp_path / 'node-0-home' / 'apps'}" in node_log  # the FAB, not the checkout
