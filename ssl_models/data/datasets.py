"""Image data sets for federated SSL: loaders, a synthetic data set, and stratified subsampling.

Everything here returns NHWC ``uint8`` image arrays and ``int64`` label arrays (the project-wide
convention); conversion to float NCHW happens on the training device (see ``ssl_models.data.augment``).

Sources:

* ``.npz`` files holding ``x_train``, ``y_train``, ``x_test``, ``y_test`` (any data set a user exports);
* torchvision's on-disk formats of CIFAR-10 and CIFAR-100 (labelled train/test splits);
* STL-10's own binary files (``stl10_binary/``), read with numpy: its labelled train/test splits and its unlabelled
  split, decoded once into NHWC ``.npy`` files of the decoded cache and memory-mapped (``load_stl10``);
* a deterministic synthetic data set with class-dependent patterns, for smoke tests without files.

Loaded files are cached per process (see ``load_npz``) because simulated clients living in one
process reload the same file every round, and decoded ``.npz`` files on the machine's disk (memory-mapped by later
processes: a deployed ClientApp is a new process per message). This module never imports flwr; torchvision is imported
only when a torchvision data set is actually requested.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ssl_models.data.partition import stratified_choice

DATASET_NAMES = ("cifar10", "cifar100", "stl10", "npz", "folder", "synthetic")
TORCHVISION_DATASETS = {"cifar10": 10, "cifar100": 100, "stl10": 10}
# Same default as ``DataConfig.path`` documents: a per-user cache folder, never a machine path.
DEFAULT_TORCHVISION_ROOT = "~/.cache/fedssl/data"
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
# How many distinct files / torchvision roots stay cached per process (each CIFAR copy is ~180 MB).
_CACHE_SIZE = 4


@dataclass
class ImageData:
    """An image data set split into train and test parts.

    ``x_*`` are NHWC ``uint8`` arrays with 3 channels (possibly ``np.memmap``s of the decoded cache on disk), ``y_*``
    are 1-D ``int64`` label arrays. Arrays returned by the cached loaders are shared between callers: treat them as
    read-only (index them, which copies, instead of writing into them).

    An unlabelled set (``labelled`` false: a folder of images, an .npz without labels) has ``y_train`` all zeros
    (one class, so that the seeded class-stratified subsample and the iid split work unchanged), ``num_classes``
    1 and no test part: what needs labels (a label-skewed split, the evaluation) refuses it or reads a labelled set
    of its own (``eval.path``).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str
    labelled: bool = True
    # The class names of labels 0..K-1 where the source has them (a folder's class subfolders), else empty.
    class_names: tuple[str, ...] = ()

    @property
    def image_size(self) -> int:
        """Height of the training images (all supported data sets use square images)."""
        return int(self.x_train.shape[1])


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def validate_images(images: np.ndarray, array_name: str, source: str) -> None:
    """Raise ``ValueError`` unless ``images`` is an NHWC ``uint8`` array with 3 channels."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"{source}: {array_name} must be a numpy array, got {type(images).__name__}")  # noqa: TRY004 - a bad data file is a ValueError throughout
    if images.ndim != 4 or images.shape[-1] != 3:
        hint = ""
        if images.ndim == 4 and images.shape[1] == 3:
            hint = " (it looks like NCHW; transpose it to NHWC with x.transpose(0, 2, 3, 1))"
        elif images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 1):
            hint = (
                " (grayscale images: give them three channels, e.g. np.repeat(x.reshape(*x.shape[:3], 1), 3, axis=-1))"
            )
        elif images.ndim == 4 and images.shape[-1] == 4:
            hint = " (RGBA images: drop the alpha channel, x[..., :3])"
        raise ValueError(
            f"{source}: {array_name} must have shape (N, H, W, 3) (NHWC, RGB; NCHW is not accepted), "
            f"got shape {images.shape}{hint}"
        )
    if images.dtype != np.uint8:
        raise ValueError(f"{source}: {array_name} must have dtype uint8 (pixel values 0..255), got {images.dtype}")


def validate_labels(labels: np.ndarray, array_name: str, num_images: int, source: str) -> np.ndarray:
    """Check a label array (1-D, integer, non-negative, one per image) and return it as ``int64``."""
    if not isinstance(labels, np.ndarray):
        raise ValueError(f"{source}: {array_name} must be a numpy array, got {type(labels).__name__}")  # noqa: TRY004 - a bad data file is a ValueError throughout
    if labels.ndim != 1:
        raise ValueError(f"{source}: {array_name} must be 1-D (one integer label per image), got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{source}: {array_name} must have an integer dtype, got {labels.dtype}")
    if labels.shape[0] != num_images:
        raise ValueError(
            f"{source}: {array_name} has {labels.shape[0]} labels but the matching images array has {num_images} images"
        )
    if labels.size and labels.min() < 0:
        raise ValueError(f"{source}: {array_name} holds negative labels (min {labels.min()}); labels must be >= 0")
    return labels.astype(np.int64, copy=False)


def _count_classes(*label_arrays: np.ndarray) -> int:
    """Number of classes implied by integer labels 0..K-1 (largest label + 1)."""
    largest = max((int(y.max()) for y in label_arrays if y.size), default=-1)
    return largest + 1


def _build_image_data(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    name: str,
    source: str,
    num_classes: int | None = None,
    labelled: bool = True,
) -> ImageData:
    """Validate the four arrays and wrap them into an ``ImageData`` (an unlabelled set: ``y_train`` all zeros, no
    test part, one class)."""
    validate_images(x_train, "x_train", source)
    validate_images(x_test, "x_test", source)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{source}: x_train images are {x_train.shape[1:]} but x_test images are {x_test.shape[1:]}")
    if not labelled:
        return ImageData(
            x_train,
            np.zeros(len(x_train), np.int64),
            x_test[:0],
            np.zeros(0, np.int64),
            num_classes=1,
            name=name,
            labelled=False,
        )
    y_train = validate_labels(y_train, "y_train", x_train.shape[0], source)
    y_test = validate_labels(y_test, "y_test", x_test.shape[0], source)
    implied = _count_classes(y_train, y_test)
    if num_classes is None:
        # Labels must be the classes 0..K-1: one stray label (1000 among 0..9) would otherwise make 1 001 classes,
        # 991 of them without an image, and every score would be read against the wrong chance level.
        absent = np.setdiff1d(np.arange(implied), np.unique(y_train))
        if absent.size:
            stray = sorted(int(v) for v in np.unique(np.concatenate([y_train, y_test])) if v > absent.min())[:5]
            raise ValueError(
                f"{source}: labels must be the classes 0..K-1, each with training images; these labels "
                f"imply {implied} classes but {absent.size} of them have no training image (the first: "
                f"{int(absent[0])}); labels above it: {stray}"
            )
        num_classes = implied
    elif implied > num_classes:
        raise ValueError(f"{source}: labels go up to {implied - 1} but the data set has {num_classes} classes")
    return ImageData(x_train, y_train, x_test, y_test, num_classes=num_classes, name=name)


# --------------------------------------------------------------------------------------------------
# .npz files
# --------------------------------------------------------------------------------------------------


DECODED_CACHE_VARIABLE = "FEDSSL_DATA_CACHE"  # a folder, or "off"; default ~/.cache/fedssl/decoded


def decoded_cache_root() -> Path | None:
    """Where decoded ``.npz`` data sets are kept on this machine's disk (None: the cache is off)."""
    value = os.environ.get(DECODED_CACHE_VARIABLE, "")
    if value.strip().lower() == "off":
        return None
    return Path(value).expanduser() if value.strip() else Path.home() / ".cache" / "fedssl" / "decoded"


