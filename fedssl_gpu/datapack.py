"""A data set (an ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test`` and optionally ``class_names``) packed
into few, small, checksummed parts for a machine that receives files in transfers of limited size, and unpacked
there into a regular ``.npz``.

Encodings (``encoding=``; measured on the CIFAR-10 dev copy in ``benchmarks/results/gpu_data_encoding.md``):

- ``"lossless"`` (the default; ``"lossless:Q"`` names another base quality): each image as a baseline JPEG at
  quality 75 with 4:2:0 chroma (the source images were decoded from JPEG files of about that quality, so re-encoding
  them so is nearly idempotent), plus the exact residual (source minus decoded JPEG, modulo 256) compressed with
  bzip2. The unpacked pixels equal the source's bit for bit; unpack checks their sha256 and refuses a machine whose
  JPEG decoder decodes differently (then pack with ``"xz"``).
- ``"jpeg:Q"`` / ``"jpeg:Q:444"``: lossy, JPEG at quality Q with 4:2:0 (default) or 4:4:4 chroma; the manifest
  states the effect measured at pack time (PSNR, mean and max absolute pixel difference, channel mean/std change).
- ``"xz"``: lossless and decoder-independent: the raw pixels, xz (preset 9, extreme); the largest.

Every JPEG of a pack has the same header (quantisation and standard Huffman tables; same image size), so it is
stored once per part and each image keeps only its entropy-coded scan: at 32x32 that header is about two thirds of
a stand-alone file.

A part is ``<stem>.part-<i>-of-<N>.fedpack``::

    b"FEDPACK1" | header length (8 bytes, little-endian) | header (JSON: the manifest) | payload | sha256 (32 bytes)

The trailing sha256 covers everything before it, so any damaged byte is found before anything is parsed; each
manifest also lists every part's payload sha256 and the pack's id, so parts of other packs, duplicates and missing
parts are named. Parts split on image boundaries; the test split (and ``class_names``) come first, in part 1.

CLI::

    python3 -m fedssl_gpu.datapack pack SRC.npz OUT_DIR --part-limit-mib 45 [--encoding lossless] [--subset-per-class N]
    python3 -m fedssl_gpu.datapack unpack PARTS_DIR OUT.npz
    python3 -m fedssl_gpu.datapack describe PARTS_DIR
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import io
import json
import lzma
import math
import re
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "fedpack/1"
MAGIC = b"FEDPACK1"
SUFFIX = ".fedpack"
DEFAULT_ENCODING = "lossless"
DEFAULT_PART_LIMIT_MIB = 45
LOSSLESS_BASE_QUALITY = 75
SUBSET_SEED = 0
MIB = 2**20
_LEN = struct.Struct("<Q")
_DIGEST = 32
_FRAME = len(MAGIC) + _LEN.size + _DIGEST  # bytes of a part besides its header and payload
_EOI = b"\xff\xd9"
_SUBSAMPLING = {"420": 2, "422": 1, "444": 0}
_PART_NAME = re.compile(r"^(?P<stem>.+)\.part-(?P<i>\d+)-of-(?P<n>\d+)\.fedpack$")
_XZ_PRESET = 9 | lzma.PRESET_EXTREME
_SPLITS = ("test", "train")  # the order images go into parts: the test split first, in part 1


# ------------------------------------------------------------------------------------------------------ encodings
@dataclass(frozen=True)
class Encoding:
    kind: str  # "lossless" | "jpeg" | "xz"
    quality: int | None = None
    subsampling: str | None = None  # "420" | "422" | "444" (JPEG-based kinds)

    @property
    def name(self) -> str:
        if self.kind == "xz":
            return "xz"
        if self.kind == "lossless":
            return "lossless" if self.quality == LOSSLESS_BASE_QUALITY else f"lossless:{self.quality}"
        return f"jpeg:{self.quality}" + ("" if self.subsampling == "420" else f":{self.subsampling}")

    def detail(self) -> dict:
        if self.kind == "xz":
            return {"kind": "xz", "pixels": "raw uint8, xz preset 9 extreme, one stream per split per part"}
        jpeg = {
            "quality": self.quality,
            "subsampling": f"{self.subsampling[0]}:{self.subsampling[1]}:{self.subsampling[2]}",
            "huffman": "standard tables",
            "header": "shared, stored once per part",
        }
        if self.kind == "jpeg":
            return {"kind": "jpeg", "jpeg": jpeg}
        return {
            "kind": "lossless",
            "jpeg": jpeg,
            "residual": "source minus decoded JPEG modulo 256, uint8, bzip2 level 9, one stream per split per part",
        }


def parse_encoding(spec: str) -> Encoding:
    """``"lossless"``, ``"lossless:Q"``, ``"jpeg:Q"``, ``"jpeg:Q:444"`` (or ``:420``, ``:422``) or ``"xz"``."""
    fields = str(spec).strip().lower().split(":")
    kind = fields[0]
    try:
        if kind == "xz" and len(fields) == 1:
            return Encoding("xz")
        if kind == "lossless" and len(fields) <= 2:
            q = int(fields[1]) if len(fields) == 2 else LOSSLESS_BASE_QUALITY
            if 1 <= q <= 100:
                return Encoding("lossless", q, "420")
        if kind == "jpeg" and len(fields) in (2, 3):
            q = int(fields[1])
            sub = fields[2].replace(":", "") if len(fields) == 3 else "420"
            if 1 <= q <= 100 and sub in _SUBSAMPLING:
                return Encoding("jpeg", q, sub)
    except ValueError:
        pass
    raise ValueError(
        f"unknown data encoding {spec!r}: use 'lossless', 'lossless:Q', 'jpeg:Q', 'jpeg:Q:444' (Q in 1..100) or 'xz'"
    )


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def _pil_image(img: np.ndarray):
    from PIL import Image

    return Image.fromarray(img[..., 0] if img.ndim == 3 and img.shape[2] == 1 else img)


def _header_length(jpeg: bytes) -> int:
    """Bytes of a baseline JPEG up to the end of its (first) start-of-scan segment."""
    i = 2
    while i + 4 <= len(jpeg):
        if jpeg[i] != 0xFF:
            break
        marker, length = jpeg[i + 1], int.from_bytes(jpeg[i + 2 : i + 4], "big")
        i += 2 + length
        if marker == 0xDA:
            return i
    raise RuntimeError("not a baseline JPEG stream (no start-of-scan segment)")


def jpeg_encode(images: np.ndarray, quality: int, subsampling: str = "420") -> tuple[bytes, bytes, np.ndarray]:
    """Baseline JPEGs of ``images`` (N, H, W[, C]) uint8: (the header they share, their scans concatenated, offsets
    (N + 1) into that). A file is ``header + scan + b"\\xff\\xd9"``."""
    header = None
    scans, offsets = [], np.zeros(len(images) + 1, np.int64)
    sub = _SUBSAMPLING[subsampling]
    for i, img in enumerate(images):
        buf = io.BytesIO()
        _pil_image(img).save(buf, "JPEG", quality=quality, subsampling=sub, optimize=False, progressive=False)
        data = buf.getvalue()
        if header is None:
            header = data[: _header_length(data)]
        if not data.startswith(header) or not data.endswith(_EOI):
            raise RuntimeError(f"image {i}: its JPEG header differs from the first image's (mixed image sizes?)")
        scans.append(data[len(header) : -2])
        offsets[i + 1] = offsets[i] + len(scans[-1])
    return header or b"", b"".join(scans), offsets


def jpeg_decode(header: bytes, scans, offsets: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode into ``out`` (N, H, W[, C]) uint8 the images that :func:`jpeg_encode` wrote."""
    from PIL import Image

    scans = bytes(scans)
    shape = out.shape[1:]
    for i in range(len(out)):
        with Image.open(io.BytesIO(header + scans[offsets[i] : offsets[i + 1]] + _EOI), formats=("JPEG",)) as im:
            out[i] = np.asarray(im).reshape(shape)
    return out


