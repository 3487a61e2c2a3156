"""Tests for ssl_models.data.datasets: .npz / torchvision loaders, synthetic data, stratified subsampling."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ssl_models.data import datasets as data
from ssl_models.data.datasets import ImageData, load_dataset, load_npz, load_torchvision, subsample, synthetic_dataset


def write_npz(path: Path, **overrides: np.ndarray) -> Path:
    """A small valid .npz (20 train / 8 test images of 8x8, 4 classes), with arrays replaced or removed."""
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, size=(20, 8, 8, 3), dtype=np.uint8),
        "y_train": (np.arange(20) % 4).astype(np.int32),
        "x_test": rng.integers(0, 256, size=(8, 8, 8, 3), dtype=np.uint8),
        "y_test": (np.arange(8) % 4).astype(np.int64),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


# ------------------------------------------------------------------------------------------- npz


def test_load_npz_reads_arrays_and_normalises_labels(tmp_path):
    path = write_npz(tmp_path / "tiny.npz")
    loaded = load_npz(path)
    with np.load(path) as raw:
        assert np.array_equal(loaded.x_train, raw["x_train"])
        assert np.array_equal(loaded.y_train, raw["y_train"])
    assert loaded.y_train.dtype == np.int64 and loaded.y_test.dtype == np.int64
    assert loaded.num_classes == 4
    assert loaded.name == "tiny"
    assert loaded.image_size == 8


def test_load_npz_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_npz(missing)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"x_train": np.zeros((20, 3, 8, 8), np.uint8)}, r"x_train.*NHWC.*NCHW is not accepted.*looks like NCHW"),
        ({"x_test": np.zeros((8, 8, 8), np.uint8)}, r"x_test must have shape \(N, H, W, 3\)"),
        ({"x_train": np.zeros((20, 8, 8, 3), np.float32)}, r"x_train must have dtype uint8"),
        ({"y_train": np.zeros((20, 1), np.int64)}, r"y_train must be 1-D"),
        ({"y_test": np.zeros(8, np.float32)}, r"y_test must have an integer dtype"),
        ({"y_test": np.zeros(7, np.int64)}, r"y_test has 7 labels but .* 8 images"),
        ({"y_train": -np.ones(20, np.int64)}, r"y_train holds negative labels"),
        ({"x_test": np.zeros((8, 4, 4, 3), np.uint8)}, r"x_train images are \(8, 8, 3\) but x_test"),
        ({"y_test": None}, r"lacks the arrays \['y_test'\]"),
    ],
)
def test_load_npz_rejects_bad_arrays_naming_file_and_array(tmp_path, overrides, message):
    path = write_npz(tmp_path / "bad.npz", **overrides)
    with pytest.raises(ValueError, match=message) as info:
        load_npz(path)
    assert "bad.npz" in str(info.value)


def test_load_npz_is_cached_until_the_file_changes(tmp_path):
    path = write_npz(tmp_path / "cached.npz")
    first = load_npz(path)
    second = load_npz(path)
    assert second.x_train is first.x_train  # same parsed arrays: no second decompression
    renamed = load_npz(path, name="other")
    assert renamed.name == "other" and first.name == "cached"  # callers cannot alter the cache
    write_npz(path, y_train=(np.arange(20) % 5).astype(np.int64))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    reloaded = load_npz(path)
    assert reloaded.num_classes == 5


def test_load_npz_num_classes_override(tmp_path):
    path = write_npz(tmp_path / "tiny.npz")
    assert load_npz(path, num_classes=10).num_classes == 10
    with pytest.raises(ValueError, match="num_classes=3"):
        load_npz(path, num_classes=3)


def test_real_cifar10_dev_copy_loads(cifar_npz):
    loaded = load_dataset("cifar10", path=cifar_npz)
    assert loaded.name == "cifar10" and loaded.num_classes == 10
    assert loaded.x_train.shape == (45000, 32, 32, 3) and loaded.x_test.shape == (5000, 32, 32, 3)
    assert np.array_equal(np.bincount(loaded.y_test), [500] * 10)


# ----------------------------------------------------------------------------------- torchvision


def test_load_torchvision_missing_files_explains_alternatives(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar10.*\.npz.*place the torchvision cifar10 files") as info:
        load_torchvision("cifar10", tmp_path, download=False)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"could not load cifar100 .*place the torchvision cifar100 files"):
        load_dataset("cifar100", root=tmp_path)


def test_load_torchvision_stl10_is_transposed_to_nhwc(monkeypatch, tmp_path):
    import torchvision.datasets

    class FakeSTL10:
        """Stands in for torchvision's STL10: NCHW uint8 ``data`` and numpy ``labels``."""

        def __init__(self, root, split="train", download=False):
            count = 6 if split == "train" else 4
            self.data = np.arange(count * 3 * 96 * 96, dtype=np.int64).reshape(count, 3, 96, 96).astype(np.uint8)
            self.labels = np.arange(count) % 10

    monkeypatch.setattr(torchvision.datasets, "STL10", FakeSTL10)
    data._load_torchvision_cached.cache_clear()
    try:
        loaded = load_torchvision("stl10", tmp_path)
    finally:
        data._load_torchvision_cached.cache_clear()
    expected = FakeSTL10(tmp_path).data
    assert loaded.x_train.shape == (6, 96, 96, 3) and loaded.x_test.shape == (4, 96, 96, 3)
    assert np.array_equal(loaded.x_train[2, 5, 7], expected[2, :, 5, 7])  # pixel (5, 7) of image 2, RGB
    assert loaded.num_classes == 10 and loaded.y_train.dtype == np.int64