def decode_work_folder(
    entry: Path | None, prefix: str, needed: int, what: str, hint: str = ""
) -> tuple[Path, Path | None]:
    """A new folder to decode ``what`` into, and the cache entry it will become (None: no usable cache folder).

    The folder lies beside ``entry``, so that publishing it is one atomic rename; without a cache folder, or with
    one that cannot be created, it is a private temporary folder and the entry is None. Refused, with the folder
    removed, when its disk has less than ``needed`` bytes free (``hint``: what else would help)."""
    work = None
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        except OSError:
            entry = None  # an unwritable cache folder: decode as without one
    if work is None:
        work = Path(tempfile.mkdtemp(prefix=prefix))
    free = shutil.disk_usage(work).free
    if free < needed:
        shutil.rmtree(work, ignore_errors=True)
        raise OSError(
            f"{what} needs {needed / 2**20:.0f} MiB decoded but {work.parent} has {free / 2**20:.0f} MiB free; "
            f"point {DECODED_CACHE_VARIABLE} to a folder with room{hint}"
        )
    return work, entry


def _decoded_entry(resolved_path: str, mtime_ns: int, size_bytes: int) -> Path | None:
    root = decoded_cache_root()
    if root is None:
        return None
    key = hashlib.sha256(f"{resolved_path}|{mtime_ns}|{size_bytes}".encode()).hexdigest()[:32]
    return root / key


def _read_decoded(entry: Path, resolved_path: str, mtime_ns: int, size_bytes: int) -> dict[str, np.ndarray] | None:
    """The cached arrays of exactly this file version (images memory-mapped), or None."""
    try:
        marker = json.loads((entry / "complete.json").read_text())
    except (OSError, ValueError):
        return None
    if marker != {"path": resolved_path, "mtime_ns": mtime_ns, "size": size_bytes}:
        return None  # another file, or another version of it: never served
    try:
        arrays = {
            key: np.load(entry / f"{key}.npy", mmap_mode="r" if key.startswith("x_") else None, allow_pickle=False)
            for key in NPZ_KEYS
        }
        if (entry / "labelled.npy").is_file():  # written for every file since unlabelled ones are read
            arrays["labelled"] = np.load(entry / "labelled.npy", allow_pickle=False)
        return arrays
    except (OSError, ValueError):
        return None


