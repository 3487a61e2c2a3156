"""Submitting one run to a SuperLink with the ``flwr`` CLI, watching it, stopping it.

Two ways to reach a federation:

- **a private local simulation** (no connection named): a SuperLink of the study's own, started by ``flwr run`` from
  this app's folder with its own ``FLWR_HOME`` (inside the study folder) and free ports, so it never shares a
  SuperLink (and the code it imports for the ClientApps) with another checkout; it is stopped, with every process
  it started, when the study ends or is interrupted;
- **a named connection** (``connection``: a ``[superlink.<name>]`` of the user's ``$FLWR_HOME/config.toml``, as
  ``flwr run . <name>`` takes it): a deployed federation, or a simulation on a Ray cluster. The ServerApp writes
  the run's folder on the SuperLink's machine: the study reads it from the same path, so that path must be shared
  (or the study run on that machine).

``submit`` returns the run id (``flwr run --format json``); ``status`` reads ``flwr ls --run-id`` (``None`` while
running, else Flower's final status); ``stop`` is ``flwr stop``.
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

APP_DIR = Path(__file__).resolve().parents[1]


def flwr_cli() -> str:
    """The ``flwr`` command of this Python environment (the one whose packages the app uses)."""
    local = Path(sys.executable).parent / "flwr"
    return str(local) if local.exists() else "flwr"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with_env(key: str, value: str) -> list[int]:
    """Process ids whose environment holds ``key=value`` (what one private SuperLink started), this one excluded."""
    needle = f"{key}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def kill_processes_with_env(key: str, value: str, grace_s: float = 5.0) -> None:
    """TERM, then KILL, every process whose environment has ``key=value``."""
    pids = processes_with_env(key, value)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        if not pids:
            return


class LaunchError(RuntimeError):
    """``flwr`` refused or failed to start a run; the message holds what it said."""


class Launcher:
    """Runs ``flwr run`` / ``flwr ls`` / ``flwr stop`` for one study."""

    def __init__(self, *, connection: str | None = None, flwr_home: Path | None = None,
                 federation_config: str | None = None, app_dir: Path = APP_DIR) -> None:
        self.connection = connection
        self.app_dir = Path(app_dir)
        self.federation_config = federation_config
        self.env = dict(os.environ)
        self.env.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
        self.env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        self.env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        self.private_home: Path | None = None
        if connection is None:  # a SuperLink of our own: its own home and ports, stopped by close()
            self.private_home = Path(flwr_home or (Path.cwd() / ".flwr-study")).resolve()
            self.private_home.mkdir(parents=True, exist_ok=True)
            self.env.update({"FLWR_HOME": str(self.private_home),
                             "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
                             "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())})

    @property
    def simulation(self) -> bool:
        """True for the private local simulation (federation size from the config), False for a connection."""
        return self.connection is None

    def _cmd(self, *args: str) -> list[str]:
        return [flwr_cli(), *args]

    def _call(self, args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=self.app_dir, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def submit(self, run_config: str, num_supernodes: int | None = None) -> int:
        """Start a run; returns its id. ``num_supernodes`` sizes the private simulation (ignored on a connection
        unless ``federation_config`` says otherwise)."""
        args = self._cmd("run", str(self.app_dir))
        if self.connection:
            args.append(self.connection)
        args += ["--run-config", run_config, "--format", "json"]
        federation = []
        if self.simulation and num_supernodes:
            federation.append(f"num-supernodes={int(num_supernodes)}")
        if self.federation_config:
            federation.append(self.federation_config)
        if federation:
            args += ["--federation-config", " ".join(federation)]
        proc = self._call(args, timeout=300.0)
        out = (proc.stdout or "").strip()
        try:
            reply = json.loads(out[out.index("{"):]) if "{" in out else {}
        except ValueError:
            reply = {}
        run_id = reply.get("run-id", reply.get("run_id"))
        if proc.returncode != 0 or not reply.get("success", run_id is not None) or run_id is None:
            said = " ".join((reply.get("error-message") or (proc.stdout + proc.stderr)).split())
            raise LaunchError(f"flwr run failed (exit {proc.returncode}): {said[-1500:]}")
        return int(run_id)

    def status(self, run_id: int) -> str | None:
        """Flower's status of the run: None while it is pending or running, else e.g. ``finished:completed``,
        ``finished:failed``, ``finished:stopped``; None also when ``flwr ls`` cannot answer this time."""
        args = self._cmd("ls")
        if self.connection:
            args.append(self.connection)
        args += ["--run-id", str(run_id), "--format", "json"]
        try:
            proc = self._call(args, timeout=60.0)
            out = proc.stdout.strip()
            reply = json.loads(out[out.index("{"):])
        except (subprocess.TimeoutExpired, ValueError):
            return None
        for run in reply.get("runs", []):
            if int(run.get("run-id", -1)) == int(run_id):
                status = str(run.get("status", ""))
                return status if status.startswith("finished") else None
        return None

    def stop(self, run_id: int) -> None:
        """``flwr stop`` the run (best effort: the private SuperLink is killed by ``close`` anyway)."""
        args = self._cmd("stop", str(run_id))
        if self.connection:
            args.append(self.connection)
        try:
            self._call(args, timeout=60.0)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Stop the private SuperLink and everything it started (its simulation, Ray workers)."""
        if self.private_home is not None:
            kill_processes_with_env("FLWR_HOME", str(self.private_home))


# ---------------------------------------------------------------------------------------------- one blocking run
def flwr_env(flwr_home: Path) -> dict[str, str]:
    """The environment of a private local SuperLink: its own FLWR_HOME and free ports, no runtime dependency
    installation, no telemetry, this Python environment's console scripts on PATH."""
    env = dict(os.environ)
    env.update({"FLWR_HOME": str(flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
                "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def flwr_run(run_config: str, flwr_home: Path, timeout_s: float = 600, federation_config: str | None = None,
             app_dir: Path = APP_DIR) -> subprocess.CompletedProcess:
    """``flwr run <app> --stream`` on a private local SuperLink (``flwr_home``); returns the finished process (output
    captured) after stopping every process that SuperLink started, so no daemon outlives the call."""
    cmd = [flwr_cli(), "run", str(app_dir), "--stream", "--run-config", run_config]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    try:
        return subprocess.run(cmd, cwd=app_dir, env=flwr_env(flwr_home), capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    finally:
        kill_processes_with_env("FLWR_HOME", str(flwr_home))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_experiment(raw: dict, timeout_s: float = 3600, keep_dir: Path | None = None) -> dict:
    """Write ``raw`` (an experiment config) to a folder, run it as a simulation of ``federation.num_clients``
    SuperNodes, and return {"summary", "rounds", "run_s"}; a failed run raises with the tail of its output. The folder
    is a temporary one unless ``keep_dir`` names one."""
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(keep_dir) if keep_dir is not None else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cfg.yaml").write_text(yaml.safe_dump(raw))
        t0 = time.perf_counter()
        proc = flwr_run(f"config='{folder / 'cfg.yaml'}' output-dir='{folder / 'out'}'", folder / "flwr",
                        federation_config=f"num-supernodes={raw['federation']['num_clients']}", timeout_s=timeout_s)
        summary = folder / "out" / "summary.json"
        if not summary.is_file():
            raise RuntimeError(f"{raw.get('name')} failed:\n" + (proc.stdout + proc.stderr)[-3000:])
        return {"summary": json.loads(summary.read_text()), "rounds": read_jsonl(folder / "out" / "metrics.jsonl"),
                "run_s": time.perf_counter() - t0}
