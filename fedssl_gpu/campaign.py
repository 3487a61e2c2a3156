"""``fedssl-campaign``: the whole GPU programme as one command, run from a bundle on a machine without an index.

    python3 -m fedssl_gpu.campaign run fedssl_gpu/plans/gpu.yaml --bundle ../gpu-bundle --out /tmp/campaign \\
        --budget-s 720

One call:

1. **installs** the bundle's wheels (``fedssl-bundle``) into the Python environment that runs it, with ``pip
   --no-index``; a package the environment already has is kept (a second call installs nothing);
2. **checks the device**: ``--device cuda`` (the plan's default on a GPU plan) with no usable CUDA device stops
   here with exit status 2, before any stage; the device's name, memory and the versions go to ``device.json``;
3. **unpacks the data** (the bundle's parts, checksummed) into ``<out>/data/`` once;
4. runs the plan's **stages** in order within ``--budget-s`` seconds: a stage whose estimate (``timeplan.py``) does
   not fit the time left is skipped and named, never started to be cut; the paper-shape stage checkpoints every
   round, so it may be stopped at the deadline (``fedssl-study`` stops its run for real and resumes it next call);
5. writes every result under ``--out`` (``campaign.json``: every call, every stage's status, estimate and time;
   ``campaign.md``: the same for a person) and, with ``--archive FILE``, packs the results (not the data, the
   checkpoints or the client state) into one ``.tar.gz``.

Calling it again with the same ``--out`` continues: finished stages are skipped, a cut paper-shape study resumes.
Exit status: 0 every requested stage finished; 3 some were skipped or cut for time (call again); 1 a stage failed;
2 a bad plan, bundle or device (one line naming it); 130 stopped by Ctrl-C or SIGTERM (the state is written: the next
call continues).

The stages:

- ``correctness``: ``pytest -m cuda`` (the CUDA paths' tests; on ``--device cpu`` they skip, and that is all they
  can do there), then every smoke config of the plan deployed on loopback (``deploy.py``: a SuperLink and one
  SuperNode per client, no Ray) to its ``summary.json``, checked to have trained on the requested device;
- ``throughput``: ``throughput.py`` (local training per method, fp32 against the fast path and ``train.compile``);
- ``paper-shape``: each study file of the plan (``configs/studies/gpu/``) with ``fedssl-study run --connection``
  on a loopback deployment of its client count.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
STAGES = ("correctness", "throughput", "paper-shape")
STATE_FILE = "campaign.json"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MORE = 0, 1, 2, 3
# Left out of --archive: inputs and what only resuming needs; everything else under --out is a result.
NOT_ARCHIVED = ("data", "checkpoints", "client_state", ".flwr", "deployments")


class CampaignError(RuntimeError):
    """A plan, bundle or device the campaign cannot work with; the message names it."""


# ---------------------------------------------------------------------------------------------------------- plan
@dataclass
class Plan:
    """A campaign plan file (``fedssl_gpu/plans/*.yaml``), checked before anything runs."""

    path: Path
    name: str
    device: str  # cuda or cpu: where clients and the server's evaluation run
    assumed: Any  # timeplan.Assumptions
    smoke: list[Path] = field(default_factory=list)
    smoke_set: dict[str, Any] = field(default_factory=dict)
    pytest_args: list[str] = field(default_factory=list)
    throughput: dict[str, Any] = field(default_factory=dict)  # scale, compile, steps
    studies: list[Path] = field(default_factory=list)
    study_set: dict[str, Any] = field(default_factory=dict)
    study_variants: dict[str, list[str]] = field(default_factory=dict)  # study name -> variants (default: all)
    study_seeds: dict[str, list[int]] = field(default_factory=dict)  # study name -> seeds (default: the file's)
    stages: tuple[str, ...] = STAGES

    @classmethod
    def load(cls, path: str | Path, check_runs: bool = True) -> Plan:
        """Read and check the plan; ``check_runs`` also resolves every run (needs ``flwr``: after the install)."""
        from .timeplan import Assumptions

        path = Path(path)
        if not path.is_file():
            raise CampaignError(f"plan {path}: no such file")
        raw = yaml.safe_load(path.read_text()) or {}
        known = {"campaign", "device", "assumed", "stages"}
        if not isinstance(raw, dict) or set(raw) - known:
            raise CampaignError(
                f"plan {path}: unknown key(s) {', '.join(sorted(set(raw) - known))} (known: {', '.join(sorted(known))})"
            )
        device = str(raw.get("device", "cuda"))
        if device not in ("cuda", "cpu"):
            raise CampaignError(f"plan {path}: device {device!r}: expected cuda or cpu")
        try:
            assumed = Assumptions.from_mapping(raw.get("assumed") or {}, where=f"plan {path}: assumed")
        except ValueError as exc:
            raise CampaignError(str(exc)) from None
        stages = raw.get("stages") or {}
        if not isinstance(stages, dict) or set(stages) - set(STAGES):
            raise CampaignError(
                f"plan {path}: stages: unknown stage(s) {', '.join(sorted(set(stages) - set(STAGES)))}"
                f" (known: {', '.join(STAGES)})"
            )
        plan = cls(
            path=path,
            name=str(raw.get("campaign") or path.stem),
            device=device,
            assumed=assumed,
            stages=tuple(s for s in STAGES if s in stages),
        )
        root = REPO  # paths in a plan are relative to the app's folder

        def files(items, where: str) -> list[Path]:
            out = []
            for item in items or []:
                p = (root / str(item)).resolve()
                if not p.is_file():
                    raise CampaignError(f"plan {path}: {where}: {item}: no such file")
                out.append(p)
            return out

        c = stages.get("correctness") or {}
        _only(c, {"smoke", "set", "pytest"}, f"plan {path}: stages.correctness")
        plan.smoke = files(c.get("smoke"), "stages.correctness.smoke")
        plan.smoke_set = dict(c.get("set") or {})
        plan.pytest_args = [str(a) for a in (c.get("pytest") or [])]
        t = stages.get("throughput") or {}
        _only(t, {"scale", "compile", "steps"}, f"plan {path}: stages.throughput")
        if "throughput" in plan.stages and str(t.get("scale", "paper")) not in ("paper", "tiny"):
            raise CampaignError(f"plan {path}: stages.throughput.scale: expected paper or tiny")
        compile_ = t.get("compile", True)
        if not isinstance(compile_, bool) and (
            not isinstance(compile_, list) or not all(isinstance(m, str) for m in compile_)
        ):
            raise CampaignError(
                f"plan {path}: stages.throughput.compile: expected true, false or a list of method names"
            )
        plan.throughput = {"scale": str(t.get("scale", "paper")), "compile": compile_, "steps": t.get("steps")}
        s = stages.get("paper-shape") or {}
        _only(s, {"studies", "set", "variants", "seeds"}, f"plan {path}: stages.paper-shape")
        plan.studies = files(s.get("studies"), "stages.paper-shape.studies")
        plan.study_set = dict(s.get("set") or {})
        plan.study_variants = {str(k): [str(v) for v in vs] for k, vs in (s.get("variants") or {}).items()}
        try:
            plan.study_seeds = {str(k): [int(v) for v in vs] for k, vs in (s.get("seeds") or {}).items()}
        except (TypeError, ValueError):
            raise CampaignError(f"plan {path}: stages.paper-shape.seeds: expected study name -> list of integers")
        if check_runs:
            plan.check_runs()
        return plan

    def data_overrides(self, data_path: Path | None) -> dict[str, Any]:
        out = {"train.device": self.device, "eval.device": self.device}
        if data_path is not None:
            out["data.path"] = str(data_path)
        return out

    def smoke_experiments(self, data_path: Path | None = None) -> list[tuple[Path, Any]]:
        """(file, validated ExperimentConfig) of every smoke config with the plan's overrides."""
        from fedssl_study.spec import validate_experiment
        from ssl_models.config import ConfigError, load_config_tree, merge_config

        out = []
        for f in self.smoke:
            try:
                tree = merge_config(load_config_tree(f), {**self.smoke_set, **self.data_overrides(data_path)})
                out.append((f, validate_experiment(tree)))
            except ConfigError as exc:
                raise CampaignError(f"plan {self.path}: smoke config {f.name}: {exc}") from None
        return out

    def study_objects(self, data_path: Path | None = None) -> list[Any]:
        from fedssl_study.spec import load_study
        from ssl_models.config import ConfigError

        out = []
        for f in self.studies:
            try:
                probe = load_study(f, validate=False)
                study = load_study(
                    f,
                    {**self.study_set, **self.data_overrides(data_path)},
                    variants=self.study_variants.get(probe.name),
                    seeds=self.study_seeds.get(probe.name),
                )
            except ConfigError as exc:
                raise CampaignError(f"plan {self.path}: study {f.name}: {exc}") from None
            clients = {study.experiment(v).federation.num_clients for v in study.variants}
            if len(clients) != 1:
                raise CampaignError(
                    f"plan {self.path}: study {f.name}: its variants need different client counts "
                    f"({sorted(clients)}); one deployment serves one count"
                )
            out.append(study)
        return out

    def check_runs(self) -> None:
        """Every smoke config and study run resolves to a valid experiment (before anything is installed)."""
        self.smoke_experiments()
        self.study_objects()


def _only(section: Any, keys: set[str], where: str) -> None:
    if not isinstance(section, dict):
        raise CampaignError(f"{where}: expected a mapping")
    unknown = set(section) - keys
    if unknown:
        raise CampaignError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(keys))})")


# ----------------------------------------------------------------------------------------------------- time plan
def stage_estimates(plan: Plan) -> dict[str, dict[str, float]]:
    """Seconds per stage and item, from the plan's assumptions (``timeplan.py``)."""
    from .timeplan import run_estimate, throughput_estimate

    out: dict[str, dict[str, float]] = {}
    a = plan.assumed
    if "correctness" in plan.stages:
        items = {"pytest -m cuda": a.pytest_s}
        for f, cfg in plan.smoke_experiments():
            items[f.name] = run_estimate(cfg, a)["seconds"]
        out["correctness"] = items
    if "throughput" in plan.stages:
        from .throughput import estimate_flops, timed_steps

        scale = plan.throughput["scale"]
        flops = estimate_flops(scale)
        steps = int(plan.throughput.get("steps") or timed_steps(scale))
        compile_ = plan.throughput["compile"]
        compiled = {
            m: f for m, f in flops.items() if compile_ is True or (isinstance(compile_, list) and m in compile_)
        }
        seconds = throughput_estimate(flops, steps, 2, a)  # fp32 and the fast path, every method
        # the compiled configuration: its timed steps at the fast path's rate, its overhead and its compilation
        seconds += sum(
            2 * steps * f / (a.train_tflops * 1e12) + a.throughput_overhead_s + a.compile_s for f in compiled.values()
        )
        out["throughput"] = {f"{scale} scale, {len(flops)} methods ({len(compiled)} compiled)": seconds}
    if "paper-shape" in plan.stages:
        items = {}
        for study in plan.study_objects():
            items[study.name] = sum(run_estimate(study.experiment(v, s), a)["seconds"] for v, s in study.runs())
        out["paper-shape"] = items
    return out


def timeplan_markdown(plan: Plan) -> str:
    from .timeplan import format_seconds

    est = stage_estimates(plan)
    a = plan.assumed
    lines = [
        f"# Time plan of `{plan.path.name}` ({plan.name}, device {plan.device})",
        "",
        "Estimated before anything runs (`fedssl-campaign plan " + _rel(plan.path) + " --write` writes this "
        "file; `fedssl_gpu/timeplan.py` says how): work counted in FLOPs on each run's own model, over the "
        "rates assumed below, plus fixed costs. The campaign skips a stage whose estimate exceeds the time "
        "left. Server-side training (FLESD's distillation) and Hetero-SSFL's RAD passes are not counted: "
        "for those studies the estimate is a floor.",
        "",
        "| assumed | value |",
        "|---|---|",
    ]
    for k, v in a.__dict__.items():
        lines.append(f"| `{k}` | {v:g} |")
    lines += ["", "| stage | item | estimate |", "|---|---|---|"]
    total = 0.0
    for stage, items in est.items():
        for item, seconds in items.items():
            lines.append(f"| {stage} | {item} | {format_seconds(seconds)} |")
        stage_s = sum(items.values())
        total += stage_s
        lines.append(f"| **{stage}** | all | **{format_seconds(stage_s)}** |")
    lines += [f"| **campaign** | all stages | **{format_seconds(total)}** |", ""]
    return "\n".join(lines)


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return Path(path).name


def timeplan_file(plan_path: Path) -> Path:
    return Path(plan_path).with_suffix(".timeplan.md")


# --------------------------------------------------------------------------------------------------- the state
class State:
    """``<out>/campaign.json``: the calls made, each stage's status, estimate, seconds and results."""

    def __init__(self, out: Path) -> None:
        self.path = out / STATE_FILE
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"calls": [], "stages": {}}

    def stage(self, name: str) -> dict:
        return self.data["stages"].setdefault(name, {"status": "not run"})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


# ------------------------------------------------------------------------------------------------------ install
def find_wheels(bundle: Path) -> tuple[list[Path], dict]:
    manifests = sorted(bundle.glob("part-*/bundle.json")) or sorted(bundle.glob("bundle.json"))
    if not manifests:
        raise CampaignError(f"--bundle {bundle}: no bundle.json (part-1 of a fedssl-bundle folder) inside")
    manifest = json.loads(manifests[0].read_text())
    wheels_dir = manifests[0].parent / "wheels"
    wheels = [wheels_dir / w["file"] for w in manifest["wheels"]]
    missing = [w.name for w in wheels if not w.is_file()]
    if missing:
        raise CampaignError(f"--bundle {bundle}: wheel(s) missing from {wheels_dir}: {', '.join(missing[:5])}")
    return wheels, manifest


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(bundle: Path, log: Callable[[str], None] = say) -> dict:
    """Install the bundle's wheels that this environment lacks (``pip --no-index --no-deps``): a package already
    installed is kept unless the bundle carries it because the target's version did not satisfy a requirement."""
    wheels, manifest = find_wheels(bundle)
    forced = {n.split(":", 1)[0] for n in manifest.get("notes", []) if "is needed: carried" in n}
    todo = [
        w
        for w, meta in zip(wheels, manifest["wheels"])
        if installed_version(meta["name"]) is None or meta["name"] in forced
    ]
    t0 = time.perf_counter()
    if todo:
        log(f"installing {len(todo)} of the bundle's {len(wheels)} wheels (pip --no-index)")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--no-deps",
                "--disable-pip-version-check",
                "--no-warn-script-location",
                *map(str, todo),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise CampaignError(
                f"installing the bundle's wheels failed (exit {proc.returncode}):\n"
                + (proc.stdout + proc.stderr)[-2000:]
            )
        importlib.invalidate_caches()
    flwr_pin = next((r.split("==", 1)[1] for r in manifest.get("roots", []) if r.startswith("flwr==")), None)
    probe = subprocess.run(
        [sys.executable, "-c", "import flwr, sys; sys.stdout.write(flwr.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        raise CampaignError("flwr does not import after the install:\n" + probe.stderr[-1500:])
    if flwr_pin and probe.stdout.strip() != flwr_pin:
        raise CampaignError(
            f"flwr {probe.stdout.strip()} is installed, the bundle carries {flwr_pin}: use a fresh environment"
        )
    for script in ("flwr", "flower-superlink", "flower-supernode"):
        if not (Path(sys.executable).parent / script).exists() and shutil.which(script) is None:
            raise CampaignError(f"{script} is not on PATH after the install (pip put scripts elsewhere?)")
    return {
        "installed": [w.name for w in todo],
        "kept": len(wheels) - len(todo),
        "flwr": probe.stdout.strip(),
        "seconds": round(time.perf_counter() - t0, 1),
    }


# ------------------------------------------------------------------------------------------------------- device
def check_device(device: str) -> dict:
    import torch

    info: dict[str, Any] = {
        "requested": device,
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "python": sys.version.split()[0],
        "cuda_available": torch.cuda.is_available(),
    }
    if device == "cuda":
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise CampaignError(
                "the plan asks for device cuda, but torch sees no CUDA device ("
                f"torch {torch.__version__}, built for CUDA {torch.version.cuda}"
                + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
                + "); run with --device cpu to try the campaign on the CPU"
            )
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            count=torch.cuda.device_count(),
            bf16=bool(torch.cuda.is_bf16_supported(including_emulation=False)),
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
            )
            info["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    else:
        import platform

        info.update(name=platform.processor() or platform.machine(), cores=os.cpu_count())
    return info


# --------------------------------------------------------------------------------------------------------- data
def prepare_data(bundle: Path, out: Path, log: Callable[[str], None] = say) -> tuple[Path | None, dict]:
    """The bundle's data parts unpacked into ``<out>/data/<name>.npz`` (once); (None, {}) without data."""
    from . import datapack

    parts = sorted(bundle.glob("part-*/data/*"), key=lambda p: p.name)
    if not parts:
        return None, {}
    manifest = datapack.read_manifest(parts[0])
    target = out / "data" / f"{manifest.get('name', 'data')}.npz"
    done = target.with_suffix(".json")
    if target.is_file() and done.is_file():
        return target, json.loads(done.read_text())
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"unpacking {len(parts)} data part(s) into {target}")
    try:
        info = datapack.unpack(parts, target)
    except ValueError as exc:
        raise CampaignError(f"the bundle's data: {exc}") from None
    info = {**info, "unpack_s": round(time.perf_counter() - t0, 1)}
    done.write_text(json.dumps(info, indent=1, default=str) + "\n")
    return target, info


# ------------------------------------------------------------------------------------------------------- stages
@dataclass
class Context:
    plan: Plan
    out: Path
    data_path: Path | None
    deadline: float  # time.monotonic() by which the call must end
    log: Callable[[str], None] = say
    only_studies: list[str] | None = None  # --studies: the paper-shape stage runs only these

    @property
    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def roots(self) -> list[Path]:
        return [self.out] + ([self.data_path.parent] if self.data_path else [])


def _run_config(overrides: dict[str, Any]) -> str:
    """``--run-config`` text: strings quoted, numbers and booleans as TOML has them."""
    parts = []
    for key, value in overrides.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}='{value}'")
    return " ".join(parts)


def stage_correctness(ctx: Context, record: dict) -> str:
    from .deploy import LoopbackDeployment

    folder = ctx.out / "correctness"
    folder.mkdir(parents=True, exist_ok=True)
    status = "done"
    results = record.setdefault("results", {})
    if ctx.plan.pytest_args and not (results.get("pytest") or {}).get("ok"):
        xml = folder / "pytest.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *ctx.plan.pytest_args,
            "--junitxml",
            str(xml),
        ]
        ctx.log("correctness: " + " ".join(cmd[2:]))
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(60, ctx.left_s), check=False)
        (folder / "pytest.log").write_text(proc.stdout + proc.stderr)
        counts = _junit_counts(xml)
        ok = proc.returncode == 0 and not (ctx.plan.device == "cuda" and counts.get("skipped", 0))
        results["pytest"] = {"exit": proc.returncode, **counts, "ok": ok}
        ctx.log(f"correctness: tests: {counts} (exit {proc.returncode})")
        if not ok:
            status = "failed"
    groups: dict[int, list] = {}
    for f, cfg in ctx.plan.smoke_experiments(ctx.data_path):
        groups.setdefault(cfg.federation.num_clients, []).append((f, cfg))
    for clients, items in groups.items():
        todo = [(f, cfg) for f, cfg in items if not (results.get(f.name) or {}).get("ok")]
        if not todo:
            continue
        with LoopbackDeployment(
            ctx.out / "deployments" / f"smoke-{clients}", clients, allowed_roots=ctx.roots()
        ) as dep:
            for f, cfg in todo:
                run_dir = folder / f.stem
                shutil.rmtree(run_dir, ignore_errors=True)
                # The config by its path in the app's folder: a deployed ServerApp reads it from its installed app.
                overrides = {
                    "config": _rel(f),
                    "output-dir": str(run_dir),
                    **ctx.plan.smoke_set,
                    **ctx.plan.data_overrides(ctx.data_path),
                }
                t0 = time.perf_counter()
                ctx.log(f"correctness: {f.name} deployed on loopback ({clients} SuperNodes)")
                try:
                    proc = dep.run(REPO, _run_config(overrides), timeout_s=max(60.0, ctx.left_s))
                    said = proc.stdout + proc.stderr
                except subprocess.TimeoutExpired:
                    said = "timed out"
                seconds = time.perf_counter() - t0
                summary_path = run_dir / "summary.json"
                entry: dict[str, Any] = {"seconds": round(seconds, 1), "ok": summary_path.is_file()}
                if summary_path.is_file():
                    summary = json.loads(summary_path.read_text())
                    devices = _client_devices(summary)
                    entry.update(devices=devices, linear_probe_acc=summary.get("linear_probe_acc"))
                    if devices and any(not d.startswith(ctx.plan.device) for d in devices):
                        entry.update(ok=False, reason=f"clients trained on {devices}, not {ctx.plan.device}")
                else:
                    entry["reason"] = "no summary.json: " + " ".join(said.split())[-600:]
                    (folder / f"{f.stem}.log").write_text(said + "\n" + dep.logs_tail())
                results[f.name] = entry
                ctx.log(
                    f"correctness: {f.name}: {'ok' if entry['ok'] else 'FAILED: ' + entry.get('reason', '')} "
                    f"({seconds:.0f} s)"
                )
                if not entry["ok"]:
                    status = "failed"
    return status


