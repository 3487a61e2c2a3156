"""Trained-encoder checkpoints (``model.pt``): just enough to rebuild the backbone and evaluate it.

A checkpoint is a ``torch.save``d dict holding only tensors and plain Python values, so it can be read back
with ``torch.load(weights_only=True)`` (no arbitrary pickle code runs when a downloaded file is opened)::

    {"format": "fedssl-encoder/1", "arch": "resnet18", "width": 1.0, "feature_dim": 512,
     "input_normalization": None or {"mean": [r, g, b], "std": [r, g, b]},
     "arch_options": {} or {"depth": s},
     "state_dict": {name: tensor, ...}, "extra": {...}}

The backbone is rebuilt with ``ssl_models.networks.build_backbone(arch, width, normalization)`` and loaded
strictly, so a file whose weights do not match its declared architecture is rejected instead of silently
half-loaded. ``input_normalization`` is the encoder's input layer ``(x - mean) / std`` (``augment.normalize``):
it is not part of the state dict, so it is recorded here and rebuilt on load; a file without the field (written
before it existed) has none. ``arch_options`` are the architecture options of ``build_backbone`` that shape the
weights: the number of blocks of a ViT (``depth``; a layer-wise run's encoder has as many blocks as it had stages),
read off the backbone when it is saved; a file without the field is rebuilt with the architecture's defaults.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ssl_models.networks import ARCH_OPTIONS, backbone_build_settings, build_backbone
from ssl_models.networks.input_norm import input_normalization_of

CHECKPOINT_FORMAT = "fedssl-encoder/1"
_REQUIRED_KEYS = ("format", "arch", "width", "feature_dim", "state_dict")
_PLAIN_SCALARS = (str, int, float, bool, type(None))


class CheckpointError(ValueError):
    """The file exists but is not a usable fedssl encoder checkpoint."""


def _plain_value(value: Any, where: str) -> Any:
    """Return ``value`` made of plain Python types and tensors only (numpy scalars/arrays are converted).

    Anything else would make ``torch.load(weights_only=True)`` refuse the whole file later, so fail now,
    naming the offending entry.
    """
    if isinstance(value, _PLAIN_SCALARS):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):  # subclasses (namedtuples, ...) become plain lists/tuples
        items = [_plain_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ValueError(f"extra: key {key!r} at {where} must be a str or int, got {type(key).__name__}")  # noqa: TRY004 - a bad checkpoint is a ValueError throughout
            plain[key] = _plain_value(item, f"{where}[{key!r}]")
        return plain
    raise ValueError(
        f"extra: value at {where} has type {type(value).__name__}; only str/int/float/bool/None, lists, "
        "tuples, dicts, numpy scalars/arrays and tensors can be stored"
    )


def _arch_options_of(backbone: nn.Module, arch: str) -> dict[str, Any]:
    """What shapes ``backbone``'s weights beyond arch and width, as ``build_backbone`` keywords: ``depth`` (blocks held)
    for a growable ViT, and the build settings (a ResNet's ``stem``, a ViT's ``image_size``) where they differ from
    the defaults, so that a file of a default encoder reads as it always did."""
    options: dict[str, Any] = {}
    if "depth" in ARCH_OPTIONS.get(arch, ()) and isinstance(depth := getattr(backbone, "depth", None), int):
        options["depth"] = int(depth)
    defaults = {"stem": "cifar", "image_size": 32}
    options.update({k: v for k, v in backbone_build_settings(backbone).items() if defaults.get(k) != v})
    return options


def _check_matches_architecture(
    state_dict: dict[str, torch.Tensor], arch: str, width: float, arch_options: dict[str, Any] | None = None
) -> int:
    """Build ``arch``/``width`` (with ``arch_options``) and compare parameter names and shapes; return its
    feature_dim."""
    reference, feature_dim = build_backbone(arch, width, **(arch_options or {}))
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    actual = {name: tuple(t.shape) for name, t in state_dict.items()}
    if expected != actual:
        missing = sorted(set(expected) - set(actual))[:3]
        unexpected = sorted(set(actual) - set(expected))[:3]
        reshaped = [n for n in expected if n in actual and expected[n] != actual[n]][:3]
        raise ValueError(
            f"backbone does not match arch={arch!r} width={width!r}: missing {missing}, unexpected "
            f"{unexpected}, shape mismatch {reshaped} (first three of each shown)"
        )
    return feature_dim


def save_encoder_checkpoint(
    path: str | os.PathLike[str],
    backbone: nn.Module,
    arch: str,
    width: float,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``backbone``'s weights with the metadata needed to rebuild it; returns the written path.

    ``extra`` is free-form plain data (e.g. method name, round, config). The backbone is checked against
    ``build_backbone(arch, width)`` first, so an inconsistent checkpoint is never written. The file is written
    to a temporary name and renamed, so a crash never leaves a truncated ``model.pt`` behind; parent
    directories are created.
    """
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    state_dict = {name: tensor.detach().cpu().clone() for name, tensor in backbone.state_dict().items()}
    arch_options = _arch_options_of(backbone, arch)
    feature_dim = _check_matches_architecture(state_dict, arch, width, arch_options)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "arch": arch,
        "width": float(width),
        "feature_dim": int(feature_dim),
        "input_normalization": input_normalization_of(backbone),
        "arch_options": arch_options,
        "state_dict": state_dict,
        "extra": _plain_value(extra or {}, "extra"),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A unique sibling name (not tempfile.mkstemp, whose 0600 mode would survive the rename).
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        # Saving through a file object names the zip's inner folder "archive" instead of the temp file's name.
        with open(temporary, "xb") as handle:
            torch.save(payload, handle)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target


