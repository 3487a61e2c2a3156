"""The checks an experiment's data must pass before its first round, made from the config and the data files alone.

``fedssl-run`` and ``fedssl-study`` make them on the user's machine before anything starts, and the ServerApp makes
them again before it creates the run's output folder (a run started with plain ``flwr run``, or on another machine),
so that a data file of grayscale images, a split that cannot be made or an evaluation set that cannot be scored is
one line naming the setting, before any client trains, instead of a traceback 20 s into the simulation or after the
last round. What passes is returned (the data, the split, the evaluation subsets) so the ServerApp does not load it
twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.datasets import TORCHVISION_DATASETS, ImageData
from ssl_models.data.splits import FederatedSplit, eval_subsets, federated_split, load_eval_data, load_experiment_data

# Why a run scores nothing (summary.json's eval.reason, the run's last line).
NOTHING_SCORED = (
    "the training images are unlabelled and no eval.path names a labelled set to score the encoder on; its model.pt "
    "is saved: score it later with fedssl-eval"
)


@dataclass(frozen=True)
class CheckedData:
    """The experiment's data as it passed the checks."""

    data: ImageData
    split: FederatedSplit
    eval_data: ImageData | None  # the labelled set the encoder is scored on (None: nothing is scored)
    eval_train_idx: np.ndarray  # its images the kNN bank and the probe are fitted on
    eval_test_idx: np.ndarray  # its images the scores are read on

    @property
    def client_sizes(self) -> list[int]:
        return [len(idx) for idx in self.split.client_idx]


def _data_key(cfg: ExperimentConfig) -> str:
    return "data.path" if cfg.data.path else "data.dataset"


def load_checked(cfg: ExperimentConfig, log: Callable[[str], None] | None = None) -> ImageData:
    """The experiment's data set, or ConfigError naming ``data.path`` / ``data.dataset`` with the loader's reason
    (images that are not RGB, labels that are not the classes 0..K-1, a file that is not an .npz archive, a folder
    without images or with unreadable files). ``log`` hears a folder's decoding progress."""
    try:
        return load_experiment_data(cfg, log=log)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{_data_key(cfg)}: {exc}") from None


def split_checked(cfg: ExperimentConfig, labels: np.ndarray, labelled: bool = True) -> FederatedSplit:
    """The federated split of ``labels``, or ConfigError naming the setting that makes it impossible."""
    d = cfg.data
    if not labelled and d.partition != "iid":
        raise ConfigError(
            f"data.partition: {d.partition} splits the images by label, but the training images "
            f"({cfg.data.path or cfg.data.dataset}) are unlabelled; use data.partition: iid"
        )
    present = int(np.unique(labels).size)
    if d.partition == "pathological" and d.classes_per_client > present:
        raise ConfigError(
            f"data.classes_per_client: {d.classes_per_client} is more than the {present} "
            f"class{'es' if present != 1 else ''} the training labels hold ({cfg.data.path or cfg.data.dataset}); give at most {present}, or "
            "data.partition: dirichlet or iid"
        )
    try:
        return federated_split(cfg, labels)
    except ValueError as exc:
        if str(exc).startswith("size"):  # the server's public split (partition.public_split) cannot be carved
            raise ConfigError(f"data.public_size: {exc}") from None
        raise ConfigError(f"data.partition ({d.partition}, {cfg.federation.num_clients} clients): {exc}") from None


