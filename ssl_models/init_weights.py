"""Start a run's encoder from saved weights (``model.init_weights``) instead of the seed's random ones.

Two kinds of file are accepted, both read with ``torch.load(weights_only=True)`` (no pickled code runs):

- a ``model.pt`` of this app (``ssl_models.evaluation.checkpoint``, format ``fedssl-encoder/1``): its
  ``state_dict`` is the backbone's;
- a plain state dict saved with ``torch.save`` (optionally nested under ``"state_dict"`` or ``"model"``), of the
  backbone alone, named as our backbones name their weights or as torchvision's ResNets do (``conv1``, ``bn1``,
  ``layerN.i.downsample``; the classifier ``fc.*`` is ignored). A DataParallel ``module.`` prefix is dropped, and
  from a whole SSL model's state dict (keys ``backbone.*``) only the online backbone is taken.

Only the backbone is loaded: projection/prediction heads keep their seeded initialisation (and a momentum
target, built from the backbone afterwards, starts as its copy). Loading is strict: every backbone tensor must be
in the file with the model's shape (BatchNorm's ``num_batches_tracked`` counters excepted, which old files lack),
and the file may hold nothing else; otherwise a ValueError names the file, the model, the first missing and
unexpected keys and the first shape mismatches. One exception: a layer-wise run's sub-model of s blocks (a ViT
built with an explicit ``depth``) takes the file's first s blocks.

``build_ssl_model`` is called many times per process (every client task, every evaluation), so a file is read
once per process and kept, keyed by its path, modification time and size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssl_models.config import ExperimentConfig
from ssl_models.evaluation.checkpoint import CHECKPOINT_FORMAT
from ssl_models.networks import build_backbone, describe_backbone
from ssl_models.networks.resnet import ResNetTrunk
from ssl_models.networks.vit import VisionTransformer, vit_depth_of_state

CONFIG_KEY = "model.init_weights"
NAMES_SHOWN = 5  # keys of each kind of problem an error message names
# Containers a training script commonly nests its state dict in (looked into in this order, one level at a time).
NESTING_KEYS = ("state_dict", "model")
# torchvision ResNet names -> ours, for names at the top of the module tree (their stem is conv1 + bn1).
TORCHVISION_STEM_NAMES = (("conv1.", "stem.0."), ("bn1.", "stem.1."))
TORCHVISION_CLASSIFIER_PREFIX = "fc."

# resolved path -> ((mtime_ns, size), backbone state, what the file is)
_read_files: dict[str, tuple[tuple[int, int], dict[str, torch.Tensor], str]] = {}


def read_init_weights(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], str]:
    """The backbone state dict held by the file at ``path`` (CPU tensors, keys as in the file) and a short phrase
    saying what the file is ("a model.pt of resnet18", "a plain state dict"). Read once per process while the
    file is unchanged; do not modify the returned tensors."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        reason = "is not a file" if resolved.exists() else "does not exist"
        raise ValueError(f"{CONFIG_KEY}: {path} {reason} (resolved to {resolved})")
    stat = resolved.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _read_files.get(str(resolved))
    if cached is not None and cached[0] == stamp:
        return cached[1], cached[2]
    try:
        payload = torch.load(resolved, map_location="cpu", weights_only=True)
    except Exception as error:  # zip/pickle/unpickling-policy errors all mean "not a usable weights file"
        raise ValueError(
            f"{CONFIG_KEY}: {path} is not a PyTorch file of weights that torch.load(weights_only=True) can read "
            f"({type(error).__name__}: {error})"
        ) from error
    state, kind = _backbone_state_of(payload, path)
    _read_files[str(resolved)] = (stamp, state, kind)
    return state, kind


def _backbone_state_of(payload: Any, path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], str]:
    """Unwrap a loaded file down to the backbone's tensors (see the module docstring for the layouts)."""
    if isinstance(payload, Mapping) and payload.get("format") == CHECKPOINT_FORMAT:
        payload, kind = payload.get("state_dict"), f"a model.pt of {payload.get('arch')}"
    else:
        kind = "a plain state dict"
        # a state dict's values are tensors, so a Mapping under one of these keys is a container, never a weight
        while isinstance(payload, Mapping):
            nested = next((key for key in NESTING_KEYS if isinstance(payload.get(key), Mapping)), None)
            if nested is None:
                break
            payload, kind = payload[nested], f"a plain state dict (under {nested!r})"
    if not isinstance(payload, Mapping) or not payload:
        raise ValueError(f"{CONFIG_KEY}: {path} holds no state dict (found {type(payload).__name__})")
    not_tensors = [str(key) for key, value in payload.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"{CONFIG_KEY}: {path} is not a state dict of tensors: {_first(not_tensors)} are not tensors")
    state = {str(key): value for key, value in payload.items()}
    if all(key.startswith("module.") for key in state):  # saved from a DataParallel/DDP wrapper
        state = {key[len("module.") :]: value for key, value in state.items()}
    if any(key.startswith("backbone.") for key in state):  # a whole SSL model: its online encoder only
        state = {key[len("backbone.") :]: value for key, value in state.items() if key.startswith("backbone.")}
        kind += ", backbone.* taken"
    return state, kind


