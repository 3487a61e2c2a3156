"""Experiment configuration: validated dataclasses loaded from YAML.

One ``ExperimentConfig`` describes a whole run (data, model, SSL method, local training, federation,
evaluation). It is loaded from a YAML file, optionally overridden by flat dotted keys
(``train.lr=0.1``, ``strategy.options.mu=0.1``, as Flower's ``--run-config`` delivers them), and validated before
anything starts: unknown keys, wrong types and impossible values raise ``ConfigError`` naming the dotted key.

**Composition** (``load_config_tree``): a YAML experiment may name a ``base`` experiment (a path relative to its
own file; chains allowed, cycles refused) and hold only what differs. Mappings merge key by key, any other value
(a number, a string, a list) replaces the base's, a ``null`` removes the key (its default applies again), a
mapping holding ``_replace: true`` replaces the base's mapping whole (``strategy: {_replace: true, name: fedu,
options: {threshold: 0.4}}``: a variant that switches to a strategy with other options), and a dotted key
(``strategy.options.mu: 0.1``) is the same as the nested mappings it names. A small resolver of our own rather than
OmegaConf: the merge is all this needs, and its errors stay one line naming the file and the key.

This module is pure Python (no Flower, no torch) so both the ServerApp and the ClientApp can use it,
and so it can be tested alone. Options that belong to a pluggable component (an SSL method's or a
strategy's options) are free-form dicts here; they are checked against that component's registry by
``validate_component_options``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml


class ConfigError(ValueError):
    """An invalid experiment configuration; the message names the offending key."""


DATASETS = ("cifar10", "cifar100", "stl10", "npz", "folder", "synthetic")
FOLDER_LABELS = ("auto", "subfolders", "none")
UNREADABLE = ("stop", "skip")
STL10_SPLITS = ("train", "unlabeled", "train+unlabeled")
STEMS = ("auto", "cifar", "imagenet")
FOLDER_IMAGE_SIZE = 96  # the side a folder's images are brought to when data.image_size is 0
# The side of each named data set's images (an .npz and a synthetic set: their arrays').
DATASET_SIDES = {"cifar10": 32, "cifar100": 32, "stl10": 96}
# The largest image side the CIFAR stem (3x3 stride-1 convolution, no max-pool) is chosen for by ``model.stem: auto``.
CIFAR_STEM_MAX_SIDE = 64
PARTITIONS = ("iid", "dirichlet", "pathological")
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class DataConfig:
    """Where the images come from and how they are split between clients and the server."""

    # cifar10, cifar100, stl10, npz (a file named by ``path``), folder (a folder of images named by ``path``) or
    # synthetic (generated)
    dataset: str = "cifar10"
    # An .npz file (x_train, y_train, x_test, y_test; the labels may be left out: unlabelled), a folder of images
    # (dataset: folder), or a torchvision root folder. Empty: the torchvision default root ``~/.cache/fedssl/data``.
    path: str = ""
    # The side, in pixels, a folder's images are brought to (shorter side resized to it, then the centre square cut),
    # once, into the decoded cache on disk; 0: 96 for a folder. The other sources keep their own side.
    image_size: int = 0
    # A folder: whether its first-level subfolders are classes. auto: classes when every image lies in one of at
    # least two first-level subfolders, else unlabelled; subfolders: always (an image outside them is an error);
    # none: unlabelled, however the folder is laid out.
    folder_labels: str = "auto"
    # A folder's files that cannot be read as images: stop (the first few and the count are named) or skip them
    # (named on the log).
    unreadable: str = "stop"
    download: bool = False  # let torchvision download cifar10 / cifar100 / stl10 when its files are missing
    # STL-10's training images (dataset: stl10, read from stl10_binary/ under ``path``): train (the 5 000 labelled
    # ones), unlabeled (the 100 000 unlabelled ones) or train+unlabeled (the 105 000 the papers pre-train on). The
    # last two are unlabelled training data (partition: iid); the labelled train/test splits stay the evaluation's.
    stl10_split: str = "train"
    # Class-stratified subsample of the training set before anything else; 0 keeps everything.
    max_train: int = 0
    partition: str = "pathological"  # split between clients: iid, dirichlet (alpha, min_size) or pathological
    alpha: float = 0.5  # Dirichlet concentration
    min_size: int = 10  # Dirichlet: resample until every client has at least this many images
    classes_per_client: int = 2  # pathological: the number of classes each client's images come from
    # Server-held public/auxiliary split carved from the training data before partitioning and never
    # given to any client: a count (>= 1) or a fraction (< 1); 0 disables it.
    public_size: float = 0.0
    # Sizes of the synthetic data set (dataset: synthetic).
    synthetic_train: int = 600  # training images of the synthetic data set
    synthetic_test: int = 200  # test images of the synthetic data set
    synthetic_classes: int = 10  # classes of the synthetic data set (>= 2)


@dataclass
class ModelConfig:
    arch: str = "resnet18"  # the global model's (and by default every client's) architecture
    width: float = 1.0  # channel width multiplier; tests use 0.125
    # One architecture per client, for federations that mix encoders (FLESD, Hetero-SSFL); empty: all
    # clients use ``arch``. Strategies that average weights need every client on ``arch``.
    client_archs: list = field(default_factory=list)
    # Draw each client's architecture uniformly at random from this list, seeded by ``seed`` (Hetero-SSFL's
    # "ResNet-18 and ResNet-34 chosen at random per client"); only when ``client_archs`` is empty.
    client_arch_pool: list = field(default_factory=list)
    # The ResNets' stem: cifar (3x3 stride-1 convolution, no max-pool), imagenet (7x7 stride-2 convolution and 3x3
    # stride-2 max-pool), or auto: cifar for images up to 64 px, imagenet above (the run's log states the choice).
    stem: str = "auto"
    # Start from these weights instead of the seed's random ones: a model.pt of this app, or a plain PyTorch state
    # dict of the same architecture (e.g. torchvision's ResNet weights saved with torch.save). Missing or
    # mismatched keys are named. Empty: random initialisation.
    init_weights: str = ""
    # The architecture's own options for ``arch`` (the registry's ARCH_OPTIONS): ``{depth: 6}`` builds a
    # 6-block vit_tiny, e.g. an end-to-end baseline as deep as a 6-stage layer-wise run. Empty: the defaults.
    options: dict = field(default_factory=dict)


@dataclass
class MethodConfig:
    name: str = "byol"  # the SSL method: byol, moco, mocov3, simclr or simsiam (its options: below)
    options: dict = field(default_factory=dict)  # checked against the method registry


@dataclass
class TrainConfig:
    """Local SSL training on each client."""

    local_epochs: int = 5  # passes over the client's own images per round (>= 1)
    batch_size: int = 128  # images per local step (>= 2: contrastive losses need pairs)
    drop_last: bool = True  # skip each epoch's last incomplete batch
    optimizer: str = "sgd"  # sgd, adam or adamw (other hyper-parameters: torch.optim's defaults)
    lr: float = 0.032  # learning rate of round 1 (the schedule below sets the later rounds')
    momentum: float = 0.9  # SGD momentum, in [0, 1); unused by adam / adamw
    weight_decay: float = 5e-4  # L2 weight decay of the local optimizer (>= 0)
    # Cosine decay of the learning rate across rounds (constant within a round), as in EasyFL.
    lr_schedule: str = "cosine"
    # bfloat16 autocast on CPUs with AMX/AVX512-BF16, mixed precision on CUDA, channels-last memory.
    fast_path: bool = True
    # torch.compile the training step (inductor); minutes of compilation per new model on a small CPU, so off
    # by default; where compilation fails the step runs eagerly and the round's metrics say why.
    compile: bool = False
    device: str = "auto"  # where clients train: auto (CUDA when available, else CPU), cpu or cuda
    # Cap on local optimisation steps per epoch (0 = no cap); for quick experiments and benchmarks.
    max_steps_per_epoch: int = 0


@dataclass
class AugmentConfig:
    """The random views of local SSL training and FLESD distillation, and the encoder's input normalisation.

    The default is this project's CIFAR recipe: RandomResizedCrop(scale 0.08-1), flip, ColorJitter(0.4, 0.4, 0.4,
    0.1) with p 0.8, grayscale p 0.2, no blur, no normalisation (the MoCo v1 transform of EasyFL; EasyFL's
    SimCLR/BYOL/SimSiam/MoCo v2 and FLESD use ColorJitter(0.8, 0.8, 0.8, 0.2): see their configs).
    ``normalize: true`` gives every encoder an input-normalisation layer ``(x - mean) / std`` (part of the
    backbone, recorded in ``model.pt``), so training, evaluation, FLESD and ``fedssl-eval`` all see it.
    """

    crop_scale: list = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area fraction (low, high)
    crop_ratio: list = field(default_factory=lambda: [3.0 / 4.0, 4.0 / 3.0])  # aspect ratio (low, high)
    flip_p: float = 0.5  # probability of a horizontal flip
    brightness: float = 0.4  # colour-jitter strengths, as torchvision's ColorJitter
    contrast: float = 0.4  # colour-jitter contrast strength (>= 0)
    saturation: float = 0.4  # colour-jitter saturation strength (>= 0)
    hue: float = 0.1  # colour-jitter hue strength, in [0, 0.5]
    jitter_p: float = 0.8  # probability that a view is colour-jittered
    grayscale_p: float = 0.2  # probability that a view is turned to grayscale
    blur_p: float = 0.0  # probability of a Gaussian blur (after grayscale)
    blur_sigma: list = field(default_factory=lambda: [0.1, 2.0])  # sigma ~ U(low, high), in pixels
    blur_kernel_size: int = 0  # odd side of the blur kernel; 0: 10 % of the image side made odd (3 at 32x32)
    normalize: bool = False  # input normalisation (x - mean) / std inside the encoder
    mean: list = field(default_factory=lambda: [0.4914, 0.4822, 0.4465])  # per channel (CIFAR-10 train stats)
    std: list = field(default_factory=lambda: [0.2470, 0.2435, 0.2616])  # per channel, each > 0

    def input_normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """(mean, std) of the encoder's input-normalisation layer, or None without normalisation."""
        if not self.normalize:
            return None
        return tuple(float(v) for v in self.mean), tuple(float(v) for v in self.std)


