"""The GPU campaign's code end to end on the CPU, at tiny scale, as it runs on an offline GPU machine.

A simulated target: a fresh virtual environment with no packages of its own but what the GPU lease machine is said to
have (torch, torchvision, numpy, grpcio, protobuf, pyyaml, matplotlib, pytest and what they need), made visible from
this machine's installation through a ``.pth`` folder of links; no flwr, no Ray. Then, as on the target:

1. ``fedssl-bundle`` for this machine's Python with that list and a small packed data file (the wheels come from the
   package index: built once and cached under ``~/.cache/fedssl-bundle``, reused by later runs);
2. the app unpacked from the bundle's code archive, and the campaign run from it with the target's Python:
   - a call with a budget too small for any stage: it installs from the bundle (``pip --no-index``), checks the
     device, unpacks the data, skips every stage by its estimate, names them, and exits 3;
   - a call of the correctness and throughput stages: both finish (the smoke config deployed on loopback to its
     summary.json, trained on the CPU);
   - a call of the whole plan, stopped (SIGTERM, as a lease ends) once the paper-shape run has its first
     checkpoint: exit 130, the stage recorded as cut;
   - a last call: the finished stages are skipped, the run resumes from its checkpoint and finishes; exit 0.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import venv
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, skip_unless_required

pytestmark = pytest.mark.e2e

TARGET_HAS = ("torch", "torchvision", "numpy", "grpcio", "protobuf", "pyyaml", "matplotlib", "pytest")
PLAN = "fedssl_gpu/plans/cpu-tiny.yaml"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(names) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions of ``names`` and everything they require (extras left out)."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = _norm(todo.pop())
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional or platform-specific requirement this machine does not have
        found[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def make_target(root: Path) -> tuple[Path, Path]:
    """A fresh venv seeing only TARGET_HAS's closure; returns (its python, the have-list file)."""
    env_dir = root / "target-venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    shared = root / "target-site"
    shared.mkdir()
    closure = dependency_closure(TARGET_HAS)
    for dist in closure.values():
        base = Path(dist.locate_file(""))
        for top in sorted({str(f).split("/")[0] for f in dist.files or []}):
            if top in ("..", "__pycache__") or top.endswith(".pth") or (shared / top).exists():
                continue
            if (base / top).exists():
                (shared / top).symlink_to(base / top)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "target-has.pth").write_text(str(shared) + "\n")
    have = root / "have.txt"
    have.write_text("".join(f"{name}=={dist.version}\n" for name, dist in sorted(closure.items())))
    return python, have


def tiny_npz(src: Path, dest: Path, per_class_train: int = 60, per_class_test: int = 20) -> Path:
    with np.load(src) as z:
        xs, ys, xt, yt = z["x_train"], z["y_train"], z["x_test"], z["y_test"]
        names = z["class_names"] if "class_names" in z.files else None
    pick = lambda y, k: np.concatenate([np.flatnonzero(y == c)[:k] for c in range(10)])
    tr, te = pick(ys, per_class_train), pick(yt, per_class_test)
    arrays = {"x_train": xs[tr], "y_train": ys[tr], "x_test": xt[te], "y_test": yt[te]}
    if names is not None:
        arrays["class_names"] = names
    np.savez(dest, **arrays)
    return dest


