"""Read the project's docker compose files and run their services as native processes.

No Docker engine runs on CI machines, so the deployment tests take the *same* commands the compose files
give each container and start them as processes: the image decides the program (``flwr/superlink`` ->
``flower-superlink``, the app image -> its Dockerfile's ENTRYPOINT), and every volume becomes a symlink
under a per-machine root folder that stands in for the container's file system, so paths such as
``secrets/ca.crt`` (relative to the image's WORKDIR ``/app``) or ``/data`` resolve as they would in the
container. Host names of other services resolve through the network namespace's ``hosts`` file (see
``tests/netns.py``).

Only what the project's compose files use is supported: ``${VAR}``, ``${VAR:-default}``,
``${VAR-default}``, ``${VAR:?message}``, ``${VAR?message}`` and ``$$``; overlays that replace
``command``, merge ``volumes`` by target and deep-merge mappings.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
CONTAINER_WORKDIR = "/app"  # WORKDIR of Flower's images
# The program each official image runs (their ENTRYPOINTs).
IMAGE_PROGRAMS = {
    "flwr/superlink": "flower-superlink",
    "flwr/supernode": "flower-supernode",
    "flwr/superexec": "flower-superexec",
}


class ComposeError(ValueError):
    """A compose file that cannot be read, interpolated or mapped to native processes."""


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?$", re.DOTALL)


def interpolate(value: Any, env: Mapping[str, str], where: str = "") -> Any:
    """Compose's variable substitution on every string of a parsed compose file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group("plain"):
            return env.get(match.group("plain"), "")
        m = _BRACED.match(match.group("braced"))
        if not m:
            raise ComposeError(f"{where}: invalid substitution {match.group(0)!r}")
        name, op, arg = m.group("name"), m.group("op"), interpolate(m.group("arg") or "", env, where)
        present = name in env
        filled = present and env[name] != ""
        if op in (":?", "?") and not (filled if op == ":?" else present):
            raise ComposeError(f"{where}: required variable {name} is missing: {arg}")
        if op == ":-":
            return env[name] if filled else arg
        if op == "-":
            return env[name] if present else arg
        return env.get(name, "")

    return _VAR.sub(substitute, value)


def _merge_service(base: dict, over: dict) -> dict:
    """Compose's overlay rules for one service: lists of volumes merge by target, mappings merge deeply,
    everything else (command included) is replaced."""
    out = dict(base)
    for key, value in over.items():
        if key == "volumes" and key in out:
            by_target = {_split_volume(v)[1]: v for v in out[key]}
            by_target.update({_split_volume(v)[1]: v for v in value})
            out[key] = list(by_target.values())
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_service(out[key], value)
        else:
            out[key] = value
    return out


def _split_volume(spec: str) -> tuple[str, str, str]:
    parts = spec.split(":")
    if len(parts) == 2:
        return parts[0], parts[1], "rw"
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    raise ComposeError(f"volume {spec!r}: expected HOST:TARGET[:MODE]")