# --------------------------------------------------------------------------------------------------------- effect
def pixel_effect(source: np.ndarray, decoded: np.ndarray, chunk: int = 8192) -> dict:
    """How ``decoded`` differs from ``source`` (uint8 images, last axis channels): mean and max absolute pixel
    difference, PSNR in dB (None when equal), the fraction of equal pixel values, and the change of the per-channel
    mean and standard deviation on the [0, 1] scale."""
    channels = source.shape[-1] if source.ndim == 4 else 1
    levels = np.arange(256, dtype=np.float64)
    diff_hist = np.zeros(256, np.int64)  # how many pixel values differ by 0, 1, ..., 255
    value_hist = np.zeros((2, channels, 256), np.int64)  # (source, decoded) x channel x value
    same = decoded is source
    for lo in range(0, len(source), chunk):
        s = source[lo : lo + chunk].reshape(-1, channels)
        d = s if same else decoded[lo : lo + chunk].reshape(-1, channels)
        for c in range(channels):
            value_hist[0, c] += np.bincount(s[:, c], minlength=256)
            value_hist[1, c] += np.bincount(d[:, c], minlength=256) if not same else 0
        if not same:
            diff_hist += np.bincount(np.abs(d.astype(np.int16) - s).ravel(), minlength=256)
    if same:
        value_hist[1] = value_hist[0]
        diff_hist[0] = source.size
    values = max(1, int(diff_hist.sum()))
    count = np.maximum(value_hist.sum(-1), 1)
    mean = (value_hist @ levels) / count / 255.0
    std = np.sqrt(np.maximum((value_hist @ levels**2) / count / 255.0**2 - mean**2, 0.0))
    mse = float(diff_hist @ levels**2) / values
    psnr = None if mse == 0 else round(10 * math.log10(255.0**2 / mse), 3)
    return {
        "exact": mse == 0,
        "psnr_db": psnr,
        "mean_abs_diff": round(float(diff_hist @ levels) / values, 5),
        "max_abs_diff": int(np.flatnonzero(diff_hist).max(initial=0)),
        "equal_pixel_fraction": round(int(diff_hist[0]) / values, 5),
        "channel_mean_source": [round(float(v), 6) for v in mean[0]],
        "channel_mean_change": [round(float(v), 6) for v in mean[1] - mean[0]],
        "channel_std_source": [round(float(v), 6) for v in std[0]],
        "channel_std_change": [round(float(v), 6) for v in std[1] - std[0]],
    }


