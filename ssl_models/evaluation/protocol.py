"""Evaluation of frozen SSL encoders: weighted kNN and a linear probe on precomputed features.

The project uses ONE fixed protocol so that numbers from different runs, methods and machines can be
compared. Change a default here only together with the results it invalidates.

Protocol
--------
1. Features. The backbone is switched to ``eval()`` (BatchNorm uses its running statistics, nothing is
   updated) and run under ``torch.no_grad()`` on the un-augmented images. Images are NHWC ``uint8`` and become
   float NCHW tensors in ``[0, 1]``, as in training; an encoder built with input normalisation
   (``augment.normalize``) applies its own ``(x - mean) / std`` layer, so evaluation matches its training.
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
5. Semi-supervised evaluation (FedEMA / EasyFL), a separate score reported per label fraction:
   * Labels. A class-balanced subset of the train split: every class gets ``round(fraction * N / num_classes)``
     images (rounded half up, at least 1), drawn from a NumPy generator seeded with ``seed``. For one seed the
     subsets are nested (the 1 % images are among the 10 % ones).
   * Model. The encoder followed by a 2-layer MLP head ``Linear(D, H) - BatchNorm1d(H) - ReLU - Linear(H, C)``
     with ``H = D`` unless given (EasyFL's ``--use_MLP`` uses 4096). The head starts from PyTorch's default
     ``nn.Linear`` initialisation drawn from a private generator seeded with ``seed``.
   * Training. Cross-entropy, Adam (lr 1e-3, no weight decay) for 100 epochs of shuffled mini-batches of 256,
     learning rate decayed to 0 by a per-step cosine (EasyFL keeps it constant and reports the best test
     epoch, which selects on the test set; we report the last epoch, and the decay makes it a stable one). A
     trailing mini-batch of a single image is skipped: BatchNorm cannot normalise one sample.
   * Two explicit modes, because EasyFL optimises only the head yet leaves the backbone in ``train()``, so
     its BatchNorm statistics drift while its weights stay fixed (EasyFL issue #26):
     ``finetune`` trains a deep copy of the backbone together with the head, the copy in ``train()`` mode;
     every batch is lightly augmented on the device (random 32x32 crop of the zero-padded (4 px) image and a
     horizontal flip with probability 1/2, as torchvision's ``RandomCrop(32, padding=4)`` +
     ``RandomHorizontalFlip()``; EasyFL uses none). ``head`` keeps the backbone frozen in ``eval()`` mode, so
     its features are computed once (protocol step 1, no augmentation) and only the head is trained on them.
   * Score. Test accuracy of backbone + head in ``eval()`` mode on the un-augmented test images.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ssl_models.data.augment import to_float_nchw

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

# Semi-supervised protocol constants (protocol step 5). Kept apart from DEFAULT_PROTOCOL, whose keys are the
# keyword arguments of ``evaluate_backbone``.
SEMI_SUPERVISED_PROTOCOL: Mapping[str, Any] = {
    "epochs": 100,
    "lr": 1e-3,
    "batch_size": 256,
    "mode": "finetune",
    "crop_padding": 4,
    "seed": 0,
}
SEMI_SUPERVISED_MODES = ("finetune", "head")

_STD_FLOOR = 1e-6

# --------------------------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------------------------


def _check_images(images: np.ndarray, name: str = "images") -> None:
    """Reject anything that is not an NHWC uint8 RGB batch, naming the argument."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(images).__name__}")  # noqa: TRY004 - bad images are a ValueError, like the checks below
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
    if not chunks:  # zero images: still return a well-formed (0, D) tensor
        return torch.zeros(0, _infer_feature_dim(backbone, images_uint8_nhwc.shape[1:3], device))
    return torch.cat(chunks)


def _infer_feature_dim(backbone: nn.Module, hw: tuple[int, ...], device: torch.device) -> int:
    """Feature length, from ``backbone.feature_dim`` or one dummy forward pass in eval mode."""
    if isinstance(feature_dim := getattr(backbone, "feature_dim", None), int):
        return feature_dim
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
        (train - mean) / std,
        train_y,
        num_classes,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        weight_decay=weight_decay,
        seed=seed,
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
            train_feats.to(device),
            y_train,
            test_feats.to(device),
            y_test,
            num_classes,
            k=knn_k,
            temperature=knn_temperature,
        )
        seconds["knn"] = time.perf_counter() - started
    if linear:
        started = time.perf_counter()
        result["linear_probe_acc"] = linear_probe_accuracy(
            train_feats,
            y_train,
            test_feats,
            y_test,
            num_classes,
            epochs=probe_epochs,
            lr=probe_lr,
            batch_size=probe_batch_size,
            weight_decay=probe_weight_decay,
            seed=seed,
            device=device,
        )
        seconds["linear_probe"] = time.perf_counter() - started
    result["seconds"] = seconds
    if return_features:
        result["train_features"] = train_feats
        result["test_features"] = test_feats
    return result


