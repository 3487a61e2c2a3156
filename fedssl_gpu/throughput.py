"""The GPU campaign's throughput stage: how fast local SSL training runs on this device, per method.

    python3 -m fedssl_gpu.throughput --device cuda --scale paper --out DIR [--compile] [--steps N]

For every method (SimCLR, MoCo v2, BYOL and SimSiam on a CIFAR ResNet-18, MoCo v3 on ViT-Tiny/4) the models, batch
sizes, optimisers and augmentation recipes are those of the paper configs (``configs/fedema/*.yaml``: full-width
ResNet-18, batch 128, SGD; ``configs/lwfedssl/fedmocov3.yaml``: the 12-block ViT-Tiny/4, batch 1024, AdamW); at
``--scale tiny`` the same configs shrink to ResNet-18 width 0.125 and a 2-block ViT of width 0.125 with 64-wide
heads, batch 16, so the stage runs in seconds on a CPU (its figures then only prove the code).

Each configuration (plain fp32; the fast path: bf16 autocast where native, else fp16 with a gradient scaler, and
channels-last; with ``--compile`` the fast path through ``torch.compile``, backend inductor) trains a fresh model of
the method with ``ssl_models.training.train_ssl``, the loop a client runs, one step per local epoch on one batch of
random images, so that its epoch hook marks every step: ``steps`` warm-up steps (compilation included), ``steps``
timed steps (the device synchronised at both ends), then ``PROFILED_STEPS`` step(s) under ``torch.profiler``.
Per configuration: images/s, the model FLOPs of a step (``training_step_flops``: both views' forward and backward,
2 FLOPs per multiply-add, counted on the CPU on a batch of ``FLOP_COUNT_BATCH`` images and scaled to the batch), the
achieved FLOP/s, the model FLOPs utilisation against the GPU's dense bf16 peak (``BF16_PEAK_FLOPS``; none on a
CPU) and against a large matrix product measured on the device, and the peak memory of the timed steps (CUDA:
``max_memory_allocated``; CPU: the process's peak RSS). Per method, the top operators of its fastest
configuration's profiled step (self device time on CUDA, self CPU time on a CPU).

Writes ``DIR/throughput.json`` (every figure, the device, the versions, the settings) and ``DIR/throughput.md``.
Imports torch, numpy and ``ssl_models`` only (the campaign runs it where Flower may be missing).
``estimate_flops(scale)`` and ``timed_steps(scale)`` give the campaign's time plan (``timeplan.py``) its work.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ssl_models.accounting import process_peak_rss_bytes, reset_peak_rss, training_step_flops
from ssl_models.config import ExperimentConfig
from ssl_models.factory import build_augment, build_ssl_model
from ssl_models.training import fast_path_for, resolve_device, train_ssl

REPO = Path(__file__).resolve().parents[1]
SCALES = ("paper", "tiny")
IMAGE_SIZE = 32
# The paper configuration of each method; the tiny scale shrinks the same files (TINY_OVERRIDES).
PAPER_CONFIGS: dict[str, str] = {
    "simclr": "configs/fedema/fedsimclr.yaml",
    "moco": "configs/fedema/fedmoco.yaml",
    "byol": "configs/fedema/fedbyol.yaml",
    "simsiam": "configs/fedema/fedsimsiam.yaml",
    "mocov3": "configs/lwfedssl/fedmocov3.yaml",
}
METHOD_LABELS = {"simclr": "SimCLR", "moco": "MoCo v2", "byol": "BYOL", "simsiam": "SimSiam", "mocov3": "MoCo v3"}
TINY_OVERRIDES: dict[str, Any] = {"model.width": 0.125, "train.batch_size": 16}
TINY_VIT_DEPTH = 2
TINY_HEAD_DIMS = {"proj_hidden_dim": 64, "pred_hidden_dim": 64, "proj_out_dim": 32}  # where the method has them
TIMED_STEPS = {"paper": 20, "tiny": 3}  # warm-up steps: as many again (what timeplan.throughput_estimate assumes)
PROFILED_STEPS = 1
FLOP_COUNT_BATCH = 8  # images per FLOP count (per-image FLOPs barely depend on the batch: only the losses' products)
CONFIGURATIONS = ("fp32", "fast", "compiled")
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, FLOP/s; first match of every substring of
# torch.cuda.get_device_name() wins (the H100 SXM reports itself as "NVIDIA H100 80GB HBM3").
BF16_PEAK_FLOPS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("H100", "PCIe"), "H100 PCIe", 756e12),
    (("H100", "HBM3"), "H100 SXM", 989.4e12),
    (("H100", "SXM"), "H100 SXM", 989.4e12),
    (("H200",), "H200", 989.4e12),
    (("A100",), "A100", 312e12),
)
MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}
MATMUL_MIN_SECONDS = 0.3


def timed_steps(scale: str) -> int:
    """Timed steps per configuration by default (and as many warm-up steps)."""
    _check_scale(scale)
    return TIMED_STEPS[scale]


def _check_scale(scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")


# ------------------------------------------------------------------------------------------------ what is measured
@dataclass(frozen=True)
class MethodSpec:
    name: str  # the method's registry name (ssl_models.methods)
    config_file: str  # the paper config it comes from, relative to the repository
    cfg: ExperimentConfig  # that config, shrunk at tiny scale

    @property
    def batch(self) -> int:
        return self.cfg.train.batch_size


def method_specs(scale: str) -> list[MethodSpec]:
    """The five methods at ``scale``, each from its paper config (see the module docstring)."""
    _check_scale(scale)
    specs = []
    for name, config_file in PAPER_CONFIGS.items():
        overrides: dict[str, Any] = {}
        if scale == "tiny":
            raw = ExperimentConfig.from_yaml(REPO / config_file)
            overrides = dict(TINY_OVERRIDES)
            overrides.update({f"method.options.{k}": v for k, v in TINY_HEAD_DIMS.items() if k in raw.method.options})
            if raw.model.arch == "vit_tiny":
                overrides["model.options.depth"] = TINY_VIT_DEPTH
        cfg = ExperimentConfig.from_yaml(REPO / config_file, overrides)
        if cfg.method.name != name:
            raise ValueError(f"{config_file} trains {cfg.method.name!r}, not {name!r}")
        specs.append(MethodSpec(name, config_file, cfg))
    return specs


def describe_model(method: torch.nn.Module, cfg: ExperimentConfig) -> str:
    """The encoder in words, read off the built model."""
    backbone = method.backbone
    if cfg.model.arch == "vit_tiny":
        return (
            f"ViT-Tiny/{backbone.patch_size} ({backbone.depth} blocks, dim {backbone.embed_dim}, "
            f"{backbone.num_heads} heads)"
        )
    return f"CIFAR {cfg.model.arch} (width {cfg.model.width:g})"


@functools.lru_cache(maxsize=len(SCALES))
def _flops_per_image(scale: str) -> dict[str, float]:
    """Model FLOPs of one training step per image (both views, forward and backward), counted on the CPU."""
    out = {}
    for spec in method_specs(scale):
        method = build_ssl_model(spec.cfg, seed=0)
        # count_cpu_attention: the CPU count of the ViT's attention equals the CUDA one (ssl_models/accounting/flops.py)
        counted = training_step_flops(
            method,
            (3, IMAGE_SIZE, IMAGE_SIZE),
            batch_size=min(spec.batch, FLOP_COUNT_BATCH),
            device="cpu",
            count_cpu_attention=True,
        )
        out[spec.name] = float(counted["total"])
    return out


def estimate_flops(scale: str) -> dict[str, float]:
    """Model FLOPs of one training step (the whole batch) per method at ``scale``: the time plan's work per step."""
    batches = {spec.name: spec.batch for spec in method_specs(scale)}
    return {name: per_image * batches[name] for name, per_image in _flops_per_image(scale).items()}