def effect_summary(effect: dict) -> str:
    if effect["exact"]:
        return "exact (lossless)"
    return (
        f"PSNR {effect['psnr_db']:.2f} dB, mean abs diff {effect['mean_abs_diff']:.3f}, max abs diff "
        f"{effect['max_abs_diff']}, largest channel-mean change "
        f"{max(abs(v) for v in effect['channel_mean_change']):.5f}"
    )


# ---------------------------------------------------------------------------------------------------------- input
def _load_source(npz_path: Path) -> dict:
    with np.load(npz_path, allow_pickle=False) as z:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z.files]
        if missing:
            raise ValueError(f"{npz_path.name}: no {', '.join(missing)} (need x_train, y_train, x_test, y_test)")
        arrays = {k: z[k] for k in ("x_train", "y_train", "x_test", "y_test")}
        arrays["class_names"] = z["class_names"] if "class_names" in z.files else None
    for split in _SPLITS:
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8 or x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[3] not in (1, 3)):
            raise ValueError(
                f"{npz_path.name}: x_{split} must be uint8 images (N, H, W[, 1 or 3]), not {x.dtype} {x.shape}"
            )
        if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"{npz_path.name}: y_{split} must be {len(x)} integer labels, not {y.dtype} {y.shape}")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise ValueError(f"{npz_path.name}: x_train and x_test images differ in shape")
    return arrays


def subset_indices(y: np.ndarray, per_class: int, seed: int = SUBSET_SEED) -> np.ndarray:
    """Sorted indices of ``per_class`` images of every class of ``y``, drawn at random (seeded)."""
    if per_class < 1:
        raise ValueError(f"subset_per_class must be at least 1, not {per_class}")
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        if len(idx) < per_class:
            raise ValueError(f"class {c} has {len(idx)} training images, fewer than subset_per_class={per_class}")
        picked.append(rng.choice(idx, per_class, replace=False))
    return np.sort(np.concatenate(picked))


