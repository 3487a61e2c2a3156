"""Hetero-SSFL kernels: representations of the RAD, their kernels, transport, the server average, and the local
alignment term with its gradient.

Hetero-SSFL (Makhija et al., "Federated Self-supervised Learning for Heterogeneous Clients") lets every client
keep its own encoder, of any architecture, and aligns the clients through a shared unlabelled set, the
Representation Alignment Dataset (RAD, N images every party holds identically):

1. client k computes the representations ``A_k`` (N, d_k) of the RAD with its online network (the paper: the
   **predictor output**; projector or backbone features as options) and the kernel ``K_k = A_k A_k^T`` (N, N),
   whose size does not depend on the client's width or architecture; it uploads ``K_k``;
2. the server averages the latest kernel of every client, ``K_bar = sum_j w_j K_j`` (uniform or data-size
   weights), and sends ``K_bar`` to the next round's clients;
3. a client trains on ``SSL loss + mu * (1 - CKA(K_k, K_bar))``, the gradient flowing through ``K_k`` into its
   network (``ssl_models.federated.cka.kernel_alignment_loss``).

When ``A_k`` is recomputed (``refresh``):

- ``step`` (the default; ``refresh_steps: 1``): at every local step the client forwards the RAD with its current
  weights and adds ``mu (1 - CKA(K_k, K_bar))`` and its gradient there, so every step minimises Eq. 2 evaluated at
  the current weights (FedHeNN recomputes its representations at every step too). ``refresh_steps: k > 1`` reuses
  a refresh for k steps (cheaper, stale in between, as ``epoch`` below).
- ``minibatch``: at every step a random ``rad_batch_size`` subset of the RAD against the matching sub-block of
  ``K_bar``, with the graph: Eq. 2's term at the current weights on a minibatch (cheap for a large RAD; the CKA of a
  subset is a noisy, biased estimate of the full one).
- ``epoch``: ``A_k`` once per local epoch, at its start (a literal reading of Algorithm 1's "once per local
  epoch"). The term's value and gradient ``g`` are taken there and ``g`` is added unchanged to every step of the
  epoch (through the surrogate ``<g, theta> - <g, theta>.detach()``, so the optimizer, weight decay and gradient
  scaling treat it as part of the loss). Between refreshes the term is thus **linearised**: a constant vector with
  no minimum, which under Adam moves every coordinate it dominates by up to lr per step, whatever the alignment
  does; measured at CPU scale, the clients' CKA to K_bar fell during local training in most rounds. Kept as a
  named option for that comparison, not as the default.

A detached ``K_k`` would give the alignment term no gradient at all (the bug of a public re-implementation).

**Precision of the alignment term's RAD forward** (``rad_precision``, the aligner's ``forward_dtype``): ``train``
(the default) runs the network part of that forward and its backward as the local SSL step runs its own: bfloat16
autocast and channels-last memory on the fast path (CPUs with native bf16 matrix units, bf16-capable GPUs), float32
elsewhere; ``fp32`` runs it in float32 always. Either way the representations are cast to float32 before the
kernel, and the CKA and its gradient in feature space are float32 (``cka``'s functions switch autocast off). The
kernels a client uploads and the CKA it reports (``rad_representations``) are always float32: they are what the
server averages and what the logs compare. The RAD forward and backward are most of an aligned step's work, so
``train`` speeds up every aligned step where bf16 is native; its error on the term's gradient is smaller than the
SSL loss's own bf16 error (both measured in ``benchmarks/results/heterossfl_rad_precision.md``).

**BatchNorm during the RAD forward** (``bn_mode``): ``eval`` (default) uses the running statistics, so chunks are
independent and the RAD never updates them; ``train`` uses each forward chunk's batch statistics (as the SSL steps
do) without reading or updating the running statistics, so the RAD never changes them either.

The full-RAD gradient is computed without holding the RAD's activations: a no-grad pass gives ``A`` (N, d), the
gradient ``G = dL/dA`` is cheap (it lives in feature space), then the RAD is forwarded again chunk by chunk and
``<A_chunk, G_chunk>`` is differentiated into the parameters. For the linear kernel the loss is evaluated in
feature form against ``H K_bar H`` (centred once per round; ``cka.feature_alignment_loss``), so the client holds
K_bar, its centred copy and (N, d) matrices, never an N x N kernel of its own with autograd buffers. Peak memory:
one chunk's activations plus those.

Transport reuses FLESD's encodings (``ssl_models.federated.similarity``: ``dense-fp32``, ``dense-fp16``,
``topk``) plus one float32 ``scale``: fp16 and top-n% kernels are sent as ``K / max|K|`` (a raw ``A A^T`` can
exceed fp16's range of 65 504) and multiplied back on receipt, so the average keeps each client's own scale as
the paper's K_bar does. A top-n% kernel decodes with zeros in the dropped entries (lossy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ssl_models.accounting.flops import function_training_flops
from ssl_models.data.augment import to_float_nchw
from ssl_models.federated.cka import (
    center_kernel,
    cka,
    feature_alignment_loss,
    kernel_alignment_loss,
    linear_kernel,
    rbf_kernel,
)
from ssl_models.federated.similarity import DENSE_FP32, ENCODING_MODES, TOPK, decode_similarity, encode_similarity

if TYPE_CHECKING:
    from ssl_models.methods.base import SSLMethod

REPRESENTATIONS = ("predictor", "projector", "backbone")
KERNEL_FUNCTIONS = ("linear", "rbf")
REFRESH_MODES = ("step", "minibatch", "epoch")
RAD_PRECISIONS = ("train", "fp32")
BN_MODES = ("eval", "train")
KERNEL_WEIGHTS = ("uniform", "data_size")
KERNEL_NORMALIZATIONS = ("frobenius", "none")
SCALE_KEY = "scale"
DEFAULT_FORWARD_BATCH = 256
DEFAULT_CHUNK_ROWS = 1024


# ------------------------------------------------------------------------------------------------ representations
def representation_fn(method: SSLMethod, representation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map images -> representations used for the kernel.

    ``predictor``: the online network's output ``predictor(projector(backbone(x)))`` (the paper); a method without
    a predictor (SimCLR, MoCo) uses its projector output. ``projector``: ``projector(backbone(x))``. ``backbone``:
    the pooled backbone features.
    """
    if representation not in REPRESENTATIONS:
        raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {representation!r}")
    if representation == "backbone":
        return method.backbone
    if representation == "projector" or getattr(method, "predictor", None) is None:
        return lambda x: method.projector(method.backbone(x))
    return lambda x: method.predictor(method.projector(method.backbone(x)))


