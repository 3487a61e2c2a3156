"""Encoder networks (backbones), projection/prediction heads and momentum targets.

``build_backbone(arch, width, normalization)`` is the one entry point for encoders: it looks ``arch`` up in
``BACKBONES``, so a new architecture is one module here plus one registry entry. A backbone applies its
``input_norm`` submodule to its input first (``nn.Identity`` unless the experiment normalises its inputs,
see ``input_norm.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from ssl_models.networks.input_norm import InputNormalization
from ssl_models.networks.resnet import ARCHITECTURES as RESNET_ARCHITECTURES
from ssl_models.networks.resnet import build_resnet

# arch name -> builder(arch, width) returning (module, feature_dim)
BACKBONES: dict[str, Callable[[str, float], tuple[nn.Module, int]]] = {
    name: build_resnet for name in RESNET_ARCHITECTURES
}


def available_backbones() -> list[str]:
    """Names accepted by :func:`build_backbone`."""
    return sorted(BACKBONES)


def build_backbone(arch: str, width: float = 1.0,
                   normalization: tuple[Sequence[float], Sequence[float]] | None = None) -> tuple[nn.Module, int]:
    """Build encoder ``arch`` (channel ``width`` multiplier) and return ``(module, feature_dim)``.

    ``module(x)`` maps float NCHW images in [0, 1] to ``(N, feature_dim)`` features. ``normalization`` =
    ``(mean, std)`` makes its first layer ``(x - mean) / std`` (an ``InputNormalization``; not in the state dict).
    """
    if arch not in BACKBONES:
        raise ValueError(f"arch must be one of {available_backbones()}, got {arch!r}")
    module, feature_dim = BACKBONES[arch](arch, width)
    if normalization is not None:
        if not isinstance(getattr(module, "input_norm", None), nn.Module):
            raise ValueError(f"backbone {arch!r} has no input_norm layer, so it cannot normalise its input")
        module.input_norm = InputNormalization(*normalization)
    return module, feature_dim


__all__ = ["BACKBONES", "available_backbones", "build_backbone"]
