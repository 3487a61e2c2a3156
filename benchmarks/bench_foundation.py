"""Foundation benchmark: training throughput, federation overhead, fast-path accuracy.

Writes its figures to ``benchmarks/results/foundation.json`` and ``foundation.md`` (nothing is asserted:
targets are compared and reported). Three measurements:

1. throughput: images/s of local SSL training (SimCLR, CIFAR ResNet-18, batch 64) in a plain PyTorch fp32
   loop (hand-written below: NCHW, no autocast) against ``ssl_models.training.train_ssl`` with the fast
   path (bf16 autocast where the CPU has native bf16, channels-last) and without it;
2. federation overhead: mean wall time of a warm simulated round of ``flwr run .`` (2 clients, sequential
   on this machine) divided by the wall time of the same local training (the same clients, images, steps
   and settings) run back to back in one process with ``train_ssl``;
3. fast-path accuracy: linear-probe accuracy after the same centralised training with the fast path on and
   off (same seed, same data).

Usage: python benchmarks/bench_foundation.py --data /abs/path/cifar10-dev.npz [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ssl_models.config import ExperimentConfig
from ssl_models.data.augment import SSLAugment
from ssl_models.data.datasets import load_npz, subsample
from ssl_models.data.splits import client_images
from ssl_models.evaluation.protocol import evaluate_backbone
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone
from ssl_models.training import cpu_has_fast_bf16, train_ssl

RESULTS = REPO / "benchmarks" / "results"


def simclr_r18(width: float = 1.0, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    backbone, dim = build_backbone("resnet18", width)
    return build_method("simclr", backbone, dim, proj_hidden_dim=512, proj_out_dim=128, temperature=0.5)


def plain_fp32_loop(method: torch.nn.Module, images: np.ndarray, steps: int, batch: int, seed: int = 0) -> float:
    """The reference: the most direct PyTorch loop, fp32, default memory format. Returns seconds."""
    torch.manual_seed(seed)
    x = torch.as_tensor(images)
    aug = SSLAugment(image_size=x.shape[1])
    opt = torch.optim.SGD(method.trainable_parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    method.train()
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,))
        v1, v2 = aug.two_views(x[idx])
        loss = method.training_step(v1, v2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        method.after_optimizer_step()
    return time.perf_counter() - start


def bench_throughput(images: np.ndarray, steps: int, batch: int) -> dict:
    out = {"method": "simclr", "model": "resnet18 (width 1.0)", "batch": batch, "steps_timed": steps}
    # Warm-up (1 step each, untimed) then timed steps.
    m = simclr_r18()
    plain_fp32_loop(m, images, 1, batch)
    out["plain_fp32_s_per_step"] = plain_fp32_loop(m, images, steps, batch) / steps
    for name, fast in (("train_ssl_fp32", False), ("train_ssl_fast", True)):
        m = simclr_r18()
        common = {"epochs": 1, "batch_size": batch, "lr": 0.05, "weight_decay": 5e-4, "fast_path": fast, "seed": 0}
        train_ssl(m, images[: batch * 1], **common)
        stats = train_ssl(m, images[: batch * steps], **common)
        out[f"{name}_s_per_step"] = stats.seconds / stats.steps
        out[f"{name}_precision"] = stats.precision
    for key in ("plain_fp32", "train_ssl_fp32", "train_ssl_fast"):
        out[f"{key}_images_per_s"] = batch / out[f"{key}_s_per_step"]
    out["speedup_fast_vs_plain_fp32"] = out["plain_fp32_s_per_step"] / out["train_ssl_fast_s_per_step"]
    return out


def bench_overhead(npz: Path, steps: int, rounds: int, width: float) -> dict:
    from fedssl_study.launcher import flwr_run, read_jsonl

    raw = {
        "name": "bench-overhead",
        "seed": 0,
        "rounds": rounds,
        "data": {"dataset": "cifar10", "path": str(npz), "max_train": 4000, "partition": "iid"},
        "model": {"arch": "resnet18", "width": width},
        "method": {"name": "byol", "options": {"proj_hidden_dim": 512, "proj_out_dim": 128, "pred_hidden_dim": 512}},
        "federation": {"num_clients": 2},
        "train": {"local_epochs": 1, "batch_size": 64, "max_steps_per_epoch": steps, "lr": 0.05},
        "eval": {"knn_every": 0, "linear_probe": False, "max_train": 200, "max_test": 100},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg_path = tmp / "bench.yaml"
        cfg_path.write_text(yaml.safe_dump(raw))
        t0 = time.perf_counter()
        proc = flwr_run(f"config='{cfg_path}' output-dir='{tmp / 'out'}'", tmp / "flwr", timeout_s=1800)
        total = time.perf_counter() - t0
        metrics_path = tmp / "out" / "metrics.jsonl"
        if not metrics_path.is_file():
            raise RuntimeError("flwr run produced no metrics:\n" + (proc.stdout + proc.stderr)[-4000:])
        records = read_jsonl(metrics_path)
    walls = [r["wall_s"] for r in records]
    client_train = [sum(c["train_s"] for c in r["clients"]) for r in records]

    # The same local training (same images, steps, settings, a fresh model per client) in one process.
    cfg = ExperimentConfig.from_dict(raw)
    plain = []
    for rnd in range(1, rounds + 1):
        start = time.perf_counter()
        for pid in range(2):
            torch.manual_seed(pid)
            backbone, dim = build_backbone("resnet18", width)
            method = build_method("byol", backbone, dim, **raw["method"]["options"])
            train_ssl(
                method,
                client_images(cfg, pid),
                epochs=1,
                batch_size=64,
                lr=cfg.round_lr(rnd),
                weight_decay=5e-4,
                max_steps_per_epoch=steps,
                seed=rnd * 10 + pid,
            )
        plain.append(time.perf_counter() - start)
    warm_walls, warm_plain = walls[1:], plain[1:]
    return {
        "config": f"BYOL, resnet18 width {width}, 2 clients x {steps} steps of batch 64 per round, fast path, "
        "client-resources num-cpus=2 (clients train one after the other on 2 cores)",
        "rounds": rounds,
        "round_wall_s": walls,
        "client_train_s_sum_per_round": client_train,
        "plain_loop_s_per_round": plain,
        "overhead_ratio_warm": statistics.mean(warm_walls) / statistics.mean(warm_plain),
        "overhead_ratio_first_round": walls[0] / plain[0],
        "flwr_run_total_s": total,
    }


def bench_probe(images: np.ndarray, data, epochs: int, width: float, seeds: tuple[int, ...] = (0,)) -> dict:
    """fp32 and the fast path trained from the same seeds (weights, batches, augmentations), each scored with the
    fixed protocol; with several seeds, whether the fast path's mean lies within fp32's seed spread."""
    tr = subsample(data.y_train, 5000, seed=1)
    te = subsample(data.y_test, 1000, seed=2)
    out = {
        "method": "simclr",
        "model": f"resnet18 (width {width})",
        "train_images": len(images),
        "epochs": epochs,
        "batch": 64,
        "probe": "5000 train / 1000 test, 100 epochs (fixed protocol)",
        "seeds": list(seeds),
        "runs": [],
    }
    for seed in seeds:
        for name, fast in (("fp32", False), ("fast", True)):
            m = simclr_r18(width, seed=seed)
            stats = train_ssl(
                m, images, epochs=epochs, batch_size=64, lr=0.06, weight_decay=5e-4, fast_path=fast, seed=seed
            )
            res = evaluate_backbone(
                m.backbone, data.x_train[tr], data.y_train[tr], data.x_test[te], data.y_test[te], data.num_classes
            )
            out["runs"].append(
                {
                    "seed": seed,
                    "precision": name,
                    "linear_probe_acc": res["linear_probe_acc"],
                    "knn_acc": res["knn_acc"],
                    "train_s": stats.seconds,
                    "final_loss": stats.loss,
                    "step_precision": stats.precision,
                }
            )
            print(json.dumps(out["runs"][-1]), flush=True)
    for name in ("fp32", "fast"):
        accs = [r["linear_probe_acc"] for r in out["runs"] if r["precision"] == name]
        out[f"{name}_linear_probe_mean"] = statistics.mean(accs)
        out[f"{name}_linear_probe_std"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
        out[f"{name}_linear_probe_range"] = [min(accs), max(accs)]
    out["linear_probe_diff_points"] = 100 * (out["fast_linear_probe_mean"] - out["fp32_linear_probe_mean"])
    lo, hi = out["fp32_linear_probe_range"]
    out["fast_mean_within_fp32_seed_range"] = lo <= out["fast_linear_probe_mean"] <= hi
    return out


def write_markdown(results: dict, path: Path) -> None:
    t, o, p = results.get("throughput"), results.get("overhead"), results.get("probe")
    lines = [
        f"# Foundation benchmark ({results['date']})",
        "",
        f"Machine: {results['machine']}. Command: `{results['command']}`",
        "",
    ]
    if t:
        lines += [
            "## Local training throughput (SimCLR, CIFAR ResNet-18, batch 64, CPU)",
            "",
            "| loop | s/step | images/s | precision |",
            "|---|---|---|---|",
            f"| plain PyTorch fp32 | {t['plain_fp32_s_per_step']:.2f} | {t['plain_fp32_images_per_s']:.1f} | fp32 |",
            (
                f"| train_ssl, fast path off | {t['train_ssl_fp32_s_per_step']:.2f} | "
                f"{t['train_ssl_fp32_images_per_s']:.1f} | {t['train_ssl_fp32_precision']} |"
            ),
            (
                f"| train_ssl, fast path on | {t['train_ssl_fast_s_per_step']:.2f} | "
                f"{t['train_ssl_fast_images_per_s']:.1f} | {t['train_ssl_fast_precision']} + channels-last |"
            ),
            "",
            (
                f"Speed-up of the fast path over the plain fp32 loop: **{t['speedup_fast_vs_plain_fp32']:.2f}x** "
                "(goal >= 3x)."
            ),
            "",
        ]
    if o:
        lines += [
            "## Federation overhead (`flwr run .` simulation vs the same training in one loop)",
            "",
            f"{o['config']}; {o['rounds']} rounds.",
            "",
            "| round | simulated round wall s | same training, plain loop s |",
            "|---|---|---|",
        ]
        lines += [
            f"| {i + 1} | {w:.1f} | {pl:.1f} |"
            for i, (w, pl) in enumerate(zip(o["round_wall_s"], o["plain_loop_s_per_round"]))
        ]
        lines += [
            "",
            (
                f"Overhead ratio, warm rounds (2..{o['rounds']}): **{o['overhead_ratio_warm']:.3f}** "
                f"(goal <= 1.10); first round (Ray actors start, data first loaded): "
                f"{o['overhead_ratio_first_round']:.3f}."
            ),
            "",
        ]
    if p:
        lines += [
            "## Fast path vs fp32: linear probe at CPU scale",
            "",
            (
                f"{p['method']} on {p['model']}, {p['train_images']} CIFAR-10 images, {p['epochs']} epochs of "
                f"batch 64; each seed trains both precisions from the same weights, batches and augmentations; "
                f"probe {p['probe']}."
            ),
            "",
            "| seed | precision | train s | final loss | kNN acc | linear probe acc |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['seed']} | {r['precision']} ({r['step_precision']}) | {r['train_s']:.0f} | "
            f"{r['final_loss']:.4f} | {100 * r['knn_acc']:.2f}% | {100 * r['linear_probe_acc']:.2f}% |"
            for r in p["runs"]
        ]
        lo, hi = p["fp32_linear_probe_range"]
        lines += [
            "",
            (
                f"Linear probe, mean ± std over seeds {p['seeds']}: fp32 {100 * p['fp32_linear_probe_mean']:.2f} ± "
                f"{100 * p['fp32_linear_probe_std']:.2f} (range {100 * lo:.2f}-{100 * hi:.2f}), fast path "
                f"{100 * p['fast_linear_probe_mean']:.2f} ± {100 * p['fast_linear_probe_std']:.2f}; difference "
                f"**{p['linear_probe_diff_points']:+.2f} points**; the fast path's mean is "
                f"{'within' if p['fast_mean_within_fp32_seed_range'] else 'outside'} fp32's seed range."
            ),
            "",
        ]
    lines += [
        (
            "Data: the CIFAR-10 dev copy (JPEG-derived; dev-test split), so absolute accuracies are for relative "
            "comparison only."
        ),
        "",
        (
            "Where the step's time goes, and this machine's measured bf16 / fp32 matrix-product limits next to the "
            "step's achieved GFLOP/s: `fast_path_profile.md` (`python benchmarks/profile_fast_path.py`)."
        ),
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="CIFAR-10 .npz (x_train, y_train, x_test, y_test)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script itself")
    ap.add_argument("--only", choices=("throughput", "overhead", "probe"), action="append")
    ap.add_argument("--out", default=str(RESULTS / "foundation"), help="output path without extension")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the probe comparison")
    args = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    data = load_npz(args.data)
    rng = np.random.default_rng(0)
    images = data.x_train[np.sort(rng.choice(len(data.x_train), 4096, replace=False))]
    only = set(args.only or ("throughput", "overhead", "probe"))
    # Record the command without this machine's paths: the data file by name only.
    shown = ["benchmarks/bench_foundation.py"] + [Path(a).name if a == args.data else a for a in sys.argv[1:]]
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python " + " ".join(shown),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"native bf16: {cpu_has_fast_bf16()}, CUDA: {torch.cuda.is_available()}, "
        f"torch {torch.__version__}",
    }
    q = args.quick
    if "throughput" in only:
        print("throughput ...", flush=True)
        results["throughput"] = bench_throughput(images, steps=2 if q else 8, batch=64)
        print(json.dumps(results["throughput"], indent=1), flush=True)
    if "overhead" in only:
        print("overhead ...", flush=True)
        results["overhead"] = bench_overhead(
            Path(args.data).resolve(), steps=2 if q else 24, rounds=2 if q else 4, width=0.25 if q else 1.0
        )
        print(json.dumps(results["overhead"], indent=1), flush=True)
    if "probe" in only:
        print("probe ...", flush=True)
        results["probe"] = bench_probe(
            images[: 256 if q else 2560], data, epochs=1 if q else 6, width=0.25 if q else 0.5, seeds=tuple(args.seeds)
        )
        print(json.dumps(results["probe"], indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, out.with_suffix(".md"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
