"""CPU-scale comparison of FLESD (T = 2 communication rounds) against FedAvg (SimCLR) at equal local compute.

Runs `configs/flesd/cpu-compare-flesd.yaml` and `configs/flesd/cpu-compare-fedavg.yaml` as real `flwr run .`
simulations, once per seed, with the centralized reference (`strategy: central` on FedAvg's config) and the
random-init reference every run reports, and writes the linear-probe/kNN table and the bytes each method moved to
benchmarks/results/flesd_cpu_compare.{json,md} (updated after every run; an invocation with the same configs
continues the earlier one, skipping the (row, seed) pairs it measured).

Usage: python benchmarks/compare_flesd_cpu.py --data /path/cifar10.npz [--seeds 0 1 2] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from runs import REPO, comparison_lines, previous_runs, run_missing

RESULTS = REPO / "benchmarks" / "results"
VARIANTS = {"FLESD (T=2)": "cpu-compare-flesd.yaml", "FedAvg (SimCLR)": "cpu-compare-fedavg.yaml"}
CENTRAL = "centralized (strategy central)"  # FedAvg's config on the union of the clients' data, one trainer


def load_configs() -> dict[str, dict]:
    configs = {v: yaml.safe_load((REPO / "configs" / "flesd" / f).read_text()) for v, f in VARIANTS.items()}
    central = json.loads(json.dumps(configs["FedAvg (SimCLR)"]))
    central["name"] = "cpu-compare-central"
    central["strategy"] = {"name": "central", "options": {}}
    configs[CENTRAL] = central
    return configs


def describe(raw: dict) -> str:
    t, s = raw["train"], raw["strategy"]
    return (f"{raw['rounds']} rounds x {t['local_epochs']} local epochs, strategy {s['name']}"
            + (f" ({', '.join(f'{k}={v}' for k, v in s.get('options', {}).items())})" if s.get("options") else ""))


def write_tables(runs: list[dict], configs: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "configs": configs, "runs": runs}, indent=2))
    base = next(iter(configs.values()))
    lines = [f"# FLESD vs FedAvg at CPU scale ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Command: `{command}`. Scale: {base['federation']['num_clients']} clients, Dirichlet alpha "
             f"{base['data']['alpha']} over {base['data']['max_train']} CIFAR-10 training images, server-held public "
             f"split of {base['data']['public_size']:.0f} images (FLESD's public set), ResNet-18 width "
             f"{base['model']['width']}, SimCLR; the same local compute for every row. Linear probe / kNN (%) on "
             f"{base['eval']['max_train']} labelled train and {base['eval']['max_test']} dev-test images (CIFAR-10 dev "
             "copy, JPEG-derived: relative comparison only); mean ± std over seeds.", ""]
    lines += comparison_lines(runs, list(configs), {v: describe(raw) for v, raw in configs.items()})
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=None, help="only these rows (names as in the table)")
    ap.add_argument("--out", default=str(RESULTS / "flesd_cpu_compare"))
    ap.add_argument("--keep-runs", default=None, metavar="DIR",
                    help="keep each run's folder (config, metrics, model.pt) under DIR for later re-scoring")
    args = ap.parse_args(argv)
    configs = load_configs()
    command = f"python benchmarks/compare_flesd_cpu.py --data {Path(args.data).name} --seeds " + " ".join(
        map(str, args.seeds))
    run_missing(configs, args.seeds, args.data, previous_runs(Path(args.out), configs, key="configs"),
                lambda runs: write_tables(runs, configs, Path(args.out), command), variants=args.variants,
                keep_runs=Path(args.keep_runs) if args.keep_runs else None)
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
