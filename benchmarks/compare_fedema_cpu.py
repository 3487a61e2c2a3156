"""CPU-scale comparison of FedBYOL, FedU and FedEMA (autoscaler) over several seeds.

Runs `configs/fedema/cpu-compare.yaml` as real `flwr run .` simulations (5 SuperNodes), once per
(strategy, seed), and writes the linear-probe and kNN table (mean and standard deviation over seeds) to
benchmarks/results/fedema_cpu_compare.{json,md}, updated after every run so partial results survive.
The seed changes the partition, the initial model, the augmentations and the sampling.

Usage: python benchmarks/compare_fedema_cpu.py --data /path/cifar10.npz [--seeds 0 1 2] [--rounds N]
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
VARIANTS = {
    "FedBYOL": {"name": "fedssl", "options": {}},
    "FedU": {"name": "fedu", "options": {"threshold": 0.4}},
    "FedEMA (autoscaler, tau 0.7)": {"name": "fedema", "options": {"mu_mode": "autoscaler", "tau": 0.7}},
}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def write_tables(runs: list[dict], out: Path, command: str, base: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "config": base, "runs": runs}, indent=2))
    lines = [f"# FedBYOL vs FedU vs FedEMA at CPU scale ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Command: `{command}`. Config: `configs/fedema/cpu-compare.yaml` ({base['rounds']} rounds, "
             f"{base['federation']['num_clients']} clients x {base['data']['classes_per_client']} CIFAR-10 classes, "
             f"{base['data']['max_train']} training images, ResNet-18 width {base['model']['width']}, BYOL, "
             f"E={base['train']['local_epochs']}, batch {base['train']['batch_size']}). Linear probe and kNN on "
             f"{base['eval']['max_train']} labelled train / {base['eval']['max_test']} dev-test images "
             "(CIFAR-10 dev copy, JPEG-derived: relative comparison only).", "",
             "| method | seeds | linear probe (mean ± std) | kNN (mean ± std) | per-seed linear probe | run s |",
             "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        rs = [r for r in runs if r["variant"] == variant]
        if not rs:
            continue
        per_seed = ", ".join(f"{100 * r['linear_probe_acc']:.2f}" for r in rs)
        lp, knn = mean_std([100 * r["linear_probe_acc"] for r in rs]), mean_std([100 * r["knn_acc"] for r in rs])
        lines.append(f"| {variant} | {', '.join(str(r['seed']) for r in rs)} | {lp[0]:.2f} ± {lp[1]:.2f} | "
                     f"{knn[0]:.2f} ± {knn[1]:.2f} | {per_seed} | "
                     f"{statistics.mean(r['run_s'] for r in rs):.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=0, help="override the config's rounds (0: keep)")
    ap.add_argument("--out", default=str(RESULTS / "fedema_cpu_compare"))
    args = ap.parse_args(argv)
    base = yaml.safe_load((REPO / "configs" / "fedema" / "cpu-compare.yaml").read_text())
    if args.rounds:
        base["rounds"] = args.rounds
    command = (f"python benchmarks/compare_fedema_cpu.py --data {Path(args.data).name} --seeds "
               + " ".join(map(str, args.seeds)) + (f" --rounds {args.rounds}" if args.rounds else ""))
    runs: list[dict] = []
    for seed in args.seeds:
        for variant, strategy in VARIANTS.items():
            raw = json.loads(json.dumps(base))
            raw.update(seed=seed, name=f"cpu-compare-{strategy['name']}-seed{seed}", strategy=strategy)
            raw["data"]["path"] = str(Path(args.data).resolve())
            res = run_experiment(raw)
            summary, rounds = res["summary"], res["rounds"]
            runs.append({"variant": variant, "seed": seed, "linear_probe_acc": summary["linear_probe_acc"],
                         "knn_acc": summary["knn_acc"], "run_s": res["run_s"],
                         "knn_curve": [[r["round"], r.get("knn_acc")] for r in rounds if r.get("knn_acc") is not None],
                         "loss_curve": [r["train_loss"] for r in rounds],
                         "mu": [[c.get("mu") for c in r["clients"]] for r in rounds]})
            print(json.dumps({k: runs[-1][k] for k in ("variant", "seed", "linear_probe_acc", "knn_acc", "run_s")}),
                  flush=True)
            write_tables(runs, Path(args.out), command, base)
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
