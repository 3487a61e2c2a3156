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

On a machine with NVIDIA GPUs, a local simulation is given ``client-resources-num-gpus=<gpu_share>`` unless the caller
set it (``with_gpu_share``): Flower asks Ray for 0 GPUs per client by default, and Ray then hides the GPUs from the
clients. With a share, Ray schedules the clients onto the GPUs and tells each which one is its own.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from client_app.placement import physical_gpu_count

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


# ------------------------------------------------------------------------------------------- clients on the GPUs
# At most this many clients train on one GPU at once. The studies' models are small: one client leaves most of a GPU
# idle, and a few processes side by side fill it; every client process holds its own CUDA context and model, and Ray's
# fraction does not cap GPU memory, so the count stays small. A caller who knows better sets the share itself.
MAX_CLIENTS_PER_GPU = 4
GPU_SHARE_KEY = "client-resources-num-gpus"


def gpus_for_local_clients(environ: dict[str, str] | None = None) -> int:
    """The NVIDIA GPUs of this machine, where a local simulation runs its clients; 0 when ``RAY_ADDRESS`` makes the
    simulation join a Ray cluster (its clients run on the cluster's nodes, whose GPUs are not counted here: there
    the caller sets the share, see docs/deployment.md)."""
    return 0 if (os.environ if environ is None else environ).get("RAY_ADDRESS") else physical_gpu_count()


def gpu_share(num_clients: int | None, gpus: int, max_clients_per_gpu: int = MAX_CLIENTS_PER_GPU) -> float:
    """The GPU fraction each simulated client asks Ray for: 1/k with k = min(max_clients_per_gpu, ceil(num_clients /
    gpus)) clients per GPU, so that the federation's clients spread over the GPUs and no more than
    ``max_clients_per_gpu`` share one (``num_clients`` None: not known, ``max_clients_per_gpu``). A whole fraction
    of one GPU (1/k, not gpus/num_clients): Ray never splits a client over two GPUs, so 2 GPUs at 2/3 would run
    only two clients. Rounded to Ray's resource precision (4 decimals), never above 1/k."""
    per_gpu = max_clients_per_gpu if not num_clients else min(max_clients_per_gpu, math.ceil(num_clients / gpus))
    per_gpu = max(1, per_gpu)
    return math.floor(10_000 / per_gpu) / 10_000


def num_supernodes_in(federation_config: str | None) -> int | None:
    """``num-supernodes`` of a ``--federation-config`` string, or None."""
    found = re.search(r"(?:^|\s)num-supernodes\s*=\s*(\d+)", federation_config or "")
    return int(found.group(1)) if found else None


def with_gpu_share(federation_config: str | None, gpus: int, num_clients: int | None = None) -> str | None:
    """A local simulation's ``--federation-config`` with ``client-resources-num-gpus=<gpu_share>`` added when the
    machine has ``gpus`` NVIDIA GPUs and the caller gave no share of its own; unchanged without GPUs. The clients'
    count: ``num_clients``, else the config's ``num-supernodes``."""
    if gpus <= 0 or GPU_SHARE_KEY in (federation_config or ""):
        return federation_config
    share = f"{GPU_SHARE_KEY}={gpu_share(num_clients or num_supernodes_in(federation_config), gpus):g}"
    return f"{federation_config} {share}" if federation_config else share


FLWR_RUN_VALUE_OPTIONS = ("--run-config", "-c", "--federation-config", "--federation", "--format")


def flwr_run_connection(args: list[str]) -> str | None:
    """The SuperLink connection named in ``flwr run`` arguments (the positional after the app), or None."""
    positional, takes_value = [], False
    for arg in args:
        if takes_value:
            takes_value = False
        elif arg in FLWR_RUN_VALUE_OPTIONS:
            takes_value = True
        elif not arg.startswith("-"):
            positional.append(arg)
    return positional[1] if len(positional) > 1 else None


