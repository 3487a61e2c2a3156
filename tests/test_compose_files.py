"""Static checks of the deployment files under docker/: no Docker engine needed.

Every compose configuration the README documents (the single-host file alone, with its TLS overlay or
its GPU overlay, the SuperLink machine's file, a client machine's file alone or with its GPU overlay) is
read with ``docker/compose_native.py`` and checked against the installed Flower: each command's options
exist, addresses dial services of the same project on the ports they listen on, the TLS files leave no
insecure hop to the SuperLink, GPU overlays reserve a GPU for the ClientApp executors, and every image
tag is the installed Flower version. The app image's requirement step and the two secret scripts run
for real (on temporary folders). Schema validation needs ``docker compose`` or Debian's
``docker-compose`` package and is skipped without them.
"""

from __future__ import annotations

import functools
import operator
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import flwr
import pytest
from flwr.common.config import parse_config_args

from compose_native import CONTAINER_WORKDIR, DOCKER_DIR, REPO, Compose, load_compose
from conftest import skip_unless_required

# The client file dials a SuperLink outside its project; a host name that no service has makes that
# exception explicit.
EXTERNAL_SUPERLINK = "superlink.example.org:8000"
COMPOSE_ENV = {"PARTITION_ID": "0", "NUM_PARTITIONS": "2", "SUPERLINK_ADDRESS": EXTERNAL_SUPERLINK}

