"""CPU-scale comparison of FLESD (T = 2 communication rounds) against FedAvg (SimCLR) at equal local compute.

Runs `configs/flesd/cpu-compare-flesd.yaml` and `configs/flesd/cpu-compare-fedavg.yaml` as real `flwr run .`
simulations, once per seed, and writes the linear-probe/kNN table and the bytes each method moved to
benchmarks/results/flesd_cpu_compare.{json,md} (updated after every run).

Usage: python benchmarks/compare_flesd_cpu.py --data /path/cifar10.npz [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import yaml

from runs import REPO, run_experiment

RESULTS = REPO / "benchmarks" / "results"
VARIANTS = {"FLESD (T=2)": "cpu-compare-flesd.yaml", "FedAvg (SimCLR)": "cpu-compare-fedavg.yaml"}


def describe(raw: dict) -> str:
    t, s = raw["train"], raw["strategy"]
    return (f"{raw['rounds']} rounds x {t['local_epochs']} local epochs, strategy {s['name']}"
            + (f" ({', '.join(f'{k}={v}' for k, v in s.get('options', {}).items())})" if s.get("options") else ""))


def write_tables(runs: list[dict], configs: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "configs": configs, "runs": runs}, indent=2))
    base = next(iter(configs.values()))
    lines = [f"# FLESD vs FedAvg at CPU scale ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Command: `{command}`. {base['federation']['num_clients']} clients, Dirichlet alpha "
             f"{base['data']['alpha']} over {base['data']['max_train']} CIFAR-10 training images, server-held public "
             f"split of {base['data']['public_size']:.0f} images (FLESD's public set), ResNet-18 width "
             f"{base['model']['width']}, SimCLR. Linear probe / kNN on {base['eval']['max_train']} labelled train and "
             f"{base['eval']['max_test']} dev-test images (CIFAR-10 dev copy, JPEG-derived: relative comparison only).",
             "", "| method | schedule | seeds | linear probe (mean ± std) | kNN (mean ± std) | up MiB / run | "
             "down MiB / run | run s |", "|---|---|---|---|---|---|---|---|"]
    for variant, raw in configs.items():
        rs = [r for r in runs if r["variant"] == variant]
        if not rs:
            continue
        lp = [100 * r["linear_probe_acc"] for r in rs]
        kn = [100 * r["knn_acc"] for r in rs]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        lines.append(f"| {variant} | {describe(raw)} | {', '.join(str(r['seed']) for r in rs)} | "
                     f"{statistics.mean(lp):.2f} ± {sd(lp):.2f} | {statistics.mean(kn):.2f} ± {sd(kn):.2f} | "
                     f"{statistics.mean(r['bytes_up'] for r in rs) / 2**20:.1f} | "
                     f"{statistics.mean(r['bytes_down'] for r in rs) / 2**20:.1f} | "
                     f"{statistics.mean(r['run_s'] for r in rs):.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default=str(RESULTS / "flesd_cpu_compare"))
    args = ap.parse_args(argv)
    configs = {v: yaml.safe_load((REPO / "configs" / "flesd" / f).read_text()) for v, f in VARIANTS.items()}
    command = f"python benchmarks/compare_flesd_cpu.py --data {Path(args.data).name} --seeds " + " ".join(
        map(str, args.seeds))
    runs = []
    for seed in args.seeds:
        for variant, base in configs.items():
            raw = json.loads(json.dumps(base))
            raw["seed"] = seed
            raw["name"] = f"{base['name']}-seed{seed}"
            raw["data"]["path"] = str(Path(args.data).resolve())
            res = run_experiment(raw)
            s = res["summary"]
            runs.append({"variant": variant, "seed": seed, "linear_probe_acc": s["linear_probe_acc"],
                         "knn_acc": s["knn_acc"], "bytes_up": s["bytes_up_total"], "bytes_down": s["bytes_down_total"],
                         "run_s": res["run_s"],
                         "knn_curve": [[r["round"], r.get("knn_acc")] for r in res["rounds"]]})
            print(json.dumps({k: runs[-1][k] for k in ("variant", "seed", "linear_probe_acc", "knn_acc", "run_s")}),
                  flush=True)
            write_tables(runs, configs, Path(args.out), command)
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
