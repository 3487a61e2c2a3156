"""Run `flwr run .` against a private, auto-started local SuperLink and clean up after it.

Each call gets its own FLWR_HOME and ports, and every process that inherited that FLWR_HOME (the
SuperLink, its SuperExec, the simulation and Ray workers) is killed afterwards, so no daemon outlives
the test or holds CI's output open.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_env(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    # The venv's console scripts (flower-superlink) must be on PATH for the auto-started SuperLink.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def processes_with_env(key: str, value: str) -> list[int]:
    needle = f"{key}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def kill_flwr_home_processes(flwr_home: Path, grace_s: float = 5.0) -> None:
    kill_processes_with_env("FLWR_HOME", str(flwr_home), grace_s)


def kill_processes_with_env(key: str, value: str, grace_s: float = 5.0) -> None:
    """TERM, then KILL, every process whose environment has ``key=value`` (what a test or benchmark started)."""
    pids = processes_with_env(key, value)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        if not pids:
            return


def flwr_run(run_config: str, flwr_home: Path, timeout_s: float = 600, federation_config: str | None = None,
             app_dir: Path = REPO) -> subprocess.CompletedProcess:
    """`flwr run . --stream` with the given run config; returns the finished process (output captured)."""
    flwr = Path(sys.executable).parent / "flwr"
    cmd = [str(flwr) if flwr.exists() else "flwr", "run", str(app_dir), "--stream", "--run-config", run_config]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    env = flwr_env(flwr_home)
    try:
        return subprocess.run(cmd, cwd=app_dir, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    finally:
        kill_flwr_home_processes(flwr_home)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
