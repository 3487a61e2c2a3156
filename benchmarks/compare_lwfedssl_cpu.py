"""CPU-scale comparison of the layer-wise variants against end-to-end FedMoCoV3 (the LW-FedSSL paper's main table).

Runs `configs/lwfedssl/cpu-compare-fedmocov3.yaml` (FedMoCoV3) and `configs/lwfedssl/cpu-compare.yaml` (LW-FedSSL;
FedMoCo-LW, Prog-FedSSL and FLL+DD change only `strategy.name`, as that file's header says) as real `flwr run .`
simulations, once per seed, with the centralized reference (`strategy: central` on FedMoCoV3's config: the same
MoCo v3, ViT and number of passes over every image, one trainer) and the random-init reference every run reports.
Next to the scores it puts what each run measured of its clients' resources (summary.json `resources`: FLOPs of
the whole run, the largest analytic step memory and process RSS, bytes both ways), so accuracy and cost sit in one
table. Writes benchmarks/results/lwfedssl_cpu_compare.{json,md}, updated after every run; an invocation with the
same configs continues the earlier one, skipping the (row, seed) pairs it measured.

Usage: python benchmarks/compare_lwfedssl_cpu.py --data /path/cifar10.npz [--seeds 0 1 2] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from runs import REPO, comparison_lines, previous_runs, run_missing

RESULTS = REPO / "benchmarks" / "results"
CONFIGS = REPO / "configs" / "lwfedssl"
FEDMOCOV3 = "FedMoCoV3 (end to end)"
CENTRAL = "centralized (strategy central)"
# Row name -> (config file, strategy name); the layer-wise rows share cpu-compare.yaml's options.
VARIANTS = {
    FEDMOCOV3: ("cpu-compare-fedmocov3.yaml", "fedssl"),
    "LW-FedSSL": ("cpu-compare.yaml", "lwfedssl"),
    "FedMoCo-LW": ("cpu-compare.yaml", "fedmoco_lw"),
    "Prog-FedSSL": ("cpu-compare.yaml", "prog_fedssl"),
    "FLL+DD (SimCLR)": ("cpu-compare.yaml", "fll_dd"),
    CENTRAL: ("cpu-compare-fedmocov3.yaml", "central"),
}
# FLL+DD runs SimCLR, as its paper does (configs/lwfedssl/fll-dd.yaml): the MoCo v3 projector's shape and temperature,
# no predictor and no momentum encoder; the batch stays the comparison's.
SIMCLR_ROWS = {"FLL+DD (SimCLR)"}


def simclr_method(mocov3: dict) -> dict:
    """The SimCLR method of a row that runs it: MoCo v3's projector (hidden, out, layers) and temperature."""
    o = mocov3["options"]
    return {"name": "simclr", "options": {"proj_hidden_dim": o["proj_hidden_dim"], "proj_out_dim": o["proj_out_dim"],
                                          "num_proj_layers": o["num_proj_layers"], "temperature": o["temperature"]}}


def load_configs() -> dict[str, dict]:
    """Every row's config: its file with the row's strategy (options kept for the layer-wise ones) and method."""
    files = {f: yaml.safe_load((CONFIGS / f).read_text()) for f, _ in VARIANTS.values()}
    out = {}
    for variant, (f, strategy) in VARIANTS.items():
        raw = json.loads(json.dumps(files[f]))
        if raw["strategy"]["name"] != strategy:
            keep = raw["strategy"].get("options", {}) if strategy not in ("fedssl", "central") else {}
            raw["strategy"] = {"name": strategy, "options": keep}
            raw["name"] = f"cpu-compare-{strategy}"
        if variant in SIMCLR_ROWS:
            raw["method"] = simclr_method(raw["method"])
            raw["name"] += "-simclr"
        out[variant] = raw
    return out


def resource_row(res: dict) -> dict:
    """What a run measured of its clients' cost (summary.json `resources.run`; absent keys stay None)."""
    run = (res["summary"].get("resources") or {}).get("run", {})
    return {"flops_run": run.get("flops_run"), "mem_total_max": run.get("mem_total_max"),
            "rss_peak_bytes_max": run.get("rss_peak_bytes_max")}


