"""A folder of image files as a data set: decoded once into a memory-mapped cache on the machine's disk.

``load_folder`` lists the folder, brings every image to one square side and keeps the decoded images as an NHWC
``uint8`` ``.npy`` file in the decoded cache that ``.npz`` files use (``$FEDSSL_DATA_CACHE``, default
``~/.cache/fedssl/decoded``; see ``ssl_models.data.datasets.decoded_cache_root``). Every later load, in this process,
another client's process or a later run, memory-maps that file, so a process's memory does not grow with the folder.
``load_annotated_folder`` reads a folder whose labels an annotations file gives instead (Tiny-ImageNet's val/ and
its val_annotations.txt) through the same cache. This module never imports flwr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import PIL
from PIL import Image, ImageFile

from ssl_models.data.datasets import ImageData, decode_work_folder, decoded_cache_root

LABEL_MODES = ("auto", "subfolders", "none")
UNREADABLE_MODES = ("stop", "skip")
# Bumped whenever decoding changes (resize policy, mode conversion, file layout): older entries are then never served.
CACHE_FORMAT = 1
# Formats Pillow registers an opener for that hold no pixels it can decode without further software (scientific
# containers and Windows metafiles: identification only; PostScript needs Ghostscript) or that are not pictures
# (MPEG video). A folder's stray .h5 or .mpg file is ignored instead of stopping the run as unreadable.
_EXCLUDED_FORMATS = frozenset({"BUFR", "GRIB", "HDF5", "WMF", "MPEG", "EPS", "IPTC"})
# Opened by another format's opener (JPEG's), so not in PIL.Image.OPEN under its own name.
_FORMATS_OPENED_ELSEWHERE = frozenset({"MPO"})
# How many loaded folders stay in memory per process (only their labels and the mapping: the images stay on disk).
_MEMORY_CACHE_SIZE = 4
_PROGRESS_EVERY = 5000  # images between two progress lines of a decode
_NAMED_FILES = 5  # unreadable files named in an error or on the log
_NPY_ALIGN = 64  # the .npy format pads its header so that the data starts at a multiple of 64 bytes

Log = Callable[[str], None]


class _ImageFile(NamedTuple):  # a tuple: made once per file, 50 000 times for a large folder
    relative_path: str  # POSIX form, relative to the folder: the same key on every machine
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class _Layout:
    labelled: bool
    class_names: tuple[str, ...]
    class_of_file: tuple[int, ...]  # per listed file (0 for all of them when unlabelled)


@cache
def image_extensions() -> frozenset[str]:
    """Lower-case file extensions (with the dot) counted as images: those Pillow registers for a format it can open.

    Pillow's own list (``PIL.Image.registered_extensions()``), less save-only formats (.pdf) and the formats of
    ``_EXCLUDED_FORMATS``; it therefore follows the installed Pillow (e.g. .avif where Pillow was built with it)."""
    registered = Image.registered_extensions()  # first: it loads the plugins, which fill PIL.Image.OPEN
    openable = set(Image.OPEN) | _FORMATS_OPENED_ELSEWHERE
    return frozenset(
        extension.lower()
        for extension, image_format in registered.items()
        if image_format in openable and image_format not in _EXCLUDED_FORMATS
    )


def _extensions_hint() -> str:
    common = [e for e in (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp") if e in image_extensions()]
    return f"{', '.join(common)} and {len(image_extensions()) - len(common)} more that Pillow reads"


# --------------------------------------------------------------------------------------------------
# Listing and layout
# --------------------------------------------------------------------------------------------------


def _list_images(root: Path) -> tuple[list[_ImageFile], list[str]]:
    """The folder's image files (any depth, sorted by path) and the relative paths of its other files.

    Names starting with "." (files and folders) are skipped. Symbolic links are followed, because class folders are
    often links to another disk, and a folder reached twice (a link loop) is listed once."""
    extensions = image_extensions()
    images: list[_ImageFile] = []
    others: list[str] = []
    root_stat = root.stat()
    seen_folders = {(root_stat.st_dev, root_stat.st_ino)}
    # Relative paths are built as strings ("a/b/"): pathlib objects cost a second per 50 000 files.
    pending: list[tuple[str, str]] = [(str(root), "")]
    while pending:
        folder, relative_folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                relative = relative_folder + entry.name
                try:
                    if entry.is_dir():
                        stat = entry.stat()
                        if (stat.st_dev, stat.st_ino) not in seen_folders:
                            seen_folders.add((stat.st_dev, stat.st_ino))
                            pending.append((entry.path, relative + "/"))
                    elif entry.is_file():
                        dot = entry.name.rfind(".")
                        if dot > 0 and entry.name[dot:].lower() in extensions:
                            stat = entry.stat()
                            images.append(_ImageFile(relative, stat.st_size, stat.st_mtime_ns))
                        else:
                            others.append(relative)
                except OSError:  # a broken link, or an entry removed while listing: not an image of the folder
                    continue
    images.sort(key=lambda f: f.relative_path.split("/"))  # by folder, then name: a class's images together
    others.sort()
    return images, others


def _layout(files: Sequence[_ImageFile], labels: str, source: str) -> _Layout:
    """Whether the files are labelled by their first-level subfolder, and each file's class id."""
    top_level = [f.relative_path for f in files if "/" not in f.relative_path]
    first_level = sorted({f.relative_path.split("/", 1)[0] for f in files if "/" in f.relative_path})
    unlabelled = _Layout(False, (), (0,) * len(files))
    if labels == "none":
        return unlabelled
    if labels == "subfolders":
        if top_level:
            raise ValueError(
                f"{source}: data.folder_labels is subfolders but {len(top_level)} image(s) lie outside a class "
                f"subfolder (the first: {top_level[0]}); move them into one, or set data.folder_labels: none"
            )
        if len(first_level) < 2:
            raise ValueError(
                f"{source}: data.folder_labels is subfolders but the images lie in {len(first_level)} subfolder "
                f"{first_level}; classes need at least two (one subfolder per class), or set data.folder_labels: none"
            )
    elif len(first_level) < 2:
        return unlabelled  # auto: a flat folder, or everything under one subfolder
    elif top_level:
        raise ValueError(
            f"{source}: mixed layout: {len(top_level)} image(s) at the top level (the first: {top_level[0]}) and "
            f"{len(files) - len(top_level)} in the subfolders {_short_list(first_level)}; set data.folder_labels: none "
            "to use every image unlabelled, or move the top-level images into class subfolders"
        )
    class_id = {name: index for index, name in enumerate(first_level)}
    return _Layout(True, tuple(first_level), tuple(class_id[f.relative_path.split("/", 1)[0]] for f in files))


