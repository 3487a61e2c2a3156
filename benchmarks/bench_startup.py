"""What a run costs before and after its own clock: Flower's SuperLink and SuperExec, Ray, the app's imports, and
stopping them again.

A run's ``summary.json`` has ``run_s``, the ServerApp's own time (the figure a study report's "run s" shows); the
rest of a run's wall time is start-up and shut-down. Two figures:

* a single run: ``--runs`` times (default 3) ``flwr run . --stream`` of ``--config`` (default the smoke config, one
  round, synthetic data: the run itself is seconds) on a private local SuperLink that this script starts fresh for
  each run, as ``fedssl-run`` or a first ``flwr run`` does. Measured: the command's wall time, minus ``run_s``;
* a run of a study: ``fedssl-study`` keeps one private SuperLink for the whole study, so each of its runs pays
  only the SuperExec, Ray and the app's imports. Read from the published studies under ``benchmarks/results/studies``
  (each run's ``run.json`` attempt seconds, minus its ``summary.json`` ``run_s``); no run is made for it.

Usage:
    python benchmarks/bench_startup.py                  # 3 single runs, about 3 minutes on 2 cores
    python benchmarks/bench_startup.py --runs 1 --results-dir /tmp/bench
Writes <results-dir>/startup.json and .md (default results dir: benchmarks/results). fedssl_study/estimate.py and the
docs take their start-up figures from startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))


def single_run(config: str, work: Path, index: int) -> dict[str, Any]:
    """One ``flwr run`` on a fresh private SuperLink: wall time, the run's own time, and what is left."""
    from fedssl_study.launcher import flwr_run

    out = work / f"run-{index}"
    started = time.perf_counter()
    proc = flwr_run(
        f"config='{config}' data.dataset='synthetic' rounds=1 output-dir='{out}'", work / f"flwr-home-{index}"
    )
    wall = time.perf_counter() - started
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        raise SystemExit(f"run {index} did not finish (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    run_s = float(json.loads(summary_path.read_text())["run_s"])
    return {"wall_s": round(wall, 2), "run_s": round(run_s, 2), "start_and_stop_s": round(wall - run_s, 2)}


def published_study_overheads(studies: Path) -> dict[str, list[float]]:
    """Per published study: its runs' wall time (the study runner's own clock) minus their ``run_s``."""
    by_study: dict[str, list[float]] = {}
    for run_json in sorted(studies.glob("*/runs/*/run.json")):
        summary_path = run_json.parent / "summary.json"
        if not summary_path.is_file():
            continue
        attempts = [a for a in json.loads(run_json.read_text()).get("attempts", []) if a.get("outcome") == "finished"]
        run_s = json.loads(summary_path.read_text()).get("run_s")
        if not attempts or not isinstance(run_s, (int, float)):
            continue
        overhead = float(attempts[-1]["seconds"]) - float(run_s)
        if overhead < 0:
            continue  # a run reused from an earlier study (its attempt is the copy, not the run): no figure
        by_study.setdefault(run_json.parts[-4], []).append(overhead)
    return dict(sorted(by_study.items()))


def figures(values: list[float]) -> dict[str, Any]:
    return {
        "runs": len(values),
        "min_s": round(min(values), 1),
        "median_s": round(statistics.median(values), 1),
        "max_s": round(max(values), 1),
    }


def machine() -> dict[str, Any]:
    import flwr
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flwr": flwr.__version__,
    }


def markdown(result: dict[str, Any]) -> str:
    m, single = result["machine"], result["single_run"]
    lines = [
        "# Start-up and shut-down of a run",
        "",
        f"Command: `{result['command']}`  ",
        (
            f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}, flwr {m['flwr']}. "
            f"Load average (1 min) at start {result['load_start']:.2f}, at end {result['load_end']:.2f}."
        ),
        "",
        (
            f"A single run ({result['config']}, one round, synthetic data), each on a fresh private SuperLink: wall time "
            "of `flwr run` minus the run's own `run_s`."
        ),
        "",
        "| run | wall s | run s | start-up and shut-down s |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {i + 1} | {r['wall_s']:.1f} | {r['run_s']:.1f} | {r['start_and_stop_s']:.1f} |"
        for i, r in enumerate(single["each"])
    ]
    lines += [
        "",
        (
            f"Single run: {single['min_s']:.0f}-{single['max_s']:.0f} s (median {single['median_s']:.0f} s) before and "
            "after the run's own clock."
        ),
        "",
        (
            "A run of a study (`fedssl-study` keeps one private SuperLink for the whole study): each published study run's "
            "wall time minus its `run_s`."
        ),
        "",
        "| study | runs | min s | median s | max s |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {f['runs']} | {f['min_s']:.1f} | {f['median_s']:.1f} | {f['max_s']:.1f} |"
        for name, f in result["study_runs"].items()
    ]
    every = result["study_run"]
    lines += [
        "",
        (
            f"Study run, all published studies together: {every['min_s']:.0f}-{every['max_s']:.0f} s (median "
            f"{every['median_s']:.0f} s, {every['runs']} runs)."
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="single runs to time (default 3)")
    parser.add_argument("--config", default="configs/smoke.yaml", help="the run's config (default the smoke config)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    load_start = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedssl-startup-") as tmp:
        for i in range(args.runs):
            runs.append(single_run(args.config, Path(tmp), i))
            print(f"run {i + 1}: {runs[-1]}", flush=True)
    overheads = published_study_overheads(RESULTS / "studies")
    every = [v for values in overheads.values() for v in values]
    given = list(argv if argv is not None else sys.argv[1:])
    shown = ["RESULTS_DIR" if i > 0 and given[i - 1] == "--results-dir" else a for i, a in enumerate(given)]
    result = {
        "command": "python benchmarks/bench_startup.py" + "".join(f" {shlex.quote(a)}" for a in shown),
        "config": args.config,
        "machine": machine(),
        "load_start": round(load_start, 2),
        "load_end": round(os.getloadavg()[0], 2),
        "single_run": {**figures([r["start_and_stop_s"] for r in runs]), "each": runs},
        "study_runs": {name: figures(values) for name, values in overheads.items()},
        "study_run": figures(every) if every else {},
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.results_dir / "startup.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