def resource_lines(runs: list[dict], variants: list[str]) -> list[str]:
    """Mean over seeds of each row's measured cost, with its ratio to FedMoCoV3's (the paper's direction:
    FedMoCoV3 / variant, so > 1 means the variant is cheaper)."""
    def mean(variant: str, key: str) -> float | None:
        vals = [r[key] for r in runs if r["variant"] == variant and r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def cell(variant: str, key: str, scale: float, fmt: str) -> str:
        v, ref = mean(variant, key), mean(FEDMOCOV3, key)
        if v is None:
            return "-"
        # A ratio only between federated rows: the centralized trainer moves no client messages.
        ratio = f" ({ref / v:.2f}x)" if ref and v and variant not in (FEDMOCOV3, CENTRAL) else ""
        return format(v / scale, fmt) + ratio

    lines = ["| row | client FLOPs over the run (TFLOP) | analytic step memory, max (MiB) | client RSS peak, max (MiB) "
             "| bytes down / run (MiB) | bytes up / run (MiB) |", "|---|---|---|---|---|---|"]
    for variant in variants:
        if not any(r["variant"] == variant for r in runs):
            continue
        lines.append(f"| {variant} | {cell(variant, 'flops_run', 1e12, ',.1f')} | "
                     f"{cell(variant, 'mem_total_max', 2**20, ',.0f')} | "
                     f"{cell(variant, 'rss_peak_bytes_max', 2**20, ',.0f')} | "
                     f"{cell(variant, 'bytes_down', 2**20, ',.1f')} | {cell(variant, 'bytes_up', 2**20, ',.1f')} |")
    return lines


def describe(raw: dict) -> str:
    s = raw["strategy"]
    epochs = raw["train"]["local_epochs"]
    return f"{raw['rounds']} rounds x {epochs} local epoch{'s' if epochs != 1 else ''}, strategy {s['name']}"


def write_tables(runs: list[dict], configs: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "configs": configs, "runs": runs}, indent=2))
    base = configs["LW-FedSSL"]
    m, t, d = base["model"], base["train"], base["data"]
    public = f"{100 * d['public_size']:g} %" if d["public_size"] < 1 else f"{d['public_size']:g} images"
    lines = [f"# Layer-wise FedSSL vs FedMoCoV3 at CPU scale ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Command: `{command}`. Configs: `configs/lwfedssl/cpu-compare.yaml` (the layer-wise rows, "
             "`strategy.name` changed) and `cpu-compare-fedmocov3.yaml` (FedMoCoV3 and the centralized row). Scale: "
             f"{m['arch']} width {m['width']} ({m.get('options', {}).get('depth', 12)} blocks), MoCo v3 (FLL+DD: "
             "SimCLR, as its paper), "
             f"{base['federation']['num_clients']} clients ({d['partition']}) "
             f"over {d['max_train']} CIFAR-10 training images with {public} held by the server as auxiliary "
             f"data, {base['strategy']['options'].get('stages')} stages, {base['rounds']} rounds of "
             f"{t['local_epochs']} local epoch(s), batch {t['batch_size']}, {t['optimizer']} lr {t['lr']} "
             f"({t['lr_schedule']}), crops {base['augment']['crop_scale']}. Linear probe / "
             f"kNN (%) on {base['eval']['max_train']} labelled train and {base['eval']['max_test'] or 'all'} dev-test images "
             "(CIFAR-10 dev copy, JPEG-derived: relative comparison only); mean ± std over seeds.", ""]
    lines += comparison_lines(runs, list(configs), {v: describe(raw) for v, raw in configs.items()})
    # The random-init row shows one reference per seed; every row's final encoder has all blocks, so the rows of
    # a seed share it unless a config changes the depth: then say so rather than hide it.
    for seed in sorted({r["seed"] for r in runs}):
        refs = {r["variant"]: r.get("random_init_linear_probe_acc") for r in runs if r["seed"] == seed}
        if len({v for v in refs.values() if v is not None}) > 1:
            lines.append(f"\nSeed {seed}: the rows' random-init references differ (linear probe "
                         + ", ".join(f"{v}: {100 * a:.2f}" for v, a in refs.items() if a is not None)
                         + "); each row's gain is over its own.")
    lines += ["", "Measured client cost (mean over seeds; in brackets FedMoCoV3 / row, the paper's direction). "
              "FLOPs: per-sample FLOPs of each round's local step x images trained, summed over clients and rounds "
              "(the centralized row: its one trainer; it sends no client messages, so its bytes are only the final "
              "model's for evaluation and no ratio is given). Memory: analytic fp32 step memory at the training batch and the "
              "client process's RSS peak (a CPU figure, not the paper's CUDA peak). Bytes: everything the strategy "
              "sent and received, heads included.", ""]
    lines += resource_lines(runs, list(configs))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=None, help="only these rows (names as in the table)")
    ap.add_argument("--out", default=str(RESULTS / "lwfedssl_cpu_compare"))
    ap.add_argument("--keep-runs", default=None, metavar="DIR",
                    help="keep each run's folder (config, metrics, model.pt) under DIR for later re-scoring")
    args = ap.parse_args(argv)
    configs = load_configs()
    unknown = sorted(set(args.variants or []) - set(configs))
    if unknown:
        ap.error(f"unknown --variants {unknown}; the rows are {list(configs)}")
    command = f"python benchmarks/compare_lwfedssl_cpu.py --data {Path(args.data).name} --seeds " + " ".join(
        map(str, args.seeds))
    run_missing(configs, args.seeds, args.data, previous_runs(Path(args.out), configs, key="configs"),
                lambda runs: write_tables(runs, configs, Path(args.out), command), variants=args.variants,
                keep_runs=Path(args.keep_runs) if args.keep_runs else None,
                extra=resource_row)
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
