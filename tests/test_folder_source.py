"""A folder of image files as a data set (ssl_models.data.folder): layouts, the resize policy, mode conversion,
unreadable files, the errors, and the memory-mapped cache on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from ssl_models.data import datasets, folder
from ssl_models.data.folder import load_folder

SIDE = 16


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The decoded cache in the test's folder (nothing written to the home folder), and a fresh in-process cache."""
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, str(tmp_path / "cache"))
    folder.clear_memory_cache()
    yield tmp_path / "cache"
    folder.clear_memory_cache()


def noise(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def save(image: Image.Image, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def mixed_images(where: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` images of assorted sizes, formats and modes: PNG, JPEG, BMP, GIF (palette), grayscale, RGBA."""
    sizes = [(20, 30), (64, 48), (100, 100), (33, 17)]
    paths = []
    for index in range(count):
        height, width = sizes[index % len(sizes)]
        image = noise(height, width, seed + index)
        kind = index % 6
        if kind == 0:
            paths.append(save(image, where / f"img{index:02d}.png"))
        elif kind == 1:
            paths.append(save(image, where / f"img{index:02d}.jpg"))
        elif kind == 2:
            paths.append(save(image, where / f"img{index:02d}.BMP"))  # upper-case extension counts too
        elif kind == 3:
            paths.append(save(image.convert("P"), where / f"img{index:02d}.gif"))
        elif kind == 4:
            paths.append(save(image.convert("L"), where / f"img{index:02d}.png"))
        else:
            paths.append(save(image.convert("RGBA"), where / f"img{index:02d}.png"))
    return paths


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".tmp-"))


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def test_a_flat_folder_is_unlabelled_and_ignores_other_and_hidden_files(tmp_path):
    root = tmp_path / "photos"
    mixed_images(root, 12)
    (root / "notes.txt").write_text("not an image")
    (root / "report.pdf").write_bytes(b"%PDF-1.4")  # registered by Pillow for saving only
    save(noise(8, 8, 99), root / ".hidden.png")
    save(noise(8, 8, 98), root / ".thumbnails" / "t.png")
    data = load_folder(root, image_size=SIDE)
    assert data.x_train.shape == (12, SIDE, SIDE, 3) and data.x_train.dtype == np.uint8
    assert not data.labelled and data.num_classes == 1 and data.class_names == ()
    assert data.y_train.dtype == np.int64 and data.y_train.tolist() == [0] * 12
    assert data.x_test.shape == (0, SIDE, SIDE, 3) and data.x_test.dtype == np.uint8
    assert data.y_test.shape == (0,) and data.y_test.dtype == np.int64
    assert data.name == "photos" and data.image_size == SIDE


def test_a_nested_folder_under_one_subfolder_is_unlabelled(tmp_path):
    root = tmp_path / "data"
    mixed_images(root / "all" / "a", 4)
    mixed_images(root / "all" / "b" / "deeper", 3, seed=10)
    data = load_folder(root, image_size=SIDE)
    assert data.x_train.shape[0] == 7 and not data.labelled and data.num_classes == 1


def test_class_subfolders_are_labelled_by_sorted_names(tmp_path, cache):
    root = tmp_path / "classes"
    for name, count in (("zebra", 3), ("cat", 4), ("dog", 2)):  # created out of order
        mixed_images(root / name, count, seed=len(name) * 7)
    mixed_images(root / "dog" / "puppies", 2, seed=50)  # deeper images belong to their first-level class
    data = load_folder(root, image_size=SIDE)
    assert data.labelled and data.num_classes == 3 and data.class_names == ("cat", "dog", "zebra")
    assert np.bincount(data.y_train).tolist() == [4, 4, 3]
    (entry,) = entries(cache)
    listing = json.loads((entry / "listing.json").read_text())["files"]
    assert [data.class_names[y] for y in data.y_train] == [path.split("/")[0] for path in listing]
    assert json.loads((entry / "complete.json").read_text())["class_names"] == ["cat", "dog", "zebra"]
    explicit = load_folder(root, image_size=SIDE, labels="subfolders")
    np.testing.assert_array_equal(explicit.y_train, data.y_train)
    np.testing.assert_array_equal(explicit.x_train, data.x_train)


def test_labels_none_reads_a_class_layout_unlabelled(tmp_path):
    root = tmp_path / "classes"
    mixed_images(root / "a", 3)
    mixed_images(root / "b", 2, seed=5)
    data = load_folder(root, image_size=SIDE, labels="none")
    assert not data.labelled and data.num_classes == 1 and data.y_train.tolist() == [0] * 5


# --------------------------------------------------------------------------------------------------
# Pixels
# --------------------------------------------------------------------------------------------------


def test_the_shorter_side_is_resized_and_the_centre_square_cut(tmp_path):
    size = 8
    wide = np.zeros((20, 40, 3), np.uint8)
    wide[:, :20] = (200, 30, 30)  # left and right halves differ: a wrong crop or a squash shows
    wide[:, 20:] = (20, 40, 220)
    wide[5:9, 12:26] = (250, 250, 0)
    save(Image.fromarray(wide), tmp_path / "wide" / "w.png")
    tall = np.random.default_rng(3).integers(0, 256, (40, 20, 3), dtype=np.uint8)
    save(Image.fromarray(tall), tmp_path / "tall" / "t.png")

    got_wide = load_folder(tmp_path / "wide", image_size=size).x_train[0]
    # By hand: 40x20 -> shorter side 20 to 8 gives 16x8 (bicubic), then the centre 8 columns are 4..12.
    expected = Image.fromarray(wide).resize((16, 8), Image.Resampling.BICUBIC).crop((4, 0, 12, 8))
    np.testing.assert_array_equal(got_wide, np.asarray(expected))
    assert got_wide[:, 0].tolist() != got_wide[:, -1].tolist()

    got_tall = load_folder(tmp_path / "tall", image_size=size).x_train[0]
    expected = Image.fromarray(tall).resize((8, 16), Image.Resampling.BICUBIC).crop((0, 4, 8, 12))
    # Pillow rounds its two passes in another order for a box: at most one level apart.
    assert np.abs(got_tall.astype(int) - np.asarray(expected).astype(int)).max() <= 1


def test_small_images_are_enlarged(tmp_path):
    save(noise(5, 7, 1), tmp_path / "small" / "s.png")
    assert load_folder(tmp_path / "small", image_size=SIDE).x_train.shape == (1, SIDE, SIDE, 3)


def test_every_mode_becomes_rgb(tmp_path):
    root = tmp_path / "modes"
    base = noise(SIDE, SIDE, 4)  # already the target side: the resize leaves the pixels unchanged
    rgba = base.convert("RGBA")
    rgba.putalpha(Image.new("L", base.size, 7))
    images = {
        "a_gray.png": base.convert("L"),
        "b_rgba.png": rgba,
        "c_palette.gif": base.convert("P"),
        "d_cmyk.tif": base.convert("CMYK"),
        "e_bitmap.png": base.convert("1"),
        "f_gray_alpha.png": base.convert("LA"),
    }
    for name, image in images.items():
        save(image, root / name)
    sixteen = (np.arange(SIDE * SIDE, dtype=np.uint16).reshape(SIDE, SIDE) * 257).astype(np.uint16)
    save(Image.fromarray(sixteen), root / "g_gray16.png")
    data = load_folder(root, image_size=SIDE)
    got = dict(zip(sorted([*images, "g_gray16.png"]), data.x_train, strict=True))
    for name, image in images.items():
        np.testing.assert_array_equal(got[name], np.asarray(Image.open(root / name).convert("RGB")), err_msg=name)
    np.testing.assert_array_equal(got["b_rgba.png"], np.asarray(base))  # alpha dropped, colours kept
    gray = got["a_gray.png"]
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
    top_bits = (sixteen >> 8).astype(np.uint8)  # 16-bit gray keeps its top 8 bits instead of clipping at 255
    np.testing.assert_array_equal(got["g_gray16.png"], np.repeat(top_bits[..., None], 3, axis=-1))


# --------------------------------------------------------------------------------------------------
# Unreadable files
# --------------------------------------------------------------------------------------------------


def test_a_corrupt_file_stops_with_its_name_and_the_count(tmp_path):
    root = tmp_path / "photos"
    mixed_images(root, 6)
    (root / "broken.jpg").write_bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"1 of its 7 image files cannot be read: broken\.jpg") as error:
        load_folder(root, image_size=SIDE)
    assert "data.unreadable: skip" in str(error.value) and "\n" not in str(error.value)


def test_skip_leaves_unreadable_files_out_and_names_them(tmp_path, cache):
    root = tmp_path / "photos"
    mixed_images(root, 6)
    for index in range(7):
        (root / f"bad{index}.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"7 of its 13 image files cannot be read: bad0\.png .*\(7 in all\)"):
        load_folder(root, image_size=SIDE)
    lines: list[str] = []
    data = load_folder(root, image_size=SIDE, unreadable="skip", log=lines.append)
    assert data.x_train.shape[0] == 6
    assert any("skipping 7 unreadable" in line and "bad0.png" in line for line in lines)
    (entry,) = entries(cache)  # the stopped load already wrote the entry: the skipping load decoded nothing
    metadata = json.loads((entry / "complete.json").read_text())
    assert [item["path"] for item in metadata["unreadable"]] == [f"bad{index}.png" for index in range(7)]
    assert metadata["images"] == 6 and metadata["files_listed"] == 13
    assert "bad0.png" not in json.loads((entry / "listing.json").read_text())["files"]
    with pytest.raises(ValueError, match="7 of its 13"):  # loaded with skip in this process: stop still stops
        load_folder(root, image_size=SIDE)


def test_a_truncated_jpeg_is_unreadable_even_if_pillow_was_told_to_accept_them(tmp_path, monkeypatch):
    root = tmp_path / "photos"
    mixed_images(root, 2)
    whole = save(noise(64, 64, 8), tmp_path / "whole.jpg").read_bytes()
    (root / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # as another library may set it
    with pytest.raises(ValueError, match=r"cut\.jpg \(OSError: image file is truncated"):
        load_folder(root, image_size=SIDE)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored
    assert load_folder(root, image_size=SIDE, unreadable="skip").x_train.shape[0] == 2


def test_a_class_left_without_readable_images_is_named(tmp_path):
    root = tmp_path / "classes"
    mixed_images(root / "a", 2)
    mixed_images(root / "b", 2, seed=3)
    (root / "c").mkdir()
    (root / "c" / "x.png").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"class subfolder\(s\) c hold no readable image"):
        load_folder(root, image_size=SIDE, unreadable="skip")


def test_a_folder_of_only_unreadable_files_is_an_error(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jpg").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"none of its 1 image files can be read: x\.jpg"):
        load_folder(tmp_path / "bad", image_size=SIDE, unreadable="skip")


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="image folder not found"):
        load_folder(tmp_path / "nowhere", image_size=SIDE)


def test_a_file_given_as_the_folder(tmp_path):
    path = save(noise(8, 8, 0), tmp_path / "one.png")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        load_folder(path, image_size=SIDE)


def test_an_empty_folder_says_which_extensions_count(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no image files found \(extensions \.jpg, \.jpeg, \.png.*\(it is empty\)"):
        load_folder(tmp_path / "empty", image_size=SIDE)
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match=r"holds 1 other file\(s\), e\.g\. readme\.txt"):
        load_folder(tmp_path / "empty", image_size=SIDE)


def test_subfolders_needs_two_classes(tmp_path):
    mixed_images(tmp_path / "one" / "only", 3)
    with pytest.raises(ValueError, match=r"lie in 1 subfolder \['only'\]; classes need at least two"):
        load_folder(tmp_path / "one", image_size=SIDE, labels="subfolders")


def test_subfolders_refuses_images_outside_them(tmp_path):
    root = tmp_path / "classes"
    mixed_images(root / "a", 2)
    mixed_images(root / "b", 2, seed=4)
    save(noise(8, 8, 0), root / "stray.png")
    with pytest.raises(ValueError, match=r"1 image\(s\) lie outside a class subfolder \(the first: stray\.png\)"):
        load_folder(root, image_size=SIDE, labels="subfolders")


def test_a_mixed_layout_under_auto_is_an_error_with_the_way_out(tmp_path):
    root = tmp_path / "mixed"
    mixed_images(root / "a", 2)
    mixed_images(root / "b", 2, seed=4)
    save(noise(8, 8, 0), root / "top.png")
    with pytest.raises(ValueError, match=r"mixed layout: 1 image\(s\) at the top level \(the first: top\.png\)") as err:
        load_folder(root, image_size=SIDE)
    assert "data.folder_labels: none" in str(err.value)
    assert load_folder(root, image_size=SIDE, labels="none").x_train.shape[0] == 5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"image_size": 0}, "image_size must be an integer >= 1"),
        ({"image_size": 16, "labels": "classes"}, "labels must be one of"),
        ({"image_size": 16, "unreadable": "ignore"}, "unreadable must be one of"),
    ],
)
def test_bad_options(tmp_path, options, message):
    mixed_images(tmp_path / "photos", 1)
    with pytest.raises(ValueError, match=message):
        load_folder(tmp_path / "photos", **options)


# --------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------


def count_opens(monkeypatch) -> list[object]:
    opened: list[object] = []
    real_open = Image.open

    def spy(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", spy)
    return opened


def test_a_later_load_memory_maps_the_cache_without_decoding(tmp_path, cache, monkeypatch):
    root = tmp_path / "photos"
    mixed_images(root, 10)
    opened = count_opens(monkeypatch)
    first = load_folder(root, image_size=SIDE)
    assert len(opened) == 10
    (entry,) = entries(cache)
    assert entry.name.startswith("folder-")
    assert sorted(p.name for p in entry.iterdir()) == ["complete.json", "listing.json", "x_train.npy", "y_train.npy"]
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] == []

    folder.clear_memory_cache()  # as a new process would start
    second = load_folder(root, image_size=SIDE)
    assert len(opened) == 10  # no image opened again
    for data in (first, second):
        assert isinstance(data.x_train, np.memmap) and not data.x_train.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            data.x_train[0, 0, 0, 0] = 1
    np.testing.assert_array_equal(first.x_train, second.x_train)
    np.testing.assert_array_equal(second.x_train, np.load(entry / "x_train.npy"))

    third = load_folder(root, image_size=SIDE)  # in-process: the same mapping
    assert third.x_train is second.x_train and third is not second


def test_a_changed_file_is_decoded_again_and_the_stale_entry_removed(tmp_path, cache, monkeypatch):
    root = tmp_path / "photos"
    paths = mixed_images(root, 4)
    before = np.array(load_folder(root, image_size=SIDE).x_train)
    (old_entry,) = entries(cache)
    save(Image.new("RGB", (20, 20), (1, 2, 3)), paths[0])  # paths[0] is a PNG
    stat = paths[0].stat()
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new mtime even on a coarse clock
    opened = count_opens(monkeypatch)
    after = load_folder(root, image_size=SIDE).x_train  # the in-process cache is not consulted for a changed folder
    assert len(opened) == 4
    (new_entry,) = entries(cache)
    assert new_entry != old_entry and not old_entry.exists()
    assert (after[0] == (1, 2, 3)).all() and not np.array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1:], after[1:])


def test_a_process_that_decoded_at_the_same_time_as_another_uses_the_entry_published_first(
    tmp_path, cache, monkeypatch
):
    root = tmp_path / "photos"
    mixed_images(root, 3)
    first = np.array(load_folder(root, image_size=SIDE).x_train)
    folder.clear_memory_cache()
    real_read_entry = folder._read_entry
    checks: list[Path] = []

    def entry_not_there_yet(entry, identity):  # the other process publishes while this one decodes
        checks.append(entry)
        return None if len(checks) == 1 else real_read_entry(entry, identity)

    monkeypatch.setattr(folder, "_read_entry", entry_not_there_yet)
    opened = count_opens(monkeypatch)
    second = load_folder(root, image_size=SIDE)
    assert len(opened) == 3  # decoded again, then found the entry taken
    np.testing.assert_array_equal(second.x_train, first)
    assert len(entries(cache)) == 1 and [p for p in cache.iterdir() if p.name.startswith(".tmp-")] == []


def test_an_added_file_changes_the_key(tmp_path, cache):
    root = tmp_path / "photos"
    mixed_images(root, 3)
    assert load_folder(root, image_size=SIDE).x_train.shape[0] == 3
    save(noise(10, 10, 77), root / "new.png")
    assert load_folder(root, image_size=SIDE).x_train.shape[0] == 4
    assert len(entries(cache)) == 1


def test_another_side_or_label_mode_keeps_its_own_entry(tmp_path, cache):
    root = tmp_path / "classes"
    mixed_images(root / "a", 2)
    mixed_images(root / "b", 2, seed=9)
    load_folder(root, image_size=SIDE)
    assert load_folder(root, image_size=8).x_train.shape == (4, 8, 8, 3)
    load_folder(root, image_size=SIDE, labels="none")
    assert len(entries(cache)) == 3


def test_with_the_cache_off_the_images_are_still_memory_mapped(tmp_path, cache, monkeypatch):
    monkeypatch.setenv(datasets.DECODED_CACHE_VARIABLE, "off")
    mixed_images(tmp_path / "photos", 3)
    data = load_folder(tmp_path / "photos", image_size=SIDE)
    assert isinstance(data.x_train, np.memmap) and data.x_train.shape == (3, SIDE, SIDE, 3)
    assert int(np.asarray(data.x_train).sum()) > 0
    assert not cache.exists()


def test_a_disk_without_room_for_the_decoded_images_is_named_and_keeps_nothing(tmp_path, cache, monkeypatch):
    mixed_images(tmp_path / "photos", 3)
    real = datasets.shutil.disk_usage
    monkeypatch.setattr(datasets.shutil, "disk_usage", lambda p: real(p)._replace(free=3 * SIDE * SIDE * 3 - 1))
    with pytest.raises(
        OSError, match=r"its 3 images needs 0 MiB decoded but .* has 0 MiB free; point FEDSSL_DATA_CACHE"
    ):
        load_folder(tmp_path / "photos", image_size=SIDE)
    assert not cache.exists() or not any(cache.rglob("*"))  # the temporary folder went too
    monkeypatch.setattr(datasets.shutil, "disk_usage", lambda p: real(p)._replace(free=3 * SIDE * SIDE * 3))
    assert load_folder(tmp_path / "photos", image_size=SIDE).x_train.shape[0] == 3  # exactly enough room


def test_the_progress_log(tmp_path, monkeypatch):
    monkeypatch.setattr(folder, "_PROGRESS_EVERY", 4)
    mixed_images(tmp_path / "photos", 10)
    lines: list[str] = []
    load_folder(tmp_path / "photos", image_size=SIDE, log=lines.append)
    assert [line.split(": ", 1)[1] for line in lines if "/10 images" in line] == ["4/10 images", "8/10 images"]
    assert lines[0].startswith("decoding folder") and lines[-1].startswith("decoded folder")


def test_a_link_loop_is_listed_once(tmp_path):
    root = tmp_path / "photos"
    mixed_images(root / "inner", 2)
    os.symlink(root, root / "inner" / "loop")
    assert load_folder(root, image_size=SIDE).x_train.shape[0] == 2


def test_another_process_memory_maps_what_this_one_decoded(tmp_path, cache):
    root = tmp_path / "photos"
    mixed_images(root, 5)
    data = load_folder(root, image_size=SIDE)
    code = (
        "from PIL import Image\n"
        "def refuse(*args, **kwargs): raise AssertionError('decoded again')\n"
        "Image.open = refuse\n"
        "from ssl_models.data.folder import load_folder\n"
        f"d = load_folder({str(root)!r}, image_size={SIDE})\n"
        "print(type(d.x_train).__name__, int(d.x_train.sum(dtype='int64')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, datasets.DECODED_CACHE_VARIABLE: str(cache)},
    ).stdout.split()
    assert out == ["memmap", str(int(data.x_train.sum(dtype="int64")))]


def test_load_dataset_reads_a_folder(tmp_path):
    mixed_images(tmp_path / "classes" / "a", 2)
    mixed_images(tmp_path / "classes" / "b", 3, seed=2)
    data = datasets.load_dataset(
        "folder", tmp_path / "classes", folder_options={"image_size": 16, "labels": "auto", "unreadable": "stop"}
    )
    assert data.labelled and data.num_classes == 2 and data.class_names == ("a", "b")
    assert data.x_train.shape == (5, 16, 16, 3) and data.y_train.tolist() == [0, 0, 1, 1, 1]