@contextmanager
def eval_mode(module: nn.Module):
    """``module.eval()`` for the block, then every submodule's own previous mode back."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield module
    finally:
        for m, mode in modes.items():
            m.train(mode)


@contextmanager
def rad_forward_mode(module: nn.Module, bn_mode: str = "eval"):
    """The modes of a RAD forward: everything in eval mode; with ``bn_mode="train"`` the BatchNorm layers normalise
    with each forward's batch statistics and neither read nor update their running statistics (they are switched
    to ``track_running_stats = False`` for the block, so a RAD forward never writes a buffer: an in-place write
    would also break the backward of a training step whose graph saved them). Every submodule's previous mode is
    restored."""
    if bn_mode not in BN_MODES:
        raise ValueError(f"bn_mode must be one of {BN_MODES}, got {bn_mode!r}")
    untracked: list[nn.modules.batchnorm._BatchNorm] = []
    with eval_mode(module):
        if bn_mode == "train":
            for m in module.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.train()
                    if m.track_running_stats:
                        m.track_running_stats = False
                        untracked.append(m)
        try:
            yield module
        finally:
            for m in untracked:
                m.track_running_stats = True


def _as_uint8_tensor(images: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    x = torch.as_tensor(np.require(images, requirements=["C", "W"]) if isinstance(images, np.ndarray) else images)
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise ValueError(f"RAD images: expected NHWC uint8 with 3 channels, got {tuple(x.shape)} {x.dtype}")
    return x.to(device)


def _float_input(images: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 NHWC -> float NCHW in the memory layout the model trains in (channels-last on the fast path, where a
    contiguous NCHW batch would make every convolution convert its input)."""
    x = to_float_nchw(images)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()


def _forward_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, batch_size: int, channels_last: bool = False
):
    """(start, stop, float32 representations) of ``images`` (uint8 NHWC on the model's device), chunk by chunk."""
    for start in range(0, images.shape[0], batch_size):
        stop = min(images.shape[0], start + batch_size)
        yield start, stop, fn(_float_input(images[start:stop], channels_last)).float()