def _write_decoded(
    entry: Path, arrays: dict[str, np.ndarray], resolved_path: str, mtime_ns: int, size_bytes: int
) -> None:
    """Keep the decoded arrays on disk (written to a temporary folder, then renamed), replacing the cached versions
    of older versions of the same file. A failure to write only costs the next process a decode."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        for key, value in arrays.items():
            np.save(tmp / f"{key}.npy", np.ascontiguousarray(value), allow_pickle=False)
        (tmp / "complete.json").write_text(
            json.dumps({"path": resolved_path, "mtime_ns": mtime_ns, "size": size_bytes})
        )
        if entry.exists() and _read_decoded(entry, resolved_path, mtime_ns, size_bytes) is None:
            shutil.rmtree(entry, ignore_errors=True)  # a broken entry (an interrupted writer of an older version)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process (a simulated client, the server) wrote the same entry first
            shutil.rmtree(tmp, ignore_errors=True)
        tmp = None
        for other in entry.parent.iterdir():  # stale versions of the same file
            if other != entry and other.is_dir() and not other.name.startswith(".tmp-"):
                try:
                    if json.loads((other / "complete.json").read_text()).get("path") == resolved_path:
                        shutil.rmtree(other, ignore_errors=True)
                except (OSError, ValueError):
                    continue
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _read_npz_archive(resolved_path: str, source: str) -> dict[str, np.ndarray]:
    """The four arrays of an .npz archive; a file that is not a complete archive (truncated, another format: numpy
    would say "File is not a zip file", or, for a file that is not a zip at all, talk of "pickled data") is a
    ValueError naming the file and what to check."""
    try:
        with np.load(resolved_path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):  # a plain .npy array saved under an .npz name
                raise ValueError(f"{source} holds a single array, not an .npz archive of {list(NPZ_KEYS)}")
            if "x_train" in archive.files and "y_train" not in archive.files:
                # unlabelled training images: labels, a test part, are read from elsewhere (eval.path) if at all
                x_train = archive["x_train"]
                return {
                    "x_train": x_train,
                    "y_train": np.zeros(len(x_train), np.int64),
                    "x_test": x_train[:0],
                    "y_test": np.zeros(0, np.int64),
                    "labelled": np.array(False),
                }
            missing = [key for key in NPZ_KEYS if key not in archive.files]
            if missing:
                raise ValueError(
                    f"{source} lacks the arrays {missing}; it must hold {list(NPZ_KEYS)} (has {archive.files})"
                )
            return {key: archive[key] for key in NPZ_KEYS}
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise ValueError(
            f"{source} is not a complete .npz archive ({type(exc).__name__}: {exc}); a truncated copy "
            "or another format? Write it again with numpy.savez"
        ) from None
    except ValueError as exc:
        if "pickled" in str(exc) or "allow_pickle" in str(exc):
            raise ValueError(
                f"{source} is not an .npz archive of arrays (numpy read it as pickled data); write it "
                f"with numpy.savez({', '.join(f'{k}=...' for k in NPZ_KEYS)})"
            ) from None
        raise


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_npz_cached(resolved_path: str, mtime_ns: int, size_bytes: int) -> ImageData:
    """Read and validate one .npz file; keyed on (path, mtime, size) so an edited file is re-read.

    Decompressing CIFAR-10 costs a new process about a second, and a deployed SuperNode starts a process for every
    message: the decoded arrays are therefore also kept on this machine's disk (``$FEDSSL_DATA_CACHE``, default
    ``~/.cache/fedssl/decoded``; ``off`` disables it), keyed on the same (path, mtime, size), and later processes
    memory-map them. A changed file has another key and is decoded again; the old version's copy is removed."""
    source = f"npz file {resolved_path}"
    entry = _decoded_entry(resolved_path, mtime_ns, size_bytes)
    arrays = _read_decoded(entry, resolved_path, mtime_ns, size_bytes) if entry is not None else None
    if arrays is None:
        arrays = _read_npz_archive(resolved_path, source)
        data = _build_image_data(
            arrays["x_train"],
            arrays["y_train"],
            arrays["x_test"],
            arrays["y_test"],
            name=Path(resolved_path).stem,
            source=source,
            labelled=bool(arrays.get("labelled", True)),
        )
        if entry is not None:
            _write_decoded(
                entry,
                {
                    "x_train": data.x_train,
                    "y_train": data.y_train,
                    "x_test": data.x_test,
                    "y_test": data.y_test,
                    "labelled": np.array(data.labelled),
                },
                resolved_path,
                mtime_ns,
                size_bytes,
            )
        return data
    return _build_image_data(
        arrays["x_train"],
        arrays["y_train"],
        arrays["x_test"],
        arrays["y_test"],
        name=Path(resolved_path).stem,
        source=source,
        labelled=bool(arrays.get("labelled", True)),
    )