def test_load_torchvision_unknown_name():
    with pytest.raises(ValueError, match="cifar10"):
        load_torchvision("mnist", "anywhere")


# ------------------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_balanced_and_seed_dependent():
    first = synthetic_dataset(100, 40, 5, seed=3)
    again = synthetic_dataset(100, 40, 5, seed=3)
    other = synthetic_dataset(100, 40, 5, seed=4)
    assert np.array_equal(first.x_train, again.x_train) and np.array_equal(first.y_test, again.y_test)
    assert not np.array_equal(first.x_train, other.x_train)
    assert first.x_train.shape == (100, 32, 32, 3) and first.x_train.dtype == np.uint8
    assert np.array_equal(np.bincount(first.y_train), [20] * 5)
    assert first.num_classes == 5 and first.name == "synthetic"
    assert synthetic_dataset(10, 10, 2, image_size=96).x_test.shape == (10, 96, 96, 3)


def test_synthetic_classes_are_separable_by_raw_pixel_knn():
    synth = synthetic_dataset(300, 100, 10, seed=0)
    train = synth.x_train.reshape(300, -1).astype(np.float32) / 255
    test = synth.x_test.reshape(100, -1).astype(np.float32) / 255
    distances = ((test[:, None, :] - train[None, :, :]) ** 2).sum(-1)
    accuracy = float((synth.y_train[distances.argmin(1)] == synth.y_test).mean())
    assert accuracy > 0.5  # chance is 0.1


def test_synthetic_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_classes"):
        synthetic_dataset(10, 10, 1)
    with pytest.raises(ValueError, match="num_train"):
        synthetic_dataset(0, 10, 2)


# -------------------------------------------------------------------------------------- dispatch


def test_load_dataset_dispatch(tmp_path):
    path = write_npz(tmp_path / "mine.npz")
    by_npz = load_dataset("npz", path=path)
    assert isinstance(by_npz, ImageData) and by_npz.name == "mine" and by_npz.num_classes == 4
    as_cifar = load_dataset("cifar10", path=path)
    assert as_cifar.name == "cifar10" and as_cifar.num_classes == 10
    synth = load_dataset("synthetic", seed=1, synthetic_sizes=(30, 10, 3, 16))
    assert synth.x_train.shape == (30, 16, 16, 3) and synth.num_classes == 3


def test_load_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match=r"cifar10.*cifar100.*stl10.*npz.*synthetic"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="path"):
        load_dataset("npz")
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_dataset("cifar10", path=tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="synthetic_sizes"):
        load_dataset("synthetic", synthetic_sizes=(10, 10))


# ------------------------------------------------------------------------------------- subsample


def test_subsample_all_when_unbounded():
    labels = np.arange(12) % 3
    for max_items in (None, 0, 12, 100):
        assert np.array_equal(subsample(labels, max_items, seed=0), np.arange(12))


def test_subsample_is_stratified_sorted_and_deterministic():
    labels = np.concatenate([np.zeros(80, int), np.ones(15, int), np.full(5, 2)])
    chosen = subsample(labels, 20, seed=0)
    assert len(chosen) == 20 and np.all(np.diff(chosen) > 0)
    assert np.bincount(labels[chosen]).tolist() == [16, 3, 1]  # quotas 16, 3, 1 exactly
    assert np.array_equal(chosen, subsample(labels, 20, seed=0))
    assert not np.array_equal(chosen, subsample(labels, 20, seed=1))


def test_subsample_keeps_rare_classes_present():
    labels = np.concatenate([np.zeros(995, int), np.arange(1, 6)])  # five singleton classes
    chosen = subsample(labels, 10, seed=0)
    assert set(labels[chosen]) == {0, 1, 2, 3, 4, 5}
    assert len(chosen) == 10


def test_subsample_errors():
    with pytest.raises(ValueError, match="max_items"):
        subsample(np.zeros(5, int), -1, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        subsample(np.zeros((5, 2), int), 3, seed=0)
