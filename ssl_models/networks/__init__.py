"""Encoder networks (backbones), projection/prediction heads and momentum targets.

``build_backbone(arch, width, normalization, stem=..., image_size=...)`` is the one entry point for encoders: it
looks ``arch`` up in ``BACKBONES``, so a new architecture is one module here plus one registry entry. A backbone
applies its ``input_norm`` submodule to its input first (``nn.Identity`` unless the experiment normalises its
inputs, see ``input_norm.py``).

Architectures: ResNet-18/34/50 (``resnet.py``) and the growable ViT-Tiny/4 ``vit_tiny`` (``vit.py``), which
takes one architecture option, ``depth`` (blocks held, default 12): ``build_backbone("vit_tiny", width, depth=s)``.

Two build settings follow the images rather than the user's architecture options: ``stem`` (``"cifar"``, the
default, or ``"imagenet"``) goes to the ResNets, ``image_size`` (the input side, default 32) to the ViT, whose
patch size is ``image_size // 8``. Each builder ignores the one it does not use, so callers pass both
(``ssl_models.factory.build_ssl_model`` passes ``cfg.resnet_stem()`` and ``cfg.image_side()``).
:func:`backbone_build_settings` reads them back off a built backbone (for a checkpoint to record).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ssl_models.networks.input_norm import InputNormalization
from ssl_models.networks.resnet import ARCHITECTURES as RESNET_ARCHITECTURES
from ssl_models.networks.resnet import ResNetTrunk, build_resnet
from ssl_models.networks.vit import IMAGE_SIZE as VIT_DEFAULT_IMAGE_SIZE
from ssl_models.networks.vit import VisionTransformer, build_vit

# arch name -> builder(arch, width, **arch_options) returning (module, feature_dim)
BACKBONES: dict[str, Callable[..., tuple[nn.Module, int]]] = {
    **{name: build_resnet for name in RESNET_ARCHITECTURES},
    "vit_tiny": build_vit,
}
# architecture options each builder accepts beyond (arch, width)
ARCH_OPTIONS: dict[str, tuple[str, ...]] = {"vit_tiny": ("depth",)}
# build settings (keywords of build_backbone, not user options) each builder takes; the others ignore them
_BUILD_SETTINGS: dict[str, tuple[str, ...]] = {
    **{name: ("stem",) for name in RESNET_ARCHITECTURES},
    "vit_tiny": ("image_size",),
}


def available_backbones() -> list[str]:
    """Names accepted by :func:`build_backbone`."""
    return sorted(BACKBONES)


def build_backbone(
    arch: str,
    width: float = 1.0,
    normalization: tuple[Sequence[float], Sequence[float]] | None = None,
    *,
    stem: str = "cifar",
    image_size: int = VIT_DEFAULT_IMAGE_SIZE,
    **arch_options: Any,
) -> tuple[nn.Module, int]:
    """Build encoder ``arch`` (channel ``width`` multiplier) and return ``(module, feature_dim)``.

    ``module(x)`` maps float NCHW images in [0, 1] to ``(N, feature_dim)`` features. ``normalization`` =
    ``(mean, std)`` makes its first layer ``(x - mean) / std`` (an ``InputNormalization``; not in the state dict).
    ``stem`` (``"cifar"`` or ``"imagenet"``) shapes a ResNet's stem and ``image_size`` a ViT's patches (side // 8);
    an architecture that has no such part ignores the setting. ``arch_options`` are passed to the builder; only
    the names in ``ARCH_OPTIONS[arch]`` are accepted (``depth`` for ``vit_tiny``).
    """
    if arch not in BACKBONES:
        raise ValueError(f"arch must be one of {available_backbones()}, got {arch!r}")
    valid = list(ARCH_OPTIONS.get(arch, ()))
    unknown = sorted(set(arch_options) - set(valid))
    if unknown:
        raise ValueError(f"backbone {arch!r} does not take option(s) {unknown}; valid options: {valid}")
    settings = {"stem": stem, "image_size": image_size}
    used = {name: settings[name] for name in _BUILD_SETTINGS.get(arch, ())}
    module, feature_dim = BACKBONES[arch](arch, width, **used, **arch_options)
    if normalization is not None:
        if not isinstance(getattr(module, "input_norm", None), nn.Module):
            raise ValueError(f"backbone {arch!r} has no input_norm layer, so it cannot normalise its input")
        module.input_norm = InputNormalization(*normalization)
    return module, feature_dim


def backbone_build_settings(backbone: nn.Module) -> dict[str, Any]:
    """The build settings that shape ``backbone``'s weights, as ``build_backbone`` keywords: ``{"stem": ...}`` for a
    ResNet, ``{"image_size": ...}`` for a ViT, ``{}`` otherwise. Passing them back to ``build_backbone`` rebuilds
    a backbone whose state dict has the same names and shapes."""
    if isinstance(backbone, ResNetTrunk):
        return {"stem": backbone.stem_name}
    if isinstance(backbone, VisionTransformer):
        return {"image_size": backbone.image_size}
    return {}


def describe_backbone(arch: str, backbone: nn.Module, width: float) -> str:
    """``arch`` with what shapes its weights, for messages: ``resnet18 (stem imagenet, width 1.0)``,
    ``vit_tiny (96 px in 12 px patches, 12 blocks, width 0.5)``."""
    if isinstance(backbone, ResNetTrunk):
        return f"{arch} (stem {backbone.stem_name}, width {width})"
    if isinstance(backbone, VisionTransformer):
        return (
            f"{arch} ({backbone.image_size} px in {backbone.patch_size} px patches, {backbone.depth} blocks, "
            f"width {width})"
        )
    return f"{arch} (width {width})"


__all__ = [
    "ARCH_OPTIONS",
    "BACKBONES",
    "available_backbones",
    "backbone_build_settings",
    "build_backbone",
    "describe_backbone",
]
