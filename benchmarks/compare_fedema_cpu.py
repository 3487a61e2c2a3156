"""CPU-scale comparison of FedBYOL, FedU and FedEMA (autoscaler) over several seeds.

Runs `configs/fedema/cpu-compare.yaml` as real `flwr run .` simulations (one SuperNode per client), once per
(strategy, seed), with the centralized reference (`strategy: central`) and the random-init reference every run
reports, and writes the linear-probe and kNN table (mean and standard deviation over seeds) to
benchmarks/results/fedema_cpu_compare.{json,md}, updated after every run so partial results survive.
The seed changes the partition, the initial model, the augmentations and the sampling.

Usage: python benchmarks/compare_fedema_cpu.py --data /path/cifar10.npz [--seeds 0 1 2] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from runs import REPO, comparison_lines, previous_runs, run_missing, scored_images_text

RESULTS = REPO / "benchmarks" / "results"
VARIANTS = {
    "FedBYOL": {"name": "fedssl", "options": {}},
    "FedU": {"name": "fedu", "options": {"threshold": 0.4}},
    # The official code's divergence (the size of the client's last local update): under Adam at a constant
    # learning rate the paper form (the distance to the new global model) grows every round once mu reaches 1, so
    # mu stays clipped at 1 and the clients ignore the global model (measured: benchmarks/results/
    # fedema_recipe_pilots.md). The paper-form row is kept for the seeds it was measured on.
    "FedEMA (autoscaler, tau 0.7, EasyFL divergence)": {
        "name": "fedema", "options": {"mu_mode": "autoscaler", "tau": 0.7, "divergence": "easyfl"}},
    "FedEMA (autoscaler, tau 0.7, paper divergence)": {
        "name": "fedema", "options": {"mu_mode": "autoscaler", "tau": 0.7, "divergence": "paper"}},
    # The papers' "Non-FL" row: the same BYOL, model, augmentations and number of passes over every image, on the
    # union of the clients' data by one trainer.
    "centralized (strategy central)": {"name": "central", "options": {}},
}


def partition_of(data: dict) -> str:
    """How the clients' data are split, in words."""
    if data["partition"] == "pathological":
        return f"{data['classes_per_client']} classes each"
    if data["partition"] == "dirichlet":
        return f"Dirichlet alpha {data['alpha']}"
    return data["partition"]


def write_tables(runs: list[dict], out: Path, command: str, base: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "config": base, "runs": runs}, indent=2))
    t = base["train"]
    lines = [f"# FedBYOL vs FedU vs FedEMA at CPU scale ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Command: `{command}`. Config: `configs/fedema/cpu-compare.yaml`. Scale: {base['rounds']} rounds x "
             f"{t['local_epochs']} local epochs, {base['federation']['num_clients']} clients "
             f"({partition_of(base['data'])}), {base['data']['max_train']} CIFAR-10 training images, "
             f"ResNet-18 width {base['model']['width']}, BYOL (target momentum "
             f"{base['method']['options'].get('momentum')}), {t['optimizer']} lr {t['lr']} "
             f"({t.get('lr_schedule', 'cosine')} across rounds), batch {t['batch_size']}. "
             f"Linear probe and kNN (%) on {base['eval']['max_train']} labelled train / "
             f"{scored_images_text(base['eval']['max_test'])} dev-test images (CIFAR-10 dev copy, JPEG-derived: "
             "relative comparison only); mean ± std over seeds.", ""]
    lines += comparison_lines(runs, list(VARIANTS))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=0, help="override the config's rounds (0: keep)")
    ap.add_argument("--variants", nargs="+", default=None, help="only these rows (names as in the table)")
    ap.add_argument("--out", default=str(RESULTS / "fedema_cpu_compare"))
    ap.add_argument("--keep-runs", default=None, metavar="DIR",
                    help="keep each run's folder (config, metrics, model.pt) under DIR for later re-scoring")
    args = ap.parse_args(argv)
    base = yaml.safe_load((REPO / "configs" / "fedema" / "cpu-compare.yaml").read_text())
    if args.rounds:
        base["rounds"] = args.rounds
    command = (f"python benchmarks/compare_fedema_cpu.py --data {Path(args.data).name} --seeds "
               + " ".join(map(str, args.seeds)) + (f" --rounds {args.rounds}" if args.rounds else "")
               + (" --variants " + " ".join(f"'{v}'" for v in args.variants) if args.variants else ""))
    configs = {variant: {**json.loads(json.dumps(base)), "strategy": strategy, "name": f"cpu-compare-{strategy['name']}"}
               for variant, strategy in VARIANTS.items()}
    run_missing(configs, args.seeds, args.data, previous_runs(Path(args.out), base),
                lambda runs: write_tables(runs, Path(args.out), command, base), variants=args.variants,
                keep_runs=Path(args.keep_runs) if args.keep_runs else None,
                extra=lambda res: {"mu": [[c.get("mu") for c in r["clients"]] for r in res["rounds"]]})
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