def campaign(
    python: Path, app: Path, bundle: Path, out: Path, budget: float, *extra: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(
        [
            str(python),
            "-m",
            "fedssl_gpu.campaign",
            "run",
            PLAN,
            "--bundle",
            str(bundle),
            "--out",
            str(out),
            "--budget-s",
            str(budget),
            "--device",
            "cpu",
            *extra,
        ],
        cwd=app,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_campaign_from_a_bundle_in_a_fresh_venv_without_ray(tmp_path, cifar_npz):
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False).returncode != 0:
        skip_unless_required("pip is needed to build the bundle")
    python, have = make_target(tmp_path)
    probe = subprocess.run(
        [
            str(python),
            "-c",
            (
                "import torch, numpy, yaml, grpc, pytest\n"
                "import importlib.util as u; print(u.find_spec('flwr'), u.find_spec('ray'))"
            ),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["None", "None"], "the simulated target must have neither flwr nor Ray"

    data = tiny_npz(cifar_npz, tmp_path / "cifar10-tiny.npz")
    bundle = tmp_path / "bundle"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedssl_gpu.bundle",
            "--have",
            str(have),
            "--data",
            str(data),
            "--out",
            str(bundle),
            "--limit-mib",
            "60",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert re.search(r"part-1\s+\d+\.\d+\s+\d+\.\d+\s+60", built.stdout), built.stdout  # the size table
    manifest = json.loads((bundle / "part-1" / "bundle.json").read_text())
    carried = {w["name"] for w in manifest["wheels"]}
    assert "flwr" in carried and "ray" not in carried and "uv" not in carried
    assert not carried & {_norm(n) for n in TARGET_HAS}, "what the target has is not carried"

    app = tmp_path / "app"
    app.mkdir()
    with tarfile.open(bundle / "part-1" / "fedssl-app.tar.gz") as tar:
        tar.extractall(app, filter="data")
    out = tmp_path / "campaign"

    # 1. too small a budget: installed, device checked, data unpacked, every stage skipped by its estimate
    first = campaign(python, app, bundle, out, 1)
    said = first.stdout + first.stderr
    assert first.returncode == 3, said
    assert "installing" in said and "(pip --no-index)" in said, said
    for stage in ("correctness", "throughput", "paper-shape"):
        assert re.search(rf"{stage}: skipped: needs ~\d+ s, -?\d+ s left", said), said
    has_flwr = subprocess.run(
        [str(python), "-c", ("import flwr, importlib.util as u; print(flwr.__version__, u.find_spec('ray'))")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert has_flwr.stdout.split() == [
        manifest["wheels"][[w["name"] for w in manifest["wheels"]].index("flwr")]["version"],
        "None",
    ], has_flwr.stdout + has_flwr.stderr
    state = json.loads((out / "campaign.json").read_text())
    assert state["device"]["requested"] == "cpu" and state["data"]["outputs"]["x_train"]["shape"] == [600, 32, 32, 3]
    assert state["data"]["unpack"]["pixels_verified"] is True

    # 2. correctness and throughput: both finish
    second = campaign(python, app, bundle, out, 500, "--stages", "correctness", "throughput")
    said = second.stdout + second.stderr
    assert second.returncode == 0, said + _logs(out)
    assert "installing" not in said, "a second call installs nothing"
    state = json.loads((out / "campaign.json").read_text())
    correctness = state["stages"]["correctness"]
    assert correctness["status"] == "done", correctness
    assert correctness["results"]["pytest"]["failed"] == 0 and correctness["results"]["pytest"]["skipped"] > 0
    smoke = correctness["results"]["smoke.yaml"]
    assert smoke["ok"] and smoke["devices"] == ["cpu"], smoke
    assert json.loads((out / "correctness" / "smoke" / "summary.json").read_text())["rounds_completed"] == 1
    assert state["stages"]["throughput"]["status"] == "done"
    assert (out / "throughput" / "throughput.json").is_file()

    # 3. the whole plan, stopped as a lease ends once the paper-shape run has its first checkpoint
    run_dir = out / "paper-shape" / "smoke" / "runs" / "fedbyol-seed0"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            str(python),
            "-m",
            "fedssl_gpu.campaign",
            "run",
            PLAN,
            "--bundle",
            str(bundle),
            "--out",
            str(out),
            "--budget-s",
            "500",
            "--device",
            "cpu",
        ],
        cwd=app,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not list(run_dir.glob("checkpoints/round-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, (
        "the campaign ended before the paper-shape run's first checkpoint:\n" + proc.stdout.read()
    )
    proc.send_signal(signal.SIGTERM)
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, said
    assert "correctness: finished in an earlier call: skipped" in said, said
    state = json.loads((out / "campaign.json").read_text())
    assert state["stages"]["paper-shape"]["status"] == "cut", state["stages"]["paper-shape"]
    assert not (run_dir / "summary.json").is_file()

    # 4. again: the run resumes from its checkpoint and the campaign finishes
    last = campaign(python, app, bundle, out, 500, "--archive", str(tmp_path / "results.tar.gz"))
    said = last.stdout + last.stderr
    assert last.returncode == 0, said + _logs(out)
    attempts = json.loads((run_dir / "run.json").read_text())["attempts"]
    assert [(a["outcome"], a["resumed"]) for a in attempts] == [("interrupted", False), ("finished", True)]
    assert "resuming after round 1" in (out / "paper-shape" / "smoke.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    state = json.loads((out / "campaign.json").read_text())
    assert [s["status"] for s in state["stages"].values()] == ["done", "done", "done"]
    assert len(state["calls"]) == 4 and [c.get("exit") for c in state["calls"]] == [3, 0, 130, 0]
    assert (out / "paper-shape" / "smoke" / "report.md").is_file()
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "campaign.md" in names and "campaign.json" in names
    assert not [n for n in names if n.startswith("data/") or "/checkpoints/" in n]


def _logs(out: Path) -> str:
    return "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.rglob("*.log"))[:12])