def load_npz(path: str | Path, name: str | None = None, num_classes: int | None = None) -> ImageData:
    """Load an ``.npz`` holding ``x_train``, ``y_train``, ``x_test``, ``y_test``, or ``x_train`` alone (unlabelled
    training images: ``ImageData.labelled`` false).

    Images must be NHWC ``uint8`` with 3 channels (NCHW is rejected with a hint), labels 1-D
    integers. ``name`` defaults to the file's stem; ``num_classes`` defaults to the largest label + 1.

    The parsed file is cached per process (``functools.lru_cache`` keyed on the resolved path, the
    modification time and the size): simulated clients in one process call this every round and
    decompressing CIFAR-10 takes seconds. The returned arrays are therefore shared; do not write
    into them.
    """
    file_path = Path(path).expanduser()
    if not file_path.is_file():
        raise FileNotFoundError(f"npz data file not found: {file_path} (resolved to {file_path.resolve()})")
    stat = file_path.stat()
    data = _load_npz_cached(str(file_path.resolve()), stat.st_mtime_ns, stat.st_size)
    # A shallow copy so that callers re-labelling the result cannot alter the cached object.
    relabelled = dataclasses.replace(data, name=name or data.name)
    if num_classes is not None:
        if data.num_classes > num_classes:
            raise ValueError(
                f"npz file {file_path}: labels go up to {data.num_classes - 1} but num_classes={num_classes}"
            )
        relabelled.num_classes = num_classes
    return relabelled


# --------------------------------------------------------------------------------------------------
# torchvision on-disk formats
# --------------------------------------------------------------------------------------------------


def _read_torchvision_split(name: str, root: str, train: bool, download: bool) -> tuple[np.ndarray, np.ndarray]:
    """Read one labelled split with torchvision and return (NHWC uint8 images, int64 labels)."""
    from torchvision import datasets  # deferred: only this loader needs torchvision

    if name == "cifar10":
        dataset = datasets.CIFAR10(root, train=train, download=download)
        return np.asarray(dataset.data), np.asarray(dataset.targets, dtype=np.int64)
    if name == "cifar100":
        dataset = datasets.CIFAR100(root, train=train, download=download)
        return np.asarray(dataset.data), np.asarray(dataset.targets, dtype=np.int64)
    # STL-10 stores NCHW; the labelled "train"/"test" splits are enough here (no "unlabeled").
    dataset = datasets.STL10(root, split="train" if train else "test", download=download)
    images = np.ascontiguousarray(np.asarray(dataset.data).transpose(0, 2, 3, 1))
    return images, np.asarray(dataset.labels, dtype=np.int64)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_torchvision_cached(name: str, root: str, download: bool) -> ImageData:
    """Read both splits of a torchvision data set once per process (failures are not cached)."""
    x_train, y_train = _read_torchvision_split(name, root, train=True, download=download)
    x_test, y_test = _read_torchvision_split(name, root, train=False, download=download)
    return _build_image_data(
        x_train,
        y_train,
        x_test,
        y_test,
        name=name,
        source=f"torchvision {name} under {root}",
        num_classes=TORCHVISION_DATASETS[name],
    )


def load_torchvision(name: str, root: str | Path | None = None, download: bool = False) -> ImageData:
    """Load CIFAR-10, CIFAR-100 or STL-10 (labelled splits) from torchvision's on-disk format, through torchvision
    (``load_dataset`` reads STL-10 with ``load_stl10`` instead: its unlabelled split, memory-mapped, no checksums).

    ``root`` is the folder torchvision reads (default ``~/.cache/fedssl/data``). Missing files,
    or a failed download (this project often runs without network), raise ``FileNotFoundError``
    telling the user to pass an ``.npz`` instead or to place the torchvision files under ``root``.
    Results are cached per process like ``load_npz``'s.
    """
    if name not in TORCHVISION_DATASETS:
        raise ValueError(f"name must be one of {sorted(TORCHVISION_DATASETS)} for torchvision loading, got {name!r}")
    root_path = Path(root if root is not None else DEFAULT_TORCHVISION_ROOT).expanduser().resolve()
    try:
        return dataclasses.replace(_load_torchvision_cached(name, str(root_path), bool(download)))
    except (RuntimeError, OSError) as err:  # torchvision: RuntimeError "not found"; URLError is an OSError
        action = "download failed" if download else "files are missing and download=False"
        raise FileNotFoundError(
            f"could not load {name} from torchvision root {root_path} ({action}: {err}). "
            f"Pass an .npz file with x_train/y_train/x_test/y_test (dataset 'npz' or path=...), "
            f"or place the torchvision {name} files under {root_path}."
        ) from err


# --------------------------------------------------------------------------------------------------
# STL-10's binary files
# --------------------------------------------------------------------------------------------------

