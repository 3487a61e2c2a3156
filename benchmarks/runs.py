"""Run one experiment config as a real `flwr run .` simulation from a benchmark script."""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from flwr_harness import flwr_run, read_jsonl  # noqa: E402


def run_experiment(raw: dict, timeout_s: float = 3600, keep_dir: Path | None = None) -> dict:
    """Write ``raw`` as a YAML config, run it on a federation of ``federation.num_clients`` SuperNodes, and
    return {"summary", "rounds", "run_s"}; a failed run raises with the tail of its output. With ``keep_dir``
    the run's folder (config, ``out/`` with its saved models) is kept there instead of a temporary one."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(keep_dir) if keep_dir is not None else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
        t0 = time.perf_counter()
        proc = flwr_run(f"config='{tmp / 'cfg.yaml'}' output-dir='{tmp / 'out'}'", tmp / "flwr",
                        federation_config=f"num-supernodes={raw['federation']['num_clients']}", timeout_s=timeout_s)
        summary_path = tmp / "out" / "summary.json"
        if not summary_path.is_file():
            raise RuntimeError(f"{raw.get('name')} failed:\n" + (proc.stdout + proc.stderr)[-3000:])
        return {"summary": json.loads(summary_path.read_text()), "rounds": read_jsonl(tmp / "out" / "metrics.jsonl"),
                "run_s": time.perf_counter() - t0}


def run_missing(configs: dict[str, dict], seeds: list[int], data: str, runs: list[dict],
                write: Callable[[list[dict]], None], variants: list[str] | None = None,
                extra: Callable[[dict], dict] | None = None, keep_runs: Path | None = None) -> list[dict]:
    """Run every (seed, row) of a comparison that ``runs`` does not hold yet (an earlier invocation's runs are
    kept, so a comparison completes across invocations): the row's config with that seed, ``-seed<N>`` added to its
    name and the data path set. Each run adds ``run_row`` (plus ``extra(result)``) to ``runs``, prints one line and
    calls ``write(runs)``, so a stopped comparison loses only the run under way. With ``keep_runs`` each run's
    folder (config, metrics, ``model.pt``) is kept at ``keep_runs/<variant>-seed<N>``, so its saved encoders can be
    scored again later (``fedssl-eval``) without training again."""
    for seed in seeds:
        for variant, base in configs.items():
            if variants and variant not in variants:
                continue
            if any(r["variant"] == variant and r["seed"] == seed for r in runs):
                continue
            raw = json.loads(json.dumps(base))
            raw["seed"] = seed
            raw["name"] = f"{base['name']}-seed{seed}"
            raw["data"]["path"] = str(Path(data).resolve())
            keep = {}
            if keep_runs is not None:
                keep["keep_dir"] = Path(keep_runs) / f"{variant_slug(variant)}-seed{seed}"
            res = run_experiment(raw, **keep)
            runs.append({**run_row(variant, seed, res), **(extra(res) if extra else {})})
            print(json.dumps({k: runs[-1][k] for k in ("variant", "seed", "linear_probe_acc", "knn_acc", "run_s")}),
                  flush=True)
            write(runs)
    return runs


def variant_slug(variant: str) -> str:
    """A table row's name as a folder name: "FedEMA (autoscaler, tau 0.7)" -> "fedema-autoscaler-tau-0.7"."""
    return re.sub(r"[^a-z0-9.]+", "-", variant.lower()).strip("-")


def mean_std(values: list[float]) -> str:
    """"m ± s" of percentages (s = sample standard deviation; 0 for one value), or "-" without values."""
    import statistics

    if not values:
        return "-"
    return f"{statistics.mean(values):.2f} ± {(statistics.stdev(values) if len(values) > 1 else 0.0):.2f}"


