"""Local SSL training: one plain PyTorch loop used by clients, the server and the benchmarks.

The fast path (on by default, off with ``fast_path=False``):
- CUDA: autocast to bfloat16 where the GPU supports it, else float16 with a gradient scaler;
- CPU: bfloat16 autocast when the processor has native bf16 matrix units (AMX or AVX512-BF16);
  elsewhere bf16 on CPU is slower than fp32, so the loop stays in fp32;
- channels-last memory format for the model and the batches (faster convolutions on both).
Losses are computed in float32 by the methods themselves, so only the big matrix work runs in reduced
precision.

``compile_backend`` (off by default; ``train.compile: true`` selects "inductor") runs the method's forward and
loss through ``torch.compile`` (its backward through AOTAutograd). Compilation costs minutes on a small CPU
and is redone for every new model object, so it pays only for long local training; where it fails (no C++
compiler, an unsupported operator) the loop says why once and goes on eagerly from the same step.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from ssl_models.data.augment import SSLAugment
from ssl_models.data.rows import ImageRows, read_rows
from ssl_models.optimizers import LocalOptimizer, build_local_optimizer

if TYPE_CHECKING:
    from ssl_models.methods.base import SSLMethod


@dataclass
class TrainStats:
    loss: float  # mean loss over all local steps
    num_examples: int  # images of the partition (what FedAvg weights by)
    steps: int
    seconds: float
    images_per_s: float  # images (not views) processed per second
    precision: str  # "fp32", "bf16" or "fp16"
    compiled: bool = False  # the training step ran through torch.compile
    compile_fallback: str | None = None  # why a requested compilation was given up (then it ran eagerly)
    resources: dict[str, float] = field(default_factory=dict)  # what the caller measured (FLOPs, memory, RSS)


@dataclass(frozen=True)
class FastPath:
    autocast_dtype: torch.dtype | None
    channels_last: bool
    grad_scaler: bool

    @property
    def precision(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.autocast_dtype]


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is an error, not a silent CPU run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """True when the CPU advertises native bf16 matrix instructions (AMX-BF16 or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def fast_path_for(device: torch.device, enabled: bool) -> FastPath:
    if not enabled:
        return FastPath(None, False, False)
    if device.type == "cuda":
        # including_emulation=False: torch's default also says True on pre-Ampere GPUs (V100, T4), which only
        # emulate bf16 (slow); those get fp16 with a gradient scaler
        # asked of the GPU the loop trains on (cuda:1 on a machine with mixed GPUs), not of the current one
        with torch.cuda.device(device):
            native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if native_bf16:
            return FastPath(torch.bfloat16, True, False)
        return FastPath(torch.float16, True, True)
    if device.type == "cpu" and cpu_has_fast_bf16():
        return FastPath(torch.bfloat16, True, False)
    return FastPath(None, True, False)


def make_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    lean: bool = True,
) -> LocalOptimizer | torch.optim.Optimizer:
    """``sgd``, ``adam`` or ``adamw``: the project's own (``ssl_models.optimizers``: the same arithmetic, without
    torch.optim's import of torch._dynamo in every new ClientApp process) unless ``lean`` is False (a GradScaler's
    step needs a torch.optim optimiser)."""
    params = list(params)
    if lean:
        return build_local_optimizer(params, name, lr, momentum, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer: unknown name {name!r} (valid: sgd, adam, adamw)")


def optimizer_step(
    loss: torch.Tensor,
    optimizer: LocalOptimizer | torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    what: str,
) -> float:
    """Backward and one optimizer step (through the gradient scaler when fp16 needs one); returns the loss
    value. A loss that is not finite stops training with ``what`` named *before* the step, so the weights (and
    the optimizer's state) stay those of the last good step."""
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"{what} became {value}")
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # type: ignore[arg-type]  # with a scaler, make_optimizer(lean=False): torch.optim
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return value


