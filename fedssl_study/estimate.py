"""How long a study's runs will take, said before they start (``fedssl-study run``, with or without ``--dry-run``).

Two sources, the better one first:

- **measured**: the published report of the same study (``benchmarks/results/studies/<study name>/report.csv``,
  written by ``fedssl-study`` itself): each variant's mean ``run s`` over its seeds, on the machine the report names;
- **counted**: for a study without a published report (a paper-scale study, a new one), each run's FLOPs (local
  training and the evaluations, counted on the run's own model as the GPU campaign's time plan counts them:
  ``fedssl_gpu.timeplan.run_estimate``) over the rates the published CPU studies achieved (their client TFLOP over
  their run s): a median and a range, as rough as that spread says. Server-side training (FLESD's distillation,
  Hetero-SSFL's kernels) is not counted: a floor for those.

Neither includes a run's start-up and shut-down (Flower's SuperExec and Ray starting, the app's imports, stopping
them), which is said beside the total: the range the published studies' runs took on 2 cores, as
``benchmarks/bench_startup.py`` read it into ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
PUBLISHED = APP_DIR / "benchmarks" / "results" / "studies"
STARTUP_RESULTS = APP_DIR / "benchmarks" / "results" / "startup.json"


def _study_run_start_up_s() -> tuple[float, float] | None:
    """A study run's start-up and shut-down, outside its own clock (the report's run s): the (min, max) seconds the
    published studies' runs took (``benchmarks/bench_startup.py``); None where that file is missing."""
    try:
        figures = json.loads(STARTUP_RESULTS.read_text())["study_run"]
        return float(figures["min_s"]), float(figures["max_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


START_UP_S = _study_run_start_up_s()
# --set keys that say where the data is, not what runs: a published estimate still holds with them
DATA_LOCATION_KEYS = {"data.path", "data.dataset", "data.download"}


@dataclass(frozen=True)
class PublishedStudy:
    folder: Path
    run_s: dict[str, float]  # variant -> mean run s over its seeds
    machine: str  # "AMD EPYC, 2 cores"


@dataclass(frozen=True)
class RunEstimate:
    seconds: float
    low: float  # the range the source allows
    high: float
    source: str  # "measured" or "counted"


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def published_study(name: str, root: Path = PUBLISHED) -> PublishedStudy | None:
    """The published report of study ``name`` (its rows' mean run s and the machine), or None."""
    folder = root / name
    table = folder / "report.csv"
    if not table.is_file():
        return None
    run_s: dict[str, float] = {}
    with table.open(newline="") as fh:
        for row in csv.DictReader(fh):
            seconds = _float(row.get("run_s_mean"))
            if seconds is not None and row.get("row"):
                run_s.setdefault(row["row"], seconds)
    report = folder / "report.md"
    found = re.search(r"device ([^;\n]+)", report.read_text()) if report.is_file() else None
    return PublishedStudy(folder, run_s, found.group(1).strip() if found else "a machine the report does not name")


def family(arch: str) -> str:
    """ "vit" or "resnet": the architectures whose achieved rates on a CPU are alike (a ViT's attention runs at a
    fraction of a ResNet's convolutions' rate)."""
    return "vit" if arch.startswith("vit") else "resnet"


def published_families(studies: Path = APP_DIR / "configs" / "studies") -> dict[str, str]:
    """Study name -> the architecture family of its base experiment, for every study file of the app."""
    import yaml

    from ssl_models.config import ConfigError, load_config_tree

    out = {}
    for path in sorted(studies.rglob("*.yaml")):
        try:
            raw = yaml.safe_load(path.read_text()) or {}
            arch = load_config_tree((path.parent / str(raw["base"])).resolve()).get("model", {}).get("arch", "")
        except (OSError, KeyError, TypeError, AttributeError, yaml.YAMLError, ConfigError):
            continue
        out[str(raw.get("study") or path.stem)] = family(str(arch))
    return out


def published_rates(root: Path = PUBLISHED, arch: str | None = None) -> list[float]:
    """TFLOP/s of client training per second of run, of every published study row with both figures; with
    ``arch``, of the studies of its family only (all of them if none is published)."""
    if arch is not None:
        families = published_families()
        mine = [t for t in sorted(root.glob("*/report.csv")) if families.get(t.parent.name) == family(arch)]
        if mine:
            return _rates(mine)
    return _rates(sorted(root.glob("*/report.csv")))


def _rates(tables: list[Path]) -> list[float]:
    rates = []
    for table in tables:
        with table.open(newline="") as fh:
            for row in csv.DictReader(fh):
                tflop, seconds = _float(row.get("client_tflops")), _float(row.get("run_s_mean"))
                if tflop and seconds and not re.search(r" \[[^\]]+\]$", row.get("row", "")):  # not a per-arch copy
                    rates.append(tflop / seconds)
    return rates


def counted_estimate(cfg, rates: list[float], train_images: int, test_images: int) -> RunEstimate | None:
    """A run's seconds from its counted FLOPs over the published rates (median; range from their extremes)."""
    if not rates:
        return None
    from fedssl_gpu.timeplan import Assumptions, run_estimate

    median = statistics.median(rates)
    assumed = Assumptions(
        train_tflops=median,
        fp32_tflops=median,
        run_start_s=1e-9,
        round_overhead_s=1e-9,
        pytest_s=1.0,
        throughput_overhead_s=1.0,
        compile_s=1.0,
        train_images=max(1, train_images),
        test_images=max(1, test_images),
    )
    flops = run_estimate(cfg, assumed)["flops"]
    return RunEstimate(flops / (median * 1e12), flops / (max(rates) * 1e12), flops / (min(rates) * 1e12), "counted")


def clock(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"{hours}h{rest // 60:02d}m"
    return f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


class StudyEstimator:
    """Estimates for the runs of one study; ``source_line`` says where they come from."""

    def __init__(self, study, overrides: dict | None = None, root: Path = PUBLISHED) -> None:
        self.study = study
        self.published = published_study(study.name, root)
        self.changed = sorted(set(overrides or {}) - DATA_LOCATION_KEYS)
        # for a variant the published report lacks: the rates of published studies on the base's architecture family
        self.rates = published_rates(root, study.experiment(next(iter(study.variants))).model.arch)
        self._sizes: tuple[int, int] | None = None

    def _data_sizes(self, cfg) -> tuple[int, int]:
        if self._sizes is None:
            from ssl_models.data.preflight import data_is_local
            from ssl_models.data.splits import load_experiment_data

            try:
                data = load_experiment_data(cfg) if data_is_local(cfg) else None
            except (ValueError, FileNotFoundError):
                data = None
            # without the data here: CIFAR-10's sizes, the papers' most common set
            self._sizes = (len(data.x_train), len(data.x_test)) if data is not None else (50_000, 10_000)
        return self._sizes

    def run(self, variant: str, seed: int) -> RunEstimate | None:
        seconds = self.published.run_s.get(variant) if self.published is not None else None
        if seconds is not None:
            return RunEstimate(seconds, seconds, seconds, "measured")
        cfg = self.study.experiment(variant, seed)
        return counted_estimate(cfg, self.rates, *self._data_sizes(cfg))

    def source_line(self) -> str:
        if self.published is not None:
            where = (
                self.published.folder.relative_to(APP_DIR)
                if self.published.folder.is_relative_to(APP_DIR)
                else self.published.folder
            )
            note = f"; your --set {', '.join(self.changed)} may change it" if self.changed else ""
            return (
                f"times measured: the mean run s of each variant in the published report {where}, on "
                f"{self.published.machine}{note}"
            )
        if not self.rates:
            return "no estimate: no published report of this study, and none to take a rate from"
        return (
            f"times counted, not measured (no published report of this study): each run's training and evaluation "
            f"FLOPs at the {min(self.rates):.3f}-{max(self.rates):.3f} TFLOP/s (median "
            f"{statistics.median(self.rates):.3f}) the published CPU studies of this architecture family ran at on "
            "2 cores; server-side "
            "training (FLESD, Hetero-SSFL) not counted"
        )

    def total_line(self, estimates: list[RunEstimate | None]) -> str:
        known = [e for e in estimates if e is not None]
        if not known:
            return "estimated time: unknown"
        low, mid, high = (sum(e.low for e in known), sum(e.seconds for e in known), sum(e.high for e in known))
        spread = f" ({clock(low)} to {clock(high)})" if high > low * 1.05 else ""
        missing = len(estimates) - len(known)
        start = (
            f"plus {START_UP_S[0] * len(estimates) / 60:.0f}-{START_UP_S[1] * len(estimates) / 60:.0f} min of "
            f"start-up and shut-down ({START_UP_S[0]:.0f}-{START_UP_S[1]:.0f} s per run on 2 cores, not in the run "
            "times)"
            if START_UP_S is not None
            else "plus each run's start-up (not measured here: benchmarks/bench_startup.py)"
        )
        gpu = "; at this scale a run wants a GPU" if mid / max(1, len(known)) > 4 * 3600 else ""
        return (
            f"estimated time for the {len(known)} run(s) to do: about {clock(mid)}{spread}, {start}"
            + (f"; {missing} run(s) without an estimate" if missing else "")
            + gpu
        )