def run_row(variant: str, seed: int, res: dict) -> dict:
    """What a comparison keeps of one run: scores, the random-init reference of its architecture and its gain."""
    s = res["summary"]
    arch = s["config"]["model"]["arch"]
    rand = (s.get("random_init") or {}).get(arch, {})
    return {"variant": variant, "seed": seed, "linear_probe_acc": s["linear_probe_acc"], "knn_acc": s["knn_acc"],
            "random_init_linear_probe_acc": rand.get("linear_probe_acc"), "random_init_knn_acc": rand.get("knn_acc"),
            "linear_probe_gain_over_random": s.get("linear_probe_gain_over_random"),
            "bytes_up": s["bytes_up_total"], "bytes_down": s["bytes_down_total"], "run_s": res["run_s"],
            # what the clients' local steps ran in (fp32 / bf16 / fp16): machines differ in bf16 units
            "precision": sorted({c["precision"] for r in res["rounds"] for c in r.get("clients", []) if "precision" in c}),
            "knn_curve": [[r["round"], r.get("knn_acc")] for r in res["rounds"] if r.get("knn_acc") is not None],
            "loss_curve": [r.get("train_loss") for r in res["rounds"]]}


def comparison_lines(runs: list[dict], variants: list[str], schedules: dict[str, str] | None = None) -> list[str]:
    """A markdown table: a random-init row (the runs' own initial encoders, one per seed), then one row per variant
    with linear probe, kNN and the gain over random init (mean ± std over seeds, in points), bytes and run time."""
    pct = (lambda rs, key: [100 * r[key] for r in rs if r.get(key) is not None])
    lines = ["| row | schedule | seeds | linear probe | kNN | linear-probe gain over random init | per-seed linear "
             "probe | per-seed gain | up MiB / run | run s |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_seed: dict[int, dict] = {}
    for r in runs:
        if r.get("random_init_linear_probe_acc") is not None:
            by_seed.setdefault(r["seed"], r)
    rand = list(by_seed.values())
    if rand:
        lines.append(f"| random init (same architecture and seed, never trained) | - | "
                     f"{', '.join(str(s) for s in sorted(by_seed))} | {mean_std(pct(rand, 'random_init_linear_probe_acc'))} | "
                     f"{mean_std(pct(rand, 'random_init_knn_acc'))} | 0 | "
                     f"{', '.join('%.2f' % (100 * r['random_init_linear_probe_acc']) for r in rand)} | 0 | - | - |")
    for variant in variants:
        rs = [r for r in runs if r["variant"] == variant]
        if not rs:
            continue
        lines.append(f"| {variant} | {(schedules or {}).get(variant, '')} | {', '.join(str(r['seed']) for r in rs)} | "
                     f"{mean_std(pct(rs, 'linear_probe_acc'))} | {mean_std(pct(rs, 'knn_acc'))} | "
                     f"{mean_std(pct(rs, 'linear_probe_gain_over_random'))} | "
                     f"{', '.join('%.2f' % (100 * r['linear_probe_acc']) for r in rs)} | "
                     f"{', '.join(gain_text(r) for r in rs)} | "
                     f"{sum(r['bytes_up'] for r in rs) / len(rs) / 2**20:.1f} | "
                     f"{sum(r['run_s'] for r in rs) / len(rs):.0f} |")
    return lines


def gain_text(run: dict) -> str:
    """One run's linear-probe gain over its own random init, in signed points ("-" when it has no reference)."""
    gain = run.get("linear_probe_gain_over_random")
    return "-" if gain is None else f"{100 * gain:+.2f}"


def scored_images_text(max_test: int) -> str:
    """How many dev-test images a protocol scores on, in words (``eval.max_test`` 0 means all of them)."""
    return "all" if not max_test else str(max_test)


def previous_runs(out: Path, base: dict, key: str = "config") -> list[dict]:
    """The runs of an earlier invocation that wrote ``out``.json with the same base config (so a comparison can be
    completed seed by seed, across invocations); none if the config changed or nothing was written."""
    path = Path(out).with_suffix(".json")
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return []
    return list(old.get("runs", [])) if old.get(key) == base else []