def eval_checked(cfg: ExperimentConfig, data: ImageData) -> tuple[np.ndarray, np.ndarray]:
    """The evaluation's labelled subsets of ``data`` (the evaluation set), or ConfigError when they cannot be scored:
    kNN and the linear probe need at least two classes among the images they are fitted on and at least one image to
    score."""
    key = "eval.path" if cfg.eval.path else _data_key(cfg)
    where = cfg.eval.path or cfg.data.path or cfg.data.dataset
    if data.num_classes < 2:
        raise ConfigError(
            f"{key}: the labelled data ({where}) holds {data.num_classes} class; the "
            "evaluation (kNN and linear probe) needs at least two classes to score an encoder"
        )
    train_idx, test_idx = eval_subsets(cfg, data)
    if len(test_idx) == 0:
        raise ConfigError(
            f"{key}: the test split of {where} holds no images; the evaluation scores the "
            "encoder on it (give x_test and y_test)"
        )
    fitted_classes = int(np.unique(data.y_train[train_idx]).size)
    if fitted_classes < 2:
        raise ConfigError(
            f"eval.max_train: the {len(train_idx)} labelled training images the evaluation fits on hold "
            f"{fitted_classes} class; kNN and the linear probe need at least two (raise "
            "eval.max_train, or 0 for all)"
        )
    side = cfg.image_side()
    if cfg.eval.path and data.image_size != side:
        raise ConfigError(
            f"eval.path: its images are {data.image_size} px but the encoders see {side} px images; give an "
            "evaluation set of the training images' side"
        )
    return train_idx, test_idx


def model_checked(cfg: ExperimentConfig) -> str:
    """The encoder the data calls for can be built: a ViT's image side is a multiple of 8 (its 8x8 patches), and
    ``model.init_weights`` loads into it (names and shapes). Returns the weights' line for the log ("" without);
    ConfigError naming the key otherwise."""
    side = cfg.image_side()
    archs = {cfg.model.arch, *cfg.model.client_archs, *cfg.model.client_arch_pool}
    if any(a.startswith("vit") for a in archs) and side % 8:
        raise ConfigError(
            f"data.image_size: the ViT cuts images into 8x8 patches, so their side must be a multiple "
            f"of 8 (got {side} px)"
        )
    from ssl_models.init_weights import check_init_weights

    try:
        return check_init_weights(cfg)
    except ValueError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith("model.init_weights") else f"model.init_weights: {text}") from None


def check_experiment_data(cfg: ExperimentConfig, log: Callable[[str], None] | None = None) -> CheckedData:
    """Every check of an experiment's data that needs no client: it loads, it splits, it can be scored (or there is
    nothing to score it on: unlabelled training images and no eval.path, which the run says).

    Raises ConfigError (one line naming the setting)."""
    data = load_checked(cfg, log)
    split = split_checked(cfg, data.y_train, data.labelled)
    weights = model_checked(cfg)
    if weights and log is not None:
        log(weights)
    try:
        # Unlabelled training data may still have a labelled set of its own to be scored on (STL-10's train/test).
        eval_data = load_eval_data(cfg) if cfg.eval.path or not data.labelled else data
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{'eval.path' if cfg.eval.path else _data_key(cfg)}: {exc}") from None
    if eval_data is None:
        empty = np.zeros(0, np.int64)
        return CheckedData(data, split, None, empty, empty)
    train_idx, test_idx = eval_checked(cfg, eval_data)
    return CheckedData(data, split, eval_data, train_idx, test_idx)


def data_is_local(cfg: ExperimentConfig) -> bool:
    """Whether this machine holds the experiment's data without downloading it: a synthetic set, a file or folder
    that exists, or torchvision's files already in place. A set the server is to download (``data.download``) is not
    checked ahead (the check would download it)."""
    from pathlib import Path

    d = cfg.data
    if d.dataset == "synthetic":
        return True
    if d.path and (Path(d.path).expanduser().is_file() or Path(d.path).suffix == ".npz"):
        return True  # a file: here, or the check names it missing
    if d.dataset in TORCHVISION_DATASETS and d.download:
        try:
            load_experiment_data(_without_download(cfg))
        except (FileNotFoundError, ValueError):
            return False
        return True
    return True  # a missing file is the loader's error, named by check_experiment_data


def _without_download(cfg: ExperimentConfig) -> ExperimentConfig:
    import copy

    quiet = copy.deepcopy(cfg)
    quiet.data.download = False
    return quiet
