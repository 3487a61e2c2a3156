"""A Docker engine and the images the compose files need, for tests/test_docker_compose.py and
benchmarks/bench_deployment.py --containers.

- The engine: a running one is used as it is; otherwise, as root, ``dockerd`` is started (no iptables, no IP
  forwarding: bridge networks between containers and ports published on the host still work) and stopped by its
  process id afterwards.
- Flower's images (flwr/superlink, flwr/supernode, flwr/superexec at the installed version): the official ones when
  they are present or can be pulled; otherwise stand-ins built from docker/standin/Dockerfile on a Debian root file
  system made with debootstrap, tagged with the official names (``FROM`` and ``image:`` then need no registry).
- Packages for the builds: the host's pip (with its own configuration) downloads the wheels into a cache folder
  outside the repository, served to the builds on 127.0.0.1 (builds use the host network), so a build needs no
  proxy, certificate or index configuration of its own. The app image is built from docker/app.Dockerfile as it
  is, with build arguments only; with a CPU torch wheel among pip's local wheel folders, the image gets that one.

Images stay in the engine as the cache of the next run (``docker image rm`` them to free the disk).
Everything here shells out to the ``docker`` CLI (the legacy builder: the CLI may lack buildx).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
FLWR_IMAGES = ("superlink", "supernode", "superexec")
STANDIN_LABEL = "org.fedssl.standin"
DEBIAN_IMAGE = "fedssl-standin/debian:bookworm"
APP_IMAGE = "fedssl-app"
WHEEL_PORT = 48741
CACHE = Path(os.environ.get("FEDSSL_DOCKER_CACHE", Path.home() / ".cache" / "fedssl-docker"))
ENV = {
    **os.environ,
    "DOCKER_BUILDKIT": "0",
    "COMPOSE_DOCKER_CLI_BUILD": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def flwr_version() -> str:
    from importlib.metadata import version

    return version("flwr")


def app_requirements() -> list[str]:
    """pyproject.toml's dependencies other than flwr, torch and torchvision (those three are pinned separately).

    The image installs exactly this list (docker/app.Dockerfile reads the same file), so the wheel folder that
    is its only package source must hold every one of them: a dependency added to pyproject.toml and missing
    here fails the image build with "No matching distribution".
    """
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    name = lambda d: re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].strip().lower()
    return [d for d in deps if name(d) not in {"flwr", "torch", "torchvision"}]


def sh(
    *argv: str,
    timeout: float = 600,
    check: bool = True,
    input: str | None = None,
    cwd: Path | None = None,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        cwd=cwd,
        env=env or ENV,
        stdin=None if input is not None else subprocess.DEVNULL,
        check=False,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:6])} ... failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


def compose_command() -> list[str] | None:
    """``docker compose`` (v2 plugin) when the CLI has it, else Compose v1's ``docker-compose``."""
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0
    ):
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def engine_running() -> bool:
    return (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False).returncode == 0
    )


def engine_unavailable() -> str | None:
    """Why no engine can be used or started here (None: one can)."""
    if shutil.which("docker") is None:
        return "no docker CLI (Debian: apt-get install docker.io)"
    if compose_command() is None:
        return "no docker compose / docker-compose (Debian: apt-get install docker-compose)"
    if engine_running():
        return None
    if shutil.which("dockerd") is None:
        return "no Docker engine running and no dockerd to start (Debian: apt-get install docker.io)"
    if os.geteuid() != 0:
        return "no Docker engine running, and starting dockerd needs root"
    return None


@dataclass
class Engine:
    """The engine for a test: started here (and stopped by its pid) unless one was running."""

    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> Engine:
        if engine_running():
            return self
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["dockerd", "--iptables=false", "--ip-masq=false", "--ip-forward=false", "--storage-driver=overlay2"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while not engine_running():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dockerd did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        return self

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def stop(self) -> None:
        """Stop the dockerd started here (it stops its containerd and containers), by its process id."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


class WheelServer:
    """A folder of wheels on http://127.0.0.1:<port>/ (a thread of this process) for `pip --find-links`."""

    def __init__(self, folder: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(folder))
        try:  # one fixed port where free: the URL is a build argument, part of the builds' layer cache keys
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
        except OSError:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def image_info(ref: str) -> dict | None:
    proc = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, text=True, env=ENV, check=False)
    return json.loads(proc.stdout)[0] if proc.returncode == 0 else None