def _label_storage(y: np.ndarray) -> np.ndarray:
    return y.astype(np.uint8) if len(y) and y.min() >= 0 and y.max() <= 255 else y


# ----------------------------------------------------------------------------------------------------------- pack
class _Prepared:
    """The images of both splits encoded once; parts are slices of this (global index: test images, then train)."""

    def __init__(self, arrays: dict, enc: Encoding):
        self.enc = enc
        self.x = {s: arrays[f"x_{s}"] for s in _SPLITS}
        self.y = {s: arrays[f"y_{s}"] for s in _SPLITS}
        self.n = {s: len(self.x[s]) for s in _SPLITS}
        self.total = sum(self.n.values())
        self.header = b""
        self.scans: dict[str, tuple[bytes, np.ndarray]] = {}
        self.decoded = dict(self.x)
        self.residual: dict[str, np.ndarray] = {}
        self.base_effect = None
        if enc.kind in ("jpeg", "lossless"):
            for s in _SPLITS:
                header, scans, offsets = jpeg_encode(self.x[s], enc.quality, enc.subsampling)
                self.header = self.header or header
                if header and header != self.header:
                    raise RuntimeError("the splits' JPEG headers differ")
                self.scans[s] = (scans, offsets)
                self.decoded[s] = jpeg_decode(self.header, scans, offsets, np.empty_like(self.x[s]))
        if enc.kind == "lossless":
            self.base_effect = pixel_effect(self._all(self.x), self._all(self.decoded))
            self.residual = {s: self.x[s] - self.decoded[s] for s in _SPLITS}  # uint8: modulo 256
            self.decoded = dict(self.x)

    def _all(self, arrays: dict) -> np.ndarray:
        return np.concatenate([arrays[s] for s in _SPLITS])

    def ranges(self, a: int, b: int) -> dict[str, tuple[int, int]]:
        """The split-local index ranges of global images [a, b)."""
        out, start = {}, 0
        for s in _SPLITS:
            lo, hi = max(a - start, 0), min(b - start, self.n[s])
            if lo < hi:
                out[s] = (lo, hi)
            start += self.n[s]
        return out

    def payload(self, a: int, b: int) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        if self.enc.kind != "xz":
            arrays["jpeg_header"] = np.frombuffer(self.header, np.uint8)
        for s, (lo, hi) in self.ranges(a, b).items():
            arrays[f"{s}.labels"] = _label_storage(self.y[s][lo:hi])
            if self.enc.kind == "xz":
                arrays[f"{s}.pixels.xz"] = np.frombuffer(
                    lzma.compress(self.x[s][lo:hi].tobytes(), preset=_XZ_PRESET), np.uint8
                )
                continue
            scans, offsets = self.scans[s]
            arrays[f"{s}.lengths"] = np.diff(offsets[lo : hi + 1]).astype(np.uint32)
            arrays[f"{s}.jpeg"] = np.frombuffer(scans[offsets[lo] : offsets[hi]], np.uint8)
            if self.enc.kind == "lossless":
                arrays[f"{s}.residual.bz2"] = np.frombuffer(
                    bz2.compress(self.residual[s][lo:hi].tobytes(), 9), np.uint8
                )
        return arrays


