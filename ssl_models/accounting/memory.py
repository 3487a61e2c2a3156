"""Training memory: an analytic, hardware-independent count and the process's observed RSS peak.

Analytic training memory (docs/methods/lwfedssl.md, Resource accounting) = parameters + gradients + optimiser state + saved activations:

- parameters: every parameter of the module (online, heads, frozen blocks and target branch), and buffers
  (BN statistics, a MoCo queue) reported separately;
- gradients: one per trainable parameter (``method.trainable_parameters()`` when the module has it, otherwise
  the parameters with ``requires_grad``), in the parameter's dtype;
- optimiser state: SGD with momentum keeps one buffer per trainable parameter (none without momentum),
  Adam/AdamW two (exp_avg, exp_avg_sq); Adam's per-parameter scalar step counters are ignored;
- saved activations: the tensors autograd keeps for backward during one training step, captured with
  ``torch.autograd.graph.saved_tensors_hooks`` and deduplicated by storage (a tensor saved by several ops, or
  several views of one storage, count once, with the whole storage they keep alive). Storages of parameters and
  buffers are excluded (already counted); an input batch saved by the first layer counts. Layers that run under
  ``no_grad`` (frozen ViT blocks, the momentum encoder) save nothing, so frozen-layer savings show up.

Observed peak: :func:`process_peak_rss_bytes` reads ``VmHWM`` from ``/proc/self/status``; reset it first with
:func:`reset_peak_rss` (writes ``5`` to ``/proc/self/clear_refs``) and measure one configuration per fresh
subprocess. The figure includes the interpreter and ``import torch`` (about 0.8 GB).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

OPTIMIZER_STATE_FACTORS: dict[str, int] = {"sgd": 1, "adam": 2, "adamw": 2}


def optimizer_state_factor(optimizer_name: str, sgd_momentum: float = 0.9) -> int:
    """State tensors per trainable parameter: SGD 1 with momentum (0 without), Adam/AdamW 2."""
    if optimizer_name not in OPTIMIZER_STATE_FACTORS:
        raise ValueError(f"optimizer_name must be one of {sorted(OPTIMIZER_STATE_FACTORS)}, got {optimizer_name!r}")
    if optimizer_name == "sgd" and not sgd_momentum:
        return 0
    return OPTIMIZER_STATE_FACTORS[optimizer_name]


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage (e.g. some subclasses)
        return tensor.numel() * tensor.element_size()


def saved_activation_bytes(step: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Run ``step()`` and measure what autograd saves for backward, deduplicated by storage.

    ``exclude``: tensors whose storages are not activations (parameters, buffers). Every saved tensor is kept
    referenced until the count is done, so no storage can be freed and its address reused within the step.
    Returns ``{"bytes", "storages" (distinct), "saved_tensors" (pack calls)}``.
    """
    excluded: set[tuple[str, int]] = set()
    for tensor in exclude:
        try:
            excluded.add(_storage_key(tensor))
        except (RuntimeError, NotImplementedError):
            pass
    held: list[torch.Tensor] = []
    sizes: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)  # noqa: F821 - runs in the `with` below, before `del held`
        try:
            key = _storage_key(tensor)
        except (RuntimeError, NotImplementedError):
            key = ("id", id(tensor))
        if key not in excluded and key not in sizes:
            sizes[key] = _storage_nbytes(tensor)
        # A detached view of the same storage: handing autograd the tensor itself ties a saved output and its
        # grad_fn into a reference cycle the garbage collector cannot see, which kept every measured step's
        # activations alive (a client measuring every round grew by one step's activations per round).
        return tensor.detach()

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        result = step()
    counts = {"bytes": sum(sizes.values()), "storages": len(sizes), "saved_tensors": len(held)}
    del result, held
    return counts


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    if hasattr(module, "trainable_parameters"):
        params = module.trainable_parameters()  # type: ignore[operator]  # hasattr-checked
    else:
        params = [p for p in module.parameters() if p.requires_grad]
    unique: dict[int, nn.Parameter] = {}
    for p in params:
        unique.setdefault(id(p), p)
    return list(unique.values())


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _default_step(module: nn.Module, *inputs: torch.Tensor) -> Any:
    if hasattr(module, "training_step"):
        return module.training_step(*inputs)  # type: ignore[operator]  # hasattr-checked
    return module(*inputs)


