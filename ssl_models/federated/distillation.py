"""FLESD server-side distillation: teach the global model the clients' ensembled similarity structure.

The distillation is MoCo with soft labels (FLESD, built on the MoCo v2 code):

- the student is the current global model (``method.backbone`` + ``method.projector``), continuing from its
  weights, trained with Adam;
- the key encoder is a momentum (EMA) copy of the student, updated *before* computing each batch's keys;
- a FIFO queue keeps the K most recent L2-normalised keys together with their public-set indices;
- each batch's keys are enqueued *before* the logits are computed, so every query's own key is in the queue;
- logits ``q . queue^T / T`` are trained with soft cross-entropy against the ensemble row of the query,
  restricted to the queue's images and renormalised (``ssl_models.federated.similarity.distillation_targets``);
- the first ``ceil(K / B)`` iterations only fill the queue (no loss, no optimizer step); ``queue_warmup=
  "every_epoch"`` repeats that at the start of every epoch over the public set, as the official code's
  ``if i < K // bs: continue`` inside its epoch loop (the queue itself is kept across epochs).

The auxiliary contrastive loss of the FLESD code has weight 0 by default and is not implemented.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ssl_models.data.augment import SSLAugment
from ssl_models.federated.similarity import distillation_targets
from ssl_models.networks.momentum import copy_as_target, ema_update_
from ssl_models.training import fast_path_for, optimizer_step

if TYPE_CHECKING:
    from ssl_models.methods.base import SSLMethod


# ------------------------------------------------------------------------------------------- queue
class IndexedQueue:
    """FIFO queue of K L2-normalised keys, stored as ``keys`` (dim, K), and their public-set ``indices`` (K,).

    Storage is circular (column ``ptr`` is overwritten next), so the column order is not the arrival
    order; keys and indices always share a column, which is all the loss needs. Empty slots hold zero
    keys and index -1 until ``full``.
    """

    def __init__(self, dim: int, size: int, device: torch.device | str = "cpu") -> None:
        for name, value in (("dim", dim), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.size = size
        self.keys = torch.zeros(dim, size, dtype=torch.float32, device=device)
        self.indices = torch.full((size,), -1, dtype=torch.long, device=device)
        self.ptr = 0  # next column to overwrite = the oldest key once full
        self.full = False

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, indices: torch.Tensor) -> None:
        """Append ``keys`` (B, dim) (L2-normalised here) and their ``indices`` (B,), overwriting the oldest.

        Writes wrap around the end of the storage; with B > K only the last K keys are kept.
        """
        if keys.dim() != 2 or keys.shape[1] != self.keys.shape[0]:
            raise ValueError(f"keys must have shape (B, dim={self.keys.shape[0]}), got {tuple(keys.shape)}")
        if indices.shape != (keys.shape[0],):
            raise ValueError(f"indices must have shape ({keys.shape[0]},), got {tuple(indices.shape)}")
        keys = F.normalize(keys.detach().float(), dim=1)[-self.size :]
        indices = indices.detach()[-self.size :]
        count = keys.shape[0]
        columns = (self.ptr + torch.arange(count, device=self.keys.device)) % self.size
        self.keys[:, columns] = keys.t().to(self.keys.device)
        self.indices[columns] = indices.to(self.indices.device, torch.long)
        self.full = self.full or self.ptr + count >= self.size
        self.ptr = (self.ptr + count) % self.size


# ------------------------------------------------------------------------------------------- loss
def similarity_distillation_loss(
    student_q: torch.Tensor, queue_keys: torch.Tensor, target_probs: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Soft cross-entropy ``-sum_j p_j log softmax(q . queue^T / T)_j``, averaged over the batch.

    ``student_q`` (B, dim) is L2-normalised here; ``queue_keys`` (dim, K) are expected normalised already
    (``IndexedQueue`` stores them so); ``target_probs`` (B, K) rows sum to 1. Equal to
    ``KL(p || softmax) + H(p)``: the entropy of the fixed targets shifts the value, never the gradient, so
    the minimum is H(p), not 0. Computed in float32 with autocast off (as ``ssl_models.methods.losses``).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if student_q.dim() != 2 or queue_keys.dim() != 2 or queue_keys.shape[0] != student_q.shape[1]:
        raise ValueError(
            f"student_q must be (B, dim) and queue_keys (dim, K), got {tuple(student_q.shape)} and "
            f"{tuple(queue_keys.shape)}"
        )
    if target_probs.shape != (student_q.shape[0], queue_keys.shape[1]):
        raise ValueError(
            f"target_probs must have shape (B={student_q.shape[0]}, K={queue_keys.shape[1]}), "
            f"got {tuple(target_probs.shape)}"
        )
    with torch.autocast(device_type=student_q.device.type, enabled=False):
        q = F.normalize(student_q.float(), dim=1)
        log_probs = F.log_softmax(q @ queue_keys.float() / temperature, dim=1)
        return -(target_probs.float().to(q.device) * log_probs).sum(dim=1).mean()


# ------------------------------------------------------------------------------------------- training loop
class _Encoder(nn.Module):
    """``projector(backbone(x))``; wraps the method's own modules (no copy) so EMA can pair parameters."""

    def __init__(self, backbone: nn.Module, projector: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.projector = projector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.backbone(x))