@dataclass
class StrategyConfig:
    name: str = "fedssl"  # the server's federated algorithm, one of the strategies below (their options: below)
    options: dict = field(default_factory=dict)  # checked against the strategy registry


@dataclass
class FederationConfig:
    num_clients: int = 5  # clients (data partitions) in the federation
    clients_per_round: int = 0  # 0: every client every round
    min_available_clients: int = 0  # 0: equal to num_clients
    round_timeout_s: float = 3600.0  # seconds the server waits for a round's replies; a client later counts as failed
    # How long the server waits at start for all clients' nodes to connect (deployments).
    node_wait_s: float = 300.0
    # Every client reply is validated before it is used; a round goes on with at least this many valid replies
    # (0: even with none, the global model then unchanged), else the run stops.
    min_replies: int = 1
    max_reply_mb: float = 8192.0  # a reply carrying more array data than this is refused


@dataclass
class EvalConfig:
    """The fixed evaluation protocol (see ssl_models/evaluation/protocol.py)."""

    knn_every: int = 10  # rounds between kNN monitors; 0 disables; the last round is always measured
    knn_k: int = 200  # neighbours of the weighted kNN classifier on the encoder's features
    knn_temperature: float = 0.1  # temperature of the kNN's vote weights exp(similarity / t) (> 0)
    linear_probe: bool = True  # at the end, also fit a linear classifier on the frozen features and score it
    probe_epochs: int = 100  # epochs of that linear probe
    # Class-stratified subsamples of the labelled train (kNN bank / probe fit) and test sets; 0 = all.
    max_train: int = 0
    max_test: int = 0  # test images scored (class-stratified subsample); 0 = all
    device: str = "auto"  # where the server evaluates: auto, cpu or cuda
    # The labelled set the encoder is scored on: an .npz (x_train, y_train, x_test, y_test) or a folder with train/
    # and test/ (or val/) subfolders of one subfolder per class. Empty: the training data set's own labelled
    # splits; with unlabelled training data and no eval.path, nothing is scored (the run says so).
    path: str = ""
    # Score a randomly initialised encoder of the run's architecture(s) (the run's own initial weights) with
    # the same protocol, once per run, and report every score's gain over it.
    random_init_reference: bool = True