# data.stl10_split: the training images. The labelled train/test splits are always the evaluation's.
STL10_SPLITS = ("train", "unlabeled", "train+unlabeled")
STL10_FOLDER = "stl10_binary"  # the folder stl10_binary.tar.gz unpacks to
STL10_SIDE = 96
STL10_CLASSES = 10
_STL10_IMAGE_BYTES = 3 * STL10_SIDE * STL10_SIDE
_STL10_IMAGE_FILES = {
    "train": ("train_X.bin",),
    "test": ("test_X.bin",),
    "unlabeled": ("unlabeled_X.bin",),
    "train+unlabeled": ("train_X.bin", "unlabeled_X.bin"),
}
_STL10_LABEL_FILES = {"train": "train_y.bin", "test": "test_y.bin"}
# Bumped whenever the decoded layout changes: older cache entries are then never served.
_STL10_CACHE_FORMAT = 1
_STL10_CHUNK = 1000  # images transposed at a time while decoding (28 MB): memory stays flat for the 2.7 GB split
_STL10_PROGRESS_EVERY = 20000  # images between two progress lines of a decode

Log = Callable[[str], None]


def stl10_folder(root: str | Path | None) -> Path:
    """The ``stl10_binary`` folder of ``root`` (default ``~/.cache/fedssl/data``): ``root/stl10_binary``, or
    ``root`` itself when it is that folder (holds ``train_X.bin`` or carries its name). Resolved; it may not exist."""
    base = Path(root if root else DEFAULT_TORCHVISION_ROOT).expanduser()
    if (base / STL10_FOLDER).is_dir():
        return (base / STL10_FOLDER).resolve()
    if base.name == STL10_FOLDER or (base / "train_X.bin").is_file():
        return base.resolve()
    return (base / STL10_FOLDER).resolve()


def _stl10_files_needed(split: str) -> tuple[str, ...]:
    """The files of ``stl10_folder`` that loading ``split`` reads (a labelled split reads the test part too)."""
    if split == "train":
        return ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin")
    return _STL10_IMAGE_FILES[split]


