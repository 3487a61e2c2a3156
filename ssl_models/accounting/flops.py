"""FLOPs of one training step or one forward, counted with ``torch.utils.flop_counter.FlopCounterMode``.

Conventions (docs/methods/lwfedssl.md, Resource accounting): 2 FLOPs per multiply-add; only matrix products and convolutions are counted
(no norms, activations or softmax); the backward counted is the one autograd actually runs, so frozen layers
(no weight gradient) and the first layer (no input gradient) cost less than 2x their forward. Results are per
sample: per image of the batch, i.e. for an SSL step both views of that image. ``fvcore_equivalent`` is
forward / 2, the multiply-add count that fvcore (and the LW-FedSSL paper) reports.

Attention on CPU: ``F.scaled_dot_product_attention`` dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu``, which FlopCounterMode (torch 2.x) has no formula for, so on
CPU the two attention matmuls (QK^T and AV, 4 * tokens^2 * D FLOPs per block and sample) are not counted, while on
CUDA (flash / efficient / cuDNN kernels) they are. The ViT-Tiny/4 reference figure the tests check
(0.6913 GFLOP forward) is the CPU count. ``count_cpu_attention=True`` registers formulas for the CPU kernels
(the same as torch's for the CUDA kernels), making CPU counts match CUDA counts: 0.7303 GFLOP for ViT-Tiny/4.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

if TYPE_CHECKING:
    from ssl_models.methods.base import SSLMethod

aten = torch.ops.aten
_ModuleT = TypeVar("_ModuleT", bound=nn.Module)  # function_training_flops: the module's type, kept


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """QK^T and (scores)V of ``_scaled_dot_product_flash_attention_for_cpu`` (q: (b, h, s_q, d))."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (d_q + d_v)


