"""The papers' other data sets read from their own on-disk layouts: STL-10's binary files (its labelled train/test
splits and its unlabelled split, decoded once into the memory-mapped cache) and Tiny-ImageNet's folders (train/ one
folder per class; val/ images labelled by val_annotations.txt). Every file here is a tiny fake in the real format."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssl_models import config as config_module
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data import datasets, folder
from ssl_models.data.datasets import load_dataset, load_stl10
from ssl_models.data.folder import load_annotated_folder, read_annotations
from ssl_models.data.preflight import check_experiment_data
from ssl_models.data.splits import load_eval_data

STL_SIDE = 96
STL_TRAIN_LABELS = np.array([1, 2, 3, 10, 1, 2], dtype=np.uint8)  # on disk: 1..10
STL_TEST_LABELS = np.array([4, 5, 1, 10], dtype=np.uint8)
STL_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")
STL_UNLABELLED = 10


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The decoded cache in the test's folder (nothing written to the home folder), fresh in-process caches."""
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, str(tmp_path / "cache"))
    datasets.clear_stl10_cache()
    folder.clear_memory_cache()
    yield tmp_path / "cache"
    datasets.clear_stl10_cache()
    folder.clear_memory_cache()


# --------------------------------------------------------------------------------------------------
# STL-10
# --------------------------------------------------------------------------------------------------


def stl_pictures(count: int, seed: int) -> np.ndarray:
    """``count`` HWC pictures (as a viewer shows them): noise, with a white top-left and a black bottom-left pixel so
    that a flipped or transposed reading shows."""
    pictures = np.random.default_rng(seed).integers(1, 255, size=(count, STL_SIDE, STL_SIDE, 3), dtype=np.uint8)
    pictures[:, 0, 0] = 255  # row 0, column 0
    pictures[:, STL_SIDE - 1, 0] = 0  # last row, column 0
    return pictures


def stl_bytes(pictures: np.ndarray) -> bytes:
    """The binary format, from its definition: per image, the red, then green, then blue 96x96 plane, each written
    column-major (column 0's 96 pixels top to bottom first)."""
    planes = pictures.transpose(0, 3, 2, 1)  # (image, channel, column, row): the row index varies fastest
    return np.ascontiguousarray(planes).tobytes()


@pytest.fixture()
def stl10(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    """A fake stl10_binary/ under tmp_path/stl (6 train, 4 test, 10 unlabelled images) and its pictures."""
    pictures = {"train": stl_pictures(6, 1), "test": stl_pictures(4, 2), "unlabeled": stl_pictures(STL_UNLABELLED, 3)}
    binary = tmp_path / "stl" / "stl10_binary"
    binary.mkdir(parents=True)
    for split, images in pictures.items():
        (binary / f"{split}_X.bin").write_bytes(stl_bytes(images))
    (binary / "train_y.bin").write_bytes(STL_TRAIN_LABELS.tobytes())
    (binary / "test_y.bin").write_bytes(STL_TEST_LABELS.tobytes())
    (binary / "class_names.txt").write_text("\n".join(STL_CLASSES) + "\n")
    return tmp_path / "stl", pictures


def stl_config(root: Path, split: str, **data) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "data": {"dataset": "stl10", "path": str(root), "stl10_split": split, "partition": "iid", **data},
            "federation": {"num_clients": 2},
            "model": {"arch": "resnet18", "width": 0.125},
        }
    )


def test_stl10_train_split_is_labelled_with_its_test_part(stl10):
    root, pictures = stl10
    data = load_dataset("stl10", path=root)
    assert data.x_train.shape == (6, STL_SIDE, STL_SIDE, 3) and data.x_test.shape == (4, STL_SIDE, STL_SIDE, 3)
    assert data.x_train.dtype == np.uint8 and isinstance(data.x_train, np.memmap)
    assert data.labelled and data.num_classes == 10 and data.class_names == STL_CLASSES
    assert data.y_train.tolist() == [0, 1, 2, 9, 0, 1] and data.y_test.tolist() == [3, 4, 0, 9]
    assert data.y_train.dtype == np.int64
    assert np.array_equal(data.x_train, pictures["train"]) and np.array_equal(data.x_test, pictures["test"])
    # the orientation: row 0, column 0 is the white pixel, the last row's first pixel the black one
    assert (data.x_train[:, 0, 0] == 255).all() and (data.x_train[:, STL_SIDE - 1, 0] == 0).all()
    # data.path may also name stl10_binary/ itself
    same = load_dataset("stl10", path=root / "stl10_binary")
    assert np.array_equal(same.x_train, data.x_train) and same.y_test.tolist() == data.y_test.tolist()


