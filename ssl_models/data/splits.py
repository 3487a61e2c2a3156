"""The federated view of a data set: which training images each client and the server hold.

Server and clients compute the same split from the same config (everything is seeded), so only the
config travels, never index lists. Order of operations, fixed so that results are reproducible:
1. load the data set; 2. class-stratified subsample of ``data.max_train`` training images;
3. carve the server-held public/auxiliary split (never given to a client);
4. partition what remains among ``federation.num_clients`` clients.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ssl_models.config import FOLDER_IMAGE_SIZE, ExperimentConfig
from ssl_models.data.datasets import ImageData, load_dataset, subsample
from ssl_models.data.partition import partition_indices, public_split
from ssl_models.data.rows import ImageRows, select_rows


@dataclass(frozen=True)
class FederatedSplit:
    public_idx: np.ndarray  # indices into x_train held by the server only
    client_idx: tuple[np.ndarray, ...]  # per client, indices into x_train


def load_experiment_data(
    cfg: ExperimentConfig, path: str | None = None, log: Callable[[str], None] | None = None
) -> ImageData:
    """The experiment's data set (files are cached by ``ssl_models.data.datasets``). ``path`` overrides data.path."""
    d = cfg.data
    return load_dataset(
        d.dataset,
        path=(path or d.path or None),
        download=d.download,
        seed=cfg.seed,
        synthetic_sizes=(d.synthetic_train, d.synthetic_test, d.synthetic_classes),
        folder_options={
            "image_size": d.image_size or FOLDER_IMAGE_SIZE,
            "labels": d.folder_labels,
            "unreadable": d.unreadable,
            "log": log,
        },
        stl10_split=d.stl10_split,
        log=log,
    )


def federated_split(cfg: ExperimentConfig, labels: np.ndarray) -> FederatedSplit:
    d = cfg.data
    key = (
        d.max_train,
        d.public_size,
        d.partition,
        d.alpha,
        d.min_size,
        d.classes_per_client,
        cfg.federation.num_clients,
        cfg.seed,
        hashlib.sha1(labels.tobytes()).hexdigest(),
    )
    # Simulated clients share a process and ask for the same split every round: compute it once.
    if key not in _SPLIT_CACHE:
        if len(_SPLIT_CACHE) >= 4:
            _SPLIT_CACHE.pop(next(iter(_SPLIT_CACHE)))
        _SPLIT_CACHE[key] = _compute_split(key, labels)
    return _SPLIT_CACHE[key]


_SPLIT_CACHE: dict[tuple, FederatedSplit] = {}


def _compute_split(key: tuple, labels: np.ndarray) -> FederatedSplit:
    max_train, public_size, scheme, alpha, min_size, cpc, num_clients, seed, _ = key
    used = subsample(labels, max_train or None, seed=seed)
    public = np.zeros(0, dtype=np.int64)
    if public_size:
        size = int(public_size) if public_size >= 1 else float(public_size)
        pub_local, rest_local = public_split(labels[used], size, seed=seed + 1)
        public, used = used[pub_local], used[rest_local]
    kwargs = {"dirichlet": {"alpha": alpha, "min_size": min_size}, "pathological": {"classes_per_client": cpc}}.get(
        scheme, {}
    )
    parts = partition_indices(labels[used], scheme, num_clients, seed + 2, **kwargs)
    return FederatedSplit(public_idx=np.sort(public), client_idx=tuple(np.sort(used[p]) for p in parts))


def client_images(cfg: ExperimentConfig, partition_id: int, data: ImageData | None = None) -> np.ndarray | ImageRows:
    """The training images of one client (NHWC uint8); a large partition of a memory-mapped data set (a folder's
    cache) stays on disk, read a batch at a time (``select_rows``), so client memory does not grow with it."""
    n = cfg.federation.num_clients
    if not 0 <= partition_id < n:
        raise ValueError(f"partition-id {partition_id} out of range for {n} clients")
    data = data or load_experiment_data(cfg)
    return select_rows(data.x_train, federated_split(cfg, data.y_train).client_idx[partition_id])


def union_images(cfg: ExperimentConfig, data: ImageData | None = None) -> np.ndarray | ImageRows:
    """The union of every client's training images (the centralized reference trains on it), in index order; on
    disk when large, as ``client_images``."""
    data = data or load_experiment_data(cfg)
    split = federated_split(cfg, data.y_train)
    return select_rows(data.x_train, np.sort(np.concatenate(split.client_idx)))


def public_images(cfg: ExperimentConfig, data: ImageData | None = None, source: str = "split") -> np.ndarray:
    """The public/auxiliary images every party can compute: the server-held split (``source="split"``) or
    client 0's partition (``source="client0"``, FLESD's code, where client 0 then does not train)."""
    data = data or load_experiment_data(cfg)
    split = federated_split(cfg, data.y_train)
    if source == "client0":
        return data.x_train[split.client_idx[0]]
    if source != "split":
        raise ValueError(f"public source must be 'split' or 'client0', got {source!r}")
    if len(split.public_idx) == 0:
        raise ValueError("the public split is empty: set data.public_size (a count, or a fraction < 1)")
    return data.x_train[split.public_idx]


