"""Where a local training step's time goes on this machine, and how far it is from the hardware's limits.

Writes ``benchmarks/results/fast_path_profile.{md,json}``:

1. the machine's matrix-product limits: GFLOP/s of square ``torch.mm`` in float32 and in bfloat16 (sizes 1024-4096),
   the ceiling any bf16 fast path can approach;
2. one SSL training step (SimCLR or BYOL on a CIFAR ResNet-18, batch B x 2 views) with the project's fast path (bf16
   autocast where the CPU has native bf16, channels-last) and in plain fp32, profiled with ``torch.profiler``: the
   share of augmentation, forward, backward and optimizer (``record_function`` ranges around each phase), and the
   time per operator group (convolution, batch norm, activation, layout and dtype conversions, matrix products,
   optimizer, other), forward and backward together; the achieved GFLOP/s of the step (its FLOPs counted with
   ``torch.utils.flop_counter``) next to the matrix-product limits.

Usage: python benchmarks/profile_fast_path.py [--method simclr] [--batch 64] [--steps 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ssl_models.data.augment import SSLAugment
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone
from ssl_models.training import cpu_has_fast_bf16, fast_path_for

RESULTS = REPO / "benchmarks" / "results"
HEADS = {
    "simclr": {"proj_hidden_dim": 512, "proj_out_dim": 128},
    "byol": {"proj_hidden_dim": 4096, "proj_out_dim": 256, "pred_hidden_dim": 4096},
}
GROUPS = (  # operator name fragments -> group, first match wins
    ("convolution", ("conv", "mkldnn_convolution")),
    ("batch norm", ("batch_norm", "native_batch_norm")),
    ("activation", ("relu", "threshold")),
    ("layout / dtype conversion", ("copy_", "to_copy", "contiguous", "clone", "_to_dense", "reorder")),
    ("matrix product", ("addmm", "mm", "bmm", "linear", "matmul")),
    ("optimizer", ("sgd", "_foreach", "add_", "mul_", "lerp")),
)


def matmul_gflops(dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9


# A CIFAR ResNet-18's 3x3 convolutions at width 1: (channels, feature-map side, layers of that shape); each
# stage's first layer (stride 2 or a channel change) is counted as one of its four.
RESNET18_CONVS = ((64, 32, 4), (128, 16, 4), (256, 8, 4), (512, 4, 4))


def conv_gflops(dtype: torch.dtype, batch: int, channels: int, side: int, repeats: int = 4) -> dict[str, float]:
    """GFLOP/s (and seconds, ``<mode>_s``) of one 3x3 convolution (stride 1, channels-last, oneDNN) forward and
    forward + backward (input and weight gradients), FLOPs counted as the direct convolution's 2 N C_in C_out 9 H W per pass. A fp32
    kernel that does fewer operations (Winograd-style) shows up as a rate above the fp32 matrix-product limit."""
    x = torch.randn(batch, channels, side, side).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(channels, channels, 3, 3).to(dtype).contiguous(memory_format=torch.channels_last)
    flops = 2 * batch * channels * channels * 9 * side * side
    out = {}
    for mode in ("forward", "forward+backward"):
        xg, wg = x.clone().requires_grad_(mode != "forward"), w.clone().requires_grad_(mode != "forward")

        def run(xg=xg, wg=wg, mode=mode):
            y = torch.nn.functional.conv2d(xg, wg, padding=1)
            if mode != "forward":
                y.backward(torch.ones_like(y))

        run()  # warm-up: oneDNN builds its kernels on the first call
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        seconds = (time.perf_counter() - t0) / repeats
        out[f"{mode}_s"] = seconds
        out[mode] = flops * (1 if mode == "forward" else 3) / seconds / 1e9
    return out


def conv_limits(batch: int) -> dict:
    """Every ResNet-18 3x3 shape in fp32 and bf16, and the convolutions-only bf16 / fp32 time ratio of a whole
    step (forward + backward, each shape weighted by its number of layers): what a fast path whose time is
    mostly convolutions can reach."""
    shapes, seconds = [], {"float32": 0.0, "bfloat16": 0.0}
    for channels, side, layers in RESNET18_CONVS:
        row = {"channels": channels, "side": side, "layers": layers}
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).split(".")[-1]
            row[name] = conv_gflops(dt, batch, channels, side)
            seconds[name] += layers * row[name]["forward+backward_s"]
        shapes.append(row)
    return {
        "batch": batch,
        "shapes": shapes,
        "step_convs_s": seconds,
        "step_convs_ratio": seconds["float32"] / seconds["bfloat16"],
    }


def build(method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", 1.0)
    return build_method(method, backbone, dim, **HEADS[method])


def step_fn(model, augment, images, opt, fast: bool):
    fp = fast_path_for(torch.device("cpu"), fast)
    gen = torch.Generator().manual_seed(0)

    def step():
        with record_function("augmentation"):
            v1, v2 = augment.two_views(images, generator=gen)
            if fp.channels_last:
                v1 = v1.contiguous(memory_format=torch.channels_last)
                v2 = v2.contiguous(memory_format=torch.channels_last)
        with (
            record_function("forward"),
            torch.autocast("cpu", dtype=fp.autocast_dtype or torch.float32, enabled=fp.autocast_dtype is not None),
        ):
            loss = model.training_step(v1, v2)
        opt.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            model.after_optimizer_step()

    return step, fp


def group_of(name: str) -> str:
    low = name.lower()
    for group, parts in GROUPS:
        if any(p in low for p in parts):
            return group
    return "other"


def profile_step(method: str, batch: int, steps: int, fast: bool) -> dict:
    model = build(method)
    fp = fast_path_for(torch.device("cpu"), fast)
    if fp.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    images = torch.as_tensor(np.random.default_rng(0).integers(0, 256, (batch, 32, 32, 3), dtype=np.uint8))
    augment = SSLAugment(image_size=32)
    opt = torch.optim.SGD(model.trainable_parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    step, fp = step_fn(model, augment, images, opt, fast)
    for _ in range(2):  # warm-up (oneDNN primitive creation)
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - t0) / steps
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    phases, groups, top = defaultdict(float), defaultdict(float), []
    for evt in prof.key_averages():
        if evt.key in ("augmentation", "forward", "backward", "optimizer"):
            phases[evt.key] += evt.cpu_time_total / 2 / 1e6
    total_self = 0.0
    for evt in prof.key_averages():
        if evt.key in phases or evt.self_cpu_time_total <= 0:
            continue
        self_s = evt.self_cpu_time_total / 2 / 1e6
        total_self += self_s
        groups[group_of(evt.key)] += self_s
        top.append((self_s, evt.key))
    top.sort(reverse=True)
    return {
        "method": method,
        "batch": batch,
        "fast_path": fast,
        "precision": fp.precision,
        "channels_last": fp.channels_last,
        "seconds_per_step": seconds,
        "flops_per_step": flops,
        "gflops_achieved": flops / seconds / 1e9,
        "phases_s": dict(phases),
        "groups_self_s": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "self_total_s": total_self,
        "top_ops": [{"op": k, "self_s": s} for s, k in top[:12]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=sorted(HEADS), default="simclr")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "fast_path_profile"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    limits = {
        str(dt).split(".")[-1]: {n: matmul_gflops(dt, n) for n in (1024, 2048, 4096)}
        for dt in (torch.float32, torch.bfloat16)
    }
    convs = conv_limits(2 * args.batch)  # both views go through the encoder as one batch
    runs = [profile_step(args.method, args.batch, args.steps, fast) for fast in (False, True)]
    command = (
        f"python benchmarks/profile_fast_path.py --method {args.method} --batch {args.batch} "
        f"--steps {args.steps} --threads {args.threads}"
    )
    record = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "native_bf16": cpu_has_fast_bf16(),
        "torch": torch.__version__,
        "threads": args.threads,
        "matmul_gflops": limits,
        "conv_gflops": convs,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    fp32, fast = runs
    best = {k: max(v.values()) for k, v in limits.items()}
    lines = [
        f"# Where a training step's time goes ({record['date']})",
        "",
        (
            f"Command: `{command}`. torch {torch.__version__}, {args.threads} threads, CPU with native bf16: "
            f"{record['native_bf16']}. {args.method} on a CIFAR ResNet-18 (width 1), batch {args.batch} x 2 views, "
            "SGD; random images (the step's cost does not depend on their content)."
        ),
        "",
        "## The machine's matrix-product limits",
        "",
        "| dtype | 1024 | 2048 | 4096 | (GFLOP/s, square torch.mm) |",
        "|---|---|---|---|---|",
    ]
    for dt, by_n in limits.items():
        lines.append(f"| {dt} | " + " | ".join(f"{by_n[n]:.0f}" for n in (1024, 2048, 4096)) + " | |")
    lines += [
        "",
        f"bf16 / fp32 best: {best['bfloat16'] / best['float32']:.2f}x.",
        "",
        "## The convolutions' limits",
        "",
        (
            f"One 3x3 convolution of each ResNet-18 shape at batch {convs['batch']} (both views), channels-last, "
            "GFLOP/s counted as the direct convolution (a fp32 rate above the fp32 matrix-product limit means "
            "the kernel does fewer operations than that count):"
        ),
        "",
        "| channels x side (layers) | fp32 fwd | bf16 fwd | fp32 fwd+bwd | bf16 fwd+bwd | bf16 / fp32 fwd+bwd |",
        "|---|---|---|---|---|---|",
    ]
    for r in convs["shapes"]:
        f32, b16 = r["float32"], r["bfloat16"]
        lines.append(
            f"| {r['channels']} x {r['side']} ({r['layers']}) | {f32['forward']:.0f} | {b16['forward']:.0f} | "
            f"{f32['forward+backward']:.0f} | {b16['forward+backward']:.0f} | "
            f"{b16['forward+backward'] / f32['forward+backward']:.2f}x |"
        )
    lines += [
        "",
        (
            f"The step's 3x3 convolutions alone (forward + backward, weighted by layers): fp32 "
            f"{convs['step_convs_s']['float32']:.3f} s, bf16 {convs['step_convs_s']['bfloat16']:.3f} s: "
            f"**{convs['step_convs_ratio']:.2f}x**, the ceiling of a fast path whose time is convolutions."
        ),
        "",
        "## The step",
        "",
        "| | precision | s / step | GFLOP / step | achieved GFLOP/s | share of the dtype's matmul limit |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        limit = best["bfloat16" if r["precision"] == "bf16" else "float32"]
        lines.append(
            f"| {'fast path' if r['fast_path'] else 'plain fp32'} | {r['precision']} | "
            f"{r['seconds_per_step']:.3f} | {r['flops_per_step'] / 1e9:.1f} | {r['gflops_achieved']:.0f} | "
            f"{100 * r['gflops_achieved'] / limit:.0f} % |"
        )
    lines += [
        "",
        f"Fast path speed-up: **{fp32['seconds_per_step'] / fast['seconds_per_step']:.2f}x**.",
        "",
        "Phases (profiler ranges, s per step; the profiler's own overhead inflates them a little):",
        "",
        "| phase | plain fp32 | fast path |",
        "|---|---|---|",
    ]
    for phase in ("augmentation", "forward", "backward", "optimizer"):
        lines.append(f"| {phase} | {fp32['phases_s'].get(phase, 0):.3f} | {fast['phases_s'].get(phase, 0):.3f} |")
    lines += [
        "",
        "Operator groups (self time, forward and backward together, s per step):",
        "",
        "| group | plain fp32 | fast path |",
        "|---|---|---|",
    ]
    for group in dict.fromkeys(list(fast["groups_self_s"]) + list(fp32["groups_self_s"])):
        lines.append(
            f"| {group} | {fp32['groups_self_s'].get(group, 0):.3f} | {fast['groups_self_s'].get(group, 0):.3f} |"
        )
    lines += ["", "Top operators of the fast path (self time, s per step):", "", "| operator | s |", "|---|---|"]
    lines += [f"| `{t['op']}` | {t['self_s']:.3f} |" for t in fast["top_ops"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