def _stl10_signature(folder: Path, names: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of each file: an edited or replaced file is read again."""
    stats = [(name, (folder / name).stat()) for name in names]
    return tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)


def _missing_stl10(folder: Path, split: str) -> FileNotFoundError:
    missing = [name for name in _stl10_files_needed(split) if not (folder / name).is_file()]
    return FileNotFoundError(
        f"could not load stl10 (data.stl10_split {split}) from {folder}: {', '.join(missing)} missing. Place "
        f"STL-10's binary files there (the {STL10_FOLDER}/ folder of stl10_binary.tar.gz: train_X.bin, train_y.bin, "
        "test_X.bin, test_y.bin, unlabeled_X.bin) and give data.path its parent (or the folder itself), set "
        "data.download: true, or pass an .npz file with x_train/y_train/x_test/y_test (data.path)."
    )


def _download_stl10(folder: Path) -> None:
    """torchvision's download of stl10_binary.tar.gz (2.6 GB) into ``folder``'s parent; failures are
    FileNotFoundError like missing files (this project often runs without network)."""
    from torchvision import datasets  # deferred: only a download needs torchvision

    try:
        datasets.STL10(str(folder.parent), split="train", download=True)
    except (RuntimeError, OSError) as err:  # URLError is an OSError
        raise FileNotFoundError(f"could not download stl10 into {folder.parent}: {err}") from err


def _stl10_image_count(file: Path) -> int:
    size = file.stat().st_size
    if size == 0 or size % _STL10_IMAGE_BYTES:
        raise ValueError(
            f"STL-10 file {file} holds {size} bytes, not a whole number of 96x96x3 images ({_STL10_IMAGE_BYTES} bytes "
            "each): a truncated copy? Unpack stl10_binary.tar.gz again"
        )
    return size // _STL10_IMAGE_BYTES


def _stl10_labels(file: Path, count: int) -> np.ndarray:
    """The labels of ``file`` (one byte per image, 1..10) as int64 0..9."""
    raw = np.fromfile(file, dtype=np.uint8)
    if raw.shape[0] != count:
        raise ValueError(f"STL-10 file {file} holds {raw.shape[0]} labels but its images file holds {count} images")
    if raw.size and (raw.min() < 1 or raw.max() > STL10_CLASSES):
        raise ValueError(f"STL-10 file {file} holds labels {raw.min()}..{raw.max()}; STL-10's are 1..{STL10_CLASSES}")
    return raw.astype(np.int64) - 1


def _stl10_class_names(folder: Path) -> tuple[str, ...]:
    try:
        names = [line.strip() for line in (folder / "class_names.txt").read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):
        return ()
    return tuple(names) if len(names) == STL10_CLASSES else ()


def _stl10_identity(folder: Path, names: Sequence[str]) -> dict[str, Any]:
    files = [
        {"path": str(folder / name), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        for name, stat in ((name, (folder / name).stat()) for name in names)
    ]
    return {"source": "stl10", "format": _STL10_CACHE_FORMAT, "files": files}


def _read_stl10_entry(entry: Path, identity: dict[str, Any], count: int) -> np.ndarray | None:
    """The memory-mapped NHWC images of a complete entry of exactly these file versions, or None."""
    try:
        if json.loads((entry / "complete.json").read_text()) != identity:
            return None
        images = np.load(entry / "x.npy", mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    return images if images.shape == (count, STL10_SIDE, STL10_SIDE, 3) and images.dtype == np.uint8 else None


def _write_stl10_nhwc(sources: Sequence[Path], target: Path, count: int, log: Log | None) -> None:
    """Concatenate the images of ``sources`` into ``target`` (an NHWC uint8 .npy), streaming.

    STL-10 stores each image as 3 planes of 96x96 bytes written column by column, so a raw image read as (3, 96, 96)
    is (channel, x, y): its NHWC form is the transpose (y, x, channel), the orientation torchvision's STL10 shows
    (its ``data`` swaps the last two axes, its ``__getitem__`` then moves the channels last)."""
    out = np.lib.format.open_memmap(target, mode="w+", dtype=np.uint8, shape=(count, STL10_SIDE, STL10_SIDE, 3))
    row = 0
    for source in sources:
        raw = np.memmap(source, dtype=np.uint8, mode="r").reshape(-1, 3, STL10_SIDE, STL10_SIDE)
        for start in range(0, raw.shape[0], _STL10_CHUNK):
            chunk = raw[start : start + _STL10_CHUNK]
            out[row : row + len(chunk)] = chunk.transpose(0, 3, 2, 1)
            row += len(chunk)
            if log is not None and row % _STL10_PROGRESS_EVERY < _STL10_CHUNK and row < count:
                log(f"decoding STL-10 {source.name}: {row}/{count} images")
        del raw
    out.flush()
    del out


def _stl10_images(folder: Path, split: str, log: Log | None) -> np.ndarray:
    """The images of one split (``_STL10_IMAGE_FILES``) as a read-only, memory-mapped NHWC uint8 array.

    Decoded once into the decoded cache (``decoded_cache_root``: an ``stl10-<key>`` entry keyed on the files' paths,
    sizes and modification times), written to a temporary folder and renamed (a process never sees a partial entry);
    later loads, in any process, map it. The cache off: decoded into a temporary folder removed once mapped."""
    names = _STL10_IMAGE_FILES[split]
    sources = [folder / name for name in names]
    count = sum(_stl10_image_count(source) for source in sources)
    identity = _stl10_identity(folder, names)
    root = decoded_cache_root()
    entry = None
    if root is not None:
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
        entry = root / f"stl10-{key}"
        cached = _read_stl10_entry(entry, identity, count)
        if cached is not None:
            return cached
    work, entry = decode_work_folder(
        entry, "fedssl-stl10-", count * _STL10_IMAGE_BYTES, f"STL-10 {split} ({count} images)"
    )
    try:
        if log is not None:
            log(f"decoding STL-10 {split}: {count} images from {folder} into {work.parent}")
        _write_stl10_nhwc(sources, work / "x.npy", count, log)
        (work / "complete.json").write_text(json.dumps(identity))
        if entry is not None:
            if entry.exists() and _read_stl10_entry(entry, identity, count) is None:
                shutil.rmtree(entry, ignore_errors=True)  # a broken entry: never served
            try:
                os.replace(work, entry)
            except OSError:
                pass  # another process (a simulated client, the server) published the same files first
            images = _read_stl10_entry(entry, identity, count)
            if images is not None:
                _remove_stale_stl10_entries(entry, identity)
                return images
        images = _read_stl10_entry(work, identity, count)
        if images is None:
            raise OSError(f"STL-10 {split}: the decoded images written to {work} cannot be read back")
        return images
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)  # what is mapped stays readable


def _remove_stale_stl10_entries(keep: Path, identity: dict[str, Any]) -> None:
    """Remove the entries of older versions of the same files (same paths, another size or time)."""
    paths = [f["path"] for f in identity["files"]]
    for other in keep.parent.iterdir():
        if other == keep or not other.name.startswith("stl10-") or not other.is_dir():
            continue
        try:
            metadata = json.loads((other / "complete.json").read_text())
            if [f["path"] for f in metadata["files"]] == paths:
                shutil.rmtree(other, ignore_errors=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue


# (folder, split, the files' sizes and times) -> the split read in this process (its images stay on disk, mapped).
_STL10_LOADED: dict[tuple[str, str, tuple[tuple[str, int, int], ...]], ImageData] = {}


def clear_stl10_cache() -> None:
    """Forget the STL-10 splits read in this process (their decoded files on disk stay)."""
    _STL10_LOADED.clear()


def _read_stl10(folder: Path, split: str, log: Log | None) -> ImageData:
    source = f"STL-10 files in {folder}"
    if split != "train":
        images = _stl10_images(folder, split, log)
        # train+unlabeled: the train part's labels cover 5 % of the images; the set is used unlabelled as a whole
        # (the papers' pre-training), and the labelled train/test splits are the evaluation's (load_eval_data).
        no_labels = np.zeros(0, np.int64)
        return _build_image_data(images, no_labels, images[:0], no_labels, "stl10", source, labelled=False)
    x_train = _stl10_images(folder, "train", log)
    x_test = _stl10_images(folder, "test", log)
    y_train = _stl10_labels(folder / _STL10_LABEL_FILES["train"], len(x_train))
    y_test = _stl10_labels(folder / _STL10_LABEL_FILES["test"], len(x_test))
    data = _build_image_data(x_train, y_train, x_test, y_test, "stl10", source, num_classes=STL10_CLASSES)
    return dataclasses.replace(data, class_names=_stl10_class_names(folder))


def load_stl10(
    root: str | Path | None = None, split: str = "train", download: bool = False, log: Log | None = None
) -> ImageData:
    """STL-10 from its own binary files, read with numpy (no torchvision, no checksum of the 2.7 GB file).

    ``root`` is the folder holding ``stl10_binary/`` or that folder itself (default ``~/.cache/fedssl/data``).
    ``split`` (``data.stl10_split``) chooses the training images: ``train`` is the labelled 5 000 training images
    with the 8 000 test images as the test part (labels 1..10 on disk, 0..9 here, ``class_names`` from
    class_names.txt); ``unlabeled`` is the 100 000 unlabelled images and ``train+unlabeled`` the 105 000 of both
    (the papers' pre-training set), read as an unlabelled set (``labelled`` false, no test part: the evaluation reads
    the labelled ``train`` split).

    Images are NHWC uint8 in torchvision's orientation, memory-mapped from the decoded cache (see ``_stl10_images``):
    the first load of a split writes it (2.9 GB for train+unlabeled), every later one maps it. ``download`` lets
    torchvision fetch the archive when files are missing. Missing files are a FileNotFoundError naming them."""
    if split not in STL10_SPLITS:
        raise ValueError(f"split must be one of {list(STL10_SPLITS)}, got {split!r}")
    folder = stl10_folder(root)
    needed = _stl10_files_needed(split)
    if download and not all((folder / name).is_file() for name in needed):
        _download_stl10(folder)
    if not all((folder / name).is_file() for name in needed):
        raise _missing_stl10(folder, split)
    # Simulated clients share a process and load the data every round: read each split version once.
    key = (str(folder), split, _stl10_signature(folder, needed))
    data = _STL10_LOADED.get(key)
    if data is None:
        data = _read_stl10(folder, split, log)
        while len(_STL10_LOADED) >= _CACHE_SIZE:
            _STL10_LOADED.pop(next(iter(_STL10_LOADED)))
        _STL10_LOADED[key] = data
    return dataclasses.replace(data)  # callers may rename or relabel their copy, never the cached one


# --------------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------------


def _class_patterns(num_classes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-class base colours (K, 3) and oriented grating parameters (K, 2): frequency, angle."""
    colours = rng.uniform(0.15, 0.85, size=(num_classes, 3))
    frequencies = rng.uniform(1.0, 4.0, size=num_classes)
    # Evenly spread orientations (shuffled) keep classes with similar colours apart.
    angles = rng.permutation(np.linspace(0.0, math.pi, num_classes, endpoint=False))
    return colours, np.stack([frequencies, angles], axis=1)


def _render_images(
    labels: np.ndarray, colours: np.ndarray, gratings: np.ndarray, image_size: int, rng: np.random.Generator
) -> np.ndarray:
    """Draw each image as its class grating (random phase) on its class colour, plus noise.

    The per-image colour shift and the random phase keep raw-pixel kNN well short of perfect
    (about 0.8-0.95 with 10 classes), so a smoke test still has something to learn.
    """
    coords = (np.arange(image_size) + 0.5) / image_size
    yy, xx = np.meshgrid(coords, coords, indexing="ij")
    freq = gratings[labels, 0][:, None, None]
    angle = gratings[labels, 1][:, None, None]
    phase = rng.uniform(-math.pi, math.pi, size=(len(labels), 1, 1))
    wave = np.sin(2 * math.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase)
    colour = colours[labels] + rng.normal(0.0, 0.25, size=(len(labels), 3))
    images = colour[:, None, None, :] + 0.25 * wave[..., None]
    images = images + rng.normal(0.0, 0.1, size=images.shape)
    return np.clip(np.rint(images * 255.0), 0, 255).astype(np.uint8)


def _balanced_labels(count: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` labels with class sizes differing by at most one, in random order."""
    return rng.permutation(np.arange(count) % num_classes).astype(np.int64)


def synthetic_dataset(
    num_train: int = 600, num_test: int = 200, num_classes: int = 10, image_size: int = 32, seed: int = 0
) -> ImageData:
    """A deterministic toy data set where each class is a distinct colour and oriented grating.

    Per-image colour shifts, a random grating phase and pixel noise make samples of a class differ,
    yet a kNN on raw pixels does clearly better than chance, so the whole pipeline (augment ->
    train -> kNN eval) can be smoke tested without any file. Same arguments -> identical arrays.
    """
    for arg_name, value, lowest in (
        ("num_train", num_train, 1),
        ("num_test", num_test, 1),
        ("num_classes", num_classes, 2),
        ("image_size", image_size, 4),
    ):
        if int(value) != value or value < lowest:
            raise ValueError(f"{arg_name} must be an integer >= {lowest}, got {value!r}")
    rng = np.random.default_rng(seed)
    colours, gratings = _class_patterns(num_classes, rng)
    y_train = _balanced_labels(num_train, num_classes, rng)
    y_test = _balanced_labels(num_test, num_classes, rng)
    x_train = _render_images(y_train, colours, gratings, image_size, rng)
    x_test = _render_images(y_test, colours, gratings, image_size, rng)
    return ImageData(x_train, y_train, x_test, y_test, num_classes=num_classes, name="synthetic")


# --------------------------------------------------------------------------------------------------
# Dispatch and subsampling
# --------------------------------------------------------------------------------------------------


def _synthetic_args(synthetic_sizes: Sequence[int]) -> tuple[int, int, int, int]:
    """Unpack ``(num_train, num_test, num_classes[, image_size])``."""
    sizes = tuple(int(v) for v in synthetic_sizes)
    if len(sizes) == 3:
        return sizes + (32,)
    if len(sizes) == 4:
        return sizes
    raise ValueError(
        f"synthetic_sizes must be (num_train, num_test, num_classes) or (..., image_size), got {synthetic_sizes!r}"
    )


def load_dataset(
    name: str,
    path: str | Path | None = None,
    root: str | Path | None = None,
    download: bool = False,
    seed: int = 0,
    synthetic_sizes: Sequence[int] = (600, 200, 10),
    folder_options: Mapping[str, Any] | None = None,
    stl10_split: str = "train",
    log: Log | None = None,
) -> ImageData:
    """Load a data set by name: ``cifar10``, ``cifar100``, ``stl10``, ``npz``, ``folder`` or ``synthetic``.

    * ``npz``: ``path`` names the file (required).
    * ``folder``: ``path`` names a folder of images (``ssl_models.data.folder.load_folder``, with
      ``folder_options``: ``image_size``, ``labels``, ``unreadable``).
    * ``cifar10`` / ``cifar100`` / ``stl10``: if ``path`` is an existing file it is read as an
      ``.npz`` export of that data set (e.g. the CIFAR-10 dev copy); otherwise the data set's own files
      are read from ``root`` (or from ``path`` when it is a folder; default ``~/.cache/fedssl/data``):
      torchvision's CIFAR folders, STL-10's ``stl10_binary/`` (``load_stl10`` with ``stl10_split``; ``log`` hears
      its first decode).
    * ``synthetic``: ``synthetic_sizes = (num_train, num_test, num_classes[, image_size])`` and
      ``seed`` drive ``synthetic_dataset``.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"name must be one of {list(DATASET_NAMES)}, got {name!r}")
    if name == "synthetic":
        num_train, num_test, num_classes, image_size = _synthetic_args(synthetic_sizes)
        return synthetic_dataset(num_train, num_test, num_classes, image_size=image_size, seed=seed)
    if name == "npz":
        if not path:
            raise ValueError("path must name an .npz file when name is 'npz'")
        return load_npz(path)
    if name == "folder":
        if not path:
            raise ValueError("path must name a folder of images when name is 'folder'")
        from .folder import load_folder

        return load_folder(path, **dict(folder_options or {}))
    if name == "stl10" and stl10_split not in STL10_SPLITS:
        raise ValueError(f"stl10_split must be one of {list(STL10_SPLITS)}, got {stl10_split!r}")
    if path and Path(path).expanduser().is_file():
        if name == "stl10" and stl10_split != "train":
            raise ValueError(
                f"data.stl10_split {stl10_split} reads STL-10's binary files, but data.path {path} is a file; give "
                "the folder holding stl10_binary/, or an .npz of the unlabelled images (x_train alone) as dataset npz"
            )
        return load_npz(path, name=name, num_classes=TORCHVISION_DATASETS[name])
    if path and root is None:
        if Path(path).suffix == ".npz":
            raise FileNotFoundError(f"npz data file not found: {path}")
        root = path
    if name == "stl10":
        return load_stl10(root, stl10_split, download, log)
    return load_torchvision(name, root, download)


def subsample(labels: np.ndarray, max_items: int | None, seed: int = 0) -> np.ndarray:
    """Sorted indices of a deterministic, class-stratified subsample of at most ``max_items`` items.

    Each class keeps a share proportional to its size, and every class keeps at least one item
    whenever ``max_items`` is at least the number of classes present. ``max_items`` None or 0 (or
    larger than the data) keeps everything.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {labels.shape}")
    if max_items is not None and (int(max_items) != max_items or max_items < 0):
        raise ValueError(f"max_items must be None or an integer >= 0, got {max_items!r}")
    if not max_items or max_items >= labels.shape[0]:
        return np.arange(labels.shape[0], dtype=np.int64)
    return stratified_choice(labels, int(max_items), np.random.default_rng(seed))