def images_digest(images: np.ndarray) -> str:
    """Content hash of an image set (shape, dtype and pixels), to check that two parties hold the same one."""
    h = hashlib.sha256(f"{images.shape}|{images.dtype}".encode())
    h.update(np.ascontiguousarray(images).tobytes())
    return h.hexdigest()


def eval_subset_seeds(cfg: ExperimentConfig) -> tuple[int, int]:
    """Seeds of the evaluation's class-stratified train and test subsamples (recorded in ``model.pt`` so that
    ``fedssl-eval`` draws the same subsets)."""
    return cfg.seed + 3, cfg.seed + 4


def eval_subsets(cfg: ExperimentConfig, data: ImageData) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the labelled train images (kNN bank, probe fit) and test images used for evaluation."""
    e = cfg.eval
    train_seed, test_seed = eval_subset_seeds(cfg)
    return (
        subsample(data.y_train, e.max_train or None, seed=train_seed),
        subsample(data.y_test, e.max_test or None, seed=test_seed),
    )


EVAL_TEST_FOLDERS = ("test", "val")  # an eval.path folder's scored part: the first of these that exists


def load_eval_data(cfg: ExperimentConfig) -> ImageData | None:
    """The labelled set the encoder is scored on: ``eval.path`` when given (an .npz with its four arrays, or a
    folder with ``train/`` and ``test/`` or ``val/`` subfolders, brought to the run's image side), else the training
    data set when it is labelled, else STL-10's labelled train/test splits when the training images are its
    unlabelled ones (``data.stl10_split``), else None (nothing to score against).

    An eval.path folder's ``train/`` holds one subfolder per class; its scored part is ``test/`` (else ``val/``)
    laid out the same way, or a folder labelled by a ``val_annotations.txt`` beside its images (Tiny-ImageNet's
    ``val/``: ``images/`` and the annotations file), which is then preferred (Tiny-ImageNet's ``test/`` has no
    labels). The scored part's class ids are the train part's."""
    from pathlib import Path

    from ssl_models.data.datasets import _build_image_data, load_npz

    path = cfg.eval.path
    if not path:
        d = cfg.data
        if d.dataset == "stl10" and d.stl10_split != "train":
            # Pre-trained on unlabelled images, scored as the papers score it: on the labelled train/test splits.
            return load_dataset("stl10", path=d.path or None, download=d.download, stl10_split="train")
        data = load_experiment_data(cfg)
        return data if data.labelled else None
    where = Path(path).expanduser()
    if where.is_file() or where.suffix == ".npz":
        data = load_npz(where)
        if not data.labelled:
            raise ValueError(
                f"{where} holds no labels (x_train alone): the evaluation set needs x_train, y_train, x_test and y_test"
            )
        return data
    if not where.is_dir():
        raise FileNotFoundError(f"{where} does not exist (resolved to {where.resolve()})")
    from ssl_models.data.folder import ANNOTATIONS_FILE, load_annotated_folder, load_folder, read_annotations

    annotated = [where / name for name in EVAL_TEST_FOLDERS if (where / name / ANNOTATIONS_FILE).is_file()]
    test_dir = annotated[0] if annotated else None
    test_dir = test_dir or next((where / name for name in EVAL_TEST_FOLDERS if (where / name).is_dir()), None)
    if not (where / "train").is_dir() or test_dir is None:
        raise ValueError(
            f"{where} must hold a train/ folder and a test/ (or val/) folder, each with one subfolder per class "
            f"(or, for the second, its images with a {ANNOTATIONS_FILE})"
        )
    side = cfg.image_side()
    options: dict[str, Any] = {"image_size": side, "unreadable": cfg.data.unreadable}
    train = load_folder(where / "train", labels="subfolders", **options)
    train_names = list(train.class_names)
    if annotated:
        images_dir = test_dir / "images" if (test_dir / "images").is_dir() else test_dir
        annotations = read_annotations(test_dir / ANNOTATIONS_FILE)
        test = load_annotated_folder(images_dir, annotations, train_names, **options)
        test_labels = test.y_train  # already numbered by train_names
    else:
        test = load_folder(test_dir, labels="subfolders", **options)
        test_names = list(test.class_names)
        unknown = sorted(set(test_names) - set(train_names))
        if unknown:
            raise ValueError(f"{test_dir} has classes that {where / 'train'} lacks: {unknown[:5]}")
        # the test part's class ids as the train part numbers them (a test folder may lack a class)
        to_train_id = np.array([train_names.index(n) for n in test_names], dtype=np.int64)
        test_labels = to_train_id[test.y_train]
    data = _build_image_data(
        train.x_train,
        train.y_train,
        test.x_train,
        test_labels,
        name=where.name,
        source=f"eval.path {where}",
        num_classes=len(train_names),
    )
    return dataclasses.replace(data, class_names=tuple(train_names))