@dataclass
class Compose:
    """A compose project: its files merged, variables substituted."""

    files: list[Path]
    services: dict[str, dict]
    raw: list[dict]  # each file as parsed, before merging (for static checks)

    @property
    def project_dir(self) -> Path:
        """Relative host paths resolve against the first file's folder, as in docker compose."""
        return self.files[0].parent

    def volumes(self, service: str) -> list[tuple[Path, str, str]]:
        """(host path, container path, mode) of a service's bind mounts, host paths made absolute."""
        out = []
        for spec in self.services[service].get("volumes", []):
            host, target, mode = _split_volume(spec)
            if not host.startswith((".", "/", "~")):
                raise ComposeError(f"{service}: named volume {host!r} is not supported natively")
            out.append(((self.project_dir / Path(host).expanduser()).resolve(), target, mode))
        return out

    def program(self, service: str) -> list[str]:
        """What the service's container runs before its ``command``: the image's ENTRYPOINT."""
        spec = self.services[service]
        if "build" in spec:
            build = spec["build"]
            dockerfile = (self.project_dir / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()
            entry = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
            if not entry:
                raise ComposeError(f"{service}: {dockerfile.name} has no ENTRYPOINT")
            return json.loads(entry[-1][len("ENTRYPOINT") :])
        image = str(spec.get("image", "")).split(":")[0]
        if image not in IMAGE_PROGRAMS:
            raise ComposeError(f"{service}: image {spec.get('image')!r} is not one of {sorted(IMAGE_PROGRAMS)}")
        return [IMAGE_PROGRAMS[image]]

    def command(self, service: str) -> list[str]:
        cmd = self.services[service].get("command", [])
        return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def load_compose(files: Sequence[Path | str], env: Mapping[str, str] | None = None) -> Compose:
    """Parse compose files (the first one plus overlays), substitute variables and merge them."""
    env = dict(os.environ if env is None else env)
    paths = [Path(f).resolve() for f in files]
    raw, services = [], {}
    for path in paths:
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
            raise ComposeError(f"{path.name}: no 'services' mapping")
        raw.append(data)
        resolved = interpolate({k: v for k, v in data.items() if not str(k).startswith("x-")}, env, path.name)
        for name, spec in resolved["services"].items():
            services[name] = _merge_service(services.get(name, {}), spec or {})
    return Compose(paths, services, raw)


# ---------------------------------------------------------------------- native processes


def _translate(arg: str, mounts: Sequence[tuple[str, Path]]) -> str:
    """Rewrite container paths inside one argument to the native root's paths."""
    for target, native in mounts:
        arg = re.sub(re.escape(target) + r"(?=$|[/'\" ])", str(native).replace("\\", "\\\\"), arg)
    return arg


@dataclass
class NativeService:
    name: str
    argv: list[str]
    cwd: Path
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _environment(spec) -> dict[str, str]:
    """A service's ``environment`` (a mapping, or a list of ``KEY=value`` / ``KEY``: taken from the shell if set)."""
    if isinstance(spec, list):
        out = {}
        for item in spec:
            key, eq, value = str(item).partition("=")
            if eq:
                out[key] = value
            elif key in os.environ:
                out[key] = os.environ[key]
        return out
    return {str(k): str(v) for k, v in (spec or {}).items() if v is not None}


@dataclass
class NativeMachine:
    """One compose project run natively as one machine (optionally inside a network namespace).

    ``root`` stands in for the containers' file systems: each volume target becomes a symlink under it, so
    all services of the project see the same paths (the project's files mount each target from one host
    folder per machine; a conflict is an error)."""

    compose: Compose
    root: Path
    netns: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    services: dict[str, NativeService] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.mounts: dict[str, Path] = {}
        for service in self.compose.services:
            for host, target, _mode in self.compose.volumes(service):
                if target in self.mounts and self.mounts[target] != host:
                    raise ComposeError(
                        f"{service}: {target} is mounted from two host folders "
                        f"({self.mounts[target]} and {host}) on one machine"
                    )
                self.mounts[target] = host
        for target, host in self.mounts.items():
            if not host.is_file():  # a single secret file may be mounted on its own
                host.mkdir(parents=True, exist_ok=True)
            link = self.root / target.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(host, target_is_directory=host.is_dir())
        (self.root / CONTAINER_WORKDIR.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def native_path(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def argv(self, service: str) -> list[str]:
        """The service's program and command, with container paths rewritten to this machine's root."""
        mounts = sorted(((t, self.native_path(t)) for t in self.mounts), key=lambda m: -len(m[0]))
        program = self.compose.program(service)
        exe = Path(sys.executable).parent / program[0]
        argv = [str(exe) if exe.exists() else program[0]] + program[1:]
        return argv + [_translate(a, mounts) for a in self.compose.command(service)]

    def start(
        self, service: str, log_dir: Path, extra_env: Mapping[str, str] | None = None, log_name: str | None = None
    ) -> NativeService:
        spec = self.compose.services[service]
        env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
        env["FLWR_HOME"] = str(self.root / "flwr-home" / service)  # each container has its own
        env.update(_environment(spec.get("environment")))
        env.update(self.env)
        env.update(extra_env or {})
        argv = self.argv(service)
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns] + argv
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / (log_name or f"{service}.log")
        cwd = self.native_path(CONTAINER_WORKDIR)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        native = NativeService(service, argv, cwd, log_path, env, proc)
        self.services[service] = native
        return native

    def stop(self, service: str, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
        """Stop a service and everything it started (its process group), like stopping its container."""
        native = self.services.get(service)
        if native is None or native.proc is None:
            return
        kill_group(native.proc, sig, grace_s)

    def stop_all(self) -> None:
        for name in list(self.services):
            self.stop(name)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    """Poll until ``predicate()`` is truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def write_own_data(path: Path, num_train: int) -> Path:
    """A client site's own small data file (random images; only the training part is used)."""
    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        x_train=rng.integers(0, 256, (num_train, 32, 32, 3), dtype=np.uint8),
        y_train=rng.integers(0, 10, num_train),
        x_test=rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
        y_test=rng.integers(0, 10, 20),
    )
    return path