# ------------------------------------------------------------------------------------------------ the device
def dense_bf16_peak(device_name: str) -> tuple[str, float] | None:
    """(the data sheet's name, its dense bf16 FLOP/s) of a GPU named ``device_name``; None when not tabulated."""
    for parts, label, flops in BF16_PEAK_FLOPS:
        if all(part in device_name for part in parts):
            return label, flops
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model_name() -> str:
    """The processor's model name from ``/proc/cpuinfo`` where there is one, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            capability=".".join(str(v) for v in torch.cuda.get_device_capability(device)),
            memory_bytes=int(props.total_memory),
            cudnn=torch.backends.cudnn.version(),
        )
        peak = dense_bf16_peak(info["name"])
        info["bf16_peak"] = {"gpu": peak[0], "flops_per_s": peak[1]} if peak else None
    else:
        info.update(
            name=cpu_model_name(),
            threads=torch.get_num_threads(),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            bf16_peak=None,
        )
    return info


def _seconds_of(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, min_seconds: float = MATMUL_MIN_SECONDS) -> dict:
    """Achieved FLOP/s of a square ``n x n`` matrix product in ``dtype`` on ``device`` (2 n^3 FLOPs each), timed over
    enough repeats to last about ``min_seconds`` after a warm-up."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    product = functools.partial(torch.mm, a, b)
    one = _seconds_of(product, 3, device) / 3  # also the warm-up (kernel selection, clocks)
    repeats = max(3, min(2000, math.ceil(min_seconds / max(one, 1e-9))))
    seconds = _seconds_of(product, repeats, device)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "n": n,
        "repeats": repeats,
        "seconds": seconds,
        "flops_per_s": 2.0 * n**3 * repeats / seconds,
    }