def local_cpu_torch(wheels: Path) -> str | None:
    """The version of a CPU-only torch wheel among pip's local wheel folders (its find-links), if any."""
    tmp = wheels / "probe"
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run(
        ["python3", "-m", "pip", "download", "-q", "--no-deps", "--no-index", "-d", str(tmp), "torch"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found = [p.name for p in tmp.glob("torch-*.whl")] if proc.returncode == 0 else []
    shutil.rmtree(tmp, ignore_errors=True)
    match = re.match(r"torch-([^-]+\+cpu)-", found[0]) if found else None
    return match.group(1) if match else None


def download_wheels(folder: Path, *requirements: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    sh("python3", "-m", "pip", "download", "-q", "-d", str(folder), *requirements, timeout=1800, env=os.environ.copy())


def apt_mirror() -> str:
    """The Debian mirror apt uses here (for debootstrap), else Debian's default."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^(?:deb\s+(?:\[[^\]]*\]\s+)?|URIs:\s*)(\S+)", text, re.MULTILINE):
            if "security" not in uri and uri.rstrip("/").endswith("debian"):
                return uri
    return "http://deb.debian.org/debian"


@dataclass
class Images:
    """What was built or found, and how long it took (for the records)."""

    flwr: str = ""  # "official" or "stand-in"
    app: str = ""
    torch: str = ""
    timings_s: dict[str, float] = field(default_factory=dict)
    sizes_mb: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def build(tag: str, *args: str, **kw) -> None:
    """`docker build -t tag ...`; the image the tag named before, if another, is removed (no dangling images)."""
    before = image_info(tag)
    sh("docker", "build", "-q", "--force-rm", "--network", "host", "-t", tag, *args, **kw)
    after = image_info(tag)
    if before and after and before["Id"] != after["Id"]:
        subprocess.run(["docker", "image", "rm", before["Id"]], capture_output=True, env=ENV, check=False)


def ensure_images(version: str | None = None, rebuild_app: bool = False) -> Images:
    version = version or flwr_version()
    out = Images()
    wheels = CACHE / "wheels"
    official = [f"flwr/{name}:{version}" for name in FLWR_IMAGES]
    infos = [image_info(ref) for ref in official]
    if all(infos):
        standin = any(STANDIN_LABEL in ((i.get("Config") or {}).get("Labels") or {}) for i in infos)
        out.flwr = "stand-in (built earlier, reused)" if standin else "official (present)"
    else:
        pulled = all(
            subprocess.run(["docker", "pull", ref], capture_output=True, timeout=600, env=ENV, check=False).returncode
            == 0
            for ref in official
        )
        out.flwr = "official (pulled)" if pulled else "stand-in"
    cpu_torch = local_cpu_torch(wheels)
    out.torch = (
        f"torch {cpu_torch} (a CPU wheel among pip's local wheels)"
        if cpu_torch
        else "torch from the package index (the CUDA build on Linux x86_64)"
    )
    torch_req = f"torch=={cpu_torch}" if cpu_torch else "torch"
    t0 = time.monotonic()
    download_wheels(wheels, f"flwr=={version}", torch_req, "torchvision", *app_requirements())
    out.timings_s["pip download (host, cached after the first run)"] = time.monotonic() - t0
    with WheelServer(wheels) as server:
        pip_args = f"--no-index --find-links {server.url}"
        if out.flwr == "stand-in":
            if image_info(DEBIAN_IMAGE) is None:
                out.timings_s["debian rootfs (debootstrap + docker import)"] = _debian_image()
            t0 = time.monotonic()
            for name in FLWR_IMAGES:
                build(
                    f"flwr/{name}:{version}",
                    "--target",
                    name,
                    "--build-arg",
                    f"FLWR_VERSION={version}",
                    "--build-arg",
                    f"PIP_ARGS={pip_args}",
                    "-",
                    input=(DOCKER_DIR / "standin" / "Dockerfile").read_text(),
                    timeout=1800,
                )
            out.timings_s["stand-in Flower images"] = time.monotonic() - t0
        app = f"{APP_IMAGE}:{version}"
        t0 = time.monotonic()
        # docker/app.Dockerfile unchanged; pip reaches only the wheel folder (with a CPU torch when there is one).
        build(
            app,
            "-f",
            "docker/app.Dockerfile",
            *(["--no-cache"] if rebuild_app else []),
            "--build-arg",
            f"FLWR_VERSION={version}",
            "--build-arg",
            f"PIP_ARGS={pip_args}",
            ".",
            cwd=REPO,
            timeout=3600,
        )
        out.timings_s["app image" + (" (no cache)" if rebuild_app else "")] = time.monotonic() - t0
    out.app = app
    for ref in [*official, app]:
        info = image_info(ref)
        out.sizes_mb[ref] = round(info["Size"] / 1e6, 1) if info else -1
    return out


def _debian_image() -> float:
    """A minimal Debian (the host's release, Python 3 and venv) imported as DEBIAN_IMAGE; seconds taken."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("building the stand-in images needs debootstrap (Debian: apt-get install debootstrap)")
    t0 = time.monotonic()
    root = CACHE / "rootfs"
    shutil.rmtree(root, ignore_errors=True)
    sh(
        "debootstrap",
        "--variant=minbase",
        "--include=python3,python3-venv",
        "bookworm",
        str(root),
        apt_mirror(),
        timeout=1800,
    )
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (root / junk).glob("*"):
            if p.is_file():
                p.unlink()
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run(
        ["docker", "import", "-", DEBIAN_IMAGE], stdin=tar.stdout, capture_output=True, env=ENV, check=False
    )
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    if imp.returncode != 0:
        raise RuntimeError(f"docker import failed: {imp.stderr.decode()[-2000:]}")
    return time.monotonic() - t0


def docker_disk_mb() -> dict[str, float]:
    """The engine's disk use (images, containers, volumes, build cache), from `docker system df`."""
    proc = sh("docker", "system", "df", "--format", "{{.Type}}\t{{.Size}}")
    out = {}
    for line in proc.stdout.splitlines():
        kind, _, size = line.partition("\t")
        m = re.match(r"([\d.]+)\s*([kMGT]?B)", size)
        if m:
            out[kind] = round(float(m.group(1)) * {"B": 1e-6, "kB": 1e-3, "MB": 1, "GB": 1e3, "TB": 1e6}[m.group(2)], 1)
    return out


class Project:
    """One compose project (its own name, files and environment); `down` removes its containers and networks."""

    def __init__(self, name: str, files: list[Path], env: dict[str, str], cwd: Path) -> None:
        self.name, self.files, self.cwd = name, files, cwd
        self.env = {**ENV, **env}
        self.base = [*compose_command(), "-p", name, *[arg for f in files for arg in ("-f", str(f))]]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return sh(*self.base, *args, timeout=timeout, check=check, cwd=self.cwd, env=self.env)

    def up(self, *services: str) -> None:
        self("up", "-d", "--no-build", *services)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def state(self, service: str) -> dict:
        cid = self.container(service)
        return json.loads(sh("docker", "inspect", cid).stdout)[0]["State"] if cid else {}

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", service, check=False).stdout

    def down(self) -> None:
        self("down", "--remove-orphans", "--timeout", "5", check=False)


APP_UID = 49999  # the images' `app` user


def script(name: str, *args) -> None:
    proc = subprocess.run(
        ["bash", str(DOCKER_DIR / name), *map(str, args)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"docker/{name} failed: {proc.stderr}")


def chown_app(*paths: Path) -> None:
    for p in paths:
        os.chown(p, APP_UID, APP_UID)


def checkout(folder: Path) -> Path:
    """The files a user's checkout has under docker/ (compose files and scripts), copied into ``folder``."""
    shutil.copytree(DOCKER_DIR, folder / "docker", ignore=shutil.ignore_patterns("secrets", "state", "client-state"))
    return folder


class Cli:
    """The host's `flwr` CLI with its own FLWR_HOME and one TLS connection."""

    def __init__(self, home: Path, name: str, address: str, ca: Path) -> None:
        import sys

        self.home, self.name = home, name
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\n'
            f'address = "{address}"\nroot-certificates = "{ca}"\n'
        )
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
        }
        exe = Path(sys.executable).parent / "flwr"
        self.exe = str(exe) if exe.exists() else "flwr"

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.exe, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def register(self, pub: Path, wait_s: float = 120) -> None:
        deadline = time.monotonic() + wait_s
        while True:  # the SuperLink container may still be starting
            reg = self("supernode", "register", str(pub), self.name)
            if reg.returncode == 0 and "registered" in reg.stdout.lower():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"flwr supernode register failed: {reg.stdout + reg.stderr}")
            time.sleep(2)

    def run(self, run_config: str, log: Path) -> subprocess.Popen:
        out = open(log, "w")  # noqa: SIM115 - the child process's output: open as long as it runs
        return subprocess.Popen(
            [self.exe, "run", str(REPO), self.name, "--stream", "--run-config", run_config],
            cwd=REPO,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


class OneHost:
    """The README's one-host block (docker/compose.yml + docker/compose.tls.yml) in ``folder``: certificates and
    keys made with docker/make-*.sh, the data file in ./data, the written folders and read private files owned by
    uid 49999, the SuperLink and its executor up, both keys registered with the CLI, then every service up."""

    def __init__(self, folder: Path, data_file: Path, name: str, port: int, threads: int) -> None:
        self.root = checkout(folder / "checkout")
        docker = self.root / "docker"
        self.secrets = docker / "secrets"
        self.data = self.root / "data"
        self.outputs, self.state = self.root / "outputs", docker / "state"
        self.client_state = [docker / "client-state" / str(n) for n in (1, 2)]
        self.project = Project(
            name,
            [docker / "compose.yml", docker / "compose.tls.yml"],
            {"SUPERLINK_PORT": str(port), "FLWR_VERSION": flwr_version(), "OMP_NUM_THREADS": str(threads)},
            cwd=self.root,
        )
        self.cli = Cli(folder / "cli", "local-docker-tls", f"127.0.0.1:{port}", self.secrets / "ca.crt")
        self.data_file = data_file

    def up(self) -> None:
        script("make-certs.sh", self.secrets, "superlink", "localhost", "127.0.0.1")
        for n in (1, 2):
            script("make-supernode-key.sh", self.secrets / f"supernode-{n}")
        self.data.mkdir()
        try:
            os.link(self.data_file, self.data / "cifar10.npz")
        except OSError:
            shutil.copy(self.data_file, self.data / "cifar10.npz")
        for d in (self.outputs, self.state, *self.client_state):
            d.mkdir(parents=True)
        chown_app(
            self.outputs,
            self.state,
            *self.client_state,
            self.secrets / "server.key",
            self.secrets / "superexec.secret",
            *(self.secrets / f"supernode-{n}" / f for n in (1, 2) for f in ("supernode.key", "superexec.secret")),
        )
        self.project.up("superlink", "superexec-serverapp")
        for n in (1, 2):
            self.cli.register(self.secrets / f"supernode-{n}" / "supernode.key.pub")
        self.project.up()

    def down(self) -> None:
        self.project.down()


def main() -> int:
    """Build (or find) the images the compose files use; print what was used, sizes and times."""
    reason = engine_unavailable()
    if reason:
        print(f"no Docker engine: {reason}")
        return 1
    engine = Engine(CACHE / "dockerd.log").start()
    try:
        images = ensure_images()
    finally:
        if engine.started_here:
            print("stopping the dockerd started for the build")
        engine.stop()
    print(
        json.dumps(
            {
                "flwr images": images.flwr,
                "app": images.app,
                "torch": images.torch,
                "sizes_mb": images.sizes_mb,
                "build_s": images.timings_s,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
