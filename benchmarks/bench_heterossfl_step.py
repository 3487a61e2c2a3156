"""Hetero-SSFL local step: its time and the alignment term's numerical error, per RAD-forward precision.

Writes ``benchmarks/results/heterossfl_rad_precision.json`` and ``.md`` (figures are reported, nothing asserted).
At the CPU comparison's scale (``configs/heterossfl/cpu-compare.yaml``: quarter-width ResNet-18 / ResNet-34, SimCLR,
batch 64, a 500-image RAD, BatchNorm batch statistics on the RAD), on the CIFAR-10 copy given with ``--data``:

1. seconds per local step (``train_ssl`` on the fast path, as a client runs it) of: local SSL only (no term), the
   term recomputed on the whole RAD at every step (``refresh: step``) and on a 128-image RAD minibatch
   (``refresh: minibatch``), each with ``rad_precision: fp32`` and ``train`` (the step's own precision); median
   over ``--repeats`` timed windows of ``--steps`` steps, after one warm-up window;
2. the term's numerical error at the initial weights: the value and gradient with the RAD forward in bf16
   against float32, next to the bf16-vs-fp32 error of the SSL loss's own gradient (what every local step
   already accepts on the fast path) and to the gap between a 128-image minibatch term and the full one.
   Cosine similarities of the flattened gradients; the targets are the kernels of the other architecture.

Usage: python benchmarks/bench_heterossfl_step.py --data /abs/path/cifar10.npz [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ssl_models.config import ExperimentConfig, load_config_tree
from ssl_models.factory import build_augment, build_ssl_model
from ssl_models.federated.kernel_alignment import KernelAligner, client_kernel, rad_representations
from ssl_models.training import fast_path_for, train_ssl

RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "heterossfl" / "cpu-compare.yaml"
CASES = (
    ("no term (local SSL)", None, None),
    ("step, fp32", "step", "fp32"),
    ("step, train", "step", "train"),
    ("minibatch 128, fp32", "minibatch", "fp32"),
    ("minibatch 128, train", "minibatch", "train"),
)


def aligner_for(
    cfg: ExperimentConfig, rad: np.ndarray, target: torch.Tensor, refresh: str, precision: str, mu: float
) -> KernelAligner:
    fp = fast_path_for(torch.device("cpu"), cfg.train.fast_path)
    bf16 = precision == "train" and fp.autocast_dtype == torch.bfloat16
    opts = cfg.strategy.options
    return KernelAligner(
        rad,
        target,
        mu=mu,
        refresh=refresh,
        rad_batch_size=128,
        forward_batch_size=int(opts.get("rad_forward_batch", 512)),
        bn_mode="train",
        forward_dtype=torch.bfloat16 if bf16 else None,
        channels_last=fp.channels_last if precision == "train" else False,
    )


def target_kernel(cfg: ExperimentConfig, rad: np.ndarray, arch: str) -> torch.Tensor:
    other = "resnet34" if arch == "resnet18" else "resnet18"
    return client_kernel(
        rad_representations(build_ssl_model(cfg, seed=1, arch=other), rad, "predictor", batch_size=512, bn_mode="train")
    )


def step_seconds(
    cfg: ExperimentConfig, images: np.ndarray, rad: np.ndarray, arch: str, steps: int, repeats: int
) -> list[dict[str, Any]]:
    target = target_kernel(cfg, rad, arch)
    out = []
    for label, refresh, precision in CASES:
        model = build_ssl_model(cfg, seed=0, arch=arch)
        aligner = aligner_for(cfg, rad, target, refresh, precision, 0.5) if refresh else None
        windows = []
        for window in range(repeats + 1):  # the first window warms up (allocator, kernels)
            start = time.perf_counter()
            stats = train_ssl(
                model,
                images,
                epochs=1,
                batch_size=cfg.train.batch_size,
                lr=cfg.train.lr,
                optimizer=cfg.train.optimizer,
                weight_decay=cfg.train.weight_decay,
                fast_path=cfg.train.fast_path,
                max_steps_per_epoch=steps,
                seed=window,
                augment=build_augment(cfg, int(images.shape[1])),
                loss_hook=aligner.loss if aligner else None,
            )
            if window:
                windows.append((time.perf_counter() - start) / stats.steps)
        out.append(
            {
                "arch": arch,
                "case": label,
                "s_per_step": statistics.median(windows),
                "s_per_step_windows": windows,
                "precision": stats.precision,
            }
        )
        print(f"{arch:9s} {label:22s} {statistics.median(windows):.3f} s/step", flush=True)
    return out


def flat_grad(model: torch.nn.Module, loss_fn) -> torch.Tensor:
    params = [p for p in model.trainable_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def term_error(cfg: ExperimentConfig, images: np.ndarray, rad: np.ndarray, arch: str) -> dict[str, Any]:
    fp = fast_path_for(torch.device("cpu"), cfg.train.fast_path)
    if fp.autocast_dtype != torch.bfloat16:
        return {"arch": arch, "note": "no bf16 fast path on this machine: rad_precision train runs fp32"}
    target = target_kernel(cfg, rad, arch)
    model = build_ssl_model(cfg, seed=0, arch=arch).to(memory_format=torch.channels_last)
    model.train()
    terms = {}
    for precision in ("fp32", "train"):
        aligner = aligner_for(cfg, rad, target, "step", precision, 0.5)
        grad = flat_grad(model, lambda aligner=aligner: aligner.loss(model))
        terms[precision] = (aligner.stats.values[-1], grad)
    minibatch = aligner_for(cfg, rad, target, "minibatch", "fp32", 0.5)
    minibatch_grad = flat_grad(model, lambda: minibatch.loss(model))
    gen = torch.Generator().manual_seed(0)
    v1, v2 = build_augment(cfg, int(images.shape[1])).two_views(
        torch.as_tensor(images[: cfg.train.batch_size]), generator=gen
    )
    v1, v2 = (v.contiguous(memory_format=torch.channels_last) for v in (v1, v2))

    def ssl_loss(dtype):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            return model.training_step(v1, v2)

    ssl32, ssl16 = flat_grad(model, lambda: ssl_loss(None)), flat_grad(model, lambda: ssl_loss(torch.bfloat16))

    def cos(a, b):
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    (v32, g32), (v16, g16) = terms["fp32"], terms["train"]
    return {
        "arch": arch,
        "term_fp32": v32,
        "term_bf16": v16,
        "term_rel_diff": abs(v16 - v32) / abs(v32),
        "cos_term_bf16_vs_fp32": cos(g16, g32),
        "cos_ssl_bf16_vs_fp32": cos(ssl16, ssl32),
        "cos_term_minibatch128_vs_full": cos(minibatch_grad, g32),
        "grad_norm_term": float(g32.norm()),
        "grad_norm_ssl": float(ssl32.norm()),
    }


def write_markdown(results: dict[str, Any], path: Path) -> None:
    lines = [
        f"# Hetero-SSFL local step: RAD-forward precision ({results['date']})",
        "",
        (
            f"Command: `{results['command']}`. Machine: {results['machine']}; torch {results['torch']}, "
            f"{results['threads']} intra-op thread(s). Config: `configs/heterossfl/cpu-compare.yaml` (quarter-width "
            "encoders, SimCLR, batch 64, 500-image RAD, BatchNorm batch statistics on the RAD, mu 0.5). "
            f"Median over {results['repeats']} windows of {results['steps']} steps after a warm-up window."
        ),
        "",
        "| encoder | local step | s / step | x no term |",
        "|---|---|---|---|",
    ]
    base = {r["arch"]: r["s_per_step"] for r in results["steps_timed"] if r["case"].startswith("no term")}
    for r in results["steps_timed"]:
        lines.append(f"| {r['arch']} | {r['case']} | {r['s_per_step']:.3f} | {r['s_per_step'] / base[r['arch']]:.2f} |")
    lines += [
        "",
        (
            "The alignment term at the initial weights, RAD forward in bf16 (`rad_precision: train`) against "
            "float32, next to the SSL loss's own bf16-vs-fp32 gradient error and the 128-image minibatch term's "
            "gap to the full one (cosine similarity of the flattened gradients; 1 = same direction):"
        ),
        "",
        (
            "| encoder | term fp32 | term bf16 | relative difference | cos(term bf16, fp32) | cos(SSL loss bf16, fp32) "
            "| cos(minibatch-128 term, full) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for e in results["term_error"]:
        if "note" in e:
            lines.append(f"| {e['arch']} | {e['note']} | | | | | |")
            continue
        lines.append(
            f"| {e['arch']} | {e['term_fp32']:.5f} | {e['term_bf16']:.5f} | {e['term_rel_diff']:.2e} | "
            f"{e['cos_term_bf16_vs_fp32']:.3f} | {e['cos_ssl_bf16_vs_fp32']:.3f} | "
            f"{e['cos_term_minibatch128_vs_full']:.3f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def shown_command(argv: list[str]) -> str:
    """The command line without this machine's paths (a file outside the repository by name only)."""
    shown = ["benchmarks/bench_heterossfl_step.py"]
    for arg in argv:
        if os.path.isabs(arg):
            p = Path(arg)
            arg = str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name
        shown.append(arg)
    return "python " + " ".join(shown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="CIFAR-10 .npz (x_train: NHWC uint8)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per case")
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 window, ResNet-18 only: checks the script")
    ap.add_argument("--out", default=str(RESULTS / "heterossfl_rad_precision"), help="output path without extension")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.quick:
        args.steps, args.repeats = 2, 1
    torch.set_num_threads(args.threads)
    cfg = ExperimentConfig.from_dict(load_config_tree(CONFIG))
    x = np.load(args.data)["x_train"]
    images, rad = x[:1000], x[1000 : 1000 + 500]  # a client's 1 000 images, a 500-image RAD, as the config's scale
    archs = ["resnet18"] if args.quick else ["resnet18", "resnet34"]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": shown_command(argv),
        "threads": args.threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "steps": args.steps,
        "repeats": args.repeats,
        "steps_timed": [r for arch in archs for r in step_seconds(cfg, images, rad, arch, args.steps, args.repeats)],
        "term_error": [term_error(cfg, images, rad, arch) for arch in archs],
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out.with_suffix(".md"))
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
