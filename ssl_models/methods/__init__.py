"""Registry of self-supervised methods: adding a method means one new file plus one entry in ``METHODS``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_models.methods.base import SSLMethod
from ssl_models.methods.byol import BYOL
from ssl_models.methods.fedx import FedXMethod
from ssl_models.methods.moco import MoCo
from ssl_models.methods.mocov3 import MoCoV3
from ssl_models.methods.orchestra import Orchestra
from ssl_models.methods.simclr import SimCLR
from ssl_models.methods.simsiam import SimSiam

METHODS: dict[str, type[SSLMethod]] = {
    method.name: method for method in (SimCLR, MoCo, BYOL, SimSiam, MoCoV3, FedXMethod, Orchestra)
}


def _method_class(name: str) -> type[SSLMethod]:
    if name not in METHODS:
        raise ValueError(f"unknown SSL method {name!r}; valid names: {sorted(METHODS)}")
    return METHODS[name]


def method_default_options(name: str) -> dict[str, Any]:
    """Every option of method ``name`` with its default value."""
    return _method_class(name).default_options()


def build_method(name: str, backbone: nn.Module, feature_dim: int, **options: Any) -> SSLMethod:
    """Instantiate method ``name`` around ``backbone``; unknown names or options raise ValueError."""
    return _method_class(name)(backbone, feature_dim, **options)


__all__ = ["METHODS", "SSLMethod", "build_method", "method_default_options"]
