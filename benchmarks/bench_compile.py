"""Does ``train.compile`` (torch.compile of the training step) pay on this machine? Eager against compiled, same step.

One SSL training step (SimCLR or BYOL on a CIFAR ResNet-18, batch B x 2 views, the project's fast path: bf16
autocast where the CPU has native bf16 units, channels-last) run the way ``ssl_models.training`` runs it, once
eagerly and once through its ``CompiledStep`` (``torch.compile``, inductor): the first step (for the compiled one,
compilation included), the median of the warm steps after it, and the number of warm steps after which compiling has
paid for itself. Writes ``benchmarks/results/compile_step.{md,json}``.

Usage: python benchmarks/bench_compile.py [--method simclr] [--batch 64] [--steps 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# A compilation is measured cold: inductor keeps compiled kernels in a cache that outlives the process (a second run
# of this script compiled in 9 s instead of 55 s), so unless --warm-cache is given it gets an empty cache of its own.
if "--warm-cache" not in sys.argv:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-compile-inductor-")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ssl_models.data.augment import SSLAugment
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone
from ssl_models.training import CompiledStep, cpu_has_fast_bf16, fast_path_for

RESULTS = REPO / "benchmarks" / "results"
HEADS = {
    "simclr": {"proj_hidden_dim": 512, "proj_out_dim": 128},
    "byol": {"proj_hidden_dim": 4096, "proj_out_dim": 256, "pred_hidden_dim": 4096},
}


def time_steps(method_name: str, batch: int, steps: int, backend: str | None) -> dict:
    """Seconds of each of ``steps`` training steps (augmentation, forward + loss, backward, optimizer)."""
    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", 1.0)
    model = build_method(method_name, backbone, dim, **HEADS[method_name])
    fp = fast_path_for(torch.device("cpu"), True)
    if fp.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    augment = SSLAugment()
    images = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    messages: list[str] = []
    step_fn = CompiledStep(model, backend, messages.append)
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        v1, v2 = augment.two_views(images, generator=gen)
        if fp.channels_last:
            v1 = v1.contiguous(memory_format=torch.channels_last)
            v2 = v2.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=fp.autocast_dtype or torch.float32, enabled=fp.autocast_dtype is not None):
            loss = step_fn(v1, v2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.after_optimizer_step()
        seconds.append(time.perf_counter() - t0)
    return {
        "seconds": seconds,
        "first_s": seconds[0],
        "warm_median_s": statistics.median(seconds[1:]),
        "compiled": step_fn.active,
        "fallback": step_fn.fallback,
        "log": messages,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=sorted(HEADS), default="simclr")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="steps per mode, the first one included")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--warm-cache",
        action="store_true",
        help="keep inductor's usual on-disk cache (default: an empty one, so compilation is measured cold)",
    )
    ap.add_argument("--out", default=str(RESULTS / "compile_step"))
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (one first step and at least two warm ones)")
    torch.set_num_threads(args.threads)
    eager = time_steps(args.method, args.batch, args.steps, None)
    compiled = time_steps(args.method, args.batch, args.steps, "inductor")
    saved = eager["warm_median_s"] - compiled["warm_median_s"]
    extra = compiled["first_s"] - eager["first_s"]
    result = {
        "command": f"python benchmarks/bench_compile.py --method {args.method} --batch {args.batch} "
        f"--steps {args.steps} --threads {args.threads}" + (" --warm-cache" if args.warm_cache else ""),
        "inductor_cache": "warm (the usual on-disk cache)" if args.warm_cache else "cold (an empty cache)",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "native_bf16": cpu_has_fast_bf16(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the widest vector ISA torch uses here
        "step": f"{args.method}, CIFAR ResNet-18 width 1.0, batch {args.batch} x 2 views, fast path, SGD",
        "eager": eager,
        "compiled": compiled,
        "warm_speedup": eager["warm_median_s"] / compiled["warm_median_s"],
        # Warm steps after which compilation's extra first-step time is paid back (None: never).
        "break_even_steps": (extra / saved) if saved > 0 and compiled["compiled"] else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    be = result["break_even_steps"]
    lines = [
        f"# torch.compile of the training step ({result['date']})",
        "",
        (
            f"Command: `{result['command']}`. Machine: {result['machine']} ({result['cpu_capability']}), {args.threads} "
            f"torch threads, native bf16: {result['native_bf16']}, torch {result['torch']}. Step: {result['step']}. "
            f"Inductor's kernel cache: {result['inductor_cache']}."
        ),
        "",
        "| mode | first step s | warm step s (median) | compiled |",
        "|---|---|---|---|",
        f"| eager | {eager['first_s']:.2f} | {eager['warm_median_s']:.3f} | - |",
        (
            f"| torch.compile (inductor) | {compiled['first_s']:.2f} | {compiled['warm_median_s']:.3f} | "
            f"{'yes' if compiled['compiled'] else 'no: ' + str(compiled['fallback'])} |"
        ),
        "",
        f"Warm speed-up: **{result['warm_speedup']:.2f}x**; compilation pays for itself after "
        + (f"**{be:.0f} warm steps**." if be is not None else "**never** (no warm step is faster)."),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