@dataclass
class CheckpointConfig:
    """Server checkpoints (``<output-dir>/checkpoints/``), from which ``resume=<output-dir>`` continues a run."""

    every: int = 1  # rounds between checkpoints (the last round always has one); 0 disables them
    keep: int = 2  # the newest checkpoints kept


@dataclass
class LoggingConfig:
    """Where a run's figures go besides ``metrics.jsonl`` / ``progress.log`` / ``summary.json``."""

    # TensorBoard scalars per round in ``<output-dir>/tensorboard/`` (loss, kNN, bytes, wall time, per-client
    # values); needs the ``tensorboard`` package (``pip install 'fedssl[tensorboard]'``).
    tensorboard: bool = False


@dataclass
class ExperimentConfig:
    name: str = "experiment"  # the run's name, in its output folder's name and its reports
    seed: int = 0  # seeds the split, the initial model, client sampling and every local training
    rounds: int = 100  # federated rounds (>= 1)
    output_dir: str = ""  # where the run's results go; empty: ``./outputs/<name>-<timestamp>``
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentConfig:
        cfg = _build_dataclass(cls, data, prefix="")
        cfg.validate()
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
        """The experiment in ``path`` with its ``base`` chain resolved (``load_config_tree``), then ``overrides``
        (dotted keys) applied."""
        return cls.from_dict(merge_config(load_config_tree(path), overrides or {}))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ExperimentConfig:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check values that types alone cannot; raise ConfigError naming the key."""
        _require(self.rounds >= 1, "rounds", "must be >= 1", self.rounds)
        _require(bool(self.name.strip()), "name", "must not be empty", self.name)
        d = self.data
        _one_of(d.dataset, DATASETS, "data.dataset")
        _one_of(d.partition, PARTITIONS, "data.partition")
        _require(d.max_train >= 0, "data.max_train", "must be >= 0", d.max_train)
        _require(d.alpha > 0, "data.alpha", "must be > 0", d.alpha)
        _require(d.min_size >= 0, "data.min_size", "must be >= 0", d.min_size)
        _require(d.classes_per_client >= 1, "data.classes_per_client", "must be >= 1", d.classes_per_client)
        _require(d.public_size >= 0, "data.public_size", "must be >= 0 (a count, or a fraction < 1)", d.public_size)
        _require(
            d.public_size < 1 or float(d.public_size).is_integer(),
            "data.public_size",
            "must be a fraction below 1 or a whole count",
            d.public_size,
        )
        if d.dataset == "npz":
            _require(bool(d.path), "data.path", "must name an .npz file when data.dataset is npz", d.path)
        if d.dataset == "folder":
            _require(bool(d.path), "data.path", "must name a folder of images when data.dataset is folder", d.path)
        _require(
            d.image_size >= 0,
            "data.image_size",
            "must be >= 0 (0: the source's own side, 96 for a folder)",
            d.image_size,
        )
        _require(
            d.image_size == 0 or d.image_size >= 8, "data.image_size", "must be 0 or at least 8 pixels", d.image_size
        )
        _one_of(d.folder_labels, FOLDER_LABELS, "data.folder_labels")
        _one_of(d.unreadable, UNREADABLE, "data.unreadable")
        _one_of(d.stl10_split, STL10_SPLITS, "data.stl10_split")
        _require(
            d.stl10_split == "train" or d.dataset == "stl10",
            "data.stl10_split",
            f"applies to data.dataset stl10 only (data.dataset is {d.dataset})",
            d.stl10_split,
        )
        _require(
            d.stl10_split == "train" or d.partition == "iid",
            "data.partition",
            f"must be iid with data.stl10_split {d.stl10_split}: those training images are unlabelled, and a "
            f"{d.partition} split divides them by label",
            d.partition,
        )
        _one_of(self.model.stem, STEMS, "model.stem")
        if d.dataset == "synthetic":
            _require(d.synthetic_train >= 1, "data.synthetic_train", "must be >= 1", d.synthetic_train)
            _require(d.synthetic_test >= 1, "data.synthetic_test", "must be >= 1", d.synthetic_test)
            _require(d.synthetic_classes >= 2, "data.synthetic_classes", "must be >= 2", d.synthetic_classes)

        _require(self.model.width > 0, "model.width", "must be > 0", self.model.width)
        from ssl_models.networks import ARCH_OPTIONS  # here, not at the top: the networks never need the config

        valid = ARCH_OPTIONS.get(self.model.arch, ())
        unknown = sorted(set(self.model.options) - set(valid))
        _require(
            not unknown, "model.options", f"{self.model.arch!r} takes {list(valid)}, not {unknown}", self.model.options
        )
        depth = self.model.options.get("depth", 1)
        _require(
            isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1,
            "model.options.depth",
            "must be a positive integer",
            depth,
        )
        archs = self.model.client_archs
        _require(
            all(isinstance(a, str) and a for a in archs),
            "model.client_archs",
            "must be a list of architecture names",
            archs,
        )
        _require(
            not archs or len(archs) == self.federation.num_clients,
            "model.client_archs",
            f"must name one architecture per client ({self.federation.num_clients})",
            archs,
        )
        pool = self.model.client_arch_pool
        _require(
            all(isinstance(a, str) and a for a in pool),
            "model.client_arch_pool",
            "must be a list of architecture names",
            pool,
        )
        _require(
            not (pool and archs),
            "model.client_arch_pool",
            "cannot be combined with model.client_archs (fixed architectures); set one of them",
            pool,
        )

        t = self.train
        _require(t.local_epochs >= 1, "train.local_epochs", "must be >= 1", t.local_epochs)
        _require(t.batch_size >= 2, "train.batch_size", "must be >= 2 (contrastive losses need pairs)", t.batch_size)
        _one_of(t.optimizer, OPTIMIZERS, "train.optimizer")
        _require(t.lr > 0, "train.lr", "must be > 0", t.lr)
        _require(0 <= t.momentum < 1, "train.momentum", "must be in [0, 1)", t.momentum)
        _require(t.weight_decay >= 0, "train.weight_decay", "must be >= 0", t.weight_decay)
        _one_of(t.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
        _one_of(t.device, DEVICES, "train.device")
        _require(t.max_steps_per_epoch >= 0, "train.max_steps_per_epoch", "must be >= 0", t.max_steps_per_epoch)

        self.augment_checks()

        f = self.federation
        _require(f.num_clients >= 1, "federation.num_clients", "must be >= 1", f.num_clients)
        _require(f.clients_per_round >= 0, "federation.clients_per_round", "must be >= 0", f.clients_per_round)
        _require(
            f.clients_per_round <= f.num_clients,
            "federation.clients_per_round",
            f"cannot exceed federation.num_clients ({f.num_clients})",
            f.clients_per_round,
        )
        _require(
            f.min_available_clients >= 0, "federation.min_available_clients", "must be >= 0", f.min_available_clients
        )
        _require(
            f.min_available_clients <= f.num_clients,
            "federation.min_available_clients",
            f"cannot exceed federation.num_clients ({f.num_clients})",
            f.min_available_clients,
        )
        _require(f.round_timeout_s > 0, "federation.round_timeout_s", "must be > 0", f.round_timeout_s)
        _require(f.node_wait_s >= 0, "federation.node_wait_s", "must be >= 0", f.node_wait_s)
        _require(
            0 <= f.min_replies <= f.num_clients,
            "federation.min_replies",
            f"must be in [0, federation.num_clients ({f.num_clients})]",
            f.min_replies,
        )
        _require(f.max_reply_mb > 0, "federation.max_reply_mb", "must be > 0", f.max_reply_mb)
        if d.partition == "pathological":
            num_classes = d.synthetic_classes if d.dataset == "synthetic" else None
            if num_classes is not None:
                _require(
                    d.classes_per_client <= num_classes,
                    "data.classes_per_client",
                    f"cannot exceed the number of classes ({num_classes})",
                    d.classes_per_client,
                )

        _require(
            self.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0: no checkpoints)", self.checkpoint.every
        )
        _require(self.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1", self.checkpoint.keep)

        e = self.eval
        _require(e.knn_every >= 0, "eval.knn_every", "must be >= 0", e.knn_every)
        _require(e.knn_k >= 1, "eval.knn_k", "must be >= 1", e.knn_k)
        _require(e.knn_temperature > 0, "eval.knn_temperature", "must be > 0", e.knn_temperature)
        _require(e.probe_epochs >= 1, "eval.probe_epochs", "must be >= 1", e.probe_epochs)
        _require(e.max_train >= 0, "eval.max_train", "must be >= 0", e.max_train)
        _require(e.max_test >= 0, "eval.max_test", "must be >= 0", e.max_test)
        _one_of(e.device, DEVICES, "eval.device")

    def augment_checks(self) -> None:
        """Values of the ``augment`` section (each error names ``augment.<key>``)."""
        a = self.augment
        _pair(a.crop_scale, "augment.crop_scale", "0 < low <= high <= 1", lambda lo, hi: 0 < lo <= hi <= 1)
        _pair(a.crop_ratio, "augment.crop_ratio", "0 < low <= high", lambda lo, hi: 0 < lo <= hi)
        _pair(a.blur_sigma, "augment.blur_sigma", "0 < low <= high", lambda lo, hi: 0 < lo <= hi)
        for key in ("flip_p", "jitter_p", "grayscale_p", "blur_p"):
            _require(0 <= getattr(a, key) <= 1, f"augment.{key}", "must be in [0, 1]", getattr(a, key))
        for key in ("brightness", "contrast", "saturation"):
            _require(getattr(a, key) >= 0, f"augment.{key}", "must be >= 0", getattr(a, key))
        _require(0 <= a.hue <= 0.5, "augment.hue", "must be in [0, 0.5]", a.hue)
        _require(
            a.blur_kernel_size == 0 or (a.blur_kernel_size >= 3 and a.blur_kernel_size % 2 == 1),
            "augment.blur_kernel_size",
            "must be 0 (automatic) or an odd number >= 3",
            a.blur_kernel_size,
        )
        for key, positive in (("mean", False), ("std", True)):
            values = getattr(a, key)
            ok = (
                len(values) == 3
                and all(_is_number(v) for v in values)
                and all(v > 0 if positive else True for v in values)
            )
            _require(
                ok,
                f"augment.{key}",
                "must be 3 numbers (one per RGB channel)" + (", each > 0" if positive else ""),
                values,
            )

    def check_files(self) -> None:
        """Check that the data the config names exists on this machine (the server's, at start).

        Kept apart from ``validate`` because a deployed client may read its data from elsewhere.
        """
        d = self.data
        if d.path and d.dataset != "synthetic":
            p = Path(d.path).expanduser()
            _require(p.exists(), "data.path", f"does not exist (resolved to {p.resolve()})", d.path)
            if d.dataset == "npz" or p.suffix == ".npz":
                _require(p.is_file(), "data.path", "must be an .npz file", d.path)

    # ------------------------------------------------------------------ derived values
    @property
    def clients_per_round(self) -> int:
        return self.federation.clients_per_round or self.federation.num_clients

    @property
    def min_available_clients(self) -> int:
        return self.federation.min_available_clients or self.federation.num_clients

    def client_arch(self, client_id: int) -> str:
        """The encoder architecture of one client: fixed (``model.client_archs``), drawn at random with the seed
        from ``model.client_arch_pool``, or ``model.arch``."""
        if self.model.client_archs:
            return self.model.client_archs[client_id]
        if self.model.client_arch_pool:
            return self.drawn_client_archs()[client_id]
        return self.model.arch

    def drawn_client_archs(self) -> list[str]:
        """Every client's architecture drawn uniformly from ``model.client_arch_pool`` (seeded: the server and
        every client draw the same list from the config alone)."""
        pool = self.model.client_arch_pool
        draws = np.random.default_rng([int(self.seed), 0xA2C4]).integers(len(pool), size=self.federation.num_clients)
        return [pool[int(i)] for i in draws]

    def image_side(self) -> int:
        """The side, in pixels, of the images the encoders see: a folder's ``data.image_size`` (96 by default), a
        named data set's own, a synthetic set's, an .npz file's arrays' (read from its header when the file is here;
        32 otherwise). The server and every client compute it from the config alone (and the server's file)."""
        d = self.data
        if d.dataset == "folder":
            return d.image_size or FOLDER_IMAGE_SIZE
        if d.dataset == "synthetic":
            return 32
        if d.path and Path(d.path).expanduser().is_file():
            return npz_image_side(str(Path(d.path).expanduser().resolve()))
        return DATASET_SIDES.get(d.dataset, 32)

    def resnet_stem(self) -> str:
        """``model.stem`` resolved: ``auto`` is the CIFAR stem for images up to CIFAR_STEM_MAX_SIDE px, the ImageNet
        stem above."""
        if self.model.stem != "auto":
            return self.model.stem
        return "cifar" if self.image_side() <= CIFAR_STEM_MAX_SIDE else "imagenet"

    def round_lr(self, server_round: int) -> float:
        """Learning rate of a (1-based) round: cosine decay across rounds, constant within one."""
        if self.train.lr_schedule == "constant":
            return self.train.lr
        progress = (server_round - 1) / max(1, self.rounds)
        return self.train.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------- helpers


def validate_component_options(options: Mapping[str, Any], defaults: Mapping[str, Any], key: str) -> dict:
    """Merge ``options`` over a component's ``defaults``; unknown names and wrong types raise ConfigError."""
    merged = dict(defaults)
    for name, value in options.items():
        if name not in defaults:
            raise ConfigError(f"{key}.{name}: unknown option (valid: {', '.join(sorted(defaults)) or 'none'})")
        default = defaults[name]
        if default is not None and not _type_matches(value, type(default)):
            raise ConfigError(
                f"{key}.{name}: expected {type(default).__name__}, got {type(value).__name__} ({value!r})"
            )
        merged[name] = float(value) if isinstance(default, float) and not isinstance(value, bool) else value
    return merged


# ---------------------------------------------------------------------- composition
BASE_KEY = "base"


def read_yaml_mapping(path: str | Path, what: str = "config") -> dict:
    """The mapping at the top of a YAML file (an empty file is an empty mapping); ConfigError names the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what}: file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: {path} must hold a mapping at the top level")
    return raw


def expand_dotted(tree: Mapping[str, Any], where: str = "") -> dict:
    """``tree`` with every dotted key (``a.b: v``) turned into nested mappings (``a: {b: v}``), at every level;
    a key given both ways is combined key by key (the dotted one last). ``null`` values are kept: they mean
    something to ``merge_config``."""
    out: dict = {}

    def put(node: dict, parts: list[str], value: Any, at: str) -> None:
        head = parts[0]
        if not head:
            raise ConfigError(f"{at}: empty part in a dotted key")
        if len(parts) == 1:
            if isinstance(value, Mapping) and isinstance(node.get(head), dict):
                for k, v in expand_dotted(value, f"{at}.").items():
                    put(node[head], [k], v, f"{at}.{k}")
            else:
                node[head] = expand_dotted(value, f"{at}.") if isinstance(value, Mapping) else value
            return
        child = node.get(head)
        if not isinstance(child, dict):
            child = node[head] = {}
        put(child, parts[1:], value, at)

    for key, value in sorted(tree.items(), key=lambda kv: "." in str(kv[0])):  # plain keys first, dotted last
        if not isinstance(key, str):
            raise ConfigError(f"{where or 'config'}: keys must be strings, got {key!r}")
        put(out, key.split("."), value, f"{where}{key}")
    return out


REPLACE_KEY = "_replace"


def merge_config(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict:
    """``override`` over ``base`` (neither is changed): mappings merge key by key, other values replace, ``None``
    removes the key (its default applies), a mapping with ``_replace: true`` replaces the base's whole, dotted keys
    name nested mappings."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in expand_dotted(override).items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and value.get(REPLACE_KEY) is True:
            out[key] = _drop_nones({k: v for k, v in value.items() if k != REPLACE_KEY})
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = _drop_nones(value) if isinstance(value, Mapping) else value
    return out


def _drop_nones(tree: Mapping[str, Any]) -> dict:
    if REPLACE_KEY in tree and tree[REPLACE_KEY] not in (True, False):
        raise ConfigError(f"{REPLACE_KEY}: must be true or false (got {tree[REPLACE_KEY]!r})")
    return {
        k: (_drop_nones(v) if isinstance(v, Mapping) else v)
        for k, v in tree.items()
        if v is not None and k != REPLACE_KEY
    }


def config_chain(path: str | Path) -> list[Path]:
    """The files of ``path``'s ``base`` chain, ``path`` first, its last base last (resolved paths)."""
    chain: list[Path] = []
    current = Path(path).expanduser().resolve()
    while True:
        if current in chain:
            cycle = " -> ".join(p.name for p in chain[chain.index(current) :] + [current])
            raise ConfigError(f"base: cycle {cycle} (in {chain[-1]})")
        raw = read_yaml_mapping(current)
        chain.append(current)
        base = raw.get(BASE_KEY)
        if base is None:
            return chain
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"base: must be the path of another experiment config, relative to {current} (got {base!r})"
            )
        nxt = (current.parent / base).resolve()
        if not nxt.is_file():
            raise ConfigError(f"base: {base!r} not found (resolved to {nxt}; named in {current})")
        current = nxt