def _payload_bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def _fill(prep: _Prepared, start: int, budget: int, limit: int, reserve: int) -> tuple[int, dict]:
    """The most images from ``start`` on whose payload fits ``budget`` bytes (to within 1 % of the budget or 0.2 %
    of the images: each try of a compressed encoding compresses the candidate part), and that payload."""
    remaining = prep.total - start
    fit, fit_payload, fit_size, over = 0, None, 0, remaining + 1
    n = min(remaining, 2048)  # a first measurement, which also gives the bytes per image
    for _ in range(60):
        payload = prep.payload(start, start + n)
        size = _payload_bytes(payload)
        if size <= budget:
            fit, fit_payload, fit_size = n, payload, size
        else:
            over = n
        if fit == remaining or fit_size >= 0.99 * budget or (over <= remaining and over - fit <= max(1, fit // 500)):
            break
        guess = min(remaining, int(n * 0.995 * budget / max(size, 1)))
        n = guess if fit < guess < over else (fit + over) // 2
    if fit == 0:
        one = _payload_bytes(prep.payload(start, start + 1))
        raise ValueError(
            f"part limit of {limit} bytes is smaller than one image plus the part header: an image "
            f"takes {one} bytes encoded here, the part's header and frame about {reserve + _FRAME}, "
            f"so the limit must be at least {one + reserve + _FRAME} bytes"
        )
    return fit, fit_payload


def _part_name(stem: str, i: int, n: int) -> str:
    return f"{stem}.part-{i}-of-{n}{SUFFIX}"


def _serialise(manifest: dict, arrays: dict[str, np.ndarray]) -> tuple[bytes, bytes]:
    table, offset, blobs = [], 0, []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        table.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
        blobs.append(a.tobytes())
    payload = b"".join(blobs)
    header = json.dumps({**manifest, "arrays": table}, separators=(",", ":")).encode()
    return header, payload


def pack(
    npz_path: Path,
    out_dir: Path,
    *,
    part_limit_bytes: int = DEFAULT_PART_LIMIT_MIB * MIB,
    encoding: str = DEFAULT_ENCODING,
    subset_per_class: int | None = None,
) -> list[Path]:
    """Pack ``npz_path`` into ``out_dir/<stem>.part-<i>-of-<N>.fedpack``, each at most ``part_limit_bytes``, and
    return their paths. Earlier parts of the same stem in ``out_dir`` are removed first."""
    npz_path, out_dir = Path(npz_path), Path(out_dir)
    enc = parse_encoding(encoding)
    limit = int(part_limit_bytes)
    arrays = _load_source(npz_path)
    source = {"name": npz_path.name, "bytes": npz_path.stat().st_size, "sha256": file_sha256(npz_path)}
    subset = None
    if subset_per_class is not None:
        keep = subset_indices(arrays["y_train"], int(subset_per_class))
        subset = {
            "per_class": int(subset_per_class),
            "seed": SUBSET_SEED,
            "source_train_size": len(arrays["y_train"]),
            "train_size": len(keep),
            "indices_sha256": _sha256(keep.astype("<i8")),
        }
        arrays["x_train"], arrays["y_train"] = arrays["x_train"][keep], arrays["y_train"][keep]
    if len(arrays["x_train"]) + len(arrays["x_test"]) == 0:
        raise ValueError(f"{npz_path.name}: no images to pack")
    prep = _Prepared(arrays, enc)
    source_pixels = prep._all(prep.x)
    effect = pixel_effect(source_pixels, source_pixels if enc.kind != "jpeg" else prep._all(prep.decoded))
    effect["summary"] = effect_summary(effect)
    if prep.base_effect is not None:
        effect["jpeg_base"] = prep.base_effect  # the JPEG part alone, before the residual makes it exact
    class_names = arrays["class_names"]
    outputs = {}
    for s in _SPLITS:
        outputs[f"x_{s}"] = {
            "shape": list(prep.x[s].shape),
            "dtype": prep.x[s].dtype.str,
            "sha256": _sha256(np.ascontiguousarray(prep.decoded[s])),
        }
        outputs[f"y_{s}"] = {
            "shape": list(prep.y[s].shape),
            "dtype": prep.y[s].dtype.str,
            "sha256": _sha256(np.ascontiguousarray(prep.y[s])),
        }
    if class_names is not None:
        outputs["class_names"] = {"shape": list(class_names.shape), "dtype": class_names.dtype.str}
    from PIL import Image, features

    base = {
        "format": FORMAT,
        "tool": "fedssl_gpu.datapack",
        "name": npz_path.stem,
        "source": source,
        "encoding": enc.name,
        "encoding_detail": enc.detail(),
        "effect": effect,
        "subset": subset,
        "subset_per_class": subset["per_class"] if subset else None,
        "outputs": outputs,
        "class_names": None if class_names is None else [str(c) for c in class_names],
        "encoder": {
            "pillow": Image.__version__,
            "libjpeg_turbo": features.version("libjpeg_turbo"),
            "numpy": np.__version__,
        },
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    base_len = len(json.dumps(base, separators=(",", ":")))
    reserve = base_len + 2048
    spans: list[tuple[int, int]] = []
    for _attempt in range(8):
        budget = limit - _FRAME - reserve
        if budget <= 0:
            raise ValueError(
                f"part limit of {limit} bytes is smaller than one image plus the part header "
                f"(the header alone takes about {reserve + _FRAME} bytes"
                + (f" when the pack has {len(spans)} parts)" if _attempt else ")")
            )
        spans, payloads, start = [], [], 0
        while start < prep.total:
            n, payload = _fill(prep, start, budget, limit, reserve)
            spans.append((start, start + n))
            payloads.append(payload)
            start += n
        count = len(spans)
        serialised = [_serialise({}, p)[1] for p in payloads]
        digests = [_sha256(p) for p in serialised]
        pack_id = _sha256(json.dumps([source["sha256"], enc.name, subset, digests]).encode())[:32]
        parts = []
        for i, ((a, b), payload) in enumerate(zip(spans, payloads), start=1):
            content = {s: list(r) for s, r in prep.ranges(a, b).items()}
            manifest = {
                **base,
                "pack_id": pack_id,
                "part": i,
                "parts": count,
                "part_name": _part_name(npz_path.stem, i, count),
                "content": content,
                "part_payload_sha256": digests,
            }
            header, body = _serialise(manifest, payload)
            parts.append((header, body))
        sizes = [_FRAME + len(h) + len(p) for h, p in parts]
        if max(sizes) <= limit:
            break
        reserve += max(sizes) - limit + 1024  # the headers came out larger than reserved: plan again
    else:
        raise RuntimeError("could not fit the parts' headers in the part limit")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{npz_path.stem}.part-*{SUFFIX}"):
        if _PART_NAME.match(old.name) and _PART_NAME.match(old.name)["stem"] == npz_path.stem:
            old.unlink()
    paths = []
    for i, (header, body) in enumerate(parts, start=1):
        path = out_dir / _part_name(npz_path.stem, i, len(parts))
        framed = MAGIC + _LEN.pack(len(header)) + header + body
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as fh:
            fh.write(framed)
            fh.write(hashlib.sha256(framed).digest())
        tmp.replace(path)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------------- unpack
def _read(path: Path, *, verify: bool = True) -> tuple[dict, bytes, int]:
    """(manifest, the file's bytes, where its payload starts); ValueError naming the part when it is damaged."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"data part {path.name}: cannot be read ({exc})") from None
    if len(data) < _FRAME or not data.startswith(MAGIC):
        raise ValueError(f"data part {path.name} is damaged or not a {SUFFIX} part (no {MAGIC.decode()} frame)")
    if verify and hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise ValueError(
            f"data part {path.name} is damaged: its sha256 does not match the one it was written with (carry it again)"
        )
    try:
        (length,) = _LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        manifest = json.loads(data[start : start + length])
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, not {FORMAT}")
    except ValueError as exc:
        raise ValueError(f"data part {path.name} is damaged: its header cannot be read ({exc})") from None
    return manifest, data, start + length


def read_manifest(part: Path) -> dict:
    """The manifest of one part (checked against the part's checksum), without its array table."""
    manifest, _, _ = _read(part)
    return {k: v for k, v in manifest.items() if k != "arrays"}


def _part_files(parts) -> list[Path]:
    if isinstance(parts, (str, Path)):
        parts = Path(parts)
        if parts.is_dir():
            files = sorted(parts.glob(f"*{SUFFIX}"))
            if not files:
                raise ValueError(f"no {SUFFIX} data parts in {parts}")
            return files
        if not parts.is_file():
            raise ValueError(f"no data parts at {parts}: no such file or folder")
        return [parts]
    files = [Path(p) for p in parts]
    if not files:
        raise ValueError("no data parts given")
    return files


def _arrays(manifest: dict, data: bytes, start: int) -> dict[str, np.ndarray]:
    return {
        t["name"]: np.frombuffer(
            data, np.dtype(t["dtype"]), count=int(np.prod(t["shape"], dtype=np.int64)), offset=start + t["offset"]
        ).reshape(t["shape"])
        for t in manifest["arrays"]
    }


def unpack(parts, out_npz: Path) -> dict:
    """Check and decode the parts (a list of paths, or a folder holding them) into ``out_npz`` (a regular,
    uncompressed ``.npz`` with x_train, y_train, x_test, y_test[, class_names]) and return the pack's manifest
    (name, encoding, effect, subset, ...) with an ``unpack`` entry. ValueError naming the part for a damaged,
    missing, duplicated or foreign part, and for decoded pixels that differ from the packed ones when the
    encoding is lossless."""
    t0 = time.perf_counter()
    files = _part_files(parts)
    read = [(p, *_read(p)) for p in files]
    ids = {m["pack_id"] for _, m, _, _ in read}
    if len(ids) > 1:
        raise ValueError(
            "the data parts come from different packs: "
            + "; ".join(f"{p.name} (pack {m['pack_id'][:12]}, part {m['part']} of {m['parts']})" for p, m, _, _ in read)
        )
    first = read[0][1]
    count, stem = first["parts"], first["name"]
    by_index: dict[int, tuple] = {}
    for p, m, data, start in read:
        if m["part"] in by_index:
            raise ValueError(
                f"data part {m['part']} of {count} is given twice: {by_index[m['part']][0].name} and {p.name}"
            )
        if _sha256(memoryview(data)[start : len(data) - _DIGEST]) != first["part_payload_sha256"][m["part"] - 1]:
            raise ValueError(f"data part {p.name} does not match the pack's record of part {m['part']}")
        by_index[m["part"]] = (p, m, data, start)
    missing = [i for i in range(1, count + 1) if i not in by_index]
    if missing:
        raise ValueError(
            f"missing data part(s) of {count}: "
            + ", ".join(f"part {i} ({_part_name(stem, i, count)})" for i in missing)
        )
    enc = parse_encoding(first["encoding"])
    outputs = first["outputs"]
    out = {k: np.empty(v["shape"], np.dtype(v["dtype"])) for k, v in outputs.items() if k != "class_names"}
    residual = {s: np.empty_like(out[f"x_{s}"]) for s in _SPLITS} if enc.kind == "lossless" else {}
    for i in range(1, count + 1):
        p, m, data, start = by_index[i]
        arrays = _arrays(m, data, start)
        for s, (lo, hi) in m["content"].items():
            out[f"y_{s}"][lo:hi] = arrays[f"{s}.labels"]
            x = out[f"x_{s}"][lo:hi]
            if enc.kind == "xz":
                x[...] = np.frombuffer(lzma.decompress(arrays[f"{s}.pixels.xz"].tobytes()), np.uint8).reshape(x.shape)
                continue
            offsets = np.concatenate([[0], np.cumsum(arrays[f"{s}.lengths"], dtype=np.int64)])
            jpeg_decode(arrays["jpeg_header"].tobytes(), arrays[f"{s}.jpeg"], offsets, x)
            if enc.kind == "lossless":
                residual[s][lo:hi] = np.frombuffer(
                    bz2.decompress(arrays[f"{s}.residual.bz2"].tobytes()), np.uint8
                ).reshape(x.shape)
    for s, res in residual.items():
        out[f"x_{s}"] += res  # uint8: modulo 256, as packed
    mismatched = [
        k for k, v in outputs.items() if "sha256" in v and _sha256(np.ascontiguousarray(out[k])) != v["sha256"]
    ]
    labels_bad = [k for k in mismatched if k.startswith("y_")]
    if labels_bad:
        raise ValueError(f"data parts of {stem}: unpacked {', '.join(labels_bad)} differ from the packed ones")
    if mismatched and enc.kind != "jpeg":
        from PIL import Image, features

        raise ValueError(
            f"data parts of {stem}: the decoded {', '.join(mismatched)} differ from the source "
            f"({enc.name} should be exact): this machine's JPEG decoder (Pillow {Image.__version__}, "
            f"libjpeg-turbo {features.version('libjpeg_turbo')}) decodes differently from the packer's "
            f"({first['encoder']}); pack with encoding 'xz'"
        )
    if mismatched:
        warnings.warn(
            f"data parts of {stem}: the decoded {', '.join(mismatched)} differ slightly from what the "
            f"packer decoded (another JPEG decoder); the stated effect is approximate here",
            stacklevel=2,
        )
    if first.get("class_names") is not None:
        out["class_names"] = np.array(first["class_names"], dtype=np.dtype(outputs["class_names"]["dtype"]))
    out_npz = Path(out_npz)
    out_npz.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_npz.with_name(out_npz.name + ".tmp")
    with tmp.open("wb") as fh:
        np.savez(fh, **{k: out[k] for k in ("x_train", "y_train", "x_test", "y_test", "class_names") if k in out})
    tmp.replace(out_npz)
    info = {k: v for k, v in first.items() if k not in ("arrays", "content", "part", "part_name")}
    info["unpack"] = {
        "parts": [p.name for p, *_ in (by_index[i] for i in range(1, count + 1))],
        "bytes": sum(len(by_index[i][2]) for i in by_index),
        "pixels_verified": not mismatched,
        "seconds": round(time.perf_counter() - t0, 2),
        "out": out_npz.name,
    }
    return info


def describe(parts) -> str:
    """One line per part: its name, size in MiB, place in the pack, encoding and images (or why it is unreadable)."""
    lines = []
    for p in _part_files(parts):
        size = p.stat().st_size / MIB if p.is_file() else 0.0
        try:
            m, _, _ = _read(p)
        except ValueError as exc:
            lines.append(f"{p.name}  {size:.2f} MiB  UNUSABLE: {exc}")
            continue
        images = ", ".join(f"{s}[{lo}:{hi}]" for s, (lo, hi) in m["content"].items())
        lines.append(f"{p.name}  {size:.2f} MiB  part {m['part']} of {m['parts']}  {m['encoding']}  {images}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m fedssl_gpu.datapack", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="pack an .npz into parts")
    p.add_argument("src", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--part-limit-mib", type=float, default=DEFAULT_PART_LIMIT_MIB)
    p.add_argument(
        "--encoding", default=DEFAULT_ENCODING, help="lossless (default), lossless:Q, jpeg:Q, jpeg:Q:444 or xz"
    )
    p.add_argument("--subset-per-class", type=int, default=None, metavar="N")
    u = sub.add_parser("unpack", help="check and unpack parts into a regular .npz")
    u.add_argument("parts", type=Path, help="the folder holding the parts (or one part)")
    u.add_argument("out", type=Path)
    d = sub.add_parser("describe", help="one line per part")
    d.add_argument("parts", type=Path, nargs="+")
    args = ap.parse_args(argv)
    try:
        if args.command == "pack":
            t0 = time.perf_counter()
            paths = pack(
                args.src,
                args.out_dir,
                part_limit_bytes=int(args.part_limit_mib * MIB),
                encoding=args.encoding,
                subset_per_class=args.subset_per_class,
            )
            m = read_manifest(paths[0])
            print(describe(paths))
            print(
                f"{len(paths)} part(s), {sum(p.stat().st_size for p in paths) / MIB:.2f} MiB in all, encoding "
                f"{m['encoding']}: {m['effect']['summary']}"
                + (f"; subset {m['subset_per_class']} per class" if m["subset_per_class"] else "")
                + f" ({time.perf_counter() - t0:.1f} s)"
            )
        elif args.command == "unpack":
            info = unpack(args.parts, args.out)
            print(
                f"{args.out}: {len(info['unpack']['parts'])} part(s) checked and decoded in "
                f"{info['unpack']['seconds']:.1f} s; encoding {info['encoding']}: {info['effect']['summary']}"
                + (f"; subset {info['subset_per_class']} per class" if info["subset_per_class"] else "")
            )
        else:
            parts = args.parts[0] if len(args.parts) == 1 else args.parts
            print(describe(parts))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
