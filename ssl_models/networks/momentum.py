"""Momentum (EMA) target networks, as used by MoCo's key encoder and BYOL's target network."""

from __future__ import annotations

import copy

import torch
from torch import nn


def _check_momentum(momentum: float) -> None:
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")


@torch.no_grad()
def ema_update_(target: nn.Module, online: nn.Module, momentum: float) -> None:
    """In place: ``target = momentum * target + (1 - momentum) * online``.

    Applied to parameters AND floating-point buffers. Averaging the BatchNorm running statistics too keeps
    the target's normalisation consistent with its (averaged) weights, instead of letting the target's own
    forward passes drift them independently. Integer buffers (BN's ``num_batches_tracked``) cannot be
    averaged meaningfully and are copied from the online network. ``momentum=1`` freezes the target,
    ``momentum=0`` makes it a copy of the online network.
    """
    _check_momentum(momentum)
    target_params = list(target.parameters())
    online_params = list(online.parameters())
    target_buffers = list(target.buffers())
    online_buffers = list(online.buffers())
    if len(target_params) != len(online_params) or len(target_buffers) != len(online_buffers):
        raise ValueError("target and online must have the same architecture (parameter/buffer counts differ)")
    for target_tensor, online_tensor in zip(target_params + target_buffers, online_params + online_buffers):
        if target_tensor.shape != online_tensor.shape:
            raise ValueError(
                f"target and online tensors differ in shape: {tuple(target_tensor.shape)} vs "
                f"{tuple(online_tensor.shape)}"
            )
        if torch.is_floating_point(target_tensor):
            target_tensor.lerp_(online_tensor.to(target_tensor.dtype), 1.0 - momentum)
        else:
            target_tensor.copy_(online_tensor)


def copy_as_target(online: nn.Module) -> nn.Module:
    """Deep copy of ``online`` whose parameters have ``requires_grad=False`` (updated only by EMA)."""
    target = copy.deepcopy(online)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    return target