def federation_configs_in(args: list[str]) -> list[str]:
    """The values of every ``--federation-config`` of ``flwr run`` arguments (Flower merges them)."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--federation-config"]
    return values + [arg.split("=", 1)[1] for arg in args if arg.startswith("--federation-config=")]


def is_local_simulation(connection: str | None) -> bool:
    """True when ``flwr run`` with this connection (None: the default one) runs on a local SuperLink (address
    ``:local:`` or ``:local-in-memory:`` in ``$FLWR_HOME/config.toml``), a simulation whose clients run on this
    machine. Without that file, ``flwr run`` writes its default, whose default connection is local. Read here
    without Flower's reader, which writes that file."""
    import tomllib

    from flwr.supercore.utils import get_flwr_home

    path = get_flwr_home() / "config.toml"
    if not path.is_file():
        return connection in (None, "local")
    try:
        superlinks = tomllib.loads(path.read_text()).get("superlink", {})
        entry = superlinks.get(connection or superlinks.get("default", ""), {})
        return isinstance(entry, dict) and str(entry.get("address", "")).startswith(":local")
    except (OSError, ValueError):  # an unreadable config: flwr run will say so; add nothing
        return False


def flwr_run_args_with_gpu_share(args: list[str], num_clients: int | None) -> tuple[list[str], str | None]:
    """``fedssl-run``'s ``flwr run`` arguments, with ``--federation-config client-resources-num-gpus=<share>`` added
    for a local simulation on a GPU machine whose caller set no share; and that setting (None: nothing added)."""
    given = " ".join(federation_configs_in(args))
    gpus = gpus_for_local_clients()
    if gpus <= 0 or GPU_SHARE_KEY in given or not is_local_simulation(flwr_run_connection(args)):
        return args, None
    share = with_gpu_share(None, gpus, num_supernodes_in(given) or num_clients)
    return [*args, "--federation-config", share], share


class LaunchError(RuntimeError):
    """``flwr`` refused or failed to start a run; the message holds what it said."""


class Launcher:
    """Runs ``flwr run`` / ``flwr ls`` / ``flwr stop`` for one study."""

    def __init__(
        self,
        *,
        connection: str | None = None,
        flwr_home: Path | None = None,
        federation_config: str | None = None,
        app_dir: Path = APP_DIR,
    ) -> None:
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
            self.env.update(
                {
                    "FLWR_HOME": str(self.private_home),
                    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
                    "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
                }
            )

    @property
    def simulation(self) -> bool:
        """True for the private local simulation (federation size from the config), False for a connection."""
        return self.connection is None

    def _cmd(self, *args: str) -> list[str]:
        return [flwr_cli(), *args]

    def _call(self, args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            args,
            cwd=self.app_dir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

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
        federation_config = " ".join(federation) or None
        if self.simulation:  # the clients run on this machine: put them on its GPUs, if it has any
            federation_config = with_gpu_share(federation_config, gpus_for_local_clients(self.env), num_supernodes)
        if federation_config:
            args += ["--federation-config", federation_config]
        proc = self._call(args, timeout=300.0)
        out = (proc.stdout or "").strip()
        try:
            reply = json.loads(out[out.index("{") :]) if "{" in out else {}
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
            reply = json.loads(out[out.index("{") :])
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
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def flwr_run(
    run_config: str,
    flwr_home: Path,
    timeout_s: float = 600,
    federation_config: str | None = None,
    app_dir: Path = APP_DIR,
) -> subprocess.CompletedProcess:
    """``flwr run <app> --stream`` on a private local SuperLink (``flwr_home``); returns the finished process (output
    captured) after stopping every process that SuperLink started, so no daemon outlives the call. On a GPU machine
    the clients get a GPU share (``with_gpu_share``) unless ``federation_config`` sets one."""
    cmd = [flwr_cli(), "run", str(app_dir), "--stream", "--run-config", run_config]
    env = flwr_env(flwr_home)
    federation_config = with_gpu_share(federation_config, gpus_for_local_clients(env))
    if federation_config:
        cmd += ["--federation-config", federation_config]
    try:
        return subprocess.run(
            cmd,
            cwd=app_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
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
        proc = flwr_run(
            f"config='{folder / 'cfg.yaml'}' output-dir='{folder / 'out'}'",
            folder / "flwr",
            federation_config=f"num-supernodes={raw['federation']['num_clients']}",
            timeout_s=timeout_s,
        )
        summary = folder / "out" / "summary.json"
        if not summary.is_file():
            raise RuntimeError(f"{raw.get('name')} failed:\n" + (proc.stdout + proc.stderr)[-3000:])
        return {
            "summary": json.loads(summary.read_text()),
            "rounds": read_jsonl(folder / "out" / "metrics.jsonl"),
            "run_s": time.perf_counter() - t0,
        }