def _short_list(names: Sequence[str], shown: int = 5) -> str:
    listed = ", ".join(names[:shown])
    return f"{listed}, ... ({len(names)} in all)" if len(names) > shown else listed


def _content_key(
    resolved: str, files: Sequence[_ImageFile], image_size: int, labels: str, labels_digest: str = ""
) -> str:
    """A sha256 of what decides the decoded arrays: the folder, each image's relative path, size and modification
    time, the side and the label mode (not ``unreadable``: an entry records its unreadable files and serves both),
    and ``labels_digest``, a digest of labels read from elsewhere (an annotations file's content)."""
    described = {"format": CACHE_FORMAT, "path": resolved, "image_size": image_size, "labels": labels}
    if labels_digest:
        described["labels_digest"] = labels_digest
    digest = hashlib.sha256(json.dumps(described).encode())
    for f in files:
        digest.update(f"{f.relative_path}\0{f.size}\0{f.mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:32]


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def _to_rgb(image: Image.Image) -> Image.Image:
    """Three 8-bit channels: alpha is dropped (not composited), 16-bit grayscale keeps its top 8 bits."""
    if image.mode.startswith("I;16"):
        # Pillow's own conversion clips 16-bit values at 255 (a mostly white image); scale them instead.
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    elif image.mode in ("P", "PA") and "transparency" in image.info:
        image = image.convert("RGBA")  # the same colours, without Pillow's warning about palette transparency
    return image if image.mode == "RGB" else image.convert("RGB")


def _decode_image(path: Path, image_size: int) -> bytes:
    """One image as ``image_size * image_size * 3`` bytes (HWC, RGB): its centre square, resized."""
    with Image.open(path) as opened:
        opened.load()  # the whole file: a truncated one fails here, not later with gray rows
        rgb = _to_rgb(opened)
        width, height = rgb.size
        side = min(width, height)
        left, top = (width - side) / 2, (height - side) / 2
        # Resizing the centre square (box) is resizing the shorter side to image_size and cutting the centre square,
        # without rounding the intermediate size; Pillow's filter reads pixels just outside the box, as it would.
        square = rgb.resize(
            (image_size, image_size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side)
        )
        return square.tobytes()


def _npy_header(shape: tuple[int, ...], length: int | None = None) -> bytes:
    """A version 1.0 ``.npy`` header of a C-order ``uint8`` array, padded with spaces to ``length`` bytes.

    Padding a header to a given length lets the image count be written after the images: the final, smaller
    count's header (never longer) fills the space reserved for the listed count. The format allows any padding
    that keeps the total a multiple of 64."""
    text = f"{{'descr': '|u1', 'fortran_order': False, 'shape': {tuple(int(v) for v in shape)!r}, }}"
    fixed = len(b"\x93NUMPY") + 2 + 2 + len(text) + 1  # magic, version, header length, text, newline
    total = length if length is not None else -(-fixed // _NPY_ALIGN) * _NPY_ALIGN
    if total < fixed or total % _NPY_ALIGN:
        raise ValueError(f"an .npy header of {fixed} bytes does not fit in {total}")
    padded = text + " " * (total - fixed) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(padded)) + padded.encode("latin1")


def _decode_folder(
    root: Path,
    files: Sequence[_ImageFile],
    layout: _Layout,
    image_size: int,
    target: Path,
    log: Log | None,
) -> tuple[int, list[dict[str, str]]]:
    """Decode every listed image into ``target``/x_train.npy, streaming (one image in memory at a time), and write
    the labels and the list of decoded files beside it. Returns the number of images and the unreadable files."""
    unreadable: list[dict[str, str]] = []
    decoded_rows: list[int] = []
    reserved = _npy_header((len(files), image_size, image_size, 3))
    # A truncated file must count as unreadable: another library may have told Pillow to accept them silently.
    accept_truncated = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with open(target / "x_train.npy", "wb") as out:
            out.write(reserved)
            for row, file in enumerate(files):
                try:
                    pixels = _decode_image(root / file.relative_path, image_size)
                except Exception as exc:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError, ...
                    reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
                    unreadable.append({"path": file.relative_path, "error": reason})
                else:
                    out.write(pixels)  # outside the try: a full disk is an error, not an unreadable image
                    decoded_rows.append(row)
                if log is not None and (row + 1) % _PROGRESS_EVERY == 0 and row + 1 < len(files):
                    log(f"decoding folder {root}: {row + 1}/{len(files)} images")
            out.seek(0)
            out.write(_npy_header((len(decoded_rows), image_size, image_size, 3), length=len(reserved)))
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = accept_truncated
    labels = np.asarray([layout.class_of_file[row] for row in decoded_rows], dtype=np.int64)
    np.save(target / "y_train.npy", labels, allow_pickle=False)
    (target / "listing.json").write_text(json.dumps({"files": [files[row].relative_path for row in decoded_rows]}))
    return len(decoded_rows), unreadable


# --------------------------------------------------------------------------------------------------
# The cache on disk
# --------------------------------------------------------------------------------------------------


def _entry_identity(resolved: str, key: str, image_size: int, labels: str) -> dict[str, Any]:
    return {
        "source": "folder",
        "format": CACHE_FORMAT,
        "path": resolved,
        "key": key,
        "image_size": image_size,
        "labels": labels,
    }


def _read_entry(entry: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, np.ndarray] | None:
    """The metadata, memory-mapped images and labels of a complete entry of exactly this folder version, or None."""
    try:
        metadata = json.loads((entry / "complete.json").read_text())
        if not isinstance(metadata, dict) or any(metadata.get(k) != v for k, v in identity.items()):
            return None
        images = np.load(entry / "x_train.npy", mmap_mode="r", allow_pickle=False)
        labels = np.load(entry / "y_train.npy", allow_pickle=False)
    except (OSError, ValueError):
        return None
    side = identity["image_size"]
    if images.shape != (metadata.get("images"), side, side, 3) or labels.shape != (images.shape[0],):
        return None
    return metadata, images, labels


def _remove_stale_entries(root: Path, keep: Path, identity: dict[str, Any]) -> None:
    """Remove the entries of older versions of the same folder read with the same side and label mode (another side
    or mode is another configuration that may still be in use, and keeps its entry)."""
    same = ("source", "path", "image_size", "labels")
    for other in root.iterdir():
        if other == keep or other.name.startswith(".tmp-") or not other.is_dir():
            continue
        try:
            metadata = json.loads((other / "complete.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(metadata, dict) and all(metadata.get(k) == identity[k] for k in same):
            shutil.rmtree(other, ignore_errors=True)


def _decode_to_disk(
    root: Path,
    files: Sequence[_ImageFile],
    layout: _Layout,
    identity: dict[str, Any],
    entry: Path | None,
    log: Log | None,
    source: str,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Decode the folder into a temporary folder beside ``entry``, then rename it to ``entry`` (atomic: a process
    never sees a partial entry; two processes decoding at once rename the same content and one rename wins).

    Without a cache folder (``FEDSSL_DATA_CACHE=off``, or one that cannot be created) the images go to a temporary
    folder that is removed once mapped: the mapping stays valid, and the next process decodes again."""
    image_size = identity["image_size"]
    needed = len(files) * image_size * image_size * 3
    work, entry = decode_work_folder(
        entry, "fedssl-folder-", needed, f"{source}: its {len(files)} images", hint=", or lower data.image_size"
    )
    try:
        if log is not None:
            log(f"decoding folder {root}: {len(files)} images to {image_size}x{image_size} into {work.parent}")
        started = time.perf_counter()
        count, unreadable = _decode_folder(root, files, layout, image_size, work, log)
        if count == 0:
            raise ValueError(f"{source}: none of its {len(files)} image files can be read: {_name_files(unreadable)}")
        metadata = {
            **identity,
            "images": count,
            "files_listed": len(files),
            "labelled": layout.labelled,
            "class_names": list(layout.class_names),
            "unreadable": unreadable,
            "decode_seconds": round(time.perf_counter() - started, 3),
            "pillow": PIL.__version__,
        }
        (work / "complete.json").write_text(json.dumps(metadata, indent=1))
        if log is not None:
            log(f"decoded folder {root}: {count} images in {metadata['decode_seconds']:.1f} s")
        if entry is not None:
            stored = _publish(work, entry, identity)
            if stored is not None:
                return stored
        stored = _read_entry(work, identity)
        if stored is None:
            raise OSError(f"{source}: the decoded images written to {work} cannot be read back")
        return stored
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)  # what is mapped stays readable


def _publish(work: Path, entry: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, np.ndarray] | None:
    """Rename the complete ``work`` folder to ``entry`` and read it there (None: reading it failed)."""
    if entry.exists() and _read_entry(entry, identity) is None:
        shutil.rmtree(entry, ignore_errors=True)  # a broken entry: never written by this module, but do not serve it
    try:
        os.replace(work, entry)
    except OSError:
        pass  # another process published the same folder version first: use its entry
    stored = _read_entry(entry, identity)
    if stored is not None:
        _remove_stale_entries(entry.parent, entry, identity)
    return stored


def _name_files(unreadable: Sequence[dict[str, str]]) -> str:
    named = "; ".join(f"{item['path']} ({item['error']})" for item in unreadable[:_NAMED_FILES])
    return named + (f"; ... ({len(unreadable)} in all)" if len(unreadable) > _NAMED_FILES else "")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


# Keyed on (resolved folder, content key, unreadable mode): a folder with unreadable files loaded with skip must
# still stop a later load that asks for stop.
_LOADED: OrderedDict[tuple[str, str, str], ImageData] = OrderedDict()


def clear_memory_cache() -> None:
    """Forget the folders loaded in this process (their entries on disk stay)."""
    _LOADED.clear()


def load_folder(
    path: str | Path,
    *,
    image_size: int,
    labels: str = "auto",
    unreadable: str = "stop",
    log: Log | None = None,
) -> ImageData:
    """Load a folder of image files as the training part of an ``ImageData`` (a folder has no test part).

    Which files: every file at any depth whose extension (case-insensitive) Pillow registers for a format it can open
    (``image_extensions()``: .jpg, .png, .bmp, .gif, .tif, .webp, ... less .pdf, video and scientific containers);
    other files are ignored, and so are files and folders whose name starts with ".". Symbolic links are followed.

    Labels (``labels``): ``auto`` uses the first-level subfolders as classes when every image lies in one of at least
    two of them, and reads the folder unlabelled when they lie at the top level, under a single subfolder, or both;
    images at the top level *and* in two or more subfolders (a mixed layout) is an error, since either reading may
    be meant: set ``labels="none"`` to use every image unlabelled, or move the top-level images into class subfolders.
    ``subfolders`` always uses them (an image outside a first-level subfolder, or fewer than two classes, is an
    error); ``none`` reads any layout unlabelled. Class ids are the sorted first-level subfolder names, 0..K-1
    (``ImageData.class_names``); images deeper down belong to their first-level subfolder's class. Unlabelled: labels
    all 0, ``num_classes`` 1, ``labelled`` false.

    Pixels: any size and mode. The mode is converted to RGB by Pillow's ``convert("RGB")``: alpha channels (RGBA,
    LA, transparent palettes) are dropped, not composited on a background; CMYK uses Pillow's plain conversion;
    16-bit grayscale keeps its top 8 bits; 32-bit integer and float images are clipped to 0..255 by Pillow. EXIF
    orientation is not applied (as torchvision's ImageFolder). The first frame of an animation is used. Then the
    shorter side is resized to ``image_size`` and the centre ``image_size`` x ``image_size`` square is cut, done as
    one bicubic resize of the centre square (Pillow's BICUBIC, antialiased: its filter widens with the downscale
    factor; no rounding of the intermediate size). This is applied once, when the folder is decoded.

    Unreadable files (Pillow cannot open or fully decode them, truncated files included): ``unreadable="stop"``
    raises a ValueError naming the first five and the count; ``"skip"`` leaves them out and names them on ``log``.

    The cache: the decoded images are an NHWC ``uint8`` ``.npy`` file in the decoded cache on disk (see the module
    docstring), in an entry named after a sha256 of the resolved folder path, every image file's relative path, size
    and modification time, ``image_size`` and ``labels``, with the labels (``y_train.npy``), the decoded files in row
    order (``listing.json``) and what was decoded, skipped and the class names (``complete.json``) beside it. A
    changed folder has another key and is decoded again (one process, streaming to disk; ``log`` gets a progress line
    every 5000 images); the entry of its older version is removed. ``x_train`` is that file memory-mapped read-only;
    the result is also kept per process (listing the folder, one ``stat`` per file, still tells whether it changed).
    """
    _check_options(image_size, unreadable)
    if labels not in LABEL_MODES:
        raise ValueError(f"labels must be one of {list(LABEL_MODES)}, got {labels!r}")
    resolved, files = _listed_folder(path)
    source = f"image folder {resolved}"
    layout = _layout(files, labels, source)
    key = _content_key(str(resolved), files, image_size, labels)
    return _load_listed(resolved, files, layout, key, image_size, labels, unreadable, log, every_class=True)


def _check_options(image_size: int, unreadable: str) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be an integer >= 1 (the side of the square images), got {image_size!r}")
    if unreadable not in UNREADABLE_MODES:
        raise ValueError(f"unreadable must be one of {list(UNREADABLE_MODES)}, got {unreadable!r}")


def _listed_folder(path: str | Path) -> tuple[Path, list[_ImageFile]]:
    """The resolved folder and its image files; an error when it is missing, a file, or holds no image."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"image folder not found: {folder} (resolved to {folder.resolve()})")
    if not folder.is_dir():
        raise ValueError(f"image folder {folder} is a file, not a folder; data.path must name a folder of images")
    resolved = folder.resolve()
    files, others = _list_images(resolved)
    if not files:
        found = f"; it holds {len(others)} other file(s), e.g. {_short_list(others, 3)}" if others else " (it is empty)"
        raise ValueError(
            f"image folder {resolved}: no image files found (extensions {_extensions_hint()}; names starting with "
            f"'.' are ignored){found}"
        )
    return resolved, files


def _load_listed(
    resolved: Path,
    files: Sequence[_ImageFile],
    layout: _Layout,
    key: str,
    image_size: int,
    labels: str,
    unreadable: str,
    log: Log | None,
    every_class: bool,
) -> ImageData:
    """The listed folder's images: from this process's memory, else the cache entry ``key``, else decoded into it."""
    source = f"image folder {resolved}"
    memory_key = (str(resolved), key, unreadable)
    loaded = _LOADED.get(memory_key)
    if loaded is not None:
        _LOADED.move_to_end(memory_key)
        return dataclasses.replace(loaded)
    identity = _entry_identity(str(resolved), key, image_size, labels)
    cache_root = decoded_cache_root()
    entry = cache_root / f"folder-{key}" if cache_root is not None else None
    stored = _read_entry(entry, identity) if entry is not None else None
    if stored is None:
        stored = _decode_to_disk(resolved, files, layout, identity, entry, log, source)
    data = _image_data(stored, resolved, unreadable, log, source, every_class)
    _LOADED[memory_key] = data
    while len(_LOADED) > _MEMORY_CACHE_SIZE:
        _LOADED.popitem(last=False)
    return dataclasses.replace(data)


# --------------------------------------------------------------------------------------------------
# A flat folder labelled by an annotations file (Tiny-ImageNet's val/)
# --------------------------------------------------------------------------------------------------


ANNOTATIONS_FILE = "val_annotations.txt"  # Tiny-ImageNet's val/ labels: file name, class (wnid), bounding box


def read_annotations(path: str | Path) -> dict[str, str]:
    """File name -> class name, from a tab-separated annotations file whose first two fields are a file name and its
    class (Tiny-ImageNet's val_annotations.txt: ``val_0.JPEG<TAB>n03444034<TAB>0<TAB>32<TAB>44<TAB>62``; the
    bounding box is ignored). Blank lines are skipped; a line with fewer fields, or a file given two classes, is a
    ValueError naming the line."""
    annotations: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split("\t")]
        if len(fields) < 2 or not fields[0] or not fields[1]:
            raise ValueError(
                f"{path}, line {number}: expected a file name and its class separated by a tab, got {line[:80]!r}"
            )
        name, class_name = fields[0], fields[1]
        if annotations.setdefault(name, class_name) != class_name:
            raise ValueError(
                f"{path}, line {number}: {name} is given the class {class_name} but an earlier line gives it "
                f"{annotations[name]}"
            )
    return annotations


def load_annotated_folder(
    path: str | Path,
    annotations: Mapping[str, str],
    class_names: Sequence[str],
    *,
    image_size: int,
    unreadable: str = "stop",
    log: Log | None = None,
) -> ImageData:
    """Load a folder of images whose classes an annotations mapping gives (``read_annotations``), as the training
    part of a labelled ``ImageData``: Tiny-ImageNet's ``val/images`` with its ``val_annotations.txt``.

    ``annotations`` maps each image's path relative to ``path`` (POSIX form; a flat folder: its file name) to its
    class name; ``class_names`` numbers the classes 0..K-1 (the training part's, so that both parts number them
    alike) and is the result's ``class_names``; a class may have no image here. An image without an annotation, or
    annotated with a class ``class_names`` lacks, is a ValueError naming the first few; annotations of files that
    are not in the folder are ignored. Files, decoding, ``unreadable`` and the cache are ``load_folder``'s; the cache
    entry's key also covers the annotations and class names, so an edited annotations file is decoded again."""
    _check_options(image_size, unreadable)
    names = tuple(str(name) for name in class_names)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"class_names must be distinct and not empty, got {_short_list(names)!r}")
    resolved, files = _listed_folder(path)
    source = f"image folder {resolved}"
    unannotated = [f.relative_path for f in files if f.relative_path not in annotations]
    if unannotated:
        raise ValueError(
            f"{source}: {len(unannotated)} of its {len(files)} images have no line in the annotations (the first: "
            f"{_short_list(unannotated)}); the annotations name files by their path in the folder"
        )
    class_id = {name: index for index, name in enumerate(names)}
    unknown = sorted({annotations[f.relative_path] for f in files} - set(class_id))
    if unknown:
        raise ValueError(
            f"{source}: the annotations give classes the training part lacks: {_short_list(unknown)} (its classes: "
            f"{_short_list(names)})"
        )
    layout = _Layout(True, names, tuple(class_id[annotations[f.relative_path]] for f in files))
    # The labels come from outside the files: their content is part of what the decoded entry holds.
    labels_digest = hashlib.sha256(
        json.dumps({"classes": list(names), "of_file": layout.class_of_file}).encode()
    ).hexdigest()
    key = _content_key(str(resolved), files, image_size, "annotations", labels_digest)
    return _load_listed(resolved, files, layout, key, image_size, "annotations", unreadable, log, every_class=False)


def _image_data(
    stored: tuple[dict[str, Any], np.ndarray, np.ndarray],
    root: Path,
    unreadable: str,
    log: Log | None,
    source: str,
    every_class: bool = True,
) -> ImageData:
    """The ``ImageData`` of a decoded entry, after the checks that depend on ``unreadable``. ``every_class``: each
    class must keep a readable image (a folder's class subfolders; not an annotated folder, whose classes are
    another folder's and may be absent from it)."""
    metadata, images, labels = stored
    skipped = metadata["unreadable"]
    if skipped and unreadable == "stop":
        raise ValueError(
            f"{source}: {len(skipped)} of its {metadata['files_listed']} image files cannot be read: "
            f"{_name_files(skipped)}; set data.unreadable: skip to leave them out"
        )
    if skipped and log is not None:
        log(f"{source}: skipping {len(skipped)} unreadable image file(s): {_name_files(skipped)}")
    class_names = tuple(metadata["class_names"])
    if metadata["labelled"] and every_class:
        counts = np.bincount(labels, minlength=len(class_names))
        empty = [name for name, count in zip(class_names, counts, strict=True) if count == 0]
        if empty:
            raise ValueError(
                f"{source}: the class subfolder(s) {_short_list(empty)} hold no readable image; remove them, or "
                "set data.folder_labels: none"
            )
    side = int(metadata["image_size"])
    test_images = np.zeros((0, side, side, 3), dtype=np.uint8)
    test_images.setflags(write=False)
    return ImageData(
        x_train=images,
        y_train=labels,
        x_test=test_images,
        y_test=np.zeros(0, dtype=np.int64),
        num_classes=len(class_names) if metadata["labelled"] else 1,
        name=root.name,
        labelled=bool(metadata["labelled"]),
        class_names=class_names,
    )
