"""Input normalisation as the first layer of an encoder: ``(x - mean) / std`` per RGB channel.

Normalisation is kept inside the encoder rather than in the augmentation pipeline so that every place that
feeds images to an encoder applies the same one without knowing about it: local SSL training (online and
target/key branches), the server's kNN monitor and linear probe, FLESD's public-set representations and
distillation, semi-supervised fine-tuning, and ``fedssl-eval`` on a saved ``model.pt`` (the checkpoint records
mean and std, ``ssl_models.evaluation.checkpoint``). Images enter every encoder as floats in [0, 1].

``mean`` and ``std`` are non-persistent buffers: they follow the module to its device and into deep copies
(a BYOL target, a MoCo key encoder) but are not part of the state dict, so they never travel between server and
clients (every party builds them from the experiment config) and checkpoints keep one state-dict layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class InputNormalization(nn.Module):
    """``(x - mean) / std`` over the channels of an (N, 3, H, W) batch."""

    mean: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    std: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        mean, std = [float(v) for v in mean], [float(v) for v in std]
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"input normalisation needs 3 means and 3 stds > 0, got mean {mean}, std {std}")
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)

    def values(self) -> dict[str, list[float]]:
        """{"mean": [...], "std": [...]} as plain floats (what a checkpoint records)."""
        return {"mean": self.mean.flatten().tolist(), "std": self.std.flatten().tolist()}

    def extra_repr(self) -> str:
        v = self.values()
        return f"mean={[round(m, 4) for m in v['mean']]}, std={[round(s, 4) for s in v['std']]}"


def input_normalization_of(backbone: nn.Module) -> dict[str, list[float]] | None:
    """The input normalisation of a backbone built by ``build_backbone`` ({"mean", "std"}), or None."""
    layer = getattr(backbone, "input_norm", None)
    return layer.values() if isinstance(layer, InputNormalization) else None