# ------------------------------------------------------------------------------------------------ one configuration
class StepPhases:
    """``train_ssl``'s epoch hook: with one step per epoch it runs before every step, so it marks the phases (warm-up,
    timed, profiled), synchronising the device at the boundaries, resetting the peak memory where the timed steps
    start and reading it where they end, then starting the profiler."""

    def __init__(self, device: torch.device, warmup: int, timed: int, profiler: torch.profiler.profile | None):
        self.device, self.warmup, self.timed, self.profiler = device, warmup, timed, profiler
        self.started = time.perf_counter()
        self.warmup_s: float | None = None
        self.timed_started: float | None = None
        self.timed_s: float | None = None
        self.peak_bytes: int | None = None
        self.peak_reset = False
        self.profiling = False

    def __call__(self, method: torch.nn.Module, epoch: int) -> None:
        if epoch == self.warmup:
            synchronize(self.device)
            now = time.perf_counter()
            self.warmup_s = now - self.started
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                self.peak_reset = True
            else:
                self.peak_reset = reset_peak_rss()
            self.timed_started = time.perf_counter()
        if epoch == self.warmup + self.timed:
            self.end_timing()
            if self.profiler is not None:
                self.profiler.start()
                self.profiling = True

    def end_timing(self) -> None:
        if self.timed_s is not None or self.timed_started is None:
            return
        synchronize(self.device)
        self.timed_s = time.perf_counter() - self.timed_started
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak_bytes = process_peak_rss_bytes()


