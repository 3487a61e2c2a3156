"""Self-supervised losses as pure functions on tensors.

All functions compute in float32: inputs are cast with ``.float()`` and autocast is switched off inside
them, because under ``torch.autocast`` a float32 matmul would otherwise silently run in bf16 again. This
keeps the losses numerically safe when the embeddings come out of a bf16 autocast region.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.nn.functional as F

LossFn = TypeVar("LossFn", bound=Callable[..., torch.Tensor])


def _float32_loss(loss_fn: LossFn) -> LossFn:
    """Run ``loss_fn`` with autocast disabled on the device of its first tensor argument."""

    @functools.wraps(loss_fn)
    def wrapper(first: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with torch.autocast(device_type=first.device.type, enabled=False):
            return loss_fn(first, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dim() != 2:
        raise ValueError(f"{name_a} must be a 2-D (batch, dim) tensor, got shape {tuple(a.shape)}")


@_float32_loss
def nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """SimCLR NT-Xent loss (normalised temperature-scaled cross entropy).

    ``z1[i]`` and ``z2[i]`` are two views of image ``i``. The 2N embeddings are L2-normalised here; each of
    the 2N anchors has one positive (its other view) and 2N-2 negatives (all remaining embeddings), i.e. the
    softmax runs over 2N-1 candidates (self-similarity excluded). The loss is the mean over all 2N anchors,
    so it is symmetric in ``(z1, z2)``.
    """
    _check_temperature(temperature)
    _check_same_shape("z1", z1, "z2", z2)
    batch_size = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2], dim=0).float(), dim=1)
    logits = z @ z.t() / temperature
    self_mask = torch.eye(2 * batch_size, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))
    # anchor i (first view) pairs with i + N (second view) and vice versa
    positives = torch.cat([torch.arange(batch_size, 2 * batch_size), torch.arange(batch_size)]).to(z.device)
    return F.cross_entropy(logits, positives)


@_float32_loss
def info_nce_loss(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, temperature: float = 0.07) -> torch.Tensor:
    """MoCo InfoNCE: logits ``[q.k, q.queue] / T`` with the positive at index 0, cross-entropy, batch mean.

    ``q`` and ``k`` are L2-normalised here (so callers can pass raw projections); ``queue`` has shape
    ``(dim, K)`` and is expected to be normalised already by the caller (MoCo stores normalised keys, so
    re-normalising K columns every step would be wasted work). ``k`` and ``queue`` carry no gradient in MoCo;
    detaching them is the caller's job.
    """
    _check_temperature(temperature)
    _check_same_shape("q", q, "k", k)
    if queue.dim() != 2 or queue.shape[0] != q.shape[1]:
        raise ValueError(f"queue must have shape (dim={q.shape[1]}, K), got {tuple(queue.shape)}")
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.float(), dim=1)
    positive_logits = (q * k).sum(dim=1, keepdim=True)
    negative_logits = q @ queue.float()
    logits = torch.cat([positive_logits, negative_logits], dim=1) / temperature
    targets = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return F.cross_entropy(logits, targets)


@_float32_loss
def negative_cosine_similarity(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SimSiam's D(p, z) = -cos(p, z), averaged over the batch; range [-1, 1]. ``z`` is used as given:
    stop-gradient (``z.detach()``) is the caller's decision."""
    _check_same_shape("p", p, "z", z)
    return -F.cosine_similarity(p.float(), z.float(), dim=1).mean()


def byol_regression_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """BYOL's normalised MSE ||p/|p| - z/|z|||^2 = 2 - 2 cos(p, z), averaged over the batch; range [0, 4].

    Equal to ``2 + 2 * negative_cosine_similarity(p, z)``: same gradients up to a factor 2, different offset.
    """
    return 2.0 + 2.0 * negative_cosine_similarity(p, z)


def proximal_term(
    params: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor], mu: float, half: bool = True
) -> torch.Tensor:
    """FedProx's proximal term over named parameters: (mu/2) * sum ||w - w_g||^2 (``half=False``: the FLESD
    code's mu * sum ||w - w_g||^2). ``anchors`` are the global weights (no gradient)."""
    keys = [k for k in params if k in anchors]
    if not keys:
        raise ValueError("proximal_term: no parameter has a global anchor")
    total = sum(((params[k].float() - anchors[k].float()) ** 2).sum() for k in keys)
    return (0.5 * mu if half else mu) * cast(torch.Tensor, total)  # keys is not empty: a tensor, never the 0 start


@_float32_loss
def mocov3_contrastive_loss(q: torch.Tensor, k: torch.Tensor, temperature: float = 0.2) -> torch.Tensor:
    """MoCo v3's ctr(q, k) = CrossEntropy(normalize(q) @ normalize(k).T / T, arange(N)) * 2T.

    Query ``i`` has its positive at key ``i`` and the other N-1 keys of the batch as negatives (an N-way
    softmax, not SimCLR's 2N-1; no queue). The factor 2T is MoCo v3's, which makes the gradient scale
    independent of T. Keys carry no gradient in MoCo v3; detaching them is the caller's job. The symmetric
    MoCo v3 loss is ``ctr(q1, k2) + ctr(q2, k1)``.
    """
    _check_temperature(temperature)
    _check_same_shape("q", q, "k", k)
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.float(), dim=1)
    logits = q @ k.t() / temperature
    targets = torch.arange(q.shape[0], device=q.device)
    return F.cross_entropy(logits, targets) * (2.0 * temperature)
