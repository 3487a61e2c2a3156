"""fedssl_gpu.datapack: a data set packed into small checksummed parts and unpacked again, on a synthetic set."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image

from fedssl_gpu import datapack

CLASSES = 10
TRAIN_PER_CLASS, TEST_PER_CLASS = 24, 6
LIMIT = 30_000  # bytes: the synthetic set (300 images, about 100 kB lossless) splits into several parts


def smooth_images(rng: np.random.Generator, n: int) -> np.ndarray:
    """Photo-like 32x32 RGB images: random 4x4 fields of moderately saturated colours upsampled bicubically, a
    little luminance noise, then decoded from JPEG at quality 75 like the CIFAR-10 dev copy (so that re-encoding them
    at quality 75 is nearly idempotent, as it is there)."""
    out = np.empty((n, 32, 32, 3), np.uint8)
    for i in range(n):
        colours = rng.uniform(50, 200, (4, 4, 1)) + rng.uniform(-40, 40, (4, 4, 3))
        small = Image.fromarray(np.clip(colours, 0, 255).astype(np.uint8))
        img = np.asarray(small.resize((32, 32), Image.BICUBIC), np.int16) + rng.integers(-3, 4, (32, 32, 1))
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=75)
        out[i] = np.asarray(Image.open(buf))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": smooth_images(rng, CLASSES * TRAIN_PER_CLASS),
        "y_train": rng.permutation(np.repeat(np.arange(CLASSES, dtype=np.int64), TRAIN_PER_CLASS)),
        "x_test": smooth_images(rng, CLASSES * TEST_PER_CLASS),
        "y_test": np.repeat(np.arange(CLASSES, dtype=np.int64), TEST_PER_CLASS),
        "class_names": np.array([f"class-{c}" for c in range(CLASSES)]),
    }
    path = tmp_path_factory.mktemp("src") / "synth.npz"
    np.savez_compressed(path, **arrays)
    return path, arrays


@pytest.fixture(scope="module")
def lossless_parts(source, tmp_path_factory):
    return datapack.pack(source[0], tmp_path_factory.mktemp("packed"), part_limit_bytes=LIMIT, encoding="lossless")


def assert_same_layout(out: dict, src: dict):
    for key in ("x_train", "y_train", "x_test", "y_test", "class_names"):
        assert out[key].shape == src[key].shape and out[key].dtype == src[key].dtype, key
    for key in ("y_train", "y_test", "class_names"):
        np.testing.assert_array_equal(out[key], src[key])


def test_lossless_splits_into_small_parts_and_unpacks_exactly(source, lossless_parts, tmp_path):
    _path, src = source
    assert len(lossless_parts) >= 3
    count = len(lossless_parts)
    for i, p in enumerate(lossless_parts, start=1):
        assert p.name == f"synth.part-{i}-of-{count}.fedpack"
        assert p.stat().st_size <= LIMIT
    first = datapack.read_manifest(lossless_parts[0])
    assert first["content"]["test"] == [0, len(src["y_test"])]  # the test split (and class names) in part 1
    assert first["source"]["name"] == "synth.npz" and first["effect"]["exact"] and first["subset"] is None
    info = datapack.unpack(lossless_parts[0].parent, tmp_path / "out.npz")
    assert info["encoding"] == "lossless" and info["unpack"]["pixels_verified"]
    with np.load(tmp_path / "out.npz") as z:
        out = {k: z[k] for k in z.files}
    assert_same_layout(out, src)
    np.testing.assert_array_equal(out["x_train"], src["x_train"])
    np.testing.assert_array_equal(out["x_test"], src["x_test"])


@pytest.mark.parametrize("encoding", ["jpeg:90", "jpeg:75:444"])
def test_jpeg_unpacks_within_the_stated_effect(source, tmp_path, encoding):
    path, src = source
    parts = datapack.pack(path, tmp_path / "parts", part_limit_bytes=LIMIT, encoding=encoding)
    assert len(parts) >= 2 and all(p.stat().st_size <= LIMIT for p in parts)
    info = datapack.unpack(parts, tmp_path / "out.npz")
    effect = info["effect"]
    assert info["encoding"] == encoding and not effect["exact"] and effect["psnr_db"] > 30
    with np.load(tmp_path / "out.npz") as z:
        out = {k: z[k] for k in z.files}
    assert_same_layout(out, src)
    x_out = np.concatenate([out["x_test"], out["x_train"]]).astype(np.int16)
    x_src = np.concatenate([src["x_test"], src["x_train"]]).astype(np.int16)
    diff = np.abs(x_out - x_src)
    assert diff.max() <= effect["max_abs_diff"]
    assert diff.mean() == pytest.approx(effect["mean_abs_diff"], abs=1e-4)
    assert 10 * np.log10(255**2 / (diff.astype(float) ** 2).mean()) >= effect["psnr_db"] - 1e-3


def test_xz_is_exact(source, tmp_path):
    path, src = source
    parts = datapack.pack(path, tmp_path / "parts", part_limit_bytes=300_000, encoding="xz")
    datapack.unpack(parts, tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_array_equal(z["x_train"], src["x_train"])
        np.testing.assert_array_equal(z["x_test"], src["x_test"])


def test_lossless_is_smaller_than_the_jpeg_files_it_is_built_on(source, lossless_parts):
    """The shared JPEG header is stored once per part, not once per image."""
    _path, src = source
    files = 0
    for img in np.concatenate([src["x_test"], src["x_train"]]):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=75)
        files += len(buf.getvalue())
    assert sum(p.stat().st_size for p in lossless_parts) < files


def copy_parts(parts, folder):
    folder.mkdir()
    for p in parts:
        (folder / p.name).write_bytes(p.read_bytes())
    return sorted(folder.iterdir())


@pytest.mark.parametrize("where", ["header", "payload", "checksum"])
def test_a_damaged_part_is_named(lossless_parts, tmp_path, where):
    parts = copy_parts(lossless_parts, tmp_path / "parts")
    damaged = parts[1]
    data = bytearray(damaged.read_bytes())
    at = {"header": 40, "payload": len(data) // 2, "checksum": len(data) - 3}[where]
    data[at] ^= 0x01
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(damaged.name) + " is damaged"):
        datapack.unpack(tmp_path / "parts", tmp_path / "out.npz")
    assert not (tmp_path / "out.npz").exists()
    assert "UNUSABLE" in datapack.describe(tmp_path / "parts").splitlines()[1]


def test_a_missing_part_is_named(lossless_parts, tmp_path):
    parts = copy_parts(lossless_parts, tmp_path / "parts")
    parts[1].unlink()
    with pytest.raises(ValueError, match=f"missing data part.*{re.escape(parts[1].name)}"):
        datapack.unpack(tmp_path / "parts", tmp_path / "out.npz")
    with pytest.raises(ValueError, match="given twice"):
        datapack.unpack([parts[0], parts[0]], tmp_path / "out.npz")


def test_parts_of_two_packs_are_refused(source, lossless_parts, tmp_path):
    other = datapack.pack(source[0], tmp_path / "other", part_limit_bytes=LIMIT, encoding="jpeg:80")
    with pytest.raises(ValueError, match="different packs"):
        datapack.unpack([lossless_parts[0], *other[1:]], tmp_path / "out.npz")


def test_subset_per_class_keeps_that_many_of_each_class(source, tmp_path):
    path, src = source
    parts = datapack.pack(path, tmp_path / "parts", part_limit_bytes=LIMIT, encoding="lossless", subset_per_class=5)
    info = datapack.unpack(parts, tmp_path / "out.npz")
    assert info["subset"]["per_class"] == 5 and info["subset_per_class"] == 5
    assert info["subset"]["train_size"] == 5 * CLASSES and info["subset"]["source_train_size"] == len(src["y_train"])
    with np.load(tmp_path / "out.npz") as z:
        assert np.bincount(z["y_train"], minlength=CLASSES).tolist() == [5] * CLASSES
        keep = datapack.subset_indices(src["y_train"], 5)
        np.testing.assert_array_equal(z["x_train"], src["x_train"][keep])
        np.testing.assert_array_equal(z["y_train"], src["y_train"][keep])
        np.testing.assert_array_equal(z["x_test"], src["x_test"])  # the test split is kept whole
    with pytest.raises(ValueError, match="fewer than subset_per_class"):
        datapack.pack(path, tmp_path / "too-many", part_limit_bytes=LIMIT, subset_per_class=TRAIN_PER_CLASS + 1)


@pytest.mark.parametrize("limit", [900, 3000])
def test_a_part_limit_below_one_image_is_refused(source, tmp_path, limit):
    with pytest.raises(ValueError, match="smaller than one image"):
        datapack.pack(source[0], tmp_path / "parts", part_limit_bytes=limit, encoding="jpeg:90")


def test_encodings_are_checked():
    assert datapack.parse_encoding("jpeg:95:444").name == "jpeg:95:444"
    assert datapack.parse_encoding("lossless").quality == 75
    for bad in ("png", "jpeg", "jpeg:0", "jpeg:101", "jpeg:90:411", "lossless:x", "xz:9"):
        with pytest.raises(ValueError, match="unknown data encoding"):
            datapack.parse_encoding(bad)


def test_cli_and_describe(source, lossless_parts, tmp_path, capsys):
    lines = datapack.describe(lossless_parts).splitlines()
    assert len(lines) == len(lossless_parts)
    assert all(re.search(r"\d+\.\d\d MiB", line) for line in lines)
    assert (
        datapack.main(
            [
                "pack",
                str(source[0]),
                str(tmp_path / "p"),
                "--part-limit-mib",
                "0.05",
                "--encoding",
                "jpeg:85",
                "--subset-per-class",
                "3",
            ]
        )
        == 0
    )
    assert "subset 3 per class" in capsys.readouterr().out
    assert datapack.main(["unpack", str(tmp_path / "p"), str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as z:
        assert len(z["y_train"]) == 3 * CLASSES
    assert datapack.main(["unpack", str(tmp_path / "nothing-here"), str(tmp_path / "x.npz")]) == 2
    assert "no data parts" in capsys.readouterr().err