@pytest.mark.parametrize(
    ("split", "parts"), [("unlabeled", ("unlabeled",)), ("train+unlabeled", ("train", "unlabeled"))]
)
def test_stl10_unlabelled_splits_are_unlabelled_training_data(stl10, split, parts):
    root, pictures = stl10
    data = load_dataset("stl10", path=root, stl10_split=split)
    expected = np.concatenate([pictures[part] for part in parts])
    assert data.x_train.shape == expected.shape and np.array_equal(data.x_train, expected)
    assert isinstance(data.x_train, np.memmap)  # the 2.7 GB split stays on disk
    assert not data.labelled and data.num_classes == 1 and data.y_train.tolist() == [0] * len(expected)
    assert len(data.x_test) == 0 and data.x_test.shape[1:] == (STL_SIDE, STL_SIDE, 3)


@pytest.mark.parametrize("split", ["train", "test", "unlabeled", "train+unlabeled"])
def test_stl10_pixels_are_torchvisions(stl10, monkeypatch, split):
    """Cross-check with torchvision's own reader of the same files (its checksums skipped: the files are fakes)."""
    from torchvision.datasets import STL10

    root, _ = stl10
    monkeypatch.setattr(STL10, "_check_integrity", lambda self: True)
    reference = STL10(str(root), split=split, download=False)
    loaded = load_stl10(root, "train" if split == "test" else split)
    images = loaded.x_test if split == "test" else loaded.x_train
    assert len(images) == len(reference)
    for index in range(len(reference)):
        picture, label = reference[index]
        assert np.array_equal(np.asarray(picture), images[index]), f"image {index} of {split}"
        if split in ("train", "test"):
            assert label == (loaded.y_test if split == "test" else loaded.y_train)[index]


def test_stl10_is_decoded_once_into_the_cache(stl10, cache, monkeypatch):
    root, pictures = stl10
    load_stl10(root, "train+unlabeled")
    entries = sorted(p for p in cache.iterdir() if p.name.startswith("stl10-"))
    assert len(entries) == 1 and (entries[0] / "x.npy").is_file()
    datasets.clear_stl10_cache()  # another process: maps the entry, decodes nothing

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(datasets, "_write_stl10_nhwc", no_decode)
    again = load_stl10(root, "train+unlabeled")
    assert np.array_equal(again.x_train[6:], pictures["unlabeled"])
    monkeypatch.undo()
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, str(cache))
    # a replaced file is another version: decoded anew, the older version's entry removed
    changed = stl_pictures(STL_UNLABELLED, 4)
    unlabelled_file = root / "stl10_binary" / "unlabeled_X.bin"
    unlabelled_file.write_bytes(stl_bytes(changed))
    os.utime(unlabelled_file, ns=(1, 1))
    fresh = load_stl10(root, "train+unlabeled")
    assert np.array_equal(fresh.x_train[6:], changed)
    assert [p.name for p in cache.iterdir() if p.name.startswith("stl10-")] != [entries[0].name]
    assert len([p for p in cache.iterdir() if p.name.startswith("stl10-")]) == 1


def test_stl10_without_the_cache(stl10, monkeypatch):
    root, pictures = stl10
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, "off")
    data = load_stl10(root, "unlabeled")
    assert np.array_equal(data.x_train, pictures["unlabeled"])


def test_stl10_missing_and_truncated_files_are_named(stl10):
    root, _ = stl10
    (root / "stl10_binary" / "unlabeled_X.bin").unlink()
    assert load_stl10(root, "train").labelled  # the labelled splits do not need it
    with pytest.raises(FileNotFoundError, match=r"unlabeled_X\.bin missing.*data\.download"):
        load_stl10(root, "unlabeled")
    with pytest.raises(FileNotFoundError, match=r"train_X\.bin, train_y\.bin, test_X\.bin, test_y\.bin missing"):
        load_stl10(root / "elsewhere", "train")
    (root / "stl10_binary" / "train_X.bin").write_bytes(b"\0" * 1000)
    with pytest.raises(ValueError, match=r"train_X\.bin holds 1000 bytes, not a whole number"):
        load_stl10(root, "train")


