"""Shared base class of all self-supervised methods.

The attribute names below are a contract with the trainer and the Flower code: what is exchanged with the
server is decided by state_dict key prefixes, so every method must keep its modules under these names:

- ``backbone``: the encoder being learned (the only part kept for downstream evaluation);
- ``projector``: the online projection head;
- ``predictor``: optional online prediction head (BYOL, SimSiam);
- ``target_backbone`` / ``target_projector``: optional momentum (EMA) branch (BYOL target, MoCo key encoder);
- buffers ``queue`` / ``queue_ptr``: optional MoCo memory of negative keys.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ssl_models.networks.momentum import copy_as_target, ema_update_

ONLINE_PREFIXES: tuple[str, ...] = ("backbone.", "projector.")
PREDICTOR_PREFIX = "predictor."
TARGET_PREFIXES: tuple[str, ...] = ("target_backbone.", "target_projector.")


def resolve_options(method_name: str, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``given``; an option the method does not know is an error, not a silent no-op."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {method_name!r}; valid options: {sorted(defaults)}")
    return {**defaults, **given}


class SSLMethod(nn.Module):
    """Backbone + heads + loss of one SSL method; subclasses implement :meth:`training_step`.

    Subclasses declare ``name`` and ``default_options()`` and read their settings from ``self.options``.
    """

    name: ClassVar[str] = "base"
    # The contract's modules, declared for the type checker (nn.Module's attribute lookup types an undeclared
    # attribute as Tensor | Module). Subclasses assign them; the predictor and the target branch only where the
    # method has them (has_predictor, has_target).
    projector: nn.Module
    predictor: nn.Module
    target_backbone: nn.Module
    target_projector: nn.Module

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__()
        if not isinstance(feature_dim, int) or isinstance(feature_dim, bool) or feature_dim < 1:
            raise ValueError(f"feature_dim must be a positive integer, got {feature_dim!r}")
        self.options: dict[str, Any] = resolve_options(self.name, self.default_options(), options)
        self.backbone = backbone
        self.feature_dim = feature_dim

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        """Every option this method accepts, with its default (a fresh dict each call)."""
        return {}

    # ------------------------------------------------------------------ training hooks
    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        """Scalar float32 loss for two augmented views (float NCHW, already on the model's device)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step")

    def after_optimizer_step(self) -> None:
        """Called after every optimizer step; momentum methods update their target branch here."""

    def on_new_global(self) -> None:
        """Called after the client loaded new shared (server-averaged) weights into this module."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Backbone features of ``images``; the SSL loss is computed by :meth:`training_step`, not here."""
        return self.backbone(images)

    # ------------------------------------------------------------------ structure queries
    @property
    def has_predictor(self) -> bool:
        return getattr(self, "predictor", None) is not None

    @property
    def has_target(self) -> bool:
        return getattr(self, "target_backbone", None) is not None

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates: the online branch only (targets move by EMA, never by SGD)."""
        return [
            parameter
            for name, parameter in self.named_parameters()
            if not name.startswith(TARGET_PREFIXES) and parameter.requires_grad
        ]

    def shared_prefixes(self, with_target: bool = False) -> tuple[str, ...]:
        """state_dict key prefixes that the server averages; every other key (targets, queue) stays local.

        ``with_target`` additionally shares the target branch (the strategy option ``aggregate_target``,
        EasyFL's "aggregate the target too"). The paper's update-both shares nothing more: the client copies
        the received online weights into its target.
        """
        prefixes = ONLINE_PREFIXES
        if self.has_predictor:
            prefixes = prefixes + (PREDICTOR_PREFIX,)
        if with_target and self.has_target:
            prefixes = prefixes + TARGET_PREFIXES
        return prefixes

    # ------------------------------------------------------------------ target branch helpers
    def build_target_branch(self) -> None:
        """Create ``target_backbone`` / ``target_projector`` as frozen copies of the online modules."""
        self.target_backbone = copy_as_target(self.backbone)
        self.target_projector = copy_as_target(self.projector)

    def update_target_branch(self, momentum: float) -> None:
        """EMA step of the target branch towards the online branch (no-op when there is no target)."""
        if not self.has_target:
            return
        ema_update_(self.target_backbone, self.backbone, momentum)
        ema_update_(self.target_projector, self.projector, momentum)

    def reset_target_to_online(self) -> None:
        """Copy the online weights and buffers into the target branch (no-op when there is no target)."""
        if not self.has_target:
            return
        self.target_backbone.load_state_dict(self.backbone.state_dict())
        self.target_projector.load_state_dict(self.projector.state_dict())

    def target_embeddings(self, images: torch.Tensor, stop_gradient: bool = True) -> torch.Tensor:
        """Target-branch projections; under ``no_grad`` when ``stop_gradient`` (the usual case).

        The target parameters are frozen either way, so without stop-gradient the graph is kept but no
        optimizer ever applies a gradient to the target (as in the EasyFL ablation code).
        """
        with torch.set_grad_enabled(torch.is_grad_enabled() and not stop_gradient):
            return self.target_projector(self.target_backbone(images))


# ---------------------------------------------------------------------- option checks shared by methods
def check_positive(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a number > 0 (bools rejected: ``True`` is not a temperature)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"option {name!r} must be a positive number, got {value!r}")


def check_momentum(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an EMA momentum in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"option {name!r} must be a number in [0, 1], got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a real bool (a YAML typo like "false" must not read as True)."""
    if not isinstance(value, bool):
        raise ValueError(f"option {name!r} must be true or false, got {value!r}")  # noqa: TRY004 - a config error: load_experiment reports ValueErrors