def top_operators(profiler: torch.profiler.profile, device: torch.device, steps: int, count: int = 15) -> dict:
    """The operators with the most self time per step: device time of the kernels each launched on CUDA, CPU time on
    a CPU. Shares are of the sum over all operators (on CUDA: of the operators' self device time, kernels counted once,
    under the operator that launched them)."""
    from torch.autograd import DeviceType

    events = list(profiler.key_averages())

    def device_us(event) -> float:
        value = getattr(event, "self_device_time_total", None)
        return float(event.self_cuda_time_total if value is None else value)

    if device.type == "cuda":
        # Operators (CPU-side events), whose self device time is that of the kernels they launched; the kernels
        # themselves are events too, skipped so that no time counts twice. Should the profiler link no kernel to
        # an operator, the kernels are the table.
        rows = [(device_us(e), e.key, int(e.count)) for e in events if e.device_type == DeviceType.CPU]
        if not any(us > 0 for us, _, _ in rows):
            rows = [(device_us(e), e.key, int(e.count)) for e in events if e.device_type != DeviceType.CPU]
    else:
        rows = [(float(e.self_cpu_time_total), e.key, int(e.count)) for e in events]
    rows = [row for row in rows if row[0] > 0]
    total_us = sum(r[0] for r in rows)
    rows.sort(reverse=True)
    return {
        "time": "self device time" if device.type == "cuda" else "self CPU time",
        "steps": steps,
        "total_ms_per_step": total_us / 1e3 / steps,
        "operators": [
            {
                "operator": key,
                "ms_per_step": us / 1e3 / steps,
                "share_pct": 100.0 * us / total_us,
                "calls_per_step": calls / steps,
            }
            for us, key, calls in rows[:count]
        ],
    }