def test_stl10_labels_must_match_their_images(stl10):
    root, _ = stl10
    (root / "stl10_binary" / "test_y.bin").write_bytes(np.array([1, 2, 3], np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"test_y\.bin holds 3 labels but .* 4 images"):
        load_stl10(root, "train")
    (root / "stl10_binary" / "test_y.bin").write_bytes(np.array([0, 2, 3, 4], np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"labels 0\.\.4; STL-10's are 1\.\.10"):
        load_stl10(root, "train")


def test_stl10_unlabelled_training_is_scored_on_the_labelled_splits(stl10):
    root, pictures = stl10
    cfg = stl_config(root, "train+unlabeled")
    checked = check_experiment_data(cfg)
    assert not checked.data.labelled and len(checked.data.x_train) == 6 + STL_UNLABELLED
    assert checked.client_sizes == [8, 8]
    scored = checked.eval_data
    assert scored is not None and scored.labelled and scored.num_classes == 10
    assert np.array_equal(scored.x_train, pictures["train"]) and np.array_equal(scored.x_test, pictures["test"])
    assert scored.y_train.tolist() == [0, 1, 2, 9, 0, 1]
    evaluation = load_eval_data(cfg)
    assert evaluation is not None and evaluation.y_test.tolist() == [3, 4, 0, 9]
    # the train split is its own evaluation set, as before
    labelled = check_experiment_data(stl_config(root, "train"))
    assert labelled.eval_data is labelled.data


def test_stl10_split_settings_are_checked(stl10):
    root, _ = stl10
    assert config_module.STL10_SPLITS == datasets.STL10_SPLITS
    with pytest.raises(ConfigError, match=r"data\.stl10_split: must be one of train, unlabeled, train\+unlabeled"):
        stl_config(root, "extra")
    with pytest.raises(ConfigError, match=r"data\.stl10_split: applies to data\.dataset stl10 only"):
        ExperimentConfig.from_dict({"data": {"dataset": "cifar10", "stl10_split": "unlabeled", "partition": "iid"}})
    with pytest.raises(ConfigError, match=r"data\.partition: must be iid with data\.stl10_split unlabeled"):
        stl_config(root, "unlabeled", partition="dirichlet")
    with pytest.raises(ValueError, match=r"stl10_split unlabeled reads STL-10's binary files"):
        load_dataset("stl10", path=root / "stl10_binary" / "class_names.txt", stl10_split="unlabeled")


# --------------------------------------------------------------------------------------------------
# Tiny-ImageNet
# --------------------------------------------------------------------------------------------------


TINY_SIDE = 64
WNIDS = ("n01443537", "n01629819", "n02124075")
# val image -> class; class 0's images are bright red, class 1's mid, class 2's dark: the labels can be read back
VAL_CLASSES = ("n02124075", "n01443537", "n01629819", "n01443537", "n02124075", "n01629819")


def class_colour(class_index: int) -> tuple[int, int, int]:
    return (230 - 100 * class_index, 40, 90)


def save_jpeg(path: Path, colour: tuple[int, int, int], seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.full((TINY_SIDE, TINY_SIDE, 3), colour, dtype=np.int16)
    pixels += np.random.default_rng(seed).integers(-6, 7, size=pixels.shape, dtype=np.int16)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, format="JPEG", quality=95)


def write_annotations(val: Path, classes: tuple[str, ...]) -> None:
    lines = [f"val_{index}.JPEG\t{wnid}\t0\t{index}\t40\t63" for index, wnid in enumerate(classes)]
    (val / "val_annotations.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture()
def tiny(tmp_path) -> Path:
    """tiny-imagenet-200/ in its real layout: wnids.txt, words.txt, train/<wnid>/images/*.JPEG with
    train/<wnid>/<wnid>_boxes.txt, val/images/*.JPEG with val/val_annotations.txt, test/images/*.JPEG (no labels)."""
    root = tmp_path / "tiny-imagenet-200"
    for class_index, wnid in enumerate(WNIDS):
        for index in range(4):
            save_jpeg(root / "train" / wnid / "images" / f"{wnid}_{index}.JPEG", class_colour(class_index), index)
        boxes = "\n".join(f"{wnid}_{index}.JPEG\t0\t0\t63\t63" for index in range(4))
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text(boxes + "\n")
    for index, wnid in enumerate(VAL_CLASSES):
        save_jpeg(root / "val" / "images" / f"val_{index}.JPEG", class_colour(WNIDS.index(wnid)), 10 + index)
    write_annotations(root / "val", VAL_CLASSES)
    for index in range(2):
        save_jpeg(root / "test" / "images" / f"test_{index}.JPEG", (128, 128, 128), 20 + index)
    (root / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    (root / "words.txt").write_text(
        "n01443537\tgoldfish\nn01629819\tEuropean fire salamander\nn02124075\tEgyptian cat\n"
    )
    return root


def tiny_config(root: Path) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "data": {
                "dataset": "folder",
                "path": str(root / "train"),
                "image_size": TINY_SIDE,
                "folder_labels": "subfolders",
                "partition": "iid",
            },
            "federation": {"num_clients": 2},
            "model": {"arch": "resnet18", "width": 0.125},
            "eval": {"path": str(root)},
        }
    )


def class_of_colour(images: np.ndarray) -> list[int]:
    red = images[..., 0].reshape(len(images), -1).mean(axis=1)
    return [int(np.argmin([abs(r - class_colour(k)[0]) for k in range(len(WNIDS))])) for r in red]


def test_tiny_imagenet_train_folder_is_one_class_per_wnid(tiny):
    data = load_dataset(
        "folder",
        path=tiny / "train",
        folder_options={"image_size": TINY_SIDE, "labels": "subfolders", "unreadable": "stop"},
    )
    # the <wnid>_boxes.txt files are not images: ignored, not unreadable
    assert data.x_train.shape == (12, TINY_SIDE, TINY_SIDE, 3) and data.labelled
    assert data.num_classes == 3 and data.class_names == WNIDS
    assert data.y_train.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert class_of_colour(data.x_train) == data.y_train.tolist()


def test_tiny_imagenet_as_eval_path_reads_val_with_its_annotations(tiny):
    cfg = tiny_config(tiny)
    data = load_eval_data(cfg)
    assert data is not None and data.labelled and data.num_classes == 3 and data.class_names == WNIDS
    assert data.x_train.shape == (12, TINY_SIDE, TINY_SIDE, 3) and data.x_test.shape == (6, TINY_SIDE, TINY_SIDE, 3)
    expected = [WNIDS.index(wnid) for wnid in VAL_CLASSES]  # val_0 .. val_5, in the annotations' order
    assert data.y_test.tolist() == expected
    assert class_of_colour(data.x_test) == expected  # each row's pixels are its annotated image's
    checked = check_experiment_data(cfg)
    assert checked.eval_data is not None and len(checked.eval_test_idx) == 6


def test_tiny_imagenet_val_may_lack_a_class(tiny):
    shown = tuple(wnid for wnid in VAL_CLASSES if wnid != WNIDS[1])
    for index in range(6):
        (tiny / "val" / "images" / f"val_{index}.JPEG").unlink()
    for index, wnid in enumerate(shown):
        save_jpeg(tiny / "val" / "images" / f"val_{index}.JPEG", class_colour(WNIDS.index(wnid)), index)
    write_annotations(tiny / "val", shown)
    data = load_eval_data(tiny_config(tiny))
    assert data is not None and data.num_classes == 3 and data.y_test.tolist() == [2, 0, 0, 2]


def test_edited_annotations_are_read_again(tiny):
    first = load_eval_data(tiny_config(tiny))
    swapped = (VAL_CLASSES[1], VAL_CLASSES[0], *VAL_CLASSES[2:])
    write_annotations(tiny / "val", swapped)
    second = load_eval_data(tiny_config(tiny))
    assert first is not None and second is not None
    assert second.y_test.tolist() == [WNIDS.index(wnid) for wnid in swapped] != first.y_test.tolist()


def test_annotated_folder_errors(tiny):
    images = tiny / "val" / "images"
    annotations = read_annotations(tiny / "val" / "val_annotations.txt")
    assert annotations["val_2.JPEG"] == VAL_CLASSES[2] and len(annotations) == 6
    missing_one = {name: wnid for name, wnid in annotations.items() if name != "val_3.JPEG"}
    with pytest.raises(ValueError, match=r"1 of its 6 images have no line in the annotations .*val_3\.JPEG"):
        load_annotated_folder(images, missing_one, WNIDS, image_size=TINY_SIDE)
    with pytest.raises(ValueError, match=r"classes the training part lacks: n02124075"):
        load_annotated_folder(images, annotations, WNIDS[:2], image_size=TINY_SIDE)
    broken = tiny / "broken.txt"
    broken.write_text("val_0.JPEG\tn01443537\nval_1.JPEG\n")
    with pytest.raises(ValueError, match=r"broken\.txt, line 2: expected a file name and its class"):
        read_annotations(broken)
    broken.write_text("val_0.JPEG\tn01443537\nval_0.JPEG\tn01629819\n")
    with pytest.raises(ValueError, match=r"line 2: val_0\.JPEG is given the class n01629819"):
        read_annotations(broken)
