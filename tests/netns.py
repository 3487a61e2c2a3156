"""Separate hosts on one machine: Linux network namespaces linked by veth pairs (needs root).

A ``Network`` is a hub host (the SuperLink's machine) and spoke hosts (client machines), each its own
namespace with its own loopback and ports. Spoke ``i`` is linked to the hub by one veth pair on subnet
``10.<net>.<i>.0/24`` (hub ``.1``, spoke ``.2``), so a spoke reaches the hub, but not another spoke, as on
separate machines. Host names resolve through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts`` for the processes it starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root to include the multi-host test)"
    probe = f"fedssl-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"this machine forbids network namespaces: {exc}"
    try:
        subprocess.run(["ip", "netns", "exec", probe, "true"], check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        return f"cannot run a process in a network namespace: {exc.stderr.decode(errors='replace').strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


@dataclass
class Network:
    """A hub and ``spokes`` hosts; ``names`` maps a host to extra names for itself in its hosts file."""

    tag: str  # short and unique: it goes into interface names (15 characters at most)
    spokes: list[str]
    hub: str = "hub"
    net: int = 213
    hub_names: list[str] = field(default_factory=list)  # names the spokes use for the hub
    local_names: dict[str, list[str]] = field(default_factory=dict)  # names a host uses for itself

    def ns(self, host: str) -> str:
        return f"fedssl-{self.tag}-{host}"

    def hub_ip(self, spoke: str) -> str:
        return f"10.{self.net}.{self.spokes.index(spoke) + 1}.1"

    def spoke_ip(self, spoke: str) -> str:
        return f"10.{self.net}.{self.spokes.index(spoke) + 1}.2"

    def hosts(self) -> list[str]:
        return [self.hub, *self.spokes]

    def create(self) -> Network:
        try:
            for host in self.hosts():
                _ip("netns", "add", self.ns(host))
                _ip("-n", self.ns(host), "link", "set", "lo", "up")
            for i, spoke in enumerate(self.spokes, start=1):
                hub_if, spoke_if = f"fs{self.tag}h{i}"[:15], f"fs{self.tag}s{i}"[:15]
                _ip(
                    "link",
                    "add",
                    hub_if,
                    "netns",
                    self.ns(self.hub),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    spoke_if,
                    "netns",
                    self.ns(spoke),
                )
                _ip("-n", self.ns(self.hub), "addr", "add", f"{self.hub_ip(spoke)}/24", "dev", hub_if)
                _ip("-n", self.ns(spoke), "addr", "add", f"{self.spoke_ip(spoke)}/24", "dev", spoke_if)
                _ip("-n", self.ns(self.hub), "link", "set", hub_if, "up")
                _ip("-n", self.ns(spoke), "link", "set", spoke_if, "up")
            self._write_hosts_files()
        except Exception:
            self.destroy()
            raise
        return self

    def _write_hosts_files(self) -> None:
        for host in self.hosts():
            lines = [f"127.0.0.1 localhost {' '.join(self.local_names.get(host, []))}".rstrip(), "::1 localhost"]
            if host != self.hub and self.hub_names:
                lines.append(f"{self.hub_ip(host)} {' '.join(self.hub_names)}")
            folder = Path("/etc/netns") / self.ns(host)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def destroy(self) -> None:
        """Delete the namespaces (their veth pairs go with them) and the hosts files; never raises."""
        for host in self.hosts():
            subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / self.ns(host), ignore_errors=True)

    def run(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run a command to completion inside a host's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.ns(host), *argv], **kwargs)  # noqa: PLW1510 - the caller's kwargs choose

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()