def analytic_training_memory(
    method: nn.Module,
    optimizer_name: str,
    batch: int | Sequence[torch.Tensor],
    *,
    view_shape: Sequence[int] = (3, 32, 32),
    device: torch.device | str | None = None,
    sgd_momentum: float = 0.9,
    step_fn: Callable[..., Any] | None = None,
    seed: int = 0,
    exclude_parameters: bool = True,
) -> dict[str, int]:
    """Analytic training memory of one step of ``method``, in bytes per part (see the module docstring).

    ``batch``: the step's inputs (e.g. ``(view1, view2)`` for an ``SSLMethod``, ``(x,)`` for a plain module), or
    a batch size, in which case random inputs of ``view_shape`` are made (two views when the module has
    ``training_step``, one input otherwise). ``step_fn(module, *inputs)`` runs the forward of one step (default:
    ``module.training_step(*inputs)``, or ``module(*inputs)`` for a plain module). The step runs on a deep copy in
    training mode (on ``device``, default the module's), so the module keeps its gradients, BN statistics,
    target branch and queue.

    ``exclude_parameters=False`` also counts parameter/buffer storages that ops save (a layer's weight) as
    activations, i.e. counts them twice; the reference ResNet-18 figures in tests/test_accounting.py (616 MiB at batch 128, 330 at
    64) were taken that way and are 42.6 MiB (the weights) above the default count.

    Returns ``{"parameters", "buffers", "gradients", "optimizer_state", "activations", "total"}``.
    """
    factor = optimizer_state_factor(optimizer_name, sgd_momentum)
    parameters = list({id(p): p for p in method.parameters()}.values())
    buffers = list({id(b): b for b in method.buffers()}.values())
    trainable_bytes = _nbytes(_trainable(method))

    work = copy.deepcopy(method)
    if device is None:
        device = parameters[0].device if parameters else torch.device("cpu")
    work.to(device).train()
    if isinstance(batch, int) and not isinstance(batch, bool):
        if batch < 1:
            raise ValueError(f"batch size must be a positive integer, got {batch!r}")
        generator = torch.Generator().manual_seed(seed)
        num_inputs = 2 if hasattr(work, "training_step") else 1
        inputs = [torch.rand(batch, *view_shape, generator=generator).to(device) for _ in range(num_inputs)]
    elif isinstance(batch, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in batch):
        inputs = [t.to(device) for t in batch]
    else:
        raise ValueError(f"batch must be a batch size or a sequence of tensors, got {type(batch).__name__}")
    run = step_fn or _default_step
    saved = saved_activation_bytes(
        lambda: run(work, *inputs),  # noqa: F821 - called before `del work`
        exclude=[*work.parameters(), *work.buffers()] if exclude_parameters else (),
    )
    del work

    parts = {
        "parameters": _nbytes(parameters),
        "buffers": _nbytes(buffers),
        "gradients": trainable_bytes,
        "optimizer_state": factor * trainable_bytes,
        "activations": saved["bytes"],
    }
    parts["total"] = sum(parts.values())
    return parts


def process_peak_rss_bytes(status_path: str | Path = "/proc/self/status") -> int | None:
    """This process's resident-set high-water mark (``VmHWM``) in bytes; None where procfs is unavailable."""
    try:
        text = Path(status_path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                unit = fields[2].lower() if len(fields) > 2 else "kb"
                return int(fields[1]) * (1024 if unit == "kb" else 1)
    return None


def reset_peak_rss(clear_refs_path: str | Path = "/proc/self/clear_refs") -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``); False where not possible."""
    try:
        Path(clear_refs_path).write_text("5")
    except OSError:
        return False
    return True


__all__ = [
    "analytic_training_memory",
    "optimizer_state_factor",
    "process_peak_rss_bytes",
    "reset_peak_rss",
    "saved_activation_bytes",
]