def _our_names(state: Mapping[str, torch.Tensor], backbone: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` with torchvision's ResNet names mapped onto ours; returns (renamed state, ignored keys).

    Our ResNets name everything as torchvision does except the stem (``stem.0``/``stem.1`` for ``conv1``/``bn1``)
    and the projection shortcut (``shortcut`` for ``downsample``); our names never start with ``conv1.``/``bn1.``
    nor contain ``downsample``, so renaming cannot clash with a file that already uses our names.
    """
    if not isinstance(backbone, ResNetTrunk):
        return dict(state), []
    renamed: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, value in state.items():
        if key.startswith(TORCHVISION_CLASSIFIER_PREFIX):
            ignored.append(key)
            continue
        for theirs, ours in TORCHVISION_STEM_NAMES:
            if key.startswith(theirs):
                key = ours + key[len(theirs) :]
                break
        renamed[key.replace(".downsample.", ".shortcut.")] = value
    return renamed, ignored


def load_init_weights(
    backbone: nn.Module,
    path: str | os.PathLike[str],
    arch: str,
    width: float,
    *,
    first_blocks_only: bool = False,
) -> str:
    """Copy the weights of the file at ``path`` into ``backbone`` (built as ``arch`` with ``width``), strictly.

    ``first_blocks_only``: ``backbone`` is a ViT sub-model (a layer-wise stage) and takes the file's first blocks
    when the file holds more. Raises ValueError naming what does not fit (nothing is copied then). Returns a line
    for the run's log saying what was loaded.
    """
    file_state, kind = read_init_weights(path)
    state, ignored = _our_names(file_state, backbone)
    if first_blocks_only and isinstance(backbone, VisionTransformer):
        held = backbone.depth
        if vit_depth_of_state(state) > held:
            state = {key: value for key, value in state.items() if _vit_block_index(key) < held}
    own = backbone.state_dict()
    missing = [key for key in own if key not in state and not key.endswith("num_batches_tracked")]
    unexpected = [key for key in state if key not in own]
    mismatched = [key for key in own if key in state and tuple(state[key].shape) != tuple(own[key].shape)]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing {_first(missing)}")
        if unexpected:
            problems.append(f"unexpected {_first(unexpected)}")
        problems += [
            f"{key} is {tuple(state[key].shape)} in the file, {tuple(own[key].shape)} in the model"
            for key in mismatched[:NAMES_SHOWN]
        ]
        if len(mismatched) > NAMES_SHOWN:
            problems.append(f"{len(mismatched) - NAMES_SHOWN} more shape mismatches")
        hint = _stem_hint(state, own)
        raise ValueError(
            f"{CONFIG_KEY}: {path} ({kind}) does not fit {describe_backbone(arch, backbone, width)}: "
            + "; ".join(problems)
            + (f" ({hint})" if hint else "")
        )
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value.to(own[key].dtype))
    line = f"{CONFIG_KEY}: {describe_backbone(arch, backbone, width)} starts from {path} ({kind}, {len(state)} tensors"
    return line + (f"; {len(ignored)} classifier tensors ignored)" if ignored else ")")


def _vit_block_index(key: str) -> int:
    """The block a ViT state-dict key belongs to (``blocks.<i>.``), -1 for the embeddings and the final norm."""
    if not key.startswith("blocks."):
        return -1
    return int(key.split(".", 2)[1])


def _stem_hint(state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> str:
    """A ResNet file whose stem convolution has the other stem's kernel: say which ``model.stem`` fits it."""
    theirs, ours = state.get("stem.0.weight"), own.get("stem.0.weight")
    if theirs is None or ours is None or theirs.ndim != 4 or theirs.shape[-1] == ours.shape[-1]:
        return ""
    kernels = {3: "cifar", 7: "imagenet"}
    fitting = kernels.get(int(theirs.shape[-1]))
    return (
        f"the file's stem convolution is {theirs.shape[-1]}x{theirs.shape[-1]}: model.stem = {fitting}"
        if fitting
        else ""
    )


def _first(keys: list[str]) -> str:
    """The first NAMES_SHOWN keys and how many more there are."""
    shown = ", ".join(keys[:NAMES_SHOWN])
    return shown + (f" and {len(keys) - NAMES_SHOWN} more" if len(keys) > NAMES_SHOWN else "")


def check_init_weights(cfg: ExperimentConfig) -> str:
    """Pre-check ``model.init_weights``: build the config's encoder once and load the file into it.

    Raises ValueError as :func:`load_init_weights` does (or for a ViT image side that is not a multiple of 8);
    returns the line for the run's log, "" when ``model.init_weights`` is empty. Only ``model.arch`` is
    checked: clients of another architecture (``model.client_archs``) start from their seed's weights."""
    if not cfg.model.init_weights:
        return ""
    backbone, _ = build_backbone(
        cfg.model.arch,
        cfg.model.width,
        stem=cfg.resnet_stem(),
        image_size=cfg.image_side(),
        **cfg.model.options,
    )
    return load_init_weights(backbone, cfg.model.init_weights, cfg.model.arch, cfg.model.width)


__all__ = ["check_init_weights", "load_init_weights", "read_init_weights"]
