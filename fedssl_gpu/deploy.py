"""A Flower deployment on loopback: one SuperLink and N SuperNodes on 127.0.0.1, as separate processes.

This is how the campaign runs the app on a machine without Ray (Flower's simulation needs Ray; a deployment needs
only ``flwr``): the same ServerApp, strategies and ClientApps as everywhere else, each ClientApp in its own process
started by its SuperNode (subprocess isolation), with no TLS since nothing leaves the machine. The ``flwr`` CLI
reaches it through a connection ``[superlink.<name>]`` written to a private ``FLWR_HOME``, so ``flwr run <app>
<name>`` (and ``fedssl-study run --connection <name>``) submit runs to it. Every process is started in its own
process group and carries a marker in its environment; ``stop`` ends them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

from fedssl_study.launcher import free_port, processes_with_env

MARKER = "FEDSSL_CAMPAIGN_DEPLOYMENT"


def console_script(name: str) -> str:
    """A console script of this Python environment (where the campaign installed flwr), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


class LoopbackDeployment:
    """``start()`` a SuperLink and ``num_nodes`` SuperNodes (partition i of num_nodes each); ``stop()`` them."""

    def __init__(
        self,
        folder: Path,
        num_nodes: int,
        *,
        allowed_roots: list[Path],
        name: str = "campaign",
        threads_per_node: int | None = None,
        extra_env: dict[str, str] | None = None,
        node_configs: list[str] | None = None,
    ) -> None:
        """``node_configs``: more node config for each SuperNode, in order (e.g. ``data-path='/data/site-a'``: the node
        trains on its own data)."""
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_nodes = int(num_nodes)
        self.name = name
        self.port = free_port()
        self.cli_home = self.folder / "cli"
        threads = threads_per_node or max(1, (os.cpu_count() or 1) // max(1, self.num_nodes))
        self.env = {
            **os.environ,
            MARKER: f"{os.getpid()}-{self.port}",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            # The executor looks for new tasks every second by default; every message would wait up to that.
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"),
            # The folders the ServerApp may read and write (server_app/paths.py): the campaign's and the data's.
            "FEDSSL_ALLOWED_ROOTS": os.pathsep.join(str(Path(r).resolve()) for r in allowed_roots),
            # The SuperNodes share the machine's cores: torch threads per ClientApp, so they do not oversubscribe.
            "OMP_NUM_THREADS": str(threads),
            **(extra_env or {}),
        }
        self.procs: list[subprocess.Popen] = []
        self.node_configs = list(node_configs or [""] * self.num_nodes)
        if len(self.node_configs) != self.num_nodes:
            raise ValueError(f"node_configs: one per SuperNode ({self.num_nodes}), got {len(self.node_configs)}")

    @property
    def cli_env(self) -> dict[str, str]:
        """The environment in which ``flwr run <app> <name>`` reaches this deployment."""
        return {**self.env, "FLWR_HOME": str(self.cli_home)}

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 - the child process's output: open as long as it runs
        proc = subprocess.Popen(
            argv,
            cwd=self.folder,
            env={**self.env, "FLWR_HOME": str(self.folder / name)},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def start(self, timeout_s: float = 60.0) -> None:
        self._start(
            "superlink",
            [
                console_script("flower-superlink"),
                "--insecure",
                "--isolation",
                "subprocess",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        deadline = time.monotonic() + timeout_s
        while not self._listening():
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                self.stop()
                said = (self.folder / "superlink.log").read_text()[-2000:]
                raise RuntimeError(f"the SuperLink did not start (port {self.port}):\n{said}")
            time.sleep(0.2)
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.name}"\n\n[superlink.{self.name}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        for i in range(self.num_nodes):
            self._start(
                f"supernode-{i}",
                [
                    console_script("flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--isolation",
                    "subprocess",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    f"partition-id={i} num-partitions={self.num_nodes} {self.node_configs[i]}".strip(),
                ],
            )

    def run(self, app_dir: Path, run_config: str, timeout_s: float) -> subprocess.CompletedProcess:
        """``flwr run <app> <name> --stream``: blocks until the run ends (Flower's CLI exits 0 even when the run
        failed: the caller checks the run's ``summary.json``)."""
        return subprocess.run(
            [console_script("flwr"), "run", str(app_dir), self.name, "--stream", "--run-config", run_config],
            cwd=app_dir,
            env=self.cli_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def logs_tail(self, chars: int = 1500) -> str:
        parts = []
        for log in sorted(self.folder.glob("*.log")):
            text = log.read_text(errors="replace")[-chars:]
            parts.append(f"--- {log.name}\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        # What the SuperLink and SuperNodes started in groups of their own (executors, ServerApps, ClientApps).
        for pid in processes_with_env(MARKER, self.env[MARKER]):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.procs.clear()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