def rad_representations(
    method: SSLMethod,
    images: np.ndarray | torch.Tensor,
    representation: str = "predictor",
    *,
    device: torch.device | str = "cpu",
    batch_size: int = DEFAULT_FORWARD_BATCH,
    bn_mode: str = "eval",
) -> torch.Tensor:
    """Representations (N, d) float32 on ``device`` of the RAD images, without gradient or augmentation, in float32
    (autocast off), in chunks of ``batch_size`` with BatchNorm as ``bn_mode`` says (``rad_forward_mode``). The
    method's train/eval modes and BatchNorm statistics are left as they were."""
    device = torch.device(device)
    method.to(device)
    x = _as_uint8_tensor(images, device)
    fn = representation_fn(method, representation)
    with rad_forward_mode(method, bn_mode), torch.no_grad(), torch.autocast(device.type, enabled=False):
        return torch.cat([a for _, _, a in _forward_chunks(fn, x, batch_size)])


def client_kernel(features: torch.Tensor, kernel: str = "linear", rbf_threshold: float = 0.5) -> torch.Tensor:
    """The client's kernel of its RAD representations, float32 (N, N): ``A A^T`` (linear, the paper) or the RBF
    kernel with bandwidth ``rbf_threshold`` x the median distance."""
    if kernel not in KERNEL_FUNCTIONS:
        raise ValueError(f"kernel must be one of {KERNEL_FUNCTIONS}, got {kernel!r}")
    with torch.autocast(device_type=features.device.type, enabled=False):
        a = features.float()
        return linear_kernel(a) if kernel == "linear" else rbf_kernel(a, rbf_threshold)


def centred_kernel_norm(kernel: torch.Tensor) -> float:
    """``||H K H||_F``: the size with which a kernel enters K_bar (logged per client and round)."""
    with torch.no_grad(), torch.autocast(device_type=kernel.device.type, enabled=False):
        return float(torch.linalg.matrix_norm(center_kernel(kernel.detach().float())))


def normalize_kernel(kernel: torch.Tensor, normalization: str) -> torch.Tensor:
    """``frobenius`` (the default): ``K / ||H K H||_F``, so every client's centred kernel enters K_bar with norm 1
    and the average weighs clients as its weights say (the project's reading of the paper's uniform w = 1/n: raw
    kernels of a deeper or wider encoder are hundreds of times larger, which would make K_bar that client's kernel);
    ``none``: the kernel as it is (a client with larger representations weighs more in K_bar). A client's CKA to
    anything is unchanged either way (CKA is invariant to the kernel's scale)."""
    if normalization not in KERNEL_NORMALIZATIONS:
        raise ValueError(f"kernel normalization must be one of {KERNEL_NORMALIZATIONS}, got {normalization!r}")
    if normalization == "none":
        return kernel
    norm = centred_kernel_norm(kernel)
    return kernel / norm if norm > 0 else kernel


# ------------------------------------------------------------------------------------------------ transport
def encode_kernel(kernel: torch.Tensor, mode: str, fraction: float | None = None) -> dict[str, np.ndarray]:
    """Transport form of an (N, N) kernel: FLESD's ``encode_similarity`` payload of ``K / scale`` plus ``scale``
    (float32, shape (1,)). ``scale`` is ``max|K|`` for the fp16-valued modes (``dense-fp16``, ``topk``) and 1 for
    ``dense-fp32`` (sent exactly). ``fraction`` is for ``topk`` only."""
    if mode not in ENCODING_MODES:
        raise ValueError(f"kernel encoding must be one of {ENCODING_MODES}, got {mode!r}")
    k = kernel.detach().to("cpu", torch.float32)
    scale = 1.0
    if mode != DENSE_FP32:
        scale = float(k.abs().max()) if k.numel() else 1.0
        if not scale > 0:
            scale = 1.0
        k = k / scale
    payload = encode_similarity(k, mode, fraction if mode == TOPK else None)
    payload[SCALE_KEY] = np.array([scale], dtype=np.float32)
    return payload


def _split_payload(payload: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    if SCALE_KEY not in payload:
        raise ValueError(f"a kernel payload must hold {SCALE_KEY!r} besides its values, got keys {sorted(payload)}")
    rest = {k: v for k, v in payload.items() if k != SCALE_KEY}
    scale = float(np.asarray(payload[SCALE_KEY], dtype=np.float64).reshape(-1)[0])
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"kernel payload scale must be a positive number, got {scale}")
    return rest, scale