def build_key_encoder(method: SSLMethod) -> nn.Module:
    """A frozen deep copy of ``method.backbone`` + ``method.projector`` (the FLESD/MoCo key encoder)."""
    return copy_as_target(_Encoder(method.backbone, method.projector))


def _batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless epochs of shuffled index batches (drop-last, as the official DataLoader)."""
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def _check_positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


QUEUE_WARMUPS = ("start", "every_epoch")


def warmup_iterations(queue_size: int, batch_size: int) -> int:
    """Iterations that only fill the queue: ``ceil(K / B)`` (the code's ``K // bs`` when B divides K)."""
    return math.ceil(queue_size / batch_size)


def distill(
    method: SSLMethod,
    public_images: np.ndarray | torch.Tensor,
    ensemble: torch.Tensor,
    *,
    iterations: int,
    batch_size: int = 128,
    queue_size: int = 2048,
    momentum: float = 0.999,
    temperature: float = 0.1,
    lr: float = 1e-3,
    weight_decay: float = 1e-6,
    device: torch.device | str = "cpu",
    fast_path: bool = True,
    seed: int = 0,
    augment: SSLAugment | None = None,
    key_encoder: nn.Module | None = None,
    queue_warmup: str = "start",
    log: Callable[[str], None] | None = None,
) -> dict[str, float | int | str]:
    """Distil ``ensemble`` (N, N) into ``method.backbone`` + ``method.projector`` on ``public_images``.

    ``public_images`` are NHWC uint8, row i being ensemble index i. ``iterations`` counts batches including
    the ``ceil(queue_size / batch_size)`` warm-up iterations, so it must exceed them. ``queue_warmup``: "start"
    (warm up once) or "every_epoch" (the official code: the first warm-up batches of every epoch of
    ``N // batch_size`` drop-last batches only fill the queue, so an epoch must hold more batches than that).
    ``temperature`` is the student temperature (the target temperature was applied by
    ``ensemble_similarity``). ``key_encoder`` continues an existing momentum encoder (same architecture); by
    default a fresh copy of the student is made. The ensemble stays on its own device; only (B, K) target
    blocks are moved.

    Returns ``{"loss": mean over optimizer steps, "loss_first_quarter", "loss_last_quarter" (means over the first
    and the last quarter of the steps), "steps", "iterations", "warmup_iterations" (all skipped iterations),
    "queue_warmup", "seconds", "precision"}``.
    """
    device = torch.device(device) if isinstance(device, str) else device
    images = torch.as_tensor(public_images)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise ValueError(
            f"public_images: expected NHWC uint8 with 3 channels, got {tuple(images.shape)} {images.dtype}"
        )
    n = int(images.shape[0])
    if ensemble.shape != (n, n):
        raise ValueError(f"ensemble must have shape ({n}, {n}) to match public_images, got {tuple(ensemble.shape)}")
    iterations = _check_positive_int("iterations", iterations)
    batch_size = min(_check_positive_int("batch_size", batch_size), n)
    queue_size = _check_positive_int("queue_size", queue_size)
    warmup = warmup_iterations(queue_size, batch_size)
    if iterations <= warmup:
        raise ValueError(
            f"iterations ({iterations}) must exceed the queue warm-up of ceil(queue_size / batch_size) = {warmup}"
        )
    if queue_warmup not in QUEUE_WARMUPS:
        raise ValueError(f"queue_warmup must be one of {QUEUE_WARMUPS}, got {queue_warmup!r}")
    batches_per_epoch = n // batch_size
    if queue_warmup == "every_epoch" and batches_per_epoch <= warmup:
        raise ValueError(
            f"queue_warmup every_epoch: an epoch over {n} public images has {batches_per_epoch} batches of "
            f"{batch_size}, not more than the {warmup} warm-up batches, so no step would ever train"
        )
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")

    fp = fast_path_for(device, fast_path)
    images = images.to(device)
    method.to(device)
    student = _Encoder(method.backbone, method.projector)
    key_encoder = build_key_encoder(method) if key_encoder is None else key_encoder.to(device)
    if fp.channels_last:
        student.to(memory_format=torch.channels_last)
        key_encoder.to(memory_format=torch.channels_last)
    student.train()
    key_encoder.train()  # as MoCo: the key encoder normalises with batch statistics
    augment = (augment or SSLAugment(image_size=int(images.shape[1]))).to(device)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    scaler = torch.amp.GradScaler("cuda") if fp.grad_scaler else None
    augment_gen = torch.Generator(device=device).manual_seed(seed)
    batches = _batches(n, batch_size, torch.Generator().manual_seed(seed))
    queue: IndexedQueue | None = None

    total_loss, steps, skipped = 0.0, 0, 0
    step_losses: list[float] = []
    start = time.perf_counter()
    for iteration in range(iterations):
        position = iteration % batches_per_epoch if queue_warmup == "every_epoch" else iteration
        batch_idx = next(batches)
        view_q, view_k = augment.two_views(images[batch_idx.to(device)], generator=augment_gen)
        if fp.channels_last:
            view_q = view_q.contiguous(memory_format=torch.channels_last)
            view_k = view_k.contiguous(memory_format=torch.channels_last)
        with torch.autocast(
            device.type, dtype=fp.autocast_dtype or torch.float32, enabled=fp.autocast_dtype is not None
        ):
            with torch.no_grad():
                ema_update_(key_encoder, student, momentum)  # before the keys, as MoCo/FLESD
                keys = F.normalize(key_encoder(view_k).float(), dim=1)
            if queue is None:
                queue = IndexedQueue(keys.shape[1], queue_size, device=device)
            queue.enqueue(keys, batch_idx)  # before the logits: each query's own key is in the queue
            if position < warmup:
                skipped += 1
                continue
            targets = distillation_targets(ensemble, batch_idx, queue.indices).to(device)
            loss = similarity_distillation_loss(student(view_q), queue.keys, targets, temperature)
        step_losses.append(optimizer_step(loss, optimizer, scaler, f"distillation loss at iteration {iteration + 1}"))
        total_loss += step_losses[-1]
        steps += 1
        if log is not None and steps % 50 == 0:
            log(f"distillation step {steps}/{iterations - warmup}: mean loss so far {total_loss / steps:.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    quarter = max(1, steps // 4)
    return {
        "loss": total_loss / steps,
        # Whether the student fitted the ensemble: the mean loss of the first and of the last quarter of the steps.
        "loss_first_quarter": sum(step_losses[:quarter]) / quarter,
        "loss_last_quarter": sum(step_losses[-quarter:]) / quarter,
        "steps": steps,
        "iterations": iterations,
        "warmup_iterations": skipped,
        "queue_warmup": queue_warmup,
        "seconds": time.perf_counter() - start,
        "precision": fp.precision,
    }
