"""Evaluation of frozen SSL encoders: weighted kNN and a linear probe on precomputed features.

The project uses ONE fixed protocol so that numbers from different runs, methods and machines can be
compared. Change a default here only together with the results it invalidates.

Protocol
--------
1. Features. The backbone is switched to ``eval()`` (BatchNorm uses its running statistics, nothing is
   updated) and run under ``torch.no_grad()`` on the un-augmented images. Images are NHWC ``uint8`` and become
   float NCHW tensors in ``[0, 1]`` with no mean/std normalisation (the EasyFL/FedEMA recipe used for training).
   Features are the pooled, flattened backbone outputs (no projector), gathered as float32 on the CPU, in
   batches of 512 (the batch size does not change the result because BatchNorm is frozen).
2. Weighted kNN (Wu et al., 2018, "InstDisc"). Train and test features are L2-normalised; the similarity is
   the cosine (dot product of unit vectors). For every test point the ``k = 200`` most similar train points
   vote for their label with weight ``exp(similarity / 0.1)``; the class with the largest summed weight wins
   (ties go to the lowest class index). ``k`` is capped at the number of train points.
3. Linear probe. One ``nn.Linear(feature_dim, num_classes)`` on the frozen features. Every feature dimension is
   standardised with the TRAIN mean and (population) standard deviation; dimensions that are constant on the
   train set (std below 1e-6, e.g. dead ReLU channels) get std 1 so they stay 0 instead of exploding. The
   layer starts at zero (the problem is convex, so zero init is a fine, seed-free starting point) and is trained
   with cross-entropy and Adam (lr 1e-3, no weight decay, betas (0.9, 0.999)) for 100 epochs of mini-batches of
   256, with the learning rate decayed to 0 by a per-step cosine schedule so the last epochs do not jitter. The
   only randomness is the shuffling order, drawn from a private ``torch.Generator`` seeded with ``seed``
   (default 0), so the probe is deterministic and does not touch the global RNG. On standardised 512-d features
   this converges in a few seconds on a CPU for 45k CIFAR images (about 17.6k Adam steps).
4. Scores are fractions in ``[0, 1]`` (fields named ``*_acc``), computed on the test split.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ssl_models.augment import to_float_nchw

# Protocol constants (see the module docstring). Kept in one mapping so CLIs and logs can record them.
DEFAULT_PROTOCOL: Mapping[str, Any] = {
    "feature_batch_size": 512,
    "knn_k": 200,
    "knn_temperature": 0.1,
    "probe_epochs": 100,
    "probe_lr": 1e-3,
    "probe_batch_size": 256,
    "probe_weight_decay": 0.0,
    "seed": 0,
}

_STD_FLOOR = 1e-6

# --------------------------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------------------------


def _check_images(images: np.ndarray, name: str = "images") -> None:
    """Reject anything that is not an NHWC uint8 RGB batch, naming the argument."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"{name} must have shape (N, H, W, 3), got {images.shape}")
    if images.dtype != np.uint8:
        raise ValueError(f"{name} must have dtype uint8, got {images.dtype}")


def _training_modes(module: nn.Module) -> dict[nn.Module, bool]:
    """Remember every submodule's mode: a parent in eval() may hold children in train() and vice versa."""
    return {sub: sub.training for sub in module.modules()}


def _restore_training_modes(modes: dict[nn.Module, bool]) -> None:
    for sub, was_training in modes.items():
        sub.train(was_training)


def _uint8_batch_on(images: np.ndarray, device: torch.device) -> torch.Tensor:
    """Move a uint8 batch to ``device`` before converting it: 4x less traffic than moving floats.

    ``np.require(..., "W")`` copies read-only arrays (e.g. cached data sets), which torch cannot wrap.
    """
    return torch.from_numpy(np.require(images, requirements=["C", "W"])).to(device, non_blocking=True)


def extract_features(
    backbone: nn.Module,
    images_uint8_nhwc: np.ndarray,
    device: str | torch.device = "cpu",
    batch_size: int = 512,
) -> torch.Tensor:
    """Frozen-backbone features ``(N, D)`` float32 on the CPU for NHWC uint8 images (protocol step 1).

    The backbone is moved to ``device`` (``nn.Module.to`` works in place) and run in ``eval()`` mode under
    ``torch.no_grad()``; the previous train/eval mode of every submodule is restored afterwards.
    ``no_grad`` rather than ``inference_mode`` because the linear probe later feeds these tensors to autograd,
    which inference tensors forbid.
    """
    _check_images(images_uint8_nhwc, "images_uint8_nhwc")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    modes = _training_modes(backbone)
    backbone.to(device)
    backbone.eval()
    chunks: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for start in range(0, len(images_uint8_nhwc), batch_size):
                batch = _uint8_batch_on(images_uint8_nhwc[start : start + batch_size], device)
                batch = to_float_nchw(batch)
                chunks.append(backbone(batch).float().cpu())
    finally:
        _restore_training_modes(modes)
    if not chunks:  # zero images: still return a well-formed (0, D) tensor if D is cheap to know
        return torch.zeros(0, _infer_feature_dim(backbone, images_uint8_nhwc.shape[1:3], device))
    return torch.cat(chunks)


