"""A weight-exchanging local round (``train_local_ssl``): the strategy's *client rule* (``client_app/rules/``: how
the received global weights enter the client's model, what it adds to the local loss and uploads besides its
weights), local SSL training (``local_training``, which every other round shape uses too), and the client state to
keep until the next round."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedssl_wire import RunStopped
from ssl_models.accounting import process_peak_rss_bytes, reset_peak_rss
from ssl_models.config import ExperimentConfig
from ssl_models.data.datasets import load_npz
from ssl_models.data.splits import client_images, union_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy, train_settings
from ssl_models.federated.model_merge import easyfl_divergence
from ssl_models.methods.base import TARGET_PREFIXES
from ssl_models.methods.losses import proximal_term
from ssl_models.training import TrainStats, resolve_device, train_ssl

from ..rules import get_rule
from ..rules.base import META
from ..rules.base import model_entries as _model_entries
from .resources import local_step_resources


@dataclass
class LocalRoundResult:
    shared_state: dict[str, np.ndarray]  # uploaded to the server
    client_state: dict[str, np.ndarray]  # kept for the client's next round (model entries + meta.*)
    stats: TrainStats
    info: dict[str, Any] = field(default_factory=dict)  # what the download rule did (mu, divergence...)

    @property
    def local_state(self) -> dict[str, np.ndarray]:
        """The model entries of the client state (without meta)."""
        return {k: v for k, v in self.client_state.items() if not k.startswith(META)}


def local_images(
    cfg: ExperimentConfig, partition_id: int, data_path: str | None = None, scope: str = "partition"
) -> np.ndarray:
    """This client's training images: its partition of the experiment's data set, or, when the node
    has its own data (``data-path`` in the node config), that .npz file's whole training part, or every image of
    that folder (unlabelled, brought to the run's image side, decoded once into the node's disk cache).
    ``scope="union"``
    (the centralized reference, ``strategy: central``): the union of every client's partition."""
    if scope == "union":
        if data_path:
            raise ValueError(
                f"strategy 'central' trains on the union of the experiment's partitions, but client "
                f"{partition_id}'s node trains on its own data file ({data_path}); run the "
                "centralized reference on a node without data-path"
            )
        return union_images(cfg)
    if scope != "partition":
        raise ValueError(f"data-scope: must be 'partition' or 'union' (got {scope!r})")
    if data_path:
        if Path(data_path).expanduser().is_dir():
            from ssl_models.data.folder import load_folder

            side = cfg.image_side()
            return load_folder(data_path, image_size=side, labels="none", unreadable=cfg.data.unreadable).x_train
        return load_npz(data_path).x_train
    return client_images(cfg, partition_id)


def round_seed(cfg: ExperimentConfig, server_round: int, partition_id: int) -> int:
    """A distinct, reproducible seed for each (round, client) pair."""
    return cfg.seed * 1_000_003 + server_round * 1_009 + partition_id


def initial_client_model(cfg: ExperimentConfig, partition_id: int):
    """A client's starting model when it has no state yet: its own architecture, initialised from the experiment
    seed, so every client of one architecture starts from the same weights (what a server would send) and a
    random-init reference is the same network."""
    return build_ssl_model(cfg, seed=cfg.seed, arch=cfg.client_arch(partition_id))


# Whether the run of the message being served was stopped (the ClientApp sets it per message: the stop marker of a
# simulation's run); checked before every local epoch, so a stopped run's clients stop training within an epoch.
_STOP_CHECK: Callable[[], str | None] | None = None


def set_stop_check(check: Callable[[], str | None] | None) -> None:
    global _STOP_CHECK
    _STOP_CHECK = check


def _with_stop_check(epoch_hook):
    def hook(method, epoch: int) -> None:
        reason = _STOP_CHECK() if _STOP_CHECK is not None else None
        if reason:
            raise RunStopped(f"the run was stopped ({reason}) before local epoch {epoch + 1}: training ends here")
        if epoch_hook is not None:
            epoch_hook(method, epoch)

    return hook


def local_training(
    cfg: ExperimentConfig,
    method,
    images: np.ndarray,
    *,
    lr: float,
    seed: int,
    device,
    loss_hook=None,
    epoch_hook=None,
    log: Callable[[str], None] | None = None,
    account: bool = True,
) -> TrainStats:
    """``train_ssl`` with the experiment's local-training settings and augmentation recipe (``augment``).

    With ``account`` (every strategy but the layer-wise ones, which account their sub-models themselves) the
    returned stats carry ``resources``: ``step_resources`` of this model, the images trained, and the process's
    peak RSS during training (``rss_peak_reset`` 0: the process's lifetime peak, where the peak cannot be reset)."""
    t = cfg.train
    resources: dict[str, float] = {}
    if account:
        resources = local_step_resources(cfg, method, images, device)
        rss_reset = reset_peak_rss()
    stats = train_ssl(
        method,
        images,
        epochs=t.local_epochs,
        batch_size=t.batch_size,
        lr=lr,
        device=device,
        seed=seed,
        loss_hook=loss_hook,
        epoch_hook=_with_stop_check(epoch_hook),
        log=log,
        compile_backend="inductor" if t.compile else None,
        **train_settings(cfg, int(np.shape(images)[1])),
    )
    if account:
        resources["images_trained"] = float(stats.steps * min(t.batch_size, len(images)))
        rss = process_peak_rss_bytes()
        if rss is not None:
            resources["rss_peak_bytes"] = float(rss)
            resources["rss_peak_reset"] = float(bool(rss_reset))
        stats.resources = resources
    return stats


