"""SGD, Adam and AdamW for local SSL training, without ``torch.optim``'s machinery.

Why: building any ``torch.optim`` optimiser imports ``torch._dynamo`` (the base class's methods are wrapped in
``torch._disable_dynamo``, which imports it on their first call), although nothing is compiled. A deployed
SuperNode starts a new ClientApp process for every message, so every client pays that import every round
(benchmarks/results/deployment.md). These three do the arithmetic of ``torch.optim``'s defaults (no dampening,
Nesterov, amsgrad or maximize) with ``torch._foreach_*`` kernels, one launch per operation for all parameters,
and are checked against ``torch.optim`` step by step in tests/test_optimizers.py.

They keep what the training loop uses: ``zero_grad(set_to_none=True)``, ``step()``, ``param_groups`` (one group,
its ``lr`` read at every step) and ``state`` (per parameter). A parameter without a gradient in a step is skipped,
its state untouched, as ``torch.optim`` does. ``torch.optim`` stays in use where a ``torch.amp.GradScaler`` drives
the step (fp16 on CUDA), since the scaler keeps its own per-optimiser bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class LocalOptimizer:
    """One parameter group; subclasses implement ``_update(params, grads)`` under ``torch.no_grad``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0, **extra: Any):
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        self.param_groups: list[dict[str, Any]] = [
            {"params": params, "lr": float(lr), "weight_decay": float(weight_decay), **extra}
        ]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        with_grad = [p for p in self.param_groups[0]["params"] if p.grad is not None]
        if with_grad:
            self._update(with_grad, [p.grad for p in with_grad])

    def _update(self, params: list[torch.Tensor], grads: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError


class SGD(LocalOptimizer):
    """``torch.optim.SGD(lr, momentum, weight_decay)``: d = g + wd p; b = d (first step) or m b + d; p -= lr b."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ):
        if not momentum >= 0:
            raise ValueError(f"momentum must be >= 0, got {momentum!r}")
        super().__init__(params, lr, weight_decay, momentum=float(momentum))

    def _update(self, params: list[torch.Tensor], grads: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        g = self.param_groups[0]
        if g["weight_decay"]:
            grads = torch._foreach_add(grads, params, alpha=g["weight_decay"])
        if g["momentum"]:
            kept = [(self.state[p]["momentum_buffer"], d) for p, d in zip(params, grads) if p in self.state]
            if kept:
                buffers, updates = map(list, zip(*kept))
                torch._foreach_mul_(buffers, g["momentum"])
                torch._foreach_add_(buffers, updates)
            for p, d in zip(params, grads):
                if p not in self.state:  # a parameter's first step: its buffer is the update itself
                    self.state[p] = {"momentum_buffer": torch.clone(d).detach()}
            grads = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_add_(params, grads, alpha=-g["lr"])


class Adam(LocalOptimizer):
    """``torch.optim.Adam`` (betas 0.9/0.999, eps 1e-8); ``decoupled=True`` is ``torch.optim.AdamW``: the weight
    decay shrinks the weights (p *= 1 - lr wd) instead of joining the gradient."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        decoupled: bool = False,
    ):
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas!r}")
        super().__init__(
            params, lr, weight_decay, betas=tuple(map(float, betas)), eps=float(eps), decoupled=bool(decoupled)
        )

    def _update(self, params: list[torch.Tensor], grads: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        g = self.param_groups[0]
        lr, wd, (beta1, beta2), eps = g["lr"], g["weight_decay"], g["betas"], g["eps"]
        if wd and g["decoupled"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        elif wd:
            grads = torch._foreach_add(grads, params, alpha=wd)
        for p in params:
            if p not in self.state:
                self.state[p] = {
                    "step": 0,
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            self.state[p]["step"] += 1
        states = [self.state[p] for p in params]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
        # Per-parameter bias corrections: a parameter skipped in some steps has its own step count.
        steps = [s["step"] for s in states]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, [-lr / (1 - beta1**t) for t in steps])


def build_local_optimizer(
    params: Iterable[torch.nn.Parameter], name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> LocalOptimizer:
    """``sgd`` (with ``momentum``), ``adam`` or ``adamw`` with ``torch.optim``'s default hyper-parameters."""
    if name == "sgd":
        return SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return Adam(params, lr=lr, weight_decay=weight_decay, decoupled=True)
    raise ValueError(f"optimizer: unknown name {name!r} (valid: sgd, adam, adamw)")
