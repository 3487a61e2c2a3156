"""``fedssl-bundle``: everything an offline GPU machine needs to run the campaign, in parts that each fit one transfer.

An air-gapped GPU box (a hospital's, a company's, this project's rare GPU lease) has Python, PyTorch and a few
libraries, no package index and no internet, and takes files in transfers of limited size. The bundle holds:

- ``wheels/``: the ``flwr`` wheel and those of its dependencies that the target lacks, for the target's Python
  (``--python 3.12``), and nothing more. No Ray: on the target Flower runs as a real deployment on loopback
  (SuperLink and SuperNodes, ``fedssl_gpu/deploy.py``), which needs only ``flwr`` itself. What the target has is a
  list (``--have``: one ``name`` or ``name==version`` a line, as ``pip freeze`` writes it): a package on it with no
  version is taken as satisfying every requirement; one with a version is checked against each requirement on it
  and carried anyway when it does not satisfy one.
- ``fedssl-app.tar.gz``: the app's code (the tracked files of this checkout, without the published results);
- ``data/``: the data set, packed compactly (``fedssl_gpu/datapack.py``) and split on image boundaries so that each
  part, with the code, stays under the transfer limit.

Part 1 holds the code, the wheels, ``bundle.json`` and the first data part; every later part holds one more data
part. Each part is checked with the code counted in (a transfer of part k carries the code too), its size printed,
and the bundle refused, naming the part, when one is over ``--limit-mib``.

Building the wheel list needs the package index once (``pip download``, cached under ``--cache``); the target
needs none (``fedssl-campaign`` installs from ``wheels/`` with ``--no-index``).

Usage::

    fedssl-bundle --python 3.12 --have fedssl_gpu/targets/gpu-lease.txt --data /data/cifar10.npz --out gpu-bundle
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
BUNDLE_MANIFEST = "bundle.json"
APP_ARCHIVE = "fedssl-app.tar.gz"
# Left out of the code archive: the published results (figures for people, megabytes of them) are not code.
CODE_EXCLUDES = ("benchmarks/results/",)
# What the target needs from the package index for the campaign: Flower itself (no [simulation] extra: no Ray).
ROOT_REQUIREMENTS_DEFAULT = ("flwr",)
# Dependencies of flwr that the campaign never uses and that are left out to save transfer size, each with why:
# uv (18 MB) serves Flower's runtime dependency installation, which the campaign turns off
# (FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1, --disable-runtime-dependency-installation).
SKIP_DEFAULT = ("uv",)
MANYLINUX_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)


class BundleError(RuntimeError):
    """The bundle cannot be made as asked (a part over the limit, a wheel pip cannot find); the message says which."""


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def flwr_requirement() -> str:
    """``flwr==X`` as this project pins it (pyproject.toml), so the target runs the Flower the app was tested with."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'"flwr(?:\[[^\]]*\])?==([0-9][^"]*)"', text)
    return f"flwr=={match.group(1)}" if match else "flwr"


# ------------------------------------------------------------------------------------------------ the target's list
def read_have(path: Path | str) -> dict[str, str | None]:
    """``name`` or ``name==version`` a line (``#`` comments, blank lines and pip's ``@ file`` forms allowed)."""
    have: dict[str, str | None] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if " @ " in line:  # pip freeze's form for a local install: the name is what counts
            have[normalize(line.split(" @ ", 1)[0])] = None
            continue
        name, _sep, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise BundleError(f"--have {path}: cannot read {raw!r} (expected 'name' or 'name==version')")
        have[normalize(name.strip())] = version.strip() or None
    return have


# ------------------------------------------------------------------------------------------------------- wheels
@dataclass
class Wheel:
    path: Path
    name: str  # normalised
    version: str
    requires: list[str] = field(default_factory=list)  # Requires-Dist lines

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def read_wheel(path: Path) -> Wheel:
    with zipfile.ZipFile(path) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode("utf-8", "replace"))
    return Wheel(path, normalize(meta["Name"]), str(meta["Version"]), list(meta.get_all("Requires-Dist") or []))


def pip_download(requirements: list[str], python: str, dest: Path, log=print) -> None:
    """``pip download`` the closure of ``requirements`` as binary wheels for CPython ``python`` (``3.12``) on
    x86-64 Linux; files already in ``dest`` are kept (the cache). For this interpreter's own version no platform
    is forced (what pip would install here)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--dest",
        str(dest),
    ]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python != here:
        abi = "cp" + python.replace(".", "")
        cmd += ["--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
        for platform in (*MANYLINUX_PLATFORMS, "any"):
            cmd += ["--platform", platform]
    cmd += requirements
    log(f"pip download for Python {python}: {' '.join(requirements)}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        said = "\n".join(
            line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("WARNING: Location")
        )
        raise BundleError(
            f"pip download failed (exit {proc.returncode}); the package index is needed to build "
            f"a bundle:\n{said[-2000:]}"
        )


def marker_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of the target: CPython ``python`` on x86-64 Linux."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "os_name": "posix",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }


def select_wheels(
    wheels: list[Wheel],
    roots: list[str],
    have: dict[str, str | None],
    python: str,
    skip: tuple[str, ...] = SKIP_DEFAULT,
) -> tuple[list[Wheel], list[str]]:
    """The wheels the target lacks: walk the requirements from ``roots``; a requirement the target satisfies
    (``have``) ends the walk there (its own dependencies are installed on the target with it), anything else is
    carried and its requirements walked in turn. Returns (wheels to carry, notes on what was decided and why)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    by_name = {w.name: w for w in wheels}
    env = marker_environment(python)
    chosen: dict[str, Wheel] = {}
    notes: list[str] = []
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop(0)
        name = normalize(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if name in chosen:
            continue
        if name in {normalize(s) for s in skip}:
            notes.append(f"{name}: left out (not used by the campaign: {req})")
            continue
        if name in have:
            version = have[name]
            if version is None or req.specifier.contains(Version(version), prereleases=True):
                continue
            notes.append(f"{name}: the target has {version}, but {req} is needed: carried")
        wheel = by_name.get(name)
        if wheel is None:
            raise BundleError(f"no wheel for {req} among the downloaded ones (is it only an sdist?)")
        chosen[name] = wheel
        todo.extend(Requirement(r) for r in wheel.requires)
    return sorted(chosen.values(), key=lambda w: w.name), notes


# --------------------------------------------------------------------------------------------------------- code
def code_files(repo: Path = REPO) -> list[str]:
    """The app's files, relative to ``repo``: git's files of a checkout (deleted ones left out), else every
    file under it but caches and the results; never ``CODE_EXCLUDES``."""
    try:
        # tracked files and new ones git does not ignore: the working tree as it is, not only what is committed
        out = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [
            str(p.relative_to(repo))
            for p in repo.rglob("*")
            if p.is_file() and not any(part in {".git", "__pycache__", ".pytest_cache", "outputs"} for part in p.parts)
        ]
    return sorted(n for n in names if not n.startswith(CODE_EXCLUDES) and (repo / n).is_file())


def pack_code(dest: Path, repo: Path = REPO) -> Path:
    """The app's code as one ``.tar.gz`` (unpack it and run the campaign from its folder)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz", compresslevel=9) as tar:
        for name in code_files(repo):
            tar.add(repo / name, arcname=name, recursive=False)
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
        if commit.returncode == 0:  # which code this is, readable without git on the target
            data = (commit.stdout.strip() + "\n").encode()
            info = tarfile.TarInfo("CODE_COMMIT")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return dest


# -------------------------------------------------------------------------------------------------------- parts
def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def part_table(out: Path, code_bytes: int, limit_bytes: int) -> tuple[list[dict], str]:
    """One row per part folder: its bytes, and its bytes with the code (what one transfer of it carries)."""
    rows = []
    for part in sorted(out.glob("part-*"), key=lambda p: int(p.name.split("-")[1])):
        size = folder_bytes(part)
        # Part 1 holds the code archive; a later part travels with the code beside it.
        with_code = size if (part / APP_ARCHIVE).exists() else size + code_bytes
        rows.append(
            {
                "part": part.name,
                "bytes": size,
                "bytes_with_code": with_code,
                "over_limit": with_code > limit_bytes,
                "files": sorted(str(p.relative_to(part)) for p in part.rglob("*") if p.is_file()),
            }
        )
    lines = [f"{'part':<8} {'MiB':>7} {'with code':>10}  {'limit':>6}  contents"]
    for r in rows:
        kinds = sorted({f.split("/", 1)[0] for f in r["files"]})
        lines.append(
            f"{r['part']:<8} {r['bytes'] / MIB:7.1f} {r['bytes_with_code'] / MIB:10.1f}  "
            f"{limit_bytes / MIB:6.0f}  {', '.join(kinds)}{'   OVER THE LIMIT' if r['over_limit'] else ''}"
        )
    return rows, "\n".join(lines)


def build(
    out: Path,
    *,
    python: str,
    have: dict[str, str | None],
    data: Path | None,
    limit_bytes: int,
    cache: Path,
    encoding: str | None = None,
    subset_per_class: int | None = None,
    roots: list[str] | None = None,
    skip: tuple[str, ...] = SKIP_DEFAULT,
    log=print,
) -> dict:
    """Make the bundle in ``out`` (emptied first) and return its manifest; BundleError when a part is over the
    limit (the bundle is left on disk for a look, its manifest marks it refused)."""
    roots = roots or [flwr_requirement()]
    if out.exists():
        shutil.rmtree(out)
    part1 = out / "part-1"
    (part1 / "wheels").mkdir(parents=True)
    downloads = cache / f"wheels-py{python}"
    pip_download(roots, python, downloads, log=log)
    candidates = [read_wheel(p) for p in sorted(downloads.glob("*.whl"))]
    # The cache may hold several versions of a package from earlier builds: keep the newest of each.
    newest: dict[str, Wheel] = {}
    for w in candidates:
        from packaging.version import Version

        if w.name not in newest or Version(w.version) > Version(newest[w.name].version):
            newest[w.name] = w
    wheels, notes = select_wheels(list(newest.values()), roots, have, python, skip)
    for w in wheels:
        shutil.copy2(w.path, part1 / "wheels" / w.path.name)
    code = pack_code(part1 / APP_ARCHIVE)
    code_bytes = code.stat().st_size
    fixed = folder_bytes(part1)
    data_parts: list[Path] = []
    data_manifest: dict = {}
    if data is not None:
        # Every data part has to fit beside what its transfer carries besides: the code and (part 1) the wheels.
        room = limit_bytes - fixed - 64 * 1024  # and the manifest
        if room <= 0:
            raise BundleError(
                f"part-1: code and wheels alone take {fixed / MIB:.1f} MiB, over the "
                f"{limit_bytes / MIB:.0f} MiB limit: no room for data"
            )
        from . import datapack

        staging = out / ".data"
        kwargs = {"part_limit_bytes": room, "subset_per_class": subset_per_class}
        if encoding:
            kwargs["encoding"] = encoding
        data_parts = datapack.pack(Path(data), staging, **kwargs)
        for i, p in enumerate(data_parts, start=1):
            (out / f"part-{i}" / "data").mkdir(parents=True, exist_ok=True)
            shutil.move(str(p), out / f"part-{i}" / "data" / p.name)
        data_parts = [out / f"part-{i}" / "data" / p.name for i, p in enumerate(data_parts, start=1)]
        data_manifest = datapack.read_manifest(data_parts[0])
        shutil.rmtree(staging, ignore_errors=True)
    rows, table = part_table(out, code_bytes, limit_bytes)
    manifest = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": python,
        "roots": roots,
        "have": {k: v for k, v in sorted(have.items())},
        "skipped": list(skip),
        "notes": notes,
        "wheels": [
            {
                "file": w.path.name,
                "name": w.name,
                "version": w.version,
                "bytes": w.size,
                "sha256": sha256(part1 / "wheels" / w.path.name),
            }
            for w in wheels
        ],
        "code": {"file": APP_ARCHIVE, "bytes": code_bytes, "sha256": sha256(code)},
        "data": {"parts": [str(p.relative_to(out)) for p in data_parts], "manifest": data_manifest},
        "limit_bytes": limit_bytes,
        "parts": rows,
        "refused": [r["part"] for r in rows if r["over_limit"]],
    }
    (part1 / BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    # The manifest is in part 1 now: measure again so the printed sizes are the final ones.
    rows, table = part_table(out, code_bytes, limit_bytes)
    manifest["parts"] = rows
    (part1 / BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    log(table)
    over = [r for r in rows if r["over_limit"]]
    if over:
        names = ", ".join(f"{r['part']} ({r['bytes_with_code'] / MIB:.1f} MiB with the code)" for r in over)
        raise BundleError(f"over the {limit_bytes / MIB:.0f} MiB limit: {names}")
    return manifest


def report_markdown(manifest: dict, argv: list[str]) -> str:
    """The bundle as a person reads it: when, for which Python and target, each part's size, the wheels, the data."""
    # Paths of the building machine stay out of a published report: file names only.
    shown = [Path(a).name if Path(a).is_absolute() else a for a in argv]
    lines = [
        (f"Bundle for Python {manifest['python']}, made {manifest['created']} by `fedssl-bundle {' '.join(shown)}`"),
        "",
        "| part | MiB | MiB with the code | limit | contents |",
        "|---|---|---|---|---|",
    ]
    for r in manifest["parts"]:
        kinds = sorted({f.split("/", 1)[0] for f in r["files"]})
        lines.append(
            f"| {r['part']} | {r['bytes'] / MIB:.1f} | {r['bytes_with_code'] / MIB:.1f} | "
            f"{manifest['limit_bytes'] / MIB:.0f} | {', '.join(kinds)} |"
        )
    wheels = manifest["wheels"]
    lines += [
        "",
        f"{len(wheels)} wheels, {sum(w['bytes'] for w in wheels) / MIB:.1f} MiB: "
        + ", ".join(f"{w['name']} {w['version']}" for w in wheels)
        + ".",
    ]
    lines += [f"Left out or decided: {'; '.join(manifest['notes'])}." if manifest["notes"] else ""]
    data = manifest["data"].get("manifest") or {}
    if data:
        effect = data.get("effect") or {}
        lines += [
            "",
            f"Data: {data.get('source', {}).get('name', '?')} as {len(manifest['data']['parts'])} part(s), "
            f"encoding `{data.get('encoding', '?')}`, effect on the pixels: "
            f"{effect.get('summary', effect) if isinstance(effect, dict) else effect}"
            + (
                f"; a class-balanced subset of {data['subset_per_class']} training images per class"
                if data.get("subset_per_class")
                else ""
            )
            + ".",
        ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedssl-bundle", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the target's Python version, e.g. 3.12 (default: this interpreter's)",
    )
    ap.add_argument(
        "--have",
        required=True,
        metavar="FILE",
        help="what the target already has: 'name' or 'name==version' a line (pip freeze's output "
        "works); fedssl_gpu/targets/ has examples",
    )
    ap.add_argument(
        "--data",
        default=None,
        metavar="NPZ",
        help="the data set to pack (.npz with x_train, y_train, x_test, y_test); none: no data in the bundle",
    )
    ap.add_argument("--out", default="gpu-bundle", help="the bundle folder (emptied first)")
    ap.add_argument("--limit-mib", type=float, default=60.0, help="the largest transfer, code included (MiB)")
    ap.add_argument("--encoding", default=None, help="the data encoding (fedssl_gpu/datapack.py; default: its own)")
    ap.add_argument(
        "--subset-per-class",
        type=int,
        default=None,
        metavar="N",
        help="carry a class-balanced subset of N training images per class (the fallback when the "
        "whole set does not fit)",
    )
    ap.add_argument(
        "--cache",
        default=str(Path.home() / ".cache" / "fedssl-bundle"),
        help="where downloaded wheels are kept between builds",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=list(SKIP_DEFAULT),
        help=f"dependencies left out (default: {' '.join(SKIP_DEFAULT)}; see the module's docstring)",
    )
    ap.add_argument(
        "--report",
        default=None,
        metavar="MD",
        help="also write the size table, the wheels and the data's encoding to this Markdown file",
    )
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        print(f"fedssl-bundle: --python {args.python!r}: expected a version like 3.12", file=sys.stderr)
        return 2
    try:
        have = read_have(args.have)
        if args.data is not None and not Path(args.data).is_file():
            raise BundleError(f"--data {args.data}: no such file")
        manifest = build(
            Path(args.out).resolve(),
            python=args.python,
            have=have,
            data=Path(args.data) if args.data else None,
            limit_bytes=int(args.limit_mib * MIB),
            cache=Path(args.cache),
            encoding=args.encoding,
            subset_per_class=args.subset_per_class,
            skip=tuple(args.skip),
        )
    except (BundleError, OSError, ValueError) as exc:
        print(f"fedssl-bundle: {exc}", file=sys.stderr)
        return 2
    if args.report:
        Path(args.report).write_text(report_markdown(manifest, argv if argv is not None else sys.argv[1:]))
    wheels_mib = sum(w["bytes"] for w in manifest["wheels"]) / MIB
    print(
        f"bundle {args.out}: {len(manifest['parts'])} part(s); {len(manifest['wheels'])} wheels "
        f"({wheels_mib:.1f} MiB) for Python {args.python}, code {manifest['code']['bytes'] / MIB:.1f} MiB"
        + "".join(f"\n  note: {n}" for n in manifest["notes"])
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