def measure(
    spec: MethodSpec,
    configuration: str,
    device: torch.device,
    steps: int,
    flops_per_step: float,
    matmul_flops_per_s: float,
    peak_flops_per_s: float | None,
) -> dict[str, Any]:
    """One configuration of one method: a fresh model trained ``steps`` warm-up + ``steps`` timed + profiled steps."""
    fast = configuration != "fp32"
    compile_backend = "inductor" if configuration == "compiled" else None
    fp = fast_path_for(device, fast)
    run: dict[str, Any] = {
        "configuration": configuration,
        "fast_path": fast,
        "compile_backend": compile_backend,
        "precision": fp.precision,
        "channels_last": fp.channels_last,
        "grad_scaler": fp.grad_scaler,
        "warmup_steps": steps,
        "timed_steps": steps,
        "profiled_steps": PROFILED_STEPS,
    }
    cfg, t = spec.cfg, spec.cfg.train
    images = np.random.default_rng(0).integers(0, 256, (spec.batch, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    messages: list[str] = []
    gc.collect()  # what an earlier configuration left (a failed one's tensors) must not count in this one's peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
    method = build_ssl_model(cfg, seed=0)
    phases = StepPhases(device, steps, steps, profiler)
    try:
        stats = train_ssl(
            method,
            images,
            epochs=2 * steps + PROFILED_STEPS,
            batch_size=spec.batch,
            lr=t.lr,
            optimizer=t.optimizer,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            device=device,
            fast_path=fast,
            drop_last=True,
            max_steps_per_epoch=1,
            seed=0,
            augment=build_augment(cfg, IMAGE_SIZE),
            epoch_hook=phases,
            log=lambda line: messages.append(line) if "compile" in line else None,
            compile_backend=compile_backend,
        )
        phases.end_timing()
    except Exception as error:  # noqa: BLE001 - one failed configuration (out of memory, a compiler error) is recorded
        run["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
        return run
    finally:
        if phases.profiling:
            profiler.stop()
        del method
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run.update(
        steps_run=stats.steps,
        loss=stats.loss,
        warmup_s=phases.warmup_s,
        timed_s=phases.timed_s,
        compiled=stats.compiled,
        compile_fallback=stats.compile_fallback,
        messages=messages,
    )
    if compile_backend and not stats.compiled:
        run["error"] = f"torch.compile ({compile_backend}) failed, the step ran eagerly: {stats.compile_fallback}"
        return run
    if not math.isfinite(stats.loss):
        run["error"] = f"the loss became {stats.loss}"
        return run
    seconds = phases.timed_s
    run["images_per_s"] = steps * spec.batch / seconds
    run["step_ms"] = 1e3 * seconds / steps
    run["flops_per_s"] = flops_per_step * steps / seconds
    run["mfu_pct"] = 100.0 * run["flops_per_s"] / peak_flops_per_s if peak_flops_per_s else None
    run["matmul_util_pct"] = 100.0 * run["flops_per_s"] / matmul_flops_per_s
    memory_key = "cuda_peak_bytes" if device.type == "cuda" else "peak_rss_bytes"
    run[memory_key] = phases.peak_bytes
    run["peak_reset"] = phases.peak_reset  # False: the process's lifetime peak (RSS where it cannot be reset)
    if phases.profiling:
        run["profile"] = top_operators(profiler, device, PROFILED_STEPS)
    return run


# ------------------------------------------------------------------------------------------------ the stage
def run_throughput(
    out_dir: Path,
    *,
    device: str,
    scale: str,
    compile: bool | Sequence[str],
    steps: int | None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every method at ``scale`` on ``device`` (see the module docstring); write ``out_dir/throughput.json``
    and ``throughput.md``; return the record (``ok``: every fp32 and fast-path configuration was measured; a failed
    compilation is recorded with its reason and does not count against it). ``compile``: True compiles every
    method's step too, a list of method names only those (a compilation costs about a minute each on a GPU)."""
    _check_scale(scale)
    steps = timed_steps(scale) if steps is None else int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = resolve_device(device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    info = device_info(dev)
    configurations = [c for c in CONFIGURATIONS if compile or c != "compiled"]
    command = (
        f"python3 -m fedssl_gpu.throughput --device {device} --scale {scale} --out {out_dir}"
        + (" --compile" if compile else "")
        + f" --steps {steps}"
    )
    log(
        f"throughput: {scale} scale on {info['name']} ({dev}), {steps} warm-up + {steps} timed steps per "
        f"configuration: {', '.join(configurations)}"
    )
    fast_dtype = fast_path_for(dev, True).autocast_dtype
    # The GPU's ceiling is a bf16 product (tensor cores); a CPU's is its fast path's own dtype.
    matmul_dtype = torch.bfloat16 if dev.type == "cuda" else (fast_dtype or torch.float32)
    matmul = matmul_rate(dev, matmul_dtype, MATMUL_SIZE[dev.type])
    log(f"throughput: {matmul['dtype']} matmul {matmul['n']}^2: {matmul['flops_per_s'] / 1e12:.2f} TFLOP/s")
    peak = (info.get("bf16_peak") or {}).get("flops_per_s")
    per_image = _flops_per_image(scale)
    record: dict[str, Any] = {
        "stage": "throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": info,
        "settings": {
            "command": command,
            "device": device,
            "scale": scale,
            "compile": compile,
            "steps": steps,
            "warmup_steps": steps,
            "profiled_steps": PROFILED_STEPS,
            "configurations": configurations,
            "flop_count_batch": FLOP_COUNT_BATCH,
            "image_size": IMAGE_SIZE,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
        "matmul": matmul,
        "methods": {},
    }
    ok = True
    for spec in method_specs(scale):
        probe = build_ssl_model(spec.cfg, seed=0)
        entry: dict[str, Any] = {
            "label": METHOD_LABELS[spec.name],
            "config": spec.config_file,
            "model": describe_model(probe, spec.cfg),
            "arch": spec.cfg.model.arch,
            "width": spec.cfg.model.width,
            "batch": spec.batch,
            "optimizer": spec.cfg.train.optimizer,
            "parameters": sum(p.numel() for p in probe.parameters()),
            "trainable_parameters": sum(p.numel() for p in probe.trainable_parameters()),
            "flops_per_image": per_image[spec.name],
            "flops_per_step": per_image[spec.name] * spec.batch,
            "runs": {},
        }
        del probe
        for configuration in configurations:
            if configuration == "compiled" and not isinstance(compile, bool) and spec.name not in compile:
                continue
            run = measure(spec, configuration, dev, steps, entry["flops_per_step"], matmul["flops_per_s"], peak)
            entry["runs"][configuration] = run
            if configuration == "compiled":
                torch.compiler.reset()  # drop the compiled graphs (and the model they hold) before the next method
            if "error" in run:
                ok = ok and configuration == "compiled"
                log(f"throughput: {spec.name} {configuration}: FAILED: {run['error']}")
            else:
                log(
                    f"throughput: {spec.name} {configuration} ({run['precision']}): {run['images_per_s']:.0f} img/s, "
                    f"{run['flops_per_s'] / 1e12:.3f} TFLOP/s"
                )
        measured = {c: r for c, r in entry["runs"].items() if "images_per_s" in r}
        fp32_rate = measured.get("fp32", {}).get("images_per_s")
        for configuration, run in measured.items():
            run["over_fp32"] = run["images_per_s"] / fp32_rate if fp32_rate else None
        entry["fast_over_fp32"] = measured["fast"]["over_fp32"] if "fast" in measured else None
        entry["compiled_over_fp32"] = measured["compiled"]["over_fp32"] if "compiled" in measured else None
        if measured:
            fastest = max(measured, key=lambda c: measured[c]["images_per_s"])
            entry["fastest"] = fastest
            entry["profile"] = {"configuration": fastest, **measured[fastest].get("profile", {})}
        record["methods"][spec.name] = entry
    record["ok"] = ok
    record["seconds"] = time.perf_counter() - started
    (out_dir / "throughput.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out_dir / "throughput.md").write_text(throughput_markdown(record))
    log(f"throughput: wrote {out_dir / 'throughput.md'} ({record['seconds']:.0f} s)")
    return record


# ------------------------------------------------------------------------------------------------ the report
def _num(value: float | None, fmt: str = ".0f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"


def throughput_markdown(record: dict[str, Any]) -> str:
    info, s, mm = record["device"], record["settings"], record["matmul"]
    cuda = info["type"] == "cuda"
    memory_key, memory_name = ("cuda_peak_bytes", "peak CUDA memory") if cuda else ("peak_rss_bytes", "peak RSS")
    peak = info.get("bf16_peak")
    lines = [
        f"# Throughput of local SSL training: {info['name']}, {record['date']}, {s['scale']} scale",
        "",
        f"Command: `{s['command']}`. torch {info['torch']}"
        + (
            f", CUDA {info.get('cuda')}, cuDNN {info.get('cudnn')}, capability {info.get('capability')}"
            if cuda
            else f", {info.get('threads')} threads ({info.get('cpu_capability')})"
        )
        + f". {s['warmup_steps']} warm-up, {s['steps']} timed and {s['profiled_steps']} profiled step(s) "
        "per configuration, each step one batch of random 32x32 images through the client's loop "
        "(`train_ssl`: augmentation on the device, both views, loss, backward, optimizer).",
        "",
        f"Measured {mm['dtype']} matrix product ({mm['n']}x{mm['n']}): **{mm['flops_per_s'] / 1e12:.2f} "
        f"TFLOP/s**"
        + (
            f"; {peak['gpu']} dense bf16 peak (data sheet): {peak['flops_per_s'] / 1e12:.1f} TFLOP/s "
            f"(the matmul reaches {100 * mm['flops_per_s'] / peak['flops_per_s']:.0f} % of it)."
            if peak
            else "; no tabulated bf16 peak for this device, so no MFU against one."
        ),
    ]
    if cuda:
        lines += [
            "",
            (
                f"fp32 settings as the project trains: cuDNN TF32 {s['cudnn_allow_tf32']}, matmul TF32 "
                f"{s['matmul_allow_tf32']}, cudnn.benchmark {s['cudnn_benchmark']}."
            ),
        ]
    lines += [
        "",
        "## Summary",
        "",
        (
            "| method | model | batch | fp32 img/s | fast img/s | fast / fp32 | compiled img/s | fastest: TFLOP/s | "
            f"MFU % | % of matmul | {memory_name} |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in record["methods"].values():
        runs = entry["runs"]
        best = runs.get(entry.get("fastest", ""), {})
        compiled = runs.get("compiled")
        compiled_cell = (
            "-" if compiled is None else "failed" if "error" in compiled else _num(compiled.get("images_per_s"))
        )
        lines.append(
            f"| {entry['label']} | {entry['model']} | {entry['batch']} | {_num(runs['fp32'].get('images_per_s'))} | "
            f"{_num(runs['fast'].get('images_per_s'))} | {_num(entry.get('fast_over_fp32'), '.2f')} | "
            f"{compiled_cell} | "
            f"{_num(best.get('flops_per_s'), '.3f', 1e12)} ({entry.get('fastest', '-')}) | "
            f"{_num(best.get('mfu_pct'), '.1f')} | {_num(best.get('matmul_util_pct'), '.1f')} | "
            f"{_mib(best.get(memory_key))} |"
        )
    lines += [
        "",
        (
            "MFU: model FLOPs (both views' forward and backward, counted with `torch.utils.flop_counter`, "
            "2 per multiply-add; not the augmentation or the optimizer) per second over the dense bf16 peak; "
            "% of matmul: over the measured matrix product above."
        ),
    ]
    for entry in record["methods"].values():
        lines += [
            "",
            f"## {entry['label']}: {entry['model']}, batch {entry['batch']}, {entry['optimizer']}",
            "",
            (
                f"From `{entry['config']}`; {entry['parameters']:,} parameters ({entry['trainable_parameters']:,} "
                f"trained by the optimizer); {entry['flops_per_image'] / 1e9:.3f} GFLOP per image, "
                f"{entry['flops_per_step'] / 1e12:.4f} TFLOP per step."
            ),
            "",
            (
                f"| configuration | precision | img/s | x fp32 | ms / step | TFLOP/s | MFU % | % of matmul | "
                f"{memory_name} | warm-up s |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, run in entry["runs"].items():
            shown = {"fp32": "plain fp32", "fast": "fast path", "compiled": "fast path + torch.compile"}[name]
            if "error" in run:
                reason = run["error"].replace("|", "/")  # a table cell
                lines.append(f"| {shown} | {run['precision']} | failed: {reason} | | | | | | | |")
                continue
            lines.append(
                f"| {shown} | {run['precision']}{' + channels-last' if run['channels_last'] else ''} | "
                f"{run['images_per_s']:.0f} | {_num(run.get('over_fp32'), '.2f')} | {run['step_ms']:.1f} | "
                f"{run['flops_per_s'] / 1e12:.3f} | {_num(run['mfu_pct'], '.1f')} | {run['matmul_util_pct']:.1f} | "
                f"{_mib(run.get(memory_key))} | {run['warmup_s']:.1f} |"
            )
        profile = entry.get("profile") or {}
        if profile.get("operators"):
            lines += [
                "",
                (
                    f"Top operators of the fastest configuration ({profile['configuration']}), {profile['time']} "
                    f"of {profile['steps']} profiled step(s): {profile['total_ms_per_step']:.2f} ms per step in all."
                ),
                "",
                "| operator | ms / step | share % | calls / step |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| `{op['operator']}` | {op['ms_per_step']:.3f} | {op['share_pct']:.1f} | {op['calls_per_step']:g} |"
                for op in profile["operators"]
            ]
    lines += ["", f"Stage time: {record['seconds']:.0f} s. Every figure: `throughput.json`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--scale", choices=SCALES, default="paper")
    ap.add_argument("--out", required=True, help="folder for throughput.json and throughput.md")
    ap.add_argument("--compile", action="store_true", help="also the fast path through torch.compile (inductor)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per configuration, as many warm-up steps (default: {TIMED_STEPS})",
    )
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("throughput: --device cuda but CUDA is not available on this machine")
        return 2
    record = run_throughput(
        Path(args.out), device=args.device, scale=args.scale, compile=args.compile, steps=args.steps
    )
    print((Path(args.out) / "throughput.md").read_text())
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