def load_config_tree(path: str | Path) -> dict:
    """The experiment config in ``path`` as one mapping: its ``base`` chain (``config_chain``) merged from the
    last base to ``path`` itself (``merge_config``), without the ``base`` keys. Not validated (``from_dict`` does
    that)."""
    tree: dict = {}
    for file in reversed(config_chain(path)):
        layer = read_yaml_mapping(file)
        layer.pop(BASE_KEY, None)
        tree = merge_config(tree, layer)
    return tree


def set_dotted(tree: dict, dotted_key: str, value: Any) -> None:
    """Set ``tree['a']['b'] = value`` for ``dotted_key='a.b'``, creating mappings on the way."""
    parts = dotted_key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted_key}: cannot set a sub-key of {part!r}, which is not a mapping")
        node = child
    node[parts[-1]] = value


def leaf_keys(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Dotted names of every scalar setting (the keys the run config may override)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys += leaf_keys(hint, f"{prefix}{f.name}.")
        elif hint not in (dict, list):
            keys.append(prefix + f.name)
    return keys


def _build_dataclass(cls: type, data: Any, prefix: str):
    where = prefix.rstrip(".") or "config"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} ({data!r})")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key (valid keys{' in ' + where if prefix else ''}: "
            f"{', '.join(sorted(names))})"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        value, hint, key = data[name], hints[name], prefix + name
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build_dataclass(hint, value, key + ".")
        elif hint is list:
            if value is None:
                value = []
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{key}: expected a list, got {type(value).__name__} ({value!r})")
            kwargs[name] = list(value)
        elif hint is dict:
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} ({value!r})")
            kwargs[name] = dict(value)
        else:
            if not _type_matches(value, hint):
                raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} ({value!r})")
            kwargs[name] = float(value) if hint is float else value
    return cls(**kwargs)


def _type_matches(value: Any, expected: type) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int subclass: never accept it for numbers
        return False
    if expected is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, expected)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pair(values: list, key: str, rule: str, check) -> None:
    """A (low, high) list: two finite numbers that satisfy ``check(low, high)``."""
    ok = len(values) == 2 and all(_is_number(v) for v in values) and check(*values)
    _require(ok, key, f"must be [low, high] with {rule}", values)


@functools.lru_cache(maxsize=16)
def npz_image_side(path: str) -> int:
    """The image side of an .npz file's ``x_train`` (its header only: nothing is decompressed); 32 if unreadable."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive, archive.open("x_train.npy") as member:
            major, _ = np.lib.format.read_magic(member)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, _ = read_header(member)
        return int(shape[1]) if len(shape) == 4 else 32
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return 32


def _require(ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: {what} (got {value!r})")


def _one_of(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)} (got {value!r})")
