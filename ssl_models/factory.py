"""Build SSL models from an experiment config and split their state into shared and local parts.

What is exchanged with the server is decided by state_dict key prefixes (see
``SSLMethod.shared_prefixes``): the online encoder and projector, the predictor when the method has
one, and the target branch only with the strategy option ``aggregate_target``. Everything else (target
branch, MoCo queue) stays on the client.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ssl_models.data.augment import SSLAugment
from ssl_models.networks import build_backbone

from .config import ExperimentConfig, validate_component_options
from .init_weights import load_init_weights
from .methods import build_method, method_default_options
from .methods.base import SSLMethod


def method_options(cfg: ExperimentConfig) -> dict:
    """The method's options with defaults filled in; unknown options raise ConfigError."""
    return validate_component_options(cfg.method.options, method_default_options(cfg.method.name), "method.options")


def build_ssl_model(
    cfg: ExperimentConfig, seed: int | None = None, arch: str | None = None, **arch_options
) -> SSLMethod:
    """A freshly initialised SSL method (encoder ``arch``, default the config's); same seed, same weights.

    The backbone normalises its input when the config says so (``augment.normalize``), has the ResNet stem
    ``cfg.resnet_stem()`` or the ViT patches for ``cfg.image_side()`` px images, and, for ``model.arch``, starts
    from ``model.init_weights`` when that is set (the heads keep their seeded initialisation; see
    ``ssl_models.init_weights``). ``arch_options`` go to ``build_backbone`` over the config's ``model.options``
    (those apply to ``model.arch`` only; ``depth=s`` builds a growable ViT with s blocks: the layer-wise strategies'
    sub-models, which take the first s blocks of the initial weights)."""
    if seed is not None:
        torch.manual_seed(seed)
    arch = arch or cfg.model.arch
    options = {**(cfg.model.options if arch == cfg.model.arch else {}), **arch_options}
    backbone, feature_dim = build_backbone(
        arch,
        cfg.model.width,
        cfg.augment.input_normalization(),
        stem=cfg.resnet_stem(),
        image_size=cfg.image_side(),
        **options,
    )
    # The weights go in before the method is built, so a momentum target copied from the backbone starts equal to
    # them; loading draws no random numbers, so the heads are initialised as they would be without the file.
    if cfg.model.init_weights and arch == cfg.model.arch:
        load_init_weights(
            backbone, cfg.model.init_weights, arch, cfg.model.width, first_blocks_only="depth" in arch_options
        )
    return build_method(cfg.method.name, backbone, feature_dim, **method_options(cfg))


def build_augment(cfg: ExperimentConfig, image_size: int) -> SSLAugment:
    """The experiment's SSL augmentation recipe (its ``augment`` section) for images of ``image_size``."""
    return SSLAugment.from_config(cfg.augment, image_size)


def train_settings(cfg: ExperimentConfig, image_size: int) -> dict:
    """The keyword arguments of ``ssl_models.training.train_ssl`` that the experiment sets for every training of its
    model (its ``train`` section and augmentation recipe): one place for every caller, so that a setting reaches
    the clients' local rounds and the server's training alike. The epochs, batch, learning rate, seed, device and
    hooks are the caller's."""
    t = cfg.train
    return {
        "optimizer": t.optimizer,
        "momentum": t.momentum,
        "weight_decay": t.weight_decay,
        "fast_path": t.fast_path,
        "drop_last": t.drop_last,
        "max_steps_per_epoch": t.max_steps_per_epoch,
        "augment": build_augment(cfg, image_size),
    }


def split_state(method: torch.nn.Module, prefixes: tuple[str, ...]) -> tuple[OrderedDict, OrderedDict]:
    """(shared, local) state dicts of ``method``: keys starting with one of ``prefixes`` are shared."""
    shared: OrderedDict[str, torch.Tensor] = OrderedDict()
    local: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in method.state_dict().items():
        (shared if key.startswith(prefixes) else local)[key] = value.detach().contiguous()
    return shared, local


def state_to_numpy(state: dict[str, torch.Tensor]) -> OrderedDict:
    """Copies (never views): a CPU tensor's ``.numpy()`` shares memory with the live parameter."""
    return OrderedDict((k, v.detach().cpu().numpy().copy()) for k, v in state.items())


def load_partial_state(method: torch.nn.Module, state: dict[str, np.ndarray | torch.Tensor]) -> None:
    """Load some entries of the state dict; a key the model lacks or a shape mismatch is an error."""
    own = method.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise KeyError(f"state has keys the model does not: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    with torch.no_grad():
        for key, value in state.items():
            tensor = torch.as_tensor(value)
            if tensor.ndim <= 1 and tensor.numel() == 1 and own[key].ndim == 0:
                tensor = tensor.reshape(())  # transport turns 0-d arrays (BN's num_batches_tracked) into (1,)
            if tuple(tensor.shape) != tuple(own[key].shape):
                raise ValueError(
                    f"{key}: shape {tuple(tensor.shape)} does not match the model's {tuple(own[key].shape)}"
                )
            own[key].copy_(tensor.to(own[key].dtype))


def reset_target_from_online(method: torch.nn.Module) -> None:
    """Make every ``target_X`` module an exact copy of its online ``X`` (first participation)."""
    state = method.state_dict()
    with torch.no_grad():
        for key, value in state.items():
            if key.startswith("target_"):
                source = key[len("target_") :]
                if source in state:
                    value.copy_(state[source])


def backbone_state(shared: dict[str, np.ndarray]) -> OrderedDict:
    """The online backbone's own state dict (prefix ``backbone.`` stripped) from a shared state."""
    return OrderedDict((k[len("backbone.") :], v) for k, v in shared.items() if k.startswith("backbone."))
