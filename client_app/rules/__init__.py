"""Client rules, one module per strategy family; each registers its rules (``base.register``) when imported."""

from __future__ import annotations

import importlib
import pkgutil

from .base import RULES, ClientRule, get_rule, register

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["RULES", "ClientRule", "get_rule", "register"]