def _client_devices(summary: dict) -> list[str]:
    """The devices the run's clients trained on, as summary.json records them."""
    value = summary.get("client_devices")
    if isinstance(value, dict):
        return sorted(str(k) for k in value)
    if isinstance(value, list):
        return sorted({str(v) for v in value})
    return []


def _junit_counts(xml: Path) -> dict[str, int]:
    if not xml.is_file():
        return {}
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": tests - failures - errors - skipped, "failed": failures, "errors": errors, "skipped": skipped}


def stage_throughput(ctx: Context, record: dict) -> str:
    from .throughput import run_throughput

    t = ctx.plan.throughput
    folder = ctx.out / "throughput"
    result = run_throughput(
        folder, device=ctx.plan.device, scale=t["scale"], compile=bool(t["compile"]), steps=t.get("steps"), log=ctx.log
    )
    record["results"] = {"files": sorted(p.name for p in folder.iterdir()), "ok": bool(result.get("ok"))}
    if not result.get("ok"):
        record["reason"] = "a configuration was not measured: throughput/throughput.md says which"
    return "done" if result.get("ok") else "failed"


def stage_paper_shape(ctx: Context, record: dict) -> str:
    from fedssl_study.runner import run_folder

    from .deploy import LoopbackDeployment
    from .timeplan import run_estimate

    results = record.setdefault("results", {})
    status = "done"
    for study in ctx.plan.study_objects(ctx.data_path):
        if ctx.only_studies and study.name not in ctx.only_studies:
            if (results.get(study.name) or {}).get("status") != "done":
                status = "more" if status == "done" else status  # left for a call that names it
            continue
        entry = results.setdefault(study.name, {"status": "not run"})
        if entry["status"] == "done":
            continue
        folder = ctx.out / "paper-shape" / study.name
        remaining = [(v, s) for v, s in study.runs() if not (run_folder(folder, v, s) / "summary.json").is_file()]
        first = run_estimate(study.experiment(*remaining[0]), ctx.plan.assumed) if remaining else None
        # A study starts only when one round of its next run fits (each round is checkpointed); else it waits.
        if first is not None and ctx.left_s < ctx.plan.assumed.run_start_s + first["seconds"] / max(
            1, study.experiment(*remaining[0]).rounds
        ):
            entry.update(status="skipped", reason=f"{ctx.left_s:.0f} s left, less than one round")
            ctx.log(f"paper-shape: {study.name}: skipped ({entry['reason']})")
            status = "more"
            continue
        clients = study.experiment(study.runs()[0][0]).federation.num_clients
        sets = {**ctx.plan.study_set, **ctx.plan.data_overrides(ctx.data_path)}
        cmd = [
            sys.executable,
            "-c",
            "import sys; from fedssl_study.cli import study_main; sys.exit(study_main())",
            "run",
            str(study.path),
            "--out",
            str(folder),
            "--connection",
            "campaign",
        ]
        for key, value in sets.items():
            cmd += ["--set", f"{key}={value}"]
        variants = ctx.plan.study_variants.get(study.name)
        if variants:
            cmd += ["--variants", *variants]
        seeds = ctx.plan.study_seeds.get(study.name)
        if seeds:
            cmd += ["--seeds", *map(str, seeds)]
        ctx.log(
            f"paper-shape: {study.name}: {len(remaining)} run(s) to go on {clients} SuperNodes, {ctx.left_s:.0f} s left"
        )
        with LoopbackDeployment(ctx.out / "deployments" / study.name, clients, allowed_roots=ctx.roots()) as dep:
            env = {**dep.cli_env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            folder.parent.mkdir(parents=True, exist_ok=True)
            log = open(folder.parent / f"{study.name}.log", "a")  # noqa: SIM115 - the child process's output: open as long as it runs
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            cut = False
            try:
                while proc.poll() is None:
                    if ctx.left_s <= 0:
                        ctx.log(f"paper-shape: {study.name}: the budget is spent: stopping (it resumes next call)")
                        _stop_study(proc)
                        cut = True
                        break
                    time.sleep(1.0)
            except KeyboardInterrupt:  # the campaign itself is stopped: stop the study so that it can resume
                ctx.log(f"paper-shape: {study.name}: interrupted: stopping its run (it resumes next call)")
                _stop_study(proc)
                entry.update(status="cut", exit=proc.returncode)
                raise
            finally:
                log.close()
        code = proc.returncode
        entry.update(
            exit=code,
            report=str((folder / "report.md").relative_to(ctx.out)) if (folder / "report.md").is_file() else None,
        )
        if code == 0 and not cut:
            entry["status"] = "done"
        elif cut or code == 130:
            entry["status"] = "cut"
            status = "more" if status == "done" else status
        else:
            entry["status"] = "failed"
            status = "failed"
        ctx.log(f"paper-shape: {study.name}: {entry['status']} (exit {code})")
        if ctx.left_s <= 0 and status == "done":
            status = "more"
    return status


def _stop_study(proc: subprocess.Popen) -> None:
    """SIGTERM ``fedssl-study``: it stops its run for real (``flwr stop``) and leaves it to resume from its last
    checkpoint; KILL after two minutes."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


STAGE_FUNCTIONS = {"correctness": stage_correctness, "throughput": stage_throughput, "paper-shape": stage_paper_shape}


# ------------------------------------------------------------------------------------------------------ report
def write_report(out: Path, state: State, plan: Plan) -> Path:
    from .timeplan import format_seconds

    d = state.data
    dev = d.get("device", {})
    lines = [
        f"# Campaign `{plan.name}`",
        "",
        (
            f"Plan `{_rel(plan.path)}`; device {dev.get('name', '?')} ({dev.get('requested', '?')}); torch "
            f"{dev.get('torch', '?')}, Python {dev.get('python', '?')}; flwr {d.get('install', {}).get('flwr', '?')}."
        ),
        "",
    ]
    data = d.get("data") or {}
    if data:
        lines += [
            f"Data: {data.get('name', '?')}, encoding {data.get('encoding', '?')}"
            + (
                f", effect: {data['effect'].get('summary', data['effect'])}"
                if isinstance(data.get("effect"), dict)
                else ""
            )
            + (f", subset {data['subset_per_class']} per class" if data.get("subset_per_class") else "")
            + ".",
            "",
        ]
    lines += ["| call | started | budget | command |", "|---|---|---|---|"]
    for i, call in enumerate(d["calls"], start=1):
        lines.append(f"| {i} | {call['started']} | {call['budget_s']:.0f} s | `{call['command']}` |")
    lines += ["", "| stage | status | estimate | seconds (all calls) | note |", "|---|---|---|---|---|"]
    for name in plan.stages:
        s = d["stages"].get(name, {})
        lines.append(
            f"| {name} | {s.get('status', 'not run')} | {format_seconds(s.get('estimate_s', 0))} | "
            f"{s.get('seconds', 0):.0f} | {s.get('reason', '')} |"
        )
    for name in plan.stages:
        results = d["stages"].get(name, {}).get("results")
        if results:
            lines += ["", f"## {name}", "", "```json", json.dumps(results, indent=1, default=str), "```"]
    path = out / "campaign.md"
    path.write_text("\n".join(lines) + "\n")
    return path


GPU_RESULTS = REPO / "benchmarks" / "results" / "gpu.md"


def publish(out: Path, dest: Path = GPU_RESULTS) -> Path:
    """The campaign's measured figures as the performance page shows them: the device and versions, every call's
    command, the correctness stage's outcome and the throughput stage's tables (``throughput/throughput.md``)."""
    state = json.loads((out / STATE_FILE).read_text())
    dev = state.get("device", {})
    if dev.get("requested") != "cuda":
        raise CampaignError(
            f"{out}: this campaign ran on {dev.get('requested', '?')}, not cuda: nothing to publish as GPU figures"
        )
    lines = [
        (
            f"GPU figures from the campaign (`{state.get('plan', '?')}`) on {dev.get('name', '?')} "
            f"({dev.get('memory_gib', '?')} GiB, driver {dev.get('driver', '?')}), torch {dev.get('torch', '?')} "
            f"(CUDA {dev.get('cuda_build', '?')}), Python {dev.get('python', '?')}, flwr "
            f"{state.get('install', {}).get('flwr', '?')}"
        ),
        "",
    ]
    lines += ["Commands, one per call: " + "; ".join(f"`{c['command']}` ({c['started']})" for c in state["calls"]), ""]
    correctness = state["stages"].get("correctness", {})
    results = correctness.get("results") or {}
    if results:
        lines += [
            f"**Correctness** ({correctness.get('status', '?')}):",
            "",
            "| check | outcome | seconds |",
            "|---|---|---|",
        ]
        for name, r in results.items():
            if name == "pytest":
                lines.append(
                    f"| CUDA tests | {r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                    f"{r.get('errors', 0)} errors, {r.get('skipped', 0)} skipped | |"
                )
            else:
                lines.append(
                    f"| {name} deployed on loopback | {'ok' if r.get('ok') else 'FAILED: ' + str(r.get('reason'))}"
                    f", clients on {', '.join(r.get('devices') or ['?'])} | {r.get('seconds', '')} |"
                )
        lines.append("")
    throughput = out / "throughput" / "throughput.md"
    if throughput.is_file():
        lines += ["**Throughput**:", "", throughput.read_text().strip(), ""]
    dest.write_text("\n".join(lines))
    return dest


def archive(out: Path, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for p in sorted(out.rglob("*")):
            rel = p.relative_to(out)
            if p.is_file() and not any(part in NOT_ARCHIVED for part in rel.parts) and p.resolve() != dest.resolve():
                tar.add(p, arcname=str(rel))
    return dest


# --------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace, command: str) -> int:
    t_start = time.monotonic()
    deadline = t_start + float(args.budget_s)
    plan = Plan.load(args.plan, check_runs=False)  # its runs resolve once flwr is installed, below
    if args.device:
        plan.device = args.device
    bundle = Path(args.bundle).resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = State(out)
    state.data["plan"] = _rel(plan.path)
    state.data["calls"].append(
        {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": float(args.budget_s), "command": command}
    )
    state.save()
    state.data["install"] = install(bundle)
    say(
        f"install: flwr {state.data['install']['flwr']}, {len(state.data['install']['installed'])} wheel(s) "
        f"installed, {state.data['install']['kept']} already there"
    )
    plan.check_runs()
    state.data["device"] = check_device(plan.device)
    say(f"device: {state.data['device'].get('name')} ({plan.device})")
    data_path, data_info = prepare_data(bundle, out)
    state.data["data"] = data_info
    state.save()
    estimates = {k: sum(v.values()) for k, v in stage_estimates(plan).items()}
    wanted = [s for s in plan.stages if not args.stages or s in args.stages]
    ctx = Context(plan, out, data_path, deadline, only_studies=args.studies)
    exit_code = EXIT_OK
    for name in wanted:
        rec = state.stage(name)
        rec["estimate_s"] = round(estimates.get(name, 0.0), 1)
        if rec.get("status") == "done":
            say(f"{name}: finished in an earlier call: skipped")
            continue
        # The paper-shape stage checkpoints every round and may be cut (it checks each study's first round itself);
        # the others must fit whole.
        if (estimates.get(name, 0.0) > ctx.left_s) if name != "paper-shape" else ctx.left_s <= 0:
            rec.update(status="skipped", reason=f"needs ~{estimates[name]:.0f} s, {ctx.left_s:.0f} s left")
            say(f"{name}: skipped: {rec['reason']}")
            exit_code = max(exit_code, EXIT_MORE) if exit_code != EXIT_FAILED else exit_code
            state.save()
            continue
        say(f"{name}: starting (estimate {estimates.get(name, 0):.0f} s, {ctx.left_s:.0f} s left)")
        t0 = time.perf_counter()
        try:
            status = STAGE_FUNCTIONS[name](ctx, rec)
        except CampaignError:
            raise
        except KeyboardInterrupt:
            rec["status"] = "cut"
            rec["reason"] = "interrupted"
            rec["seconds"] = round(rec.get("seconds", 0.0) + time.perf_counter() - t0, 1)
            state.data["calls"][-1].update(seconds=round(time.monotonic() - t_start, 1), exit=130)
            state.save()
            write_report(out, state, plan)
            raise
        except Exception as exc:  # noqa: BLE001 - one stage's crash is recorded; the next stages still run
            status = "failed"
            rec["reason"] = f"{type(exc).__name__}: {exc}"
            say(f"{name}: FAILED: {rec['reason']}")
        rec["seconds"] = round(rec.get("seconds", 0.0) + time.perf_counter() - t0, 1)
        rec["status"] = {"more": "cut"}.get(status, status)
        if status == "done":
            rec.pop("reason", None)
        state.save()
        say(f"{name}: {rec['status']} in {time.perf_counter() - t0:.0f} s")
        if status == "failed":
            exit_code = EXIT_FAILED
        elif status == "more" and exit_code == EXIT_OK:
            exit_code = EXIT_MORE
    state.data["calls"][-1]["seconds"] = round(time.monotonic() - t_start, 1)
    state.data["calls"][-1]["exit"] = exit_code
    state.save()
    report = write_report(out, state, plan)
    if args.archive:
        say(f"results archived: {archive(out, Path(args.archive))}")
    say(
        f"report: {report}; "
        + {
            EXIT_OK: "every stage finished",
            EXIT_MORE: "some stages are left: call again",
            EXIT_FAILED: "a stage failed",
        }[exit_code]
    )
    return exit_code


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fedssl-campaign",
        description="The GPU programme from an offline bundle: "
        "install, check the device, run the plan's stages within a time budget.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="install from the bundle and run the plan's stages")
    r.add_argument("plan", help="the campaign plan (fedssl_gpu/plans/*.yaml)")
    r.add_argument("--bundle", required=True, help="the fedssl-bundle folder (its part-* folders)")
    r.add_argument("--out", required=True, help="the results folder (the same one continues a campaign)")
    r.add_argument("--budget-s", type=float, required=True, help="seconds this call may take")
    r.add_argument("--device", choices=("cuda", "cpu"), default=None, help="override the plan's device")
    r.add_argument("--stages", nargs="+", choices=STAGES, default=None, help="only these stages")
    r.add_argument(
        "--studies",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the paper-shape stage runs only these studies (their `study:` names)",
    )
    r.add_argument("--archive", default=None, metavar="FILE", help="pack the results into FILE (.tar.gz) at the end")
    p = sub.add_parser("plan", help="print the plan's time plan (seconds per stage)")
    p.add_argument("plan")
    p.add_argument("--write", action="store_true", help="write it next to the plan file (<plan>.timeplan.md)")
    pub = sub.add_parser(
        "publish", help="write a GPU campaign's figures to benchmarks/results/gpu.md (the performance page shows them)"
    )
    pub.add_argument("out", help="the campaign's --out folder")
    pub.add_argument("--to", default=str(GPU_RESULTS), help="the results file to write")
    args = ap.parse_args(argv)
    command = "fedssl-campaign " + " ".join(argv if argv is not None else sys.argv[1:])
    sys.path.insert(0, str(REPO))
    # SIGTERM (a lease ending, a test) stops the campaign as Ctrl-C does: its deployments and study are stopped and
    # its state written, so the next call continues.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if args.command == "publish":
            print(f"written: {publish(Path(args.out), Path(args.to))}")
            return EXIT_OK
        if args.command == "plan":
            plan = Plan.load(args.plan)
            text = timeplan_markdown(plan)
            if args.write:
                timeplan_file(plan.path).write_text(text)
                print(f"written: {timeplan_file(plan.path)}")
            print(text)
            return EXIT_OK
        return run(args, command)
    except CampaignError as exc:
        print(f"fedssl-campaign: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fedssl-campaign: interrupted: call again with the same --out to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
