"""Encoder networks (backbones), projection/prediction heads and momentum targets.

``build_backbone(arch, width, normalization)`` is the one entry point for encoders: it looks ``arch`` up in
``BACKBONES``, so a new architecture is one module here plus one registry entry. A backbone applies its
``input_norm`` submodule to its input first (``nn.Identity`` unless the experiment normalises its inputs,
see ``input_norm.py``).

Architectures: CIFAR ResNet-18/34/50 (``resnet.py``) and the growable ViT-Tiny/4 ``vit_tiny`` (``vit.py``), which
takes one architecture option, ``depth`` (blocks held, default 12): ``build_backbone("vit_tiny", width, depth=s)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ssl_models.networks.input_norm import InputNormalization
from ssl_models.networks.resnet import ARCHITECTURES as RESNET_ARCHITECTURES
from ssl_models.networks.resnet import build_resnet
from ssl_models.networks.vit import build_vit

# arch name -> builder(arch, width, **arch_options) returning (module, feature_dim)
BACKBONES: dict[str, Callable[..., tuple[nn.Module, int]]] = {
    **{name: build_resnet for name in RESNET_ARCHITECTURES},
    "vit_tiny": build_vit,
}
# architecture options each builder accepts beyond (arch, width)
ARCH_OPTIONS: dict[str, tuple[str, ...]] = {"vit_tiny": ("depth",)}


def available_backbones() -> list[str]:
    """Names accepted by :func:`build_backbone`."""
    return sorted(BACKBONES)


def build_backbone(
    arch: str,
    width: float = 1.0,
    normalization: tuple[Sequence[float], Sequence[float]] | None = None,
    **arch_options: Any,
) -> tuple[nn.Module, int]:
    """Build encoder ``arch`` (channel ``width`` multiplier) and return ``(module, feature_dim)``.

    ``module(x)`` maps float NCHW images in [0, 1] to ``(N, feature_dim)`` features. ``normalization`` =
    ``(mean, std)`` makes its first layer ``(x - mean) / std`` (an ``InputNormalization``; not in the state dict).
    ``arch_options`` are passed to the builder; only the names in ``ARCH_OPTIONS[arch]`` are accepted
    (``depth`` for ``vit_tiny``).
    """
    if arch not in BACKBONES:
        raise ValueError(f"arch must be one of {available_backbones()}, got {arch!r}")
    valid = list(ARCH_OPTIONS.get(arch, ()))
    unknown = sorted(set(arch_options) - set(valid))
    if unknown:
        raise ValueError(f"backbone {arch!r} does not take option(s) {unknown}; valid options: {valid}")
    module, feature_dim = BACKBONES[arch](arch, width, **arch_options)
    if normalization is not None:
        if not isinstance(getattr(module, "input_norm", None), nn.Module):
            raise ValueError(f"backbone {arch!r} has no input_norm layer, so it cannot normalise its input")
        module.input_norm = InputNormalization(*normalization)
    return module, feature_dim


__all__ = ["ARCH_OPTIONS", "BACKBONES", "available_backbones", "build_backbone"]
