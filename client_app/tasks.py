"""Client tasks: decoded inputs in, plain results out. No Flower types here, so each task can be
called directly in tests and benchmarks; ``client_app.app`` only decodes and encodes messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from ssl_models.config import ExperimentConfig
from ssl_models.data import load_npz
from ssl_models.factory import build_ssl_model, load_partial_state, reset_target_from_online, split_state, \
    state_to_numpy
from ssl_models.splits import client_images
from ssl_models.training import TrainStats, resolve_device, train_ssl


@dataclass
class LocalRoundResult:
    shared_state: dict[str, np.ndarray]  # uploaded to the server
    local_state: dict[str, np.ndarray]  # kept on the client until its next round
    stats: TrainStats


def local_images(cfg: ExperimentConfig, partition_id: int, data_path: str | None = None) -> np.ndarray:
    """This client's training images: its partition of the experiment's data set, or, when the node
    has its own data (``data-path`` in the node config), that file's whole training part."""
    if data_path:
        return load_npz(data_path).x_train
    return client_images(cfg, partition_id)


def round_seed(cfg: ExperimentConfig, server_round: int, partition_id: int) -> int:
    """A distinct, reproducible seed for each (round, client) pair."""
    return cfg.seed * 1_000_003 + server_round * 1_009 + partition_id


def train_local_ssl(
    cfg: ExperimentConfig,
    images: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    local_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    update_both: bool = False,
    log: Callable[[str], None] | None = None,
) -> LocalRoundResult:
    """One round of local SSL training of the generalized FedSSL framework.

    The client's private state (target/momentum branch, MoCo queue) is restored when it has one;
    then the global shared weights replace the online ones. At a first participation the target
    branch starts as a copy of the received online branch.
    """
    seed = round_seed(cfg, server_round, partition_id)
    method = build_ssl_model(cfg, seed=seed)
    if local_state:
        load_partial_state(method, local_state)
    load_partial_state(method, global_state)
    if not local_state:
        reset_target_from_online(method)
    method.on_new_global()
    t = cfg.train
    stats = train_ssl(method, images, epochs=t.local_epochs, batch_size=t.batch_size, lr=lr,
                      optimizer=t.optimizer, momentum=t.momentum, weight_decay=t.weight_decay,
                      device=resolve_device(t.device), fast_path=t.fast_path, drop_last=t.drop_last,
                      max_steps_per_epoch=t.max_steps_per_epoch, seed=seed, log=log)
    shared, local = split_state(method.cpu(), method.shared_prefixes(update_both=update_both))
    return LocalRoundResult(state_to_numpy(shared), state_to_numpy(local), stats)