def decode_kernel(payload: Mapping[str, np.ndarray], n: int) -> torch.Tensor:
    """Dense float32 (n, n) kernel from ``encode_kernel``'s payload (top-n%: dropped entries are 0)."""
    rest, scale = _split_payload(payload)
    values, _ = decode_similarity(rest, n)
    return values.mul_(scale) if scale != 1.0 else values


def check_kernel_payload(payload: Mapping[str, np.ndarray], n: int) -> None:
    """Raise ValueError unless ``payload`` is a kernel payload for an (n, n) kernel."""
    rest, _ = _split_payload(payload)
    values = np.asarray(rest.get("values"))
    if set(rest) == {"values"}:
        if values.shape != (n, n):
            raise ValueError(f"dense kernel payload has shape {values.shape}, expected ({n}, {n}) (the RAD size)")
    elif set(rest) == {"values", "indices"}:
        indices = np.asarray(rest["indices"])
        if values.ndim != 2 or values.shape[0] != n or indices.shape != values.shape or values.shape[1] > n:
            raise ValueError(f"top-n% kernel payload has shapes {values.shape}/{indices.shape}, expected ({n}, k)")
        if indices.size and (indices.min() < 0 or indices.max() >= n):
            raise ValueError(f"top-n% kernel payload indices must lie in [0, {n})")
    else:
        raise ValueError(
            f"kernel payload must hold 'values' (+ 'indices' for top-n%) and 'scale', got {sorted(payload)}"
        )