SUPERLINK, SUPERNODE, SUPEREXEC = "flower-superlink", "flower-supernode", "flower-superexec"
# The option by which each kind of service dials another one.
DIAL_OPTIONS = {SUPERNODE: "--superlink", SUPEREXEC: "--runtime-api-address"}
CLIENTAPP_PREFIX, SERVERAPP_PREFIX = "superexec-clientapp", "superexec-serverapp"
WRITTEN_OPTIONS = {"--database"}  # file options the program writes to: their mount must not be read-only
SUPERLINK_TLS_OPTIONS = ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth")
SUPERNODE_TLS_OPTIONS = ("--auth-supernode-private-key", "--root-certificates")
FLOWER_PROGRAMS = (SUPERLINK, SUPERNODE, SUPEREXEC)
HELP_ENV = {**os.environ, "COLUMNS": "200", "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
# Compose validation sees only what the test sets (a user's FLWR_VERSION or the like would change it).
SCHEMA_ENV = {k: os.environ[k] for k in ("PATH", "HOME", "DOCKER_CONFIG") if k in os.environ} | COMPOSE_ENV
SANS = ("superlink", "localhost", "127.0.0.1", "10.1.2.3")  # the names make-certs.sh is tested with


@dataclass(frozen=True)
class Combo:
    """One documented compose configuration: a file plus overlays (paths relative to docker/)."""

    files: tuple[str, ...]
    tls: bool = False
    gpu: bool = False
    single_host: bool = False  # the whole federation in one project
    external_superlink: bool = False  # its SuperNode dials ${SUPERLINK_ADDRESS}

    @property
    def id(self) -> str:
        return "+".join(self.files)

    @property
    def paths(self) -> list[Path]:
        return [DOCKER_DIR / f for f in self.files]


COMBOS = [
    Combo(("compose.yml",), single_host=True),
    Combo(("compose.yml", "compose.tls.yml"), tls=True, single_host=True),
    Combo(("compose.yml", "compose.gpu.yml"), gpu=True, single_host=True),
    Combo(("server/compose.yml",), tls=True),
    Combo(("client/compose.yml",), tls=True, external_superlink=True),
    Combo(("client/compose.yml", "client/compose.gpu.yml"), tls=True, gpu=True, external_superlink=True),
]
TLS_COMBOS = [c for c in COMBOS if c.tls]
PLAIN_COMBOS = [c for c in COMBOS if not c.tls]
CLIENT_COMBO = COMBOS[4]
NODE_COMBOS = [c for c in COMBOS if c.files[0] != "server/compose.yml"]  # the SuperLink machine runs none


def _ids(combo: Combo) -> str:
    return combo.id


@pytest.fixture(params=COMBOS, ids=_ids)
def combo(request) -> Combo:
    return request.param


@pytest.fixture
def compose(combo: Combo) -> Compose:
    return load(combo)


def load(combo: Combo, **extra_env: str) -> Compose:
    return load_compose(combo.paths, {**COMPOSE_ENV, **extra_env})


# ---------------------------------------------------------------------- helpers on a compose project


def where(c: Compose, service: str | None = None) -> str:
    files = " + ".join(str(f.relative_to(REPO)) for f in c.files)
    return f"{files}: service {service}" if service else files


def program_name(c: Compose, service: str) -> str:
    return Path(c.program(service)[0]).name


def services_running(c: Compose, program: str) -> list[str]:
    return [s for s in c.services if program_name(c, s) == program]


def options(c: Compose, service: str) -> dict[str, str | None]:
    """A command's options: ``--name`` -> the token after it (None for a flag)."""
    tokens, out = c.command(service), {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            name, eq, inline = token.partition("=")
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            out[name] = inline if eq else (nxt if nxt is not None and not nxt.startswith("--") else None)
    return out


def is_path(value: str | None) -> bool:
    return bool(value) and "/" in value and re.fullmatch(r"[\w.~/-]+", value) is not None


def mount_of(c: Compose, service: str, container_path: str) -> tuple[Path, str, str] | None:
    """The volume (host, target, mode) that holds a container path (relative to the WORKDIR), if any."""
    path = posixpath.normpath(posixpath.join(CONTAINER_WORKDIR, container_path))
    for host, target, mode in c.volumes(service):
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return host, target, mode
    return None


def host_file(c: Compose, service: str, container_path: str) -> Path | None:
    """The host file behind a container path, or None when no volume holds it."""
    mount = mount_of(c, service, container_path)
    if mount is None:
        return None
    host, target, _mode = mount
    path = posixpath.normpath(posixpath.join(CONTAINER_WORKDIR, container_path))
    return host / posixpath.relpath(path, target)


def split_address(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    assert sep and host and port.isdigit(), f"{address!r} is not host:port"
    return host, port


def dials(c: Compose) -> list[tuple[str, str, str]]:
    """(service, option, address) of every address a service dials."""
    out = []
    for service in c.services:
        option = DIAL_OPTIONS.get(program_name(c, service))
        if option:
            address = options(c, service).get(option)
            assert address, f"{where(c, service)}: no {option} address"
            out.append((service, option, address))
    return out


def dialled_service(c: Compose, address: str) -> str | None:
    """The project's service an address names (None for an address outside the project)."""
    host, _port = split_address(address)
    return host if host in c.services else None


def expected_targets(service: str, option: str) -> set[str]:
    """The programs a service may dial: SuperNodes and the ServerApp executor the SuperLink, the ClientApp
    executor a SuperNode."""
    if option == "--superlink" or service.startswith(SERVERAPP_PREFIX):
        return {SUPERLINK}
    return {SUPERNODE} if service.startswith(CLIENTAPP_PREFIX) else {SUPERLINK, SUPERNODE}


def reserved_devices(spec: dict) -> list[dict]:
    return (((spec.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


def reserves_nvidia_gpu(spec: dict) -> bool:
    return any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or []) for d in reserved_devices(spec))


# ---------------------------------------------------------------------- helpers on the installed tools


class Jobs:
    """The slow subprocesses (``--help`` of Flower's programs, compose validation, key generation), all
    started at once when the module's tests begin and read when a test needs them, so that they overlap."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders  # where the scripts write
        self.procs: dict[str, subprocess.Popen] = {}
        self.done: dict[str, subprocess.CompletedProcess] = {}

    def start(self, key: str, argv: list[str], **kwargs) -> None:
        self.procs[key] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
        )

    def result(self, key: str) -> subprocess.CompletedProcess:
        if key not in self.done:
            proc = self.procs[key]
            out, err = proc.communicate(timeout=120)
            self.done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.done[key]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    jobs = Jobs({"certs": tmp_path_factory.mktemp("certs") / "s", "supernode": tmp_path_factory.mktemp("key") / "n"})
    try:
        for program in FLOWER_PROGRAMS:
            if executable(program):
                jobs.start(f"help {program}", [executable(program), "--help"], env=HELP_ENV)
        if compose_cli():
            for combo in COMBOS:
                jobs.start(f"schema {combo.id}", schema_argv(combo), cwd=REPO, env=SCHEMA_ENV)
        if shutil.which("openssl"):
            jobs.start("certs", script_argv("make-certs.sh", jobs.folders["certs"], *SANS), cwd=REPO)
        if shutil.which("openssl") and shutil.which("ssh-keygen"):
            jobs.start("supernode", script_argv("make-supernode-key.sh", jobs.folders["supernode"]), cwd=REPO)
        yield jobs
    finally:
        jobs.stop()


def executable(program: str) -> str | None:
    """The program of this Python environment (as the native deployment tests run it), else PATH's."""
    exe = Path(sys.executable).parent / program
    return str(exe) if exe.exists() else shutil.which(program)


def parse_help_options(text: str) -> dict[str, bool]:
    """Option names of an argparse ``--help`` text -> whether the option takes a value."""
    known = {}
    for line in text.splitlines():
        m = re.match(r"^ {2}(-\S.*?)(?: {2,}|$)", line)
        if not m:
            continue
        for invocation in m.group(1).split(", "):
            name, *metavar = invocation.split()
            if name.startswith("--"):
                known[name] = bool(metavar)
    return known


@pytest.fixture(scope="module")
def flower_options(jobs: Jobs) -> dict[str, dict[str, bool]]:
    """program -> its options, from ``<program> --help``."""
    out = {}
    for program in FLOWER_PROGRAMS:
        assert executable(program), f"{program} is not installed (it comes with flwr)"
        result = jobs.result(f"help {program}")
        assert result.returncode == 0, f"{program} --help exited with {result.returncode}: {result.stderr}"
        out[program] = parse_help_options(result.stdout)
        assert "--help" in out[program] and len(out[program]) > 3, f"could not parse {program} --help:\n{result.stdout}"
    return out


@functools.cache
def compose_cli() -> tuple[str, ...] | None:
    """``docker compose`` (the plugin) if it works, else Debian's ``docker-compose``, else None."""
    if shutil.which("docker"):
        try:
            if (
                subprocess.run(
                    ["docker", "compose", "version"], capture_output=True, timeout=20, check=False
                ).returncode
                == 0
            ):
                return ("docker", "compose")
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ("docker-compose",) if shutil.which("docker-compose") else None


def need_tools(*tools: str) -> None:
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        skip_unless_required(f"{', '.join(missing)} not installed (Debian packages openssl, openssh-client)")


def schema_argv(combo: Combo) -> list[str]:
    files = [x for path in combo.paths for x in ("-f", str(path.relative_to(REPO)))]
    return [*compose_cli(), *files, "config", "-q"]


def script_argv(name: str, *args: str | Path) -> list[str]:
    return ["bash", str(DOCKER_DIR / name), *map(str, args)]


def run_script(name: str, *args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(script_argv(name, *args), cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mode) for p in sorted(folder.iterdir())}


def file_mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def openssl(*args: str | Path) -> str:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"openssl {' '.join(map(str, args))} failed: {result.stderr}"
    return result.stdout


# ---------------------------------------------------------------------- a. schema


@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_compose_schema(combo: Combo, jobs: Jobs):
    if compose_cli() is None:
        skip_unless_required(
            "neither `docker compose` nor `docker-compose` is installed; for offline schema validation "
            "install Debian's docker-compose package (apt-get install docker-compose)"
        )
    result = jobs.result(f"schema {combo.id}")
    assert result.returncode == 0, f"{combo.id}: `{' '.join(result.args)}` rejects it:\n{result.stderr}{result.stdout}"


# ---------------------------------------------------------------------- b. options and volumes


def test_command_options_exist(compose: Compose, flower_options):
    for service in compose.services:
        program = program_name(compose, service)
        known, tokens, seen = flower_options[program], compose.command(service), set()
        i = 0
        while i < len(tokens):
            name, eq, _ = tokens[i].partition("=")
            assert name.startswith("--"), (
                f"{where(compose, service)}: {tokens[i]!r} follows no option that takes a value"
            )
            assert name in known, (
                f"{where(compose, service)}: {name} is not an option of {program} "
                f"(flwr {flwr.__version__}); its options: {sorted(known)}"
            )
            assert name not in seen, f"{where(compose, service)}: {name} is given twice"
            seen.add(name)
            if known[name] and not eq:
                i += 1
                assert i < len(tokens) and not tokens[i].startswith("--"), (
                    f"{where(compose, service)}: {name} needs a value"
                )
            i += 1


def test_file_options_are_on_mounted_volumes(compose: Compose):
    for service in compose.services:
        for name, value in options(compose, service).items():
            if not is_path(value):
                continue
            mount = mount_of(compose, service, value)
            targets = [t for _, t, _ in compose.volumes(service)]
            assert mount is not None, (
                f"{where(compose, service)}: {name} {value} is not on any volume the service "
                f"mounts (relative to WORKDIR {CONTAINER_WORKDIR}; mounts: {targets})"
            )
            if name in WRITTEN_OPTIONS:
                assert mount[2] != "ro", f"{where(compose, service)}: {name} {value} is on read-only {mount[1]}"


# ---------------------------------------------------------------------- c. node config


def node_config(c: Compose, service: str) -> dict:
    raw = options(c, service).get("--node-config")
    assert raw, f"{where(c, service)}: no --node-config"
    try:
        return parse_config_args([raw])
    except Exception as err:  # noqa: BLE001 - click.ClickException or ValueError, as flower-supernode would exit
        pytest.fail(f"{where(c, service)}: --node-config {raw!r} does not parse: {err}")


@pytest.mark.parametrize("combo", NODE_COMBOS, ids=_ids)
def test_node_config(combo: Combo, compose: Compose):
    supernodes = services_running(compose, SUPERNODE)
    assert supernodes, f"{combo.id} has no SuperNode"
    configs = {s: node_config(compose, s) for s in supernodes}
    for service, cfg in configs.items():
        for key in ("partition-id", "num-partitions"):
            assert type(cfg.get(key)) is int, f"{where(compose, service)}: {key} is not an integer: {cfg}"
        assert 0 <= cfg["partition-id"] < cfg["num-partitions"], f"{where(compose, service)}: {cfg}"
    if combo.single_host:
        ids = sorted(cfg["partition-id"] for cfg in configs.values())
        assert ids == list(range(len(configs))), f"{where(compose)}: partition ids {ids} are not 0..{len(configs) - 1}"
        for service, cfg in configs.items():
            assert cfg["num-partitions"] == len(configs), (
                f"{where(compose, service)}: num-partitions={cfg['num-partitions']} but the file has "
                f"{len(configs)} SuperNodes"
            )


def test_client_node_config_takes_extra_keys():
    c = load(CLIENT_COMBO, PARTITION_ID="1", NUM_PARTITIONS="3", NODE_CONFIG="data-path='/data/own.npz'")
    (service,) = services_running(c, SUPERNODE)
    cfg = node_config(c, service)
    assert (cfg.get("partition-id"), cfg.get("num-partitions"), cfg.get("data-path")) == (1, 3, "/data/own.npz"), (
        f"{where(c, service)}: NODE_CONFIG/PARTITION_ID/NUM_PARTITIONS do not reach --node-config: {cfg}"
    )


# ---------------------------------------------------------------------- d. addresses


def test_dialled_addresses_name_listening_services(combo: Combo, compose: Compose):
    for service, option, address in dials(compose):
        target = dialled_service(compose, address)
        if target is None and combo.external_superlink and option == "--superlink":
            assert address == COMPOSE_ENV["SUPERLINK_ADDRESS"], (
                f"{where(compose, service)}: {option} {address} does not come from SUPERLINK_ADDRESS"
            )
            continue
        assert target is not None, f"{where(compose, service)}: {option} {address} names no service of the project"
        assert program_name(compose, target) in expected_targets(service, option), (
            f"{where(compose, service)}: {option} {address} dials {target}, which runs {program_name(compose, target)}"
        )
        target_opts = options(compose, target)
        assert split_address(address)[1] == target_opts.get("--port"), (
            f"{where(compose, service)}: {option} {address} but {target} listens on --port {target_opts.get('--port')}"
        )
        assert target_opts.get("--host") in ("0.0.0.0", "::"), (
            f"{where(compose, target)}: --host {target_opts.get('--host')} is not reachable from {service}'s container"
        )


def test_process_isolated_components_have_one_executor(compose: Compose):
    dialled_by: dict[str, list[str]] = {}
    for service, option, address in dials(compose):
        if option == "--runtime-api-address" and dialled_service(compose, address):
            dialled_by.setdefault(dialled_service(compose, address), []).append(service)
    for service in services_running(compose, SUPERLINK) + services_running(compose, SUPERNODE):
        if options(compose, service).get("--isolation") == "process":
            executors = dialled_by.get(service, [])
            assert len(executors) == 1, (
                f"{where(compose, service)}: --isolation process needs one executor, dialled by {executors}"
            )


# ---------------------------------------------------------------------- e. security


@pytest.mark.parametrize("combo", PLAIN_COMBOS, ids=_ids)
def test_plain_quick_start_is_explicitly_insecure(compose: Compose):
    for service in compose.services:
        assert "--insecure" in options(compose, service), f"{where(compose, service)}: no explicit --insecure"


@pytest.mark.parametrize("combo", TLS_COMBOS, ids=_ids)
def test_tls_configuration(compose: Compose):
    for service in services_running(compose, SUPERLINK):
        missing = [o for o in SUPERLINK_TLS_OPTIONS if o not in options(compose, service)]
        assert not missing, f"{where(compose, service)}: TLS/authentication options missing: {missing}"
    for service in services_running(compose, SUPERNODE):
        missing = [o for o in SUPERNODE_TLS_OPTIONS if o not in options(compose, service)]
        assert not missing, f"{where(compose, service)}: TLS/authentication options missing: {missing}"
    for service, option, address in dials(compose):
        target = dialled_service(compose, address)
        if target is None or program_name(compose, target) == SUPERLINK:
            opts = options(compose, service)
            assert "--insecure" not in opts, f"{where(compose, service)}: --insecure on its connection to the SuperLink"
            assert "--root-certificates" in opts, (
                f"{where(compose, service)}: dials the SuperLink without --root-certificates"
            )
    insecure = [s for s in compose.services if "--insecure" in options(compose, s)]
    for service in insecure:
        target = dialled_service(compose, options(compose, service).get("--runtime-api-address") or "none:0")
        assert service.startswith(CLIENTAPP_PREFIX) and target and program_name(compose, target) == SUPERNODE, (
            f"{where(compose, service)}: --insecure is only allowed for a ClientApp executor dialling its SuperNode"
        )


@pytest.mark.parametrize("combo", TLS_COMBOS, ids=_ids)
def test_tls_files_are_shared_where_they_must_match(compose: Compose):
    """An executor and what it dials read one SuperExec secret; every CA certificate is the SuperLink's."""
    for service, option, address in dials(compose):
        target = dialled_service(compose, address)
        if option != "--runtime-api-address" or target is None:
            continue
        secrets = [options(compose, s).get("--superexec-auth-secret-file") for s in (service, target)]
        files = [host_file(compose, s, v) if v else None for s, v in zip((service, target), secrets)]
        assert files[0] == files[1], (
            f"{where(compose, service)}: its SuperExec secret ({secrets[0]} -> {files[0]}) "
            f"differs from {target}'s ({secrets[1]} -> {files[1]})"
        )
    for link in services_running(compose, SUPERLINK):
        ca = host_file(compose, link, options(compose, link)["--ssl-ca-certfile"])
        for service in compose.services:
            root = options(compose, service).get("--root-certificates")
            if root:
                assert host_file(compose, service, root) == ca, (
                    f"{where(compose, service)}: --root-certificates {root} is not {link}'s CA certificate"
                )


# ---------------------------------------------------------------------- f. GPUs


def test_gpu_reservations(combo: Combo, compose: Compose):
    clientapps = [s for s in compose.services if s.startswith(CLIENTAPP_PREFIX)]
    if combo.gpu:
        assert clientapps, f"{where(compose)}: a GPU overlay but no ClientApp executor"
        for service in clientapps:
            assert reserves_nvidia_gpu(compose.services[service]), (
                f"{where(compose, service)}: no deploy.resources.reservations.devices entry with driver nvidia "
                "and capability gpu"
            )
    else:
        reserving = [s for s, spec in compose.services.items() if reserved_devices(spec)]
        assert not reserving, f"{where(compose)}: devices reserved without a GPU overlay by {reserving}"


# ---------------------------------------------------------------------- g. versions


def project_dependencies() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def requirement_name(requirement: str) -> str:
    return re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1).lower().replace("_", "-")


def satisfies(version: str, requirement: str) -> bool:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # plain numeric comparison of each bound
        ops = {
            ">=": operator.ge,
            "<=": operator.le,
            "==": operator.eq,
            "!=": operator.ne,
            ">": operator.gt,
            "<": operator.lt,
        }
        key = lambda v: tuple(int(n) for n in re.findall(r"\d+", v))
        bounds = re.findall(r"(>=|<=|==|!=|>|<)\s*([\w.]+)", requirement)
        return all(ops[op](key(version), key(bound)) for op, bound in bounds)
    return Requirement(requirement).specifier.contains(version, prereleases=True)


def pinned_flwr_version() -> str:
    """The single default of ``${FLWR_VERSION:-X}`` in every compose file and the Dockerfile's ARG."""
    found: dict[str, list[str]] = {}
    for path in sorted(DOCKER_DIR.rglob("compose*.yml")):
        text = path.read_text()
        defaults = re.findall(r"\$\{FLWR_VERSION:-([^}]*)\}", text)
        assert len(defaults) == len(re.findall(r"\$\{?FLWR_VERSION\b", text)), (
            f"{path.relative_to(REPO)}: FLWR_VERSION used without the ${{FLWR_VERSION:-X}} default"
        )
        for version in defaults:
            found.setdefault(version, []).append(str(path.relative_to(REPO)))
    args = re.findall(r"^ARG FLWR_VERSION=(\S+)\s*$", (DOCKER_DIR / "app.Dockerfile").read_text(), re.MULTILINE)
    assert len(args) == 1, f"docker/app.Dockerfile: expected one `ARG FLWR_VERSION=X`, found {args}"
    found.setdefault(args[0], []).append("docker/app.Dockerfile")
    assert len(found) == 1, f"more than one default Flower version: {found}"
    return next(iter(found))


def test_flwr_version_is_one_installed_and_required_version():
    version = pinned_flwr_version()
    assert version == flwr.__version__, f"docker/ pins Flower {version}, the installed flwr is {flwr.__version__}"
    (requirement,) = [d for d in project_dependencies() if requirement_name(d) == "flwr"]
    assert satisfies(version, requirement), f"docker/ pins Flower {version}, pyproject.toml requires {requirement}"


def test_images_use_the_installed_version(combo: Combo):
    for version, env in ((flwr.__version__, {}), ("9.9.9", {"FLWR_VERSION": "9.9.9"})):
        c = load(combo, **env)
        for service, spec in c.services.items():
            tag = str(spec.get("image", "")).rpartition(":")[2]
            assert tag == version, f"{where(c, service)}: image {spec.get('image')} is not tagged {version} ({env})"
            if "build" in spec:
                build = spec["build"]
                assert str(build.get("args", {}).get("FLWR_VERSION")) == version, (
                    f"{where(c, service)}: build arg FLWR_VERSION is not {version} ({env})"
                )
                assert (c.project_dir / build["context"]).resolve() == REPO, (
                    f"{where(c, service)}: build context {build['context']} is not the repository root"
                )
                assert (REPO / build["dockerfile"]).is_file(), f"{where(c, service)}: no {build['dockerfile']}"


# ---------------------------------------------------------------------- h. the app image


def dockerfile_instructions(path: Path) -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [line.strip() for line in text.splitlines() if line.strip()]


def docker_ignored(path: str) -> bool:
    """Whether .dockerignore keeps a path out of the build context (last matching pattern wins)."""
    ignore = REPO / ".dockerignore"
    ignored = False
    for line in ignore.read_text().splitlines() if ignore.exists() else []:
        pattern = line.strip()
        if pattern and not pattern.startswith("#"):
            negated = pattern.startswith("!")
            if fnmatch(path, pattern.lstrip("!").lstrip("/")):
                ignored = not negated
    return ignored


def test_app_image_installs_project_dependencies(tmp_path):
    instructions = dockerfile_instructions(DOCKER_DIR / "app.Dockerfile")
    copies = [shlex.split(i)[1:] for i in instructions if i.startswith("COPY ") and "pyproject.toml" in i]
    assert len(copies) == 1, f"docker/app.Dockerfile: expected one COPY of pyproject.toml, found {copies}"
    source, dest = copies[0]
    assert not docker_ignored(source), (
        f".dockerignore keeps {source} (COPY'd by docker/app.Dockerfile) out of the build context"
    )
    runs = [shlex.split(i[len("RUN ") :]) for i in instructions if i.startswith("RUN ") and "python -c" in i]
    assert len(runs) == 1, "docker/app.Dockerfile: expected one RUN python -c ... requirement step"
    tokens = runs[0]
    code = tokens[tokens.index("-c") + 1]
    assert dest in code, f"docker/app.Dockerfile: the python -c step does not read {dest}"
    written, installed = tokens[tokens.index(">") + 1], tokens[tokens.index("-r") + 1]
    assert written == installed, f"docker/app.Dockerfile: requirements written to {written}, installed from {installed}"

    shutil.copy(REPO / source, tmp_path / "pyproject.toml")
    result = subprocess.run(
        [sys.executable, "-c", code.replace(dest, str(tmp_path / "pyproject.toml"))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"docker/app.Dockerfile: the requirement step fails: {result.stderr}"
    expected = [d for d in project_dependencies() if requirement_name(d) != "flwr"]
    assert result.stdout.splitlines() == expected, (
        f"docker/app.Dockerfile installs {result.stdout.splitlines()}, pyproject.toml needs {expected} (besides flwr)"
    )


# ---------------------------------------------------------------------- i. secret scripts


def script_output(jobs: Jobs, key: str, script: str, *tools: str) -> Path:
    need_tools(*tools)
    result = jobs.result(key)
    assert result.returncode == 0, f"docker/{script} failed: {result.stderr}"
    return jobs.folders[key]


@pytest.fixture(scope="module")
def certs(jobs: Jobs) -> Path:
    return script_output(jobs, "certs", "make-certs.sh", "openssl")


@pytest.fixture(scope="module")
def supernode_key(jobs: Jobs) -> Path:
    return script_output(jobs, "supernode", "make-supernode-key.sh", "openssl", "ssh-keygen")


def assert_modes(folder: Path, private: tuple[str, ...], public: tuple[str, ...], script: str) -> None:
    for names, mode in ((private, "0o600"), (public, "0o644")):
        for name in names:
            assert file_mode(folder / name) == mode, f"{script}: {name} has mode {file_mode(folder / name)}, not {mode}"


def assert_refuses_to_overwrite(script: str, folder: Path, *args: str) -> None:
    before = snapshot(folder)
    result = run_script(script, folder, *args)
    assert result.returncode != 0, f"{script} overwrote the files in an existing folder"
    assert "exists" in result.stderr, f"{script}: no reason given for refusing: {result.stderr!r}"
    assert snapshot(folder) == before, f"{script} changed existing files although it failed"


def test_make_certs_server_certificate(certs: Path):
    san_text = openssl("x509", "-noout", "-ext", "subjectAltName", "-in", certs / "server.pem")
    entries = {e.strip().replace("IP Address:", "IP:") for e in san_text.splitlines()[-1].split(",")}
    expected = {f"IP:{h}" if re.fullmatch(r"[\d.]+", h) else f"DNS:{h}" for h in SANS}
    assert entries == expected, f"docker/make-certs.sh: server.pem's SANs are {entries}, not {expected}"
    verify = subprocess.run(
        ["openssl", "verify", "-purpose", "sslserver", "-CAfile", certs / "ca.crt", certs / "server.pem"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert verify.returncode == 0, (
        f"docker/make-certs.sh: server.pem does not verify against ca.crt: {verify.stdout}{verify.stderr}"
    )
    assert openssl("x509", "-noout", "-pubkey", "-in", certs / "server.pem") == openssl(
        "pkey", "-pubout", "-in", certs / "server.key"
    ), "docker/make-certs.sh: server.key does not match server.pem"


def test_make_certs_file_modes(certs: Path):
    assert_modes(certs, ("ca.key", "server.key", "superexec.secret"), ("ca.crt", "server.pem"), "docker/make-certs.sh")
    written = sorted(p.name for p in certs.iterdir())
    assert written == ["ca.crt", "ca.key", "server.key", "server.pem", "superexec.secret"], (
        f"docker/make-certs.sh: unexpected files {written} (temporary files left behind?)"
    )


def test_make_certs_refuses_to_overwrite(certs: Path):
    assert_refuses_to_overwrite("make-certs.sh", certs, *SANS)


def test_make_supernode_key(supernode_key: Path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    public = (supernode_key / "supernode.key.pub").read_text().split()
    assert public and public[0] == "ecdsa-sha2-nistp384", f"docker/make-supernode-key.sh: public key type {public[:1]}"
    key = load_ssh_private_key((supernode_key / "supernode.key").read_bytes(), None)  # as flower-supernode loads it
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1", (
        f"docker/make-supernode-key.sh: supernode.key is a {type(key).__name__}"
    )
    assert_modes(
        supernode_key, ("supernode.key", "superexec.secret"), ("supernode.key.pub",), "docker/make-supernode-key.sh"
    )
    assert_refuses_to_overwrite("make-supernode-key.sh", supernode_key)


@pytest.mark.parametrize(
    "script, nargs",
    [("make-certs.sh", 0), ("make-certs.sh", 1), ("make-supernode-key.sh", 0), ("make-supernode-key.sh", 2)],
)
def test_scripts_usage(tmp_path, script: str, nargs: int):
    args = [tmp_path / f"arg{i}" for i in range(nargs)]
    result = run_script(script, *args)
    assert result.returncode == 2, f"docker/{script} with {nargs} argument(s) exits {result.returncode}, not 2"
    assert result.stderr.startswith("usage:"), f"docker/{script}: no usage line: {result.stderr!r}"
    assert not any(a.exists() for a in args), f"docker/{script} created files although called wrongly"


# ---------------------------------------------------------------------- j. secrets per container, torch layer


@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_each_container_mounts_only_the_secret_files_it_uses(combo: Combo):
    """App code of any run executes in the executors: no container may see a secret its command does not name,
    and the CA's private key enters none (found in a real run: the whole secrets folder was in every container)."""
    compose = load(combo)
    for service in compose.services:
        used = {
            posixpath.normpath(posixpath.join(CONTAINER_WORKDIR, v))
            for v in options(compose, service).values()
            if is_path(v) and "secrets/" in v
        }
        for host, target, _mode in compose.volumes(service):
            if not target.startswith(f"{CONTAINER_WORKDIR}/secrets"):
                continue
            assert host.name != "ca.key", f"{where(compose, service)}: mounts the CA's private key"
            assert target in used, (
                f"{where(compose, service)}: mounts {target}, which its command does not use "
                f"(a secrets folder or another service's file); it uses {sorted(used)}"
            )


def test_torch_layer_matches_pyproject():
    """docker/app.Dockerfile installs torch first (its own layer, kept when pyproject.toml changes): the same
    requirements as pyproject.toml's."""
    text = (DOCKER_DIR / "app.Dockerfile").read_text()
    found = re.findall(r'^ARG TORCH_REQUIREMENTS="([^"]*)"', text, re.MULTILINE)
    assert len(found) == 1, 'docker/app.Dockerfile: expected one ARG TORCH_REQUIREMENTS="..."'
    expected = [d.replace(" ", "") for d in project_dependencies() if requirement_name(d) in ("torch", "torchvision")]
    assert found[0].split() == expected
    assert text.index("${TORCH_REQUIREMENTS}") < text.index("COPY pyproject.toml"), (
        "docker/app.Dockerfile: torch must be installed before pyproject.toml is copied (layer cache)"
    )


def test_standin_images_follow_the_official_layout():
    """docker/standin/Dockerfile (used only where Flower's images cannot be pulled): the official images' user,
    venv, working folder and one stage per image with its program as the entrypoint."""
    text = (DOCKER_DIR / "standin" / "Dockerfile").read_text()
    for needle in (
        "--uid 49999",
        "python3 -m venv /python/venv",
        "ENV PATH=/python/venv/bin:$PATH",
        "USER app",
        "WORKDIR /app",
        "flwr==${FLWR_VERSION}",
    ):
        assert needle in text, f"docker/standin/Dockerfile: no {needle!r}"
    stages = dict(re.findall(r"^FROM base AS (\w+)\nENTRYPOINT \[\"([\w-]+)\"\]", text, re.MULTILINE))
    assert stages == {name: f"flower-{name}" for name in ("superlink", "supernode", "superexec")}, stages
    for name, program in stages.items():
        assert shutil.which(program), f"{program} (the {name} image's entrypoint) is not a Flower program"