def _infer_feature_dim(backbone: nn.Module, hw: tuple[int, ...], device: torch.device) -> int:
    """Feature length, from ``backbone.feature_dim`` or one dummy forward pass in eval mode."""
    if isinstance(getattr(backbone, "feature_dim", None), int):
        return backbone.feature_dim
    modes = _training_modes(backbone)
    backbone.eval()
    try:
        with torch.no_grad():
            return int(backbone(torch.zeros(1, 3, *hw, device=device)).shape[1])
    finally:
        _restore_training_modes(modes)


# --------------------------------------------------------------------------------------------------------------
# Argument helpers shared by kNN and the probe
# --------------------------------------------------------------------------------------------------------------


def _as_features(values: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(values)
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be 2-D (N, D), got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
    return tensor.float()


def _as_labels(values: torch.Tensor | np.ndarray, num_rows: int, num_classes: int, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(values)
    if tensor.ndim != 1 or tensor.shape[0] != num_rows:
        raise ValueError(f"{name} must be 1-D with {num_rows} entries, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer class indices, got {tensor.dtype}")
    tensor = tensor.long()
    if num_rows and (int(tensor.min()) < 0 or int(tensor.max()) >= num_classes):
        raise ValueError(f"{name} must lie in [0, {num_classes}), got range [{int(tensor.min())}, {int(tensor.max())}]")
    return tensor


def _check_pair(train: torch.Tensor, test: torch.Tensor, num_classes: int) -> None:
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if train.shape[0] == 0:
        raise ValueError("train_feats must contain at least one row")
    if test.shape[0] == 0:
        raise ValueError("test_feats must contain at least one row (accuracy is undefined otherwise)")
    if train.shape[1] != test.shape[1]:
        raise ValueError(f"train_feats and test_feats differ in width: {train.shape[1]} vs {test.shape[1]}")


# --------------------------------------------------------------------------------------------------------------
# Weighted kNN
# --------------------------------------------------------------------------------------------------------------


def knn_predict(
    bank_feats: torch.Tensor,
    bank_labels: torch.Tensor,
    query_feats: torch.Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    batch_size: int = 1024,
) -> torch.Tensor:
    """Weighted-kNN class predictions (protocol step 2) for ``query_feats``; labels must be valid long tensors."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    bank = F.normalize(bank_feats, dim=1)
    queries = F.normalize(query_feats.to(bank.device), dim=1)
    labels = bank_labels.to(bank.device)
    k = min(k, bank.shape[0])
    predictions = []
    for start in range(0, queries.shape[0], batch_size):
        similarity = queries[start : start + batch_size] @ bank.T  # cosine, (b, bank size)
        top_similarity, top_index = similarity.topk(k, dim=1)
        # exp((s - s_max) / t): dividing every weight of a row by the same exp(s_max / t) leaves the vote
        # unchanged but keeps tiny temperatures from overflowing float32.
        weights = torch.exp((top_similarity - top_similarity[:, :1]) / temperature)
        votes = torch.zeros(weights.shape[0], num_classes, dtype=weights.dtype, device=weights.device)
        votes.scatter_add_(1, labels[top_index], weights)
        predictions.append(votes.argmax(dim=1))  # argmax returns the first maximum: ties -> lowest class
    return torch.cat(predictions).cpu()


def knn_accuracy(
    train_feats: torch.Tensor | np.ndarray,
    train_labels: torch.Tensor | np.ndarray,
    test_feats: torch.Tensor | np.ndarray,
    test_labels: torch.Tensor | np.ndarray,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    batch_size: int = 1024,
) -> float:
    """Fraction of test points whose weighted-kNN vote over the train bank is correct (protocol step 2)."""
    train = _as_features(train_feats, "train_feats")
    test = _as_features(test_feats, "test_feats")
    _check_pair(train, test, num_classes)
    train_y = _as_labels(train_labels, train.shape[0], num_classes, "train_labels")
    test_y = _as_labels(test_labels, test.shape[0], num_classes, "test_labels")
    predicted = knn_predict(train, train_y, test, num_classes, k=k, temperature=temperature, batch_size=batch_size)
    return accuracy(predicted, test_y)


def accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of equal entries, as a Python float in [0, 1]."""
    return float((predicted.cpu() == labels.cpu()).double().mean())


# --------------------------------------------------------------------------------------------------------------
# Linear probe
# --------------------------------------------------------------------------------------------------------------


def standardisation_stats(train_feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension train mean and population std; near-constant dimensions get std 1 (see protocol step 3)."""
    mean = train_feats.mean(dim=0)
    std = train_feats.std(dim=0, unbiased=False) if train_feats.shape[0] > 1 else torch.zeros_like(mean)
    return mean, torch.where(std < _STD_FLOOR, torch.ones_like(std), std)


def fit_linear_probe(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 256,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> nn.Linear:
    """Train a zero-initialised linear classifier on (already standardised) features with Adam + cosine decay.

    Runs on ``features.device``. Deterministic for a given ``seed``: the shuffling uses a private CPU generator.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    device = features.device
    labels = labels.to(device)
    # skip_init: nn.Linear's default init would draw from (and advance) the global RNG for nothing.
    probe = torch.nn.utils.skip_init(nn.Linear, features.shape[1], num_classes, device=device)
    nn.init.zeros_(probe.weight)
    nn.init.zeros_(probe.bias)
    optimizer = torch.optim.Adam(probe.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(features.shape[0] / batch_size)
    total_steps = epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(features.shape[0], generator=generator).to(device)
            for start in range(0, features.shape[0], batch_size):
                index = order[start : start + batch_size]
                loss = F.cross_entropy(probe(features[index]), labels[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
    probe.eval()
    return probe


def linear_probe_accuracy(
    train_feats: torch.Tensor | np.ndarray,
    train_labels: torch.Tensor | np.ndarray,
    test_feats: torch.Tensor | np.ndarray,
    test_labels: torch.Tensor | np.ndarray,
    num_classes: int,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 256,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> float:
    """Test accuracy of a linear probe trained on standardised frozen train features (protocol step 3).

    ``device`` defaults to the device of ``train_feats``.
    """
    train = _as_features(train_feats, "train_feats")
    test = _as_features(test_feats, "test_feats")
    _check_pair(train, test, num_classes)
    train_y = _as_labels(train_labels, train.shape[0], num_classes, "train_labels")
    test_y = _as_labels(test_labels, test.shape[0], num_classes, "test_labels")
    device = torch.device(device) if device is not None else train.device
    train, test = train.to(device), test.to(device)
    mean, std = standardisation_stats(train)
    probe = fit_linear_probe(
        (train - mean) / std, train_y, num_classes,
        epochs=epochs, lr=lr, batch_size=batch_size, weight_decay=weight_decay, seed=seed,
    )
    with torch.no_grad():
        predicted = probe((test - mean) / std).argmax(dim=1)
    return accuracy(predicted, test_y)


# --------------------------------------------------------------------------------------------------------------
# Whole protocol
# --------------------------------------------------------------------------------------------------------------


def evaluate_backbone(
    backbone: nn.Module,
    x_train: np.ndarray,
    y_train: np.ndarray | torch.Tensor,
    x_test: np.ndarray,
    y_test: np.ndarray | torch.Tensor,
    num_classes: int,
    device: str | torch.device = "cpu",
    knn: bool = True,
    linear: bool = True,
    *,
    feature_batch_size: int = DEFAULT_PROTOCOL["feature_batch_size"],
    knn_k: int = DEFAULT_PROTOCOL["knn_k"],
    knn_temperature: float = DEFAULT_PROTOCOL["knn_temperature"],
    probe_epochs: int = DEFAULT_PROTOCOL["probe_epochs"],
    probe_lr: float = DEFAULT_PROTOCOL["probe_lr"],
    probe_batch_size: int = DEFAULT_PROTOCOL["probe_batch_size"],
    probe_weight_decay: float = DEFAULT_PROTOCOL["probe_weight_decay"],
    seed: int = DEFAULT_PROTOCOL["seed"],
    return_features: bool = False,
) -> dict[str, Any]:
    """Run the whole protocol: features for both splits, then kNN and/or the linear probe.

    Returns ``{"knn_acc", "linear_probe_acc", "num_train", "num_test", "feature_dim", "seconds"}``; a disabled
    score is ``None``; ``seconds`` maps "features", "knn" and "linear_probe" to wall-clock times. With
    ``return_features=True`` the CPU float32 tensors "train_features" and "test_features" are added too.
    kNN and the probe run on ``device`` as well.
    """
    _check_images(x_train, "x_train")
    _check_images(x_test, "x_test")
    started = time.perf_counter()
    train_feats = extract_features(backbone, x_train, device=device, batch_size=feature_batch_size)
    test_feats = extract_features(backbone, x_test, device=device, batch_size=feature_batch_size)
    seconds = {"features": time.perf_counter() - started, "knn": 0.0, "linear_probe": 0.0}
    result: dict[str, Any] = {
        "knn_acc": None,
        "linear_probe_acc": None,
        "num_train": int(train_feats.shape[0]),
        "num_test": int(test_feats.shape[0]),
        "feature_dim": int(train_feats.shape[1]),
    }
    if knn:
        started = time.perf_counter()
        result["knn_acc"] = knn_accuracy(
            train_feats.to(device), y_train, test_feats.to(device), y_test, num_classes,
            k=knn_k, temperature=knn_temperature,
        )
        seconds["knn"] = time.perf_counter() - started
    if linear:
        started = time.perf_counter()
        result["linear_probe_acc"] = linear_probe_accuracy(
            train_feats, y_train, test_feats, y_test, num_classes,
            epochs=probe_epochs, lr=probe_lr, batch_size=probe_batch_size,
            weight_decay=probe_weight_decay, seed=seed, device=device,
        )
        seconds["linear_probe"] = time.perf_counter() - started
    result["seconds"] = seconds
    if return_features:
        result["train_features"] = train_feats
        result["test_features"] = test_feats
    return result