# ------------------------------------------------------------------------------------------------ server average
def average_kernels(
    sources: Iterable[tuple[Mapping[str, np.ndarray], float]], n: int, *, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """``K_bar = sum_j w_j K_j / sum_j w_j`` over ``(payload, weight)`` pairs, float32 (n, n) on the CPU.

    ``sources`` may be a generator (e.g. reading one client's kernel from disk at a time): it is consumed once
    and each payload is added ``chunk_rows`` rows at a time, so the server holds the accumulator, one payload
    and one row block. Weights must be positive; they are normalised here.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    acc = torch.zeros(n, n, dtype=torch.float32)
    total = 0.0
    for payload, weight in sources:
        weight = float(weight)
        if not weight > 0:
            raise ValueError(f"kernel weights must be > 0, got {weight}")
        check_kernel_payload(payload, n)
        rest, scale = _split_payload(payload)
        values, indices = rest["values"], rest.get("indices")
        for start in range(0, n, chunk_rows):
            stop = min(n, start + chunk_rows)
            block = torch.from_numpy(np.asarray(values[start:stop], dtype=np.float32))
            if indices is not None:  # top-n% rows: scatter into a dense zero block
                cols = torch.from_numpy(np.asarray(indices[start:stop]).astype(np.int64))
                block = torch.zeros(stop - start, n, dtype=torch.float32).scatter_(1, cols, block)
            acc[start:stop].add_(block, alpha=weight * scale)
        total += weight
        del payload, values, indices
    if total == 0.0:
        raise ValueError("average_kernels needs at least one kernel")
    return acc.div_(total)


# ------------------------------------------------------------------------------------------------ the local term
@dataclass
class AlignmentStats:
    """What the alignment term did during one local round."""

    values: list[float] = field(default_factory=list)  # mu * (1 - CKA) at every refresh (every step: minibatch)
    ckas: list[float] = field(default_factory=list)  # CKA(K_k, K_bar) at the same moments (minibatch: on the subset)
    refreshes: int = 0
    # RAD images the term sent through the network: with a backward into the parameters, and forward only (the
    # no-gradient pass of a RAD larger than one forward batch); times rad_term_flops' per-image figures = its cost.
    images_forward_backward: int = 0
    images_forward_only: int = 0

    @property
    def mean_value(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None

    def flops(self, per_image: Mapping[str, float]) -> float:
        """FLOPs of the term's network passes this round, from ``rad_term_flops``' per-image forward / backward
        (the kernel and CKA arithmetic, O(N^2 d) against the network's O(N) passes, is left out)."""
        forward, backward = float(per_image["forward"]), float(per_image["backward"])
        return self.images_forward_backward * (forward + backward) + self.images_forward_only * forward


def rad_term_flops(method: SSLMethod, representation: str, image_shape: tuple[int, ...]) -> dict[str, float]:
    """Per-image FLOPs (forward, backward, total) of one RAD image's pass for the kernel: through
    ``representation_fn(method, representation)`` and back into every trainable parameter (counted on a deep copy,
    ``function_training_flops``)."""
    return function_training_flops(method, lambda m: representation_fn(m, representation), image_shape, batch_size=2)


class KernelAligner:
    """The Hetero-SSFL alignment term ``mu * (1 - CKA(K_k, K_bar))`` for ``train_ssl``'s hooks.

    ``on_epoch_start`` (``epoch_hook``) and ``loss`` (``loss_hook``) implement the refresh modes of the module
    docstring (``step``, ``minibatch``, ``epoch``). ``target_kernel`` is the server's K_bar (N, N); ``rad_images``
    the RAD (N, H, W, 3) uint8; ``bn_mode`` the BatchNorm mode of every RAD forward (``rad_forward_mode``);
    ``forward_dtype`` the autocast dtype of the network part of those forwards (None: float32; ``torch.bfloat16``:
    the fast path's), ``channels_last`` their input layout (the model's, on the fast path).
    """

    def __init__(
        self,
        rad_images: np.ndarray | torch.Tensor,
        target_kernel: torch.Tensor,
        *,
        mu: float,
        representation: str = "predictor",
        kernel: str = "linear",
        rbf_threshold: float = 0.5,
        refresh: str = "step",
        refresh_steps: int = 1,
        rad_batch_size: int = 256,
        forward_batch_size: int = DEFAULT_FORWARD_BATCH,
        bn_mode: str = "eval",
        forward_dtype: torch.dtype | None = None,
        channels_last: bool = False,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        if refresh not in REFRESH_MODES:
            raise ValueError(f"refresh must be one of {REFRESH_MODES}, got {refresh!r}")
        if representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {representation!r}")
        if kernel not in KERNEL_FUNCTIONS:
            raise ValueError(f"kernel must be one of {KERNEL_FUNCTIONS}, got {kernel!r}")
        if bn_mode not in BN_MODES:
            raise ValueError(f"bn_mode must be one of {BN_MODES}, got {bn_mode!r}")
        for name, value in (
            ("refresh_steps", refresh_steps),
            ("rad_batch_size", rad_batch_size),
            ("forward_batch_size", forward_batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or mu < 0:
            raise ValueError(f"mu must be a number >= 0, got {mu!r}")
        self.device = torch.device(device)
        self.rad = _as_uint8_tensor(rad_images, self.device)
        n = self.rad.shape[0]
        if tuple(target_kernel.shape) != (n, n):
            raise ValueError(
                f"target kernel has shape {tuple(target_kernel.shape)}, expected ({n}, {n}) for a RAD of {n} images"
            )
        if refresh == "minibatch" and rad_batch_size < 4:
            raise ValueError(f"rad_batch_size must be >= 4 for a CKA on a minibatch, got {rad_batch_size}")
        self.target = target_kernel.detach().to(self.device, torch.float32)
        # Linear kernel on the whole RAD: the loss in feature form against H K_bar H, centred once here, so the
        # client never builds (or differentiates through) an N x N matrix of its own.
        self.centered_target = center_kernel(self.target) if kernel == "linear" and refresh != "minibatch" else None
        self.mu = float(mu)
        self.representation, self.kernel, self.rbf_threshold = representation, kernel, float(rbf_threshold)
        self.refresh, self.refresh_steps, self.bn_mode = refresh, refresh_steps, bn_mode
        if forward_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"forward_dtype must be None (float32) or torch.bfloat16, got {forward_dtype!r}")
        # The network part of every RAD forward of the term (the kernel and CKA stay float32 in any case).
        self.forward_dtype = None if forward_dtype == torch.float32 else forward_dtype
        self.channels_last = bool(channels_last)
        self.rad_batch_size, self.forward_batch_size = min(rad_batch_size, n), forward_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = AlignmentStats()
        self._grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._value = 0.0
        self._calls = 0
        self._refreshed = False

    # ---------------------------------------------------------------- hooks for train_ssl
    def on_epoch_start(self, method: SSLMethod, epoch: int) -> None:
        if self.refresh == "epoch":
            self._refresh(method)

    def loss(self, method: SSLMethod) -> torch.Tensor:
        """The alignment term of one step (a tensor added to the SSL loss)."""
        if self.refresh == "minibatch":
            return self._minibatch_loss(method)
        if not self._refreshed or (self.refresh == "step" and self._calls % self.refresh_steps == 0):
            self._refresh(method)
        self._calls += 1
        # Value: the term as last computed; gradient: its gradient there (at these very weights in ``step`` mode
        # with refresh_steps 1, so the step minimises Eq. 2 itself).
        surrogate = torch.zeros((), device=self.device)
        for p, g in self._grads:
            surrogate = surrogate + (g * p).sum()
        return surrogate - surrogate.detach() + self._value

    # ---------------------------------------------------------------- computations
    def _network_precision(self):
        """Autocast for the network part of a RAD forward, set explicitly (the hooks run both inside the training
        step's autocast and outside it, at an epoch's start)."""
        return torch.autocast(
            self.device.type, dtype=self.forward_dtype or torch.float32, enabled=self.forward_dtype is not None
        )

    def _kernel_loss(self, features: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.centered_target is not None and target is self.target:
            loss = feature_alignment_loss(features, self.centered_target)
        else:
            loss = kernel_alignment_loss(client_kernel(features, self.kernel, self.rbf_threshold), target)
        return self.mu * loss, 1.0 - float(loss.detach())

    def _record(self, value: float, similarity: float) -> None:
        self.stats.values.append(value)
        self.stats.ckas.append(similarity)

    def _refresh(self, method: SSLMethod) -> None:
        """Recompute A_k on the whole RAD, the term's value and its gradient w.r.t. the trainable parameters."""
        params = [p for p in method.trainable_parameters() if p.requires_grad]
        fn = representation_fn(method, self.representation)
        n = self.rad.shape[0]
        grads: Sequence[torch.Tensor | None]
        with rad_forward_mode(method, self.bn_mode), self._network_precision():
            if n <= self.forward_batch_size:  # one pass with the graph
                features = fn(_float_input(self.rad, self.channels_last)).float()
                loss, similarity = self._kernel_loss(features, self.target)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                self.stats.images_forward_backward += n
            else:  # no-grad pass, dL/dA in feature space, then chunk-wise backward through the network
                with torch.no_grad():
                    features = torch.cat(
                        [a for _, _, a in _forward_chunks(fn, self.rad, self.forward_batch_size, self.channels_last)]
                    )
                features.requires_grad_(True)
                loss, similarity = self._kernel_loss(features, self.target)
                (grad_features,) = torch.autograd.grad(loss, features)
                grads = [None] * len(params)
                for start, stop, a in _forward_chunks(fn, self.rad, self.forward_batch_size, self.channels_last):
                    part = torch.autograd.grad((a * grad_features[start:stop]).sum(), params, allow_unused=True)
                    grads = [g if d is None else (d if g is None else g + d) for g, d in zip(grads, part)]
                self.stats.images_forward_only += n
                self.stats.images_forward_backward += n
        self._grads = [(p, g.detach()) for p, g in zip(params, grads) if g is not None]
        self._value = float(loss.detach())
        self._refreshed = True
        self.stats.refreshes += 1
        self._record(self._value, similarity)

    def _minibatch_loss(self, method: SSLMethod) -> torch.Tensor:
        n = self.rad.shape[0]
        idx = torch.randperm(n, generator=self.generator)[: self.rad_batch_size].sort().values.to(self.device)
        fn = representation_fn(method, self.representation)
        with rad_forward_mode(method, self.bn_mode), self._network_precision():
            features = fn(_float_input(self.rad[idx], self.channels_last)).float()
            loss, similarity = self._kernel_loss(features, self.target[idx][:, idx])
        self.stats.refreshes += 1
        self.stats.images_forward_backward += int(idx.numel())  # its backward runs in the training step's
        self._record(float(loss.detach()), similarity)
        return loss


def kernel_cka(kernel: torch.Tensor, target_kernel: torch.Tensor) -> float:
    """CKA between two kernels, no gradient: how aligned a client's kernel is with K_bar (a metric)."""
    with torch.no_grad(), torch.autocast(device_type=kernel.device.type, enabled=False):
        return float(cka(kernel.detach().float(), target_kernel.detach().to(kernel.device, torch.float32)))