# --------------------------------------------------------------------------------------------------------------
# Semi-supervised evaluation (protocol step 5)
# --------------------------------------------------------------------------------------------------------------


def _check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def _check_int_at_least(value: int, name: str, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
    return int(value)


def class_balanced_label_subset(
    labels: np.ndarray | torch.Tensor, fraction: float, num_classes: int, seed: int = 0
) -> np.ndarray:
    """Sorted ``int64`` indices of the labelled images: the same number from every class (protocol step 5).

    Every class contributes ``round(fraction * len(labels) / num_classes)`` images (rounded half up, at least
    one). A class holding fewer images than that (possible only in an unbalanced label set) contributes all of
    them. Each class's indices are shuffled by one NumPy generator seeded with ``seed`` and the first ones are
    kept, so the subset is deterministic and, for one seed, a smaller fraction gives a subset of a larger one.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array of class ids, got shape {labels.shape}")
    if labels.size == 0:
        raise ValueError("labels must not be empty")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must hold integer class ids, got dtype {labels.dtype}")
    fraction = _check_fraction(fraction)
    num_classes = _check_int_at_least(num_classes, "num_classes", 1)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    per_class = max(1, math.floor(fraction * labels.shape[0] / num_classes + 0.5))
    rng = np.random.default_rng(seed)
    chosen = []
    for cls in range(num_classes):
        members = np.flatnonzero(labels == cls)
        if members.size == 0:
            raise ValueError(
                f"labels hold no image of class {cls}: a class-balanced subset needs at least one image of each "
                f"of the {num_classes} classes"
            )
        # Shuffling the whole class (not choosing per_class items) makes subsets nested across fractions.
        chosen.append(rng.permutation(members)[:per_class])
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def random_crop_flip(images: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """``RandomCrop(size, padding)`` + ``RandomHorizontalFlip(0.5)`` of a uint8 NHWC batch, batched on its device.

    Every sample is zero-padded by ``padding`` pixels on each side, cropped back to its own size at a uniform
    integer offset and mirrored with probability 1/2. Crop and flip are one gather, so pixels are copied, never
    interpolated. The draws come from ``generator`` (a CPU generator may drive a batch on another device).
    """
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be a uint8 (N, H, W, 3) tensor, got {images.dtype} {tuple(images.shape)}")
    padding = _check_int_at_least(padding, "padding", 0)
    num, height, width, _ = images.shape
    draw_device = generator.device if generator is not None else images.device
    top = torch.randint(0, 2 * padding + 1, (num,), generator=generator, device=draw_device).to(images.device)
    left = torch.randint(0, 2 * padding + 1, (num,), generator=generator, device=draw_device).to(images.device)
    flip = (torch.rand(num, generator=generator, device=draw_device) < 0.5).to(images.device)
    padded = F.pad(images, (0, 0, padding, padding, padding, padding))  # pads W and H, not the channels
    rows = top[:, None] + torch.arange(height, device=images.device)  # (N, H)
    columns = torch.arange(width, device=images.device).expand(num, width)
    # Mirroring the crop: output column j reads crop column W-1-j.
    columns = torch.where(flip[:, None], width - 1 - columns, columns) + left[:, None]  # (N, W)
    samples = torch.arange(num, device=images.device)[:, None, None]
    return padded[samples, rows[:, :, None], columns[:, None, :]]


def _seeded_linear(in_features: int, out_features: int, generator: torch.Generator | None) -> nn.Linear:
    """``nn.Linear`` with PyTorch's default init (weights and bias uniform in +-1/sqrt(fan_in)) from ``generator``.

    (``kaiming_uniform_(a=sqrt(5))``, the default weight init, is exactly that bound.) ``skip_init`` keeps the
    constructor from drawing from, and advancing, the global RNG.
    """
    layer = torch.nn.utils.skip_init(nn.Linear, in_features, out_features)
    bound = 1.0 / math.sqrt(in_features)
    with torch.no_grad():
        nn.init.uniform_(layer.weight, -bound, bound, generator=generator)
        nn.init.uniform_(layer.bias, -bound, bound, generator=generator)
    return layer


def build_mlp_head(
    feature_dim: int, num_classes: int, hidden_dim: int | None = None, generator: torch.Generator | None = None
) -> nn.Sequential:
    """The semi-supervised head ``Linear(D, H) - BatchNorm1d(H) - ReLU - Linear(H, C)``, H = D by default.

    Built on the CPU; the linear layers are initialised from ``generator`` (see ``_seeded_linear``).
    """
    feature_dim = _check_int_at_least(feature_dim, "feature_dim", 1)
    num_classes = _check_int_at_least(num_classes, "num_classes", 2)
    hidden_dim = feature_dim if hidden_dim is None else _check_int_at_least(hidden_dim, "hidden_dim", 1)
    return nn.Sequential(
        _seeded_linear(feature_dim, hidden_dim, generator),
        nn.BatchNorm1d(hidden_dim),
        nn.ReLU(inplace=True),
        _seeded_linear(hidden_dim, num_classes, generator),
    )


def _check_training_args(epochs: int, lr: float, batch_size: int) -> None:
    _check_int_at_least(epochs, "epochs", 1)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    # BatchNorm in train mode cannot normalise a batch of one sample.
    _check_int_at_least(batch_size, "batch_size", 2)


def _fit_classifier(
    model: nn.Module,
    num_items: int,
    inputs_of: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> None:
    """Train ``model`` (all its parameters, in ``train()`` mode) with cross-entropy, Adam and a cosine decay to 0.

    ``inputs_of(index)`` returns the model input of a batch of item indices (augmented images, precomputed
    features, ...); ``labels`` and the indices live on the model's device. The order of every epoch is drawn
    from the CPU ``generator``. A trailing batch of a single item is skipped: BatchNorm needs two samples.
    """
    # Batch starts below num_items - 1: exactly drops a final batch that would hold one item.
    starts = range(0, num_items - 1, batch_size)
    total_steps = epochs * len(starts)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    )
    model.train()
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(num_items, generator=generator).to(labels.device)
            for start in starts:
                index = order[start : start + batch_size]
                loss = F.cross_entropy(model(inputs_of(index)), labels[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
    model.eval()


def fit_mlp_head(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    hidden_dim: int | None = None,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
) -> nn.Sequential:
    """Train the MLP head on precomputed frozen features (protocol step 5, ``head`` mode), on ``features.device``.

    Deterministic for a given ``seed``: the head's initialisation and the shuffling both come from one private
    CPU generator seeded with it. Returns the head in ``eval()`` mode.
    """
    features = _as_features(features, "features")
    labels = _as_labels(labels, features.shape[0], num_classes, "labels")
    _check_training_args(epochs, lr, batch_size)
    if features.shape[0] < 2:
        raise ValueError(f"features must have at least 2 rows (BatchNorm needs two samples), got {features.shape[0]}")
    generator = torch.Generator().manual_seed(seed)
    head = build_mlp_head(features.shape[1], num_classes, hidden_dim, generator).to(features.device)
    _fit_classifier(
        head,
        features.shape[0],
        lambda index: features[index],
        labels.to(features.device),
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        generator=generator,
    )
    return head


def _finetune_classifier(
    backbone: nn.Module,
    images: np.ndarray,
    labels: torch.Tensor,
    num_classes: int,
    *,
    hidden_dim: int | None,
    epochs: int,
    lr: float,
    batch_size: int,
    augment: bool,
    device: torch.device,
    seed: int,
) -> nn.Sequential:
    """``finetune`` mode: train a deep copy of ``backbone`` plus a new MLP head; returns both in one module.

    The caller's backbone is never touched. The labelled images stay on ``device`` as uint8 for the whole run
    and every batch is augmented there (``random_crop_flip``) when ``augment`` is set. One CPU generator
    seeded with ``seed`` draws the head's initialisation, then the shuffling and augmentation of every step.
    """
    generator = torch.Generator().manual_seed(seed)
    encoder = copy.deepcopy(backbone).to(device)
    encoder.requires_grad_(True)  # a caller that froze its backbone must not freeze the fine-tuning
    feature_dim = _infer_feature_dim(encoder, images.shape[1:3], device)
    classifier = nn.Sequential(encoder, build_mlp_head(feature_dim, num_classes, hidden_dim, generator).to(device))
    pixels = _uint8_batch_on(images, device)

    def inputs_of(index: torch.Tensor) -> torch.Tensor:
        batch = pixels[index]
        if augment:
            batch = random_crop_flip(batch, SEMI_SUPERVISED_PROTOCOL["crop_padding"], generator)
        # to_float_nchw returns a permuted (channels-last) view. Made contiguous because the CPU backward pass
        # of the ResNet crashes (segfault / heap corruption, torch 2.14.1) on channels-last batches whose size
        # is not a multiple of 8; inference on such views (extract_features) is unaffected.
        return to_float_nchw(batch).contiguous()

    _fit_classifier(
        classifier,
        len(images),
        inputs_of,
        labels.to(device),
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        generator=generator,
    )
    return classifier


def semi_supervised_accuracy(
    backbone: nn.Module,
    x_train: np.ndarray,
    y_train: np.ndarray | torch.Tensor,
    x_test: np.ndarray,
    y_test: np.ndarray | torch.Tensor,
    num_classes: int,
    fraction: float,
    *,
    epochs: int = SEMI_SUPERVISED_PROTOCOL["epochs"],
    lr: float = SEMI_SUPERVISED_PROTOCOL["lr"],
    batch_size: int = SEMI_SUPERVISED_PROTOCOL["batch_size"],
    hidden_dim: int | None = None,
    mode: str = SEMI_SUPERVISED_PROTOCOL["mode"],
    augment: bool | None = None,
    device: str | torch.device = "cpu",
    seed: int = SEMI_SUPERVISED_PROTOCOL["seed"],
    feature_batch_size: int = DEFAULT_PROTOCOL["feature_batch_size"],
) -> dict[str, Any]:
    """Test accuracy after training on ``fraction`` of the train labels, class-balanced (protocol step 5).

    ``mode="finetune"`` trains a deep copy of the backbone (in ``train()`` mode) and the MLP head together;
    ``mode="head"`` freezes the backbone in ``eval()`` mode, computes the features once and trains only the
    head on them. ``augment`` (crop with 4 px zero padding + horizontal flip) defaults to on for ``finetune``;
    ``head`` mode cannot augment, since its features are computed once. ``hidden_dim`` defaults to the feature
    dimension. The caller's backbone keeps its weights, BatchNorm statistics and train/eval modes (``head`` mode
    moves it to ``device``, as ``extract_features`` does). ``seed`` drives the label subset, the head's
    initialisation, the shuffling and the augmentation.

    Returns ``{"fraction", "num_labelled", "mode", "augment", "accuracy", "epochs", "seconds"}`` with the
    accuracy as a fraction in [0, 1] and ``seconds`` the wall-clock time of the whole call.
    """
    started = time.perf_counter()
    _check_images(x_train, "x_train")
    _check_images(x_test, "x_test")
    num_classes = _check_int_at_least(num_classes, "num_classes", 2)
    train_y = _as_labels(y_train, x_train.shape[0], num_classes, "y_train")
    test_y = _as_labels(y_test, x_test.shape[0], num_classes, "y_test")
    if x_test.shape[0] == 0:
        raise ValueError("x_test must contain at least one image (accuracy is undefined otherwise)")
    if mode not in SEMI_SUPERVISED_MODES:
        raise ValueError(f"mode must be one of {SEMI_SUPERVISED_MODES}, got {mode!r}")
    _check_training_args(epochs, lr, batch_size)
    augment = mode == "finetune" if augment is None else bool(augment)
    if augment and mode == "head":
        raise ValueError("augment=True needs mode='finetune': head mode trains on features computed once")
    device = torch.device(device)

    subset = class_balanced_label_subset(train_y.numpy(), fraction, num_classes, seed)
    images, labels = x_train[subset], train_y[torch.from_numpy(subset)]
    if mode == "finetune":
        classifier = _finetune_classifier(
            backbone,
            images,
            labels,
            num_classes,
            hidden_dim=hidden_dim,
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            augment=augment,
            device=device,
            seed=seed,
        )
        # extract_features runs any module in eval() mode over uint8 images: here it yields the logits.
        logits = extract_features(classifier, x_test, device=device, batch_size=feature_batch_size)
    else:
        train_feats = extract_features(backbone, images, device=device, batch_size=feature_batch_size)
        head = fit_mlp_head(
            train_feats.to(device),
            labels,
            num_classes,
            hidden_dim=hidden_dim,
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            seed=seed,
        )
        test_feats = extract_features(backbone, x_test, device=device, batch_size=feature_batch_size)
        with torch.no_grad():
            logits = head(test_feats.to(device))
    return {
        "fraction": float(fraction),
        "num_labelled": len(subset),
        "mode": mode,
        "augment": augment,
        "accuracy": accuracy(logits.argmax(dim=1), test_y),
        "epochs": int(epochs),
        "seconds": time.perf_counter() - started,
    }