def train_local_ssl(
    cfg: ExperimentConfig,
    images: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    update_both: bool = False,
    aggregate_target: bool = False,
    rule: str = "fedssl",
    rule_options: Mapping[str, Any] | None = None,
    rule_inputs: Mapping[str, Any] | None = None,
    proximal_mu: float = 0.0,
    proximal_form: str = "paper",
    log: Callable[[str], None] | None = None,
) -> LocalRoundResult:
    """One round on one client: download rule, local SSL training, upload and client state.

    Upload: the online encoder and projector (+ predictor), plus the target branch only with
    ``aggregate_target``; with ``update_both`` the target is not kept either (the next download replaces it).
    ``rule_inputs``: per-client values from the server for the download rule (FedEMA's ``server_lambda``).
    ``proximal_mu > 0`` adds FedProx's proximal term towards the received global weights to every step."""
    client_rule = get_rule(rule)
    seed = round_seed(cfg, server_round, partition_id)
    method = build_ssl_model(cfg, seed=seed, arch=cfg.client_arch(partition_id))
    if rule == "local" and not global_state and not _model_entries(client_state):
        # Local SSL with mixed encoders: the server sends its initial model only to clients of model.arch; the
        # others start from the seeded initial model of their own architecture.
        global_state = state_to_numpy(split_state(initial_client_model(cfg, partition_id), method.shared_prefixes())[0])
    options = {**(rule_options or {}), "update_both": bool(update_both), "aggregate_target": bool(aggregate_target)}
    info = client_rule.download(method, global_state, client_state, server_round, options, **(rule_inputs or {}))
    method.on_new_global()
    with_update = client_rule.keeps == "model_and_update"
    start_state = state_to_numpy(method.state_dict()) if with_update else None
    device = resolve_device(cfg.train.device)
    terms = []
    if proximal_mu > 0:
        anchors = {k: torch.as_tensor(v).to(device) for k, v in global_state.items()}
        named = dict(method.named_parameters())
        params = {k: p for k, p in named.items() if k in anchors and p.requires_grad}
        terms.append(lambda _m: proximal_term(params, anchors, proximal_mu, half=proximal_form == "paper"))
    if client_rule.loss_term is not None:
        term = client_rule.loss_term(method, global_state, options, device)
        if term is not None:
            terms.append(term)
    hook = None
    if len(terms) == 1:
        hook = terms[0]
    elif terms:
        hook = lambda m: sum(term(m) for term in terms)
    # A rule may run its own round instead of local training (Orchestra's seeding round); None: train as usual.
    stats = (
        client_rule.replaces_training(method, images, cfg, options, device, server_round=server_round, seed=seed)
        if client_rule.replaces_training is not None
        else None
    )
    if stats is None:
        stats = local_training(cfg, method, images, lr=lr, seed=seed, device=device, loss_hook=hook, log=log)
    extra = (
        client_rule.upload_extra(method, images, cfg, options, device, info)
        if client_rule.upload_extra is not None
        else {}
    )
    bad = sorted(k for k in extra if not k.startswith(f"{rule}."))
    if bad:
        raise ValueError(f"client rule {rule!r} uploads arrays outside its prefix '{rule}.': {', '.join(bad)}")
    method.cpu()
    shared, local = split_state(method, method.shared_prefixes(with_target=aggregate_target))
    if client_rule.keeps == "own":
        # What the server does not hold: target branch (unless the next download replaces it), MoCo queue.
        kept = state_to_numpy({k: v for k, v in local.items() if not (update_both and k.startswith(TARGET_PREFIXES))})
    else:
        # Min-Local: the client's own model is all it has. FedEMA/FedU need the client's whole last model (online,
        # predictor, target) next time, and the size of this local update (EasyFL's divergence), which is also
        # reported: the server's autoscaler uses it.
        kept = state_to_numpy(method.state_dict())
    if with_update:
        info["update_size"] = easyfl_divergence(start_state, kept)
        kept[META + "update_size"] = np.array([info["update_size"]])
        if info.get("lambda") is not None and not info.get("lambda_from_server", False):
            kept[META + "lambda"] = np.array([float(info["lambda"])])  # computed here: keep it for later rounds
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    shared = {**state_to_numpy(shared), **{k: np.asarray(v) for k, v in extra.items()}}
    return LocalRoundResult(shared, kept, stats, info)