def _cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any
) -> int:
    """Five matmuls, as torch counts the CUDA attention backward: recomputed scores, dScores, dV, dQ, dK."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (d_q + d_v + d_v + d_q + d_q)


def _cpu_attention_mapping() -> dict[Any, Callable[..., int]]:
    mapping: dict[Any, Callable[..., int]] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flop),
    ):
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = formula
    return mapping


def flop_counter(count_cpu_attention: bool = False) -> FlopCounterMode:
    """A silent ``FlopCounterMode``; see the module docstring for ``count_cpu_attention``."""
    return FlopCounterMode(display=False, custom_mapping=_cpu_attention_mapping() if count_cpu_attention else None)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def _module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _random_batch(
    shape: Sequence[int],
    batch_size: int,
    device: torch.device,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    return torch.rand(batch_size, *shape, generator=generator).to(device=device, dtype=dtype)


def _per_sample(forward: int, backward: int, batch_size: int) -> dict[str, float]:
    fwd, bwd = forward / batch_size, backward / batch_size
    return {
        "forward": fwd,
        "backward": bwd,
        "total": fwd + bwd,
        "fvcore_equivalent": fwd / 2.0,
        "batch_size": batch_size,
    }


def forward_flops(
    module: nn.Module, input_shape: Sequence[int], batch_size: int = 2, *, count_cpu_attention: bool = False
) -> float:
    """Forward FLOPs per sample of ``module`` on inputs of ``input_shape`` (one sample, e.g. ``(3, 32, 32)``).

    Runs ``batch_size`` random samples in eval mode under ``no_grad`` on the module's device (no side effects:
    eval mode updates no BN statistics and skips no blocks); the module's train/eval mode is restored.
    """
    _check_batch_size(batch_size)
    was_training = module.training
    generator = torch.Generator().manual_seed(0)
    x = _random_batch(input_shape, batch_size, _module_device(module), generator)
    module.eval()
    try:
        with torch.no_grad(), flop_counter(count_cpu_attention) as counter:
            module(x)
    finally:
        module.train(was_training)
    return counter.get_total_flops() / batch_size


def backbone_training_flops(
    module: nn.Module, input_shape: Sequence[int], batch_size: int = 2, *, count_cpu_attention: bool = False
) -> dict[str, float]:
    """Per-sample forward / backward / total FLOPs of a supervised-style step of ``module`` alone.

    Forward in training mode, then ``backward`` of the summed output (which adds no counted FLOPs): what the
    section 5 reference table counts. Runs on a deep copy, so no gradient, BN statistic or generator state is
    left behind. Parameters with ``requires_grad=False`` get no weight gradient and their cost shows up.
    """
    return function_training_flops(
        module, lambda work: work, input_shape, batch_size, count_cpu_attention=count_cpu_attention
    )


def training_step_flops(
    method: SSLMethod,
    view_shape: Sequence[int] = (3, 32, 32),
    batch_size: int = 2,
    device: torch.device | str | None = None,
    *,
    count_cpu_attention: bool = False,
    seed: int = 0,
) -> dict[str, float]:
    """Per-sample FLOPs of one complete SSL training step of ``method`` (an ``SSLMethod``).

    Counts ``method.training_step(view1, view2)`` (every online and target forward, the loss) as ``forward``
    and the ``backward`` of its loss as ``backward``; no optimizer step (its element-wise updates are not
    counted by FlopCounterMode anyway). Works on a deep copy in training mode, on ``device`` (default: the
    method's), so the method keeps its gradients, target branch, queue, BN statistics and generators. Per sample
    = per image: divide by ``batch_size`` images, each of which contributes two views.

    Returns ``{"forward", "backward", "total", "fvcore_equivalent" (= forward / 2), "batch_size"}``;
    multiply ``total`` by images per step x steps per round for a round's cost.
    """
    _check_batch_size(batch_size)
    work = copy.deepcopy(method)
    target_device = torch.device(device) if device is not None else _module_device(method)
    work.to(target_device).train()
    generator = torch.Generator().manual_seed(seed)
    view1 = _random_batch(view_shape, batch_size, target_device, generator)
    view2 = _random_batch(view_shape, batch_size, target_device, generator)
    with flop_counter(count_cpu_attention) as forward_counter:
        loss = work.training_step(view1, view2)
    backward = 0
    if loss.requires_grad:
        with flop_counter(count_cpu_attention) as backward_counter:
            loss.backward()
        backward = backward_counter.get_total_flops()
    return _per_sample(forward_counter.get_total_flops(), backward, batch_size)


def function_training_flops(
    module: _ModuleT,
    function_of: Callable[[_ModuleT], Callable[[torch.Tensor], torch.Tensor]],
    input_shape: Sequence[int],
    batch_size: int = 2,
    *,
    device: torch.device | str | None = None,
    count_cpu_attention: bool = False,
) -> dict[str, float]:
    """Per-sample forward / backward / total FLOPs of ``function_of(module)`` on inputs of ``input_shape``, the
    backward being that of its summed output to every parameter that requires a gradient: the cost of a forward and
    backward through a part of a model other than its training step (e.g. Hetero-SSFL's alignment term, which
    forwards the RAD through backbone, projector and predictor and backpropagates into them).

    ``function_of`` builds the function from the module it is given: it runs on a deep copy in training mode (on
    ``device``, default the module's), so the caller's module keeps its gradients and BatchNorm statistics.
    """
    _check_batch_size(batch_size)
    work = copy.deepcopy(module)
    target_device = torch.device(device) if device is not None else _module_device(module)
    work.to(target_device).train()
    fn = function_of(work)
    x = _random_batch(input_shape, batch_size, target_device, torch.Generator().manual_seed(0))
    with flop_counter(count_cpu_attention) as forward_counter:
        out = fn(x)
    backward = 0
    if out.requires_grad:
        with flop_counter(count_cpu_attention) as backward_counter:
            out.backward(torch.ones_like(out))
        backward = backward_counter.get_total_flops()
    return _per_sample(forward_counter.get_total_flops(), backward, batch_size)


__all__ = ["backbone_training_flops", "flop_counter", "forward_flops", "function_training_flops", "training_step_flops"]