def _read_payload(path: Path, map_location: str | torch.device) -> dict[str, Any]:
    """``torch.load`` with weights_only, turning every "this is not our file" failure into CheckpointError."""
    if not path.exists():
        raise FileNotFoundError(f"encoder checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"encoder checkpoint path is not a file: {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # zip/pickle/unpickling-policy errors all mean "not a valid checkpoint"
        raise CheckpointError(f"{path} is not a readable torch checkpoint ({type(error).__name__}: {error})") from error
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is not a {CHECKPOINT_FORMAT} encoder checkpoint (found format {found!r})")
    missing = [key for key in _REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks the checkpoint fields {missing}")
    return payload


def load_encoder_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the encoder stored at ``path``; returns ``(backbone, info)``.

    The backbone is built with ``build_backbone`` (with its recorded input normalisation), loaded strictly,
    moved to ``map_location`` and put in ``eval()`` mode (checkpoints are read for evaluation; call
    ``.train()`` to fine-tune). ``info`` holds "format", "arch", "width", "feature_dim",
    "input_normalization", "extra", "path" and, when the file records some, "arch_options" (a ViT's depth).

    Raises ``FileNotFoundError`` for a missing file and ``CheckpointError`` (a ``ValueError``) for anything
    that is not a consistent fedssl encoder checkpoint.
    """
    path = Path(path)
    payload = _read_payload(path, map_location)
    norm = payload.get("input_normalization")
    arch_options = payload.get("arch_options") or {}
    try:
        backbone, feature_dim = build_backbone(
            payload["arch"], payload["width"], None if norm is None else (norm["mean"], norm["std"]), **arch_options
        )
        backbone.load_state_dict(payload["state_dict"], strict=True)
    except (ValueError, RuntimeError, TypeError, KeyError) as error:
        raise CheckpointError(
            f"{path}: weights do not fit arch={payload['arch']!r} width={payload['width']!r}: {error}"
        ) from error
    if feature_dim != payload["feature_dim"]:
        raise CheckpointError(
            f"{path}: stored feature_dim {payload['feature_dim']} but the rebuilt backbone has {feature_dim}"
        )
    backbone.to(map_location).eval()
    info = {key: payload[key] for key in ("format", "arch", "width", "feature_dim")}
    info["input_normalization"] = norm
    if arch_options:  # only for architectures shaped by options (a grown ViT's depth)
        info["arch_options"] = dict(arch_options)
    info["extra"] = payload.get("extra", {})
    info["path"] = str(path)
    return backbone, info
