"""What produced a run: written into ``summary.json`` (``provenance``) and shown in every study report.

- ``versions``: Python, torch, torchvision, flwr, numpy (the installed distributions);
- ``device``: the CPU model and core count, and the GPU's name when training ran on one;
- ``app_digest``: SHA-256 over the app's own Python files (their paths and contents), the same wherever the app
  is installed (a checkout, the copy Flower installs from the FAB, a container image);
- ``git_commit`` / ``git_dirty``: the commit of the app's folder when it is a git checkout of its own (None for an
  installed copy: then ``app_digest`` says which code ran); a study records its checkout's commit per run too;
- ``config_hash``: SHA-256 of the resolved experiment config (``summary.json``'s ``config``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from fedssl_wire import WIRE_VERSION, app_code_digest

APP_DIR = Path(__file__).resolve().parents[1]


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "flwr", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere ``platform.processor()``) and its core count."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def device_description(device: str | None = None) -> str:
    """The CPU, and the GPU when ``device`` is a CUDA device (or ``auto`` and one is present)."""
    text = cpu_model()
    try:
        import torch

        if (device in (None, "auto", "cuda") or str(device).startswith("cuda")) and torch.cuda.is_available():
            text += f"; GPU {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001, S110 - a description, never a reason to fail
        pass
    return text


def git_state(folder: Path = APP_DIR) -> tuple[str | None, bool | None]:
    """(commit, has uncommitted changes) when ``folder`` is the top of a git checkout, else (None, None)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(folder).resolve():
            return None, None  # an installed copy inside some other repository
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 of a resolved config's canonical JSON: which experiment exactly a run was."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def provenance(config: Mapping[str, Any], device: str | None = None) -> dict[str, Any]:
    commit, dirty = git_state()
    return {
        "versions": package_versions(),
        "device": device_description(device),
        "host": platform.node(),
        "app_digest": app_code_digest(),
        "wire_version": WIRE_VERSION,
        "git_commit": commit,
        "git_dirty": dirty,
        "config_hash": config_hash(config),
    }