class CompiledStep:
    """``method.training_step`` through ``torch.compile(backend=...)``, falling back to the eager step for good
    the first time the compiled one raises (compilation happens on the first call, before any weight moves)."""

    def __init__(self, method: SSLMethod, backend: str | None, log: Callable[[str], None] | None = None):
        self.eager = method.training_step
        self.backend = backend
        self.fallback: str | None = None
        self.log = log
        self.compiled = None
        if backend is not None:
            try:
                self.compiled = torch.compile(method.training_step, backend=backend)
            except Exception as error:  # noqa: BLE001 - any failure means: train eagerly, and say so
                self.give_up(error)

    @property
    def active(self) -> bool:
        return self.compiled is not None

    def give_up(self, error: BaseException) -> None:
        self.compiled = None
        self.fallback = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        if self.log is not None:
            self.log(f"torch.compile (backend {self.backend}) failed, training eagerly: {self.fallback}")

    def __call__(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            try:
                return self.compiled(view1, view2)
            except Exception as error:  # noqa: BLE001
                self.give_up(error)
        return self.eager(view1, view2)


def train_ssl(
    method: SSLMethod,
    images: np.ndarray | torch.Tensor | ImageRows,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    device: torch.device | str = "cpu",
    fast_path: bool = True,
    drop_last: bool = True,
    max_steps_per_epoch: int = 0,
    seed: int = 0,
    augment: SSLAugment | None = None,
    loss_hook: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    epoch_hook: Callable[[torch.nn.Module, int], None] | None = None,
    log: Callable[[str], None] | None = None,
    compile_backend: str | None = None,
) -> TrainStats:
    """Train ``method`` (an ``SSLMethod``) on ``images`` (NHWC uint8) for ``epochs`` local epochs.

    ``loss_hook(method)`` returns an extra loss term added to every step (FedProx, alignment terms);
    ``epoch_hook(method, epoch)`` runs at the start of every local epoch (Hetero-SSFL recomputes its RAD
    representations there).
    Images held in memory are moved to the device once, images on disk (a memory map, ``ImageRows``) a batch at a
    time; every batch is augmented there into two views.
    ``compile_backend`` (e.g. "inductor"): the step through ``torch.compile``, eager where that fails.
    """
    device = torch.device(device) if isinstance(device, str) else device
    fp = fast_path_for(device, fast_path)
    # Images memory-mapped from the decoded cache on disk (a folder's, a node's own data, a large partition of one)
    # are read a batch at a time, so that the process's memory does not grow with their number; the others are moved
    # to the device once.
    on_disk = images if isinstance(images, (np.memmap, ImageRows)) else None
    shape, dtype = tuple(images.shape), images.dtype
    if len(shape) != 4 or shape[-1] != 3 or dtype not in (np.uint8, torch.uint8):
        raise ValueError(f"images: expected NHWC uint8 with 3 channels, got {shape} {dtype}")
    n = int(shape[0])
    if n < 2:
        raise ValueError(f"images: need at least 2 images to train, got {n}")
    x = torch.as_tensor(images).to(device) if on_disk is None else None

    def rows(picked: torch.Tensor) -> torch.Tensor:
        if on_disk is None:
            return cast(torch.Tensor, x)[picked]
        # read in file order, in the permutation's order: the same batch as the images held in memory give
        return torch.from_numpy(read_rows(on_disk, picked.cpu().numpy())).to(device, non_blocking=True)

    # A partition smaller than one batch still trains (one step per epoch on everything it has).
    bs = min(batch_size, n)
    steps_per_epoch = n // bs if drop_last else math.ceil(n / bs)
    if max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, max_steps_per_epoch)

    augment = (augment or SSLAugment(image_size=int(shape[1]))).to(device)
    method.to(device)
    if fp.channels_last:
        method.to(memory_format=torch.channels_last)
    method.train()
    opt = make_optimizer(method.trainable_parameters(), optimizer, lr, momentum, weight_decay, lean=not fp.grad_scaler)
    scaler = torch.amp.GradScaler("cuda") if fp.grad_scaler else None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    perm_gen = torch.Generator().manual_seed(seed)

    step_fn = CompiledStep(method, compile_backend, log)
    total_loss, steps = 0.0, 0
    start = time.perf_counter()
    for epoch in range(epochs):
        if epoch_hook is not None:
            epoch_hook(method, epoch)
        perm = torch.randperm(n, generator=perm_gen).to(device)
        for step in range(steps_per_epoch):
            batch = rows(perm[step * bs : (step + 1) * bs])
            if batch.shape[0] < 2:  # a last partial batch of one image cannot form pairs
                continue
            v1, v2 = augment.two_views(batch, generator=gen)
            if fp.channels_last:
                v1 = v1.contiguous(memory_format=torch.channels_last)
                v2 = v2.contiguous(memory_format=torch.channels_last)
            what = f"local SSL loss at epoch {epoch + 1} step {step + 1}"

            def forward_backward_step(v1: torch.Tensor = v1, v2: torch.Tensor = v2, what: str = what) -> float:
                with torch.autocast(
                    device.type, dtype=fp.autocast_dtype or torch.float32, enabled=fp.autocast_dtype is not None
                ):
                    loss = step_fn(v1, v2)
                    if loss_hook is not None:
                        loss = loss + loss_hook(method)
                return optimizer_step(loss, opt, scaler, what)

            if step_fn.active and steps == 0:
                # The compiled backward may be built only when the first backward runs: a failure there also
                # falls back (no optimizer step has happened yet), and the step is redone eagerly on the buffers
                # (BN statistics, queues) as they were before the failed try.
                buffers = {name: b.detach().clone() for name, b in method.named_buffers()}
                try:
                    value = forward_backward_step()
                except FloatingPointError:
                    raise
                except Exception as error:
                    if not step_fn.active:
                        raise
                    step_fn.give_up(error)
                    opt.zero_grad(set_to_none=True)
                    with torch.no_grad():
                        for name, b in method.named_buffers():
                            b.copy_(buffers[name])
                    value = forward_backward_step()
            else:
                value = forward_backward_step()
            if hasattr(method, "set_progress"):  # momentum schedules (MoCo v3) follow the local progress
                method.set_progress(  # type: ignore[operator]  # hasattr-checked
                    (epoch * steps_per_epoch + step + 1) / (epochs * steps_per_epoch)
                )
            method.after_optimizer_step()
            total_loss += value
            steps += 1
        if log is not None:
            log(f"epoch {epoch + 1}/{epochs}: mean loss so far {total_loss / max(1, steps):.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    images_seen = steps * bs
    return TrainStats(
        loss=total_loss / max(1, steps),
        num_examples=n,
        steps=steps,
        seconds=seconds,
        images_per_s=images_seen / seconds if seconds > 0 else 0.0,
        precision=fp.precision,
        compiled=step_fn.active,
        compile_fallback=step_fn.fallback,
    )
