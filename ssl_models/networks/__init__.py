"""Encoder networks (backbones), projection/prediction heads and momentum targets.

``build_backbone(arch, width)`` is the one entry point for encoders: it looks ``arch`` up in ``BACKBONES``,
so a new architecture is one module here plus one registry entry.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ssl_models.networks.resnet import ARCHITECTURES as RESNET_ARCHITECTURES
from ssl_models.networks.resnet import build_resnet

# arch name -> builder(arch, width) returning (module, feature_dim)
BACKBONES: dict[str, Callable[[str, float], tuple[nn.Module, int]]] = {
    name: build_resnet for name in RESNET_ARCHITECTURES
}


def available_backbones() -> list[str]:
    """Names accepted by :func:`build_backbone`."""
    return sorted(BACKBONES)


def build_backbone(arch: str, width: float = 1.0) -> tuple[nn.Module, int]:
    """Build encoder ``arch`` (channel ``width`` multiplier) and return ``(module, feature_dim)``.

    ``module(x)`` maps float NCHW images to ``(N, feature_dim)`` features.
    """
    if arch not in BACKBONES:
        raise ValueError(f"arch must be one of {available_backbones()}, got {arch!r}")
    return BACKBONES[arch](arch, width)


__all__ = ["BACKBONES", "available_backbones", "build_backbone"]
