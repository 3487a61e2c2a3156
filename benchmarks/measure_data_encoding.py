"""How compactly the data set can travel to the GPU machine, and what each encoding does to the pixels.

Measures, on the whole data set (x_train and x_test together):

- lossless: the raw pixels; the source file as it is; zlib level 9 and xz (preset 9, extreme) of each raw array;
  a PNG per image (optimize); a lossless WebP per image (method 4); and ``fedssl_gpu.datapack``'s ``lossless``
  (a shared-header JPEG at quality 75 plus the bzip2-compressed exact residual), packed and unpacked for real;
- lossy: ``fedssl_gpu.datapack``'s ``jpeg:Q`` at qualities 75, 85, 90 and 95 with 4:2:0 and 4:4:4 chroma, packed and
  unpacked for real, beside the size of the same JPEGs as stand-alone files; for each the mean and max absolute
  pixel difference, PSNR and the change of the per-channel mean and standard deviation;
- whether re-encoding at the source's JPEG quality is nearly idempotent (quality 74, 75, 76; 4:2:0).

Writes benchmarks/results/gpu_data_encoding.{json,md}.

Usage: python benchmarks/measure_data_encoding.py --data /path/cifar10-dev.npz [--part-limit-mib 45] [--images N]
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import os
import platform
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedssl_gpu import datapack

MIB = 2**20
JPEG_QUALITIES = (75, 85, 90, 95)


def per_image_bytes(images: np.ndarray, fmt: str, **kw) -> int:
    from PIL import Image

    total = 0
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, fmt, **kw)
        total += len(buf.getvalue())
    return total


def lossless_row(name: str, nbytes: int, seconds: float | None, limit: int, note: str = "") -> dict:
    return {
        "encoding": name,
        "lossless": True,
        "bytes": nbytes,
        "mib": nbytes / MIB,
        "parts": math.ceil(nbytes / limit),
        "parts_measured": False,
        "mean_abs_diff": 0.0,
        "max_abs_diff": 0,
        "psnr_db": None,
        "channel_mean_change_max": 0.0,
        "channel_std_change_max": 0.0,
        "encode_s": seconds,
        "note": note,
    }


def datapack_row(src: Path, encoding: str, limit: int, tmp: Path, x_all: np.ndarray) -> dict:
    out_dir = tmp / encoding.replace(":", "_")
    t0 = time.perf_counter()
    parts = datapack.pack(src, out_dir, part_limit_bytes=limit, encoding=encoding)
    pack_s = time.perf_counter() - t0
    sizes = [p.stat().st_size for p in parts]
    info = datapack.unpack(parts, tmp / "unpacked.npz")
    with np.load(tmp / "unpacked.npz") as z:
        decoded = np.concatenate([z["x_train"], z["x_test"]])
    check = datapack.pixel_effect(x_all, decoded)  # measured again on what unpack wrote
    (tmp / "unpacked.npz").unlink()
    for p in parts:
        p.unlink()
    effect = info["effect"]
    assert check["mean_abs_diff"] == effect["mean_abs_diff"] and check["max_abs_diff"] == effect["max_abs_diff"]
    return {
        "encoding": f"datapack {encoding}",
        "lossless": effect["exact"],
        "bytes": sum(sizes),
        "mib": sum(sizes) / MIB,
        "parts": len(parts),
        "parts_measured": True,
        "part_mib": [round(s / MIB, 2) for s in sizes],
        "mean_abs_diff": effect["mean_abs_diff"],
        "max_abs_diff": effect["max_abs_diff"],
        "psnr_db": effect["psnr_db"],
        "equal_pixel_fraction": effect["equal_pixel_fraction"],
        "channel_mean_change": effect["channel_mean_change"],
        "channel_std_change": effect["channel_std_change"],
        "channel_mean_change_max": max(abs(v) for v in effect["channel_mean_change"]),
        "channel_std_change_max": max(abs(v) for v in effect["channel_std_change"]),
        "encode_s": round(pack_s, 1),
        "unpack_s": info["unpack"]["seconds"],
        "pixels_verified": info["unpack"]["pixels_verified"],
        "jpeg_base": effect.get("jpeg_base"),
    }


def idempotence(x_all: np.ndarray) -> list[dict]:
    rows = []
    for q in (74, 75, 76):
        header, scans, offsets = datapack.jpeg_encode(x_all, q, "420")
        decoded = datapack.jpeg_decode(header, scans, offsets, np.empty_like(x_all))
        e = datapack.pixel_effect(x_all, decoded)
        same_images = float((decoded == x_all).reshape(len(x_all), -1).all(1).mean())
        rows.append(
            {
                "quality": q,
                "subsampling": "4:2:0",
                "equal_pixel_fraction": e["equal_pixel_fraction"],
                "equal_image_fraction": round(same_images, 5),
                "psnr_db": e["psnr_db"],
                "mean_abs_diff": e["mean_abs_diff"],
                "max_abs_diff": e["max_abs_diff"],
            }
        )
    return rows


def fmt(v, spec: str, none: str = "exact") -> str:
    return none if v is None else format(v, spec)


def markdown(result: dict) -> str:
    limit_mib = result["part_limit_mib"]
    src = result["source"]
    lines = [
        f"# Data encoding for the GPU machine ({result['date']})",
        "",
        (
            f"Source `{src['name']}` ({src['train']} train + {src['test']} test images, {src['image_shape']} uint8; "
            f"sha256 {src['sha256'][:16]}…, {src['bytes'] / MIB:.1f} MiB). Command: `{result['command']}`"
        ),
        "",
        f"Machine: {result['machine']}.",
        "",
        (
            f"Parts at {limit_mib:g} MiB: counted from the real pack for `datapack` rows, else ceil(total / limit). "
            "Pixel differences are against the stored pixels (0..255); channel mean/std changes on the [0, 1] scale "
            "(largest over the three channels). Seconds: pack (encode, check, write) and unpack (check, decode, write "
            "the .npz) for `datapack` rows, the compression alone otherwise."
        ),
        "",
        (
            f"| encoding | total MiB | parts at {limit_mib:g} MiB | mean abs diff | max diff | PSNR dB | "
            "Δ channel mean | Δ channel std | pack s | unpack s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['encoding']} | {r['mib']:.2f} | {r['parts']} | {r['mean_abs_diff']:.3f} | "
            f"{r['max_abs_diff']} | {fmt(r['psnr_db'], '.2f', 'exact')} | "
            f"{r['channel_mean_change_max']:.5f} | "
            f"{r['channel_std_change_max']:.5f} | {fmt(r.get('encode_s'), '.1f', '')} | "
            f"{fmt(r.get('unpack_s'), '.1f', '')} |"
        )
    lines += [
        "",
        (
            f"The same JPEGs as stand-alone `.jpg` files (each with its own {result['jpeg_header_bytes']}-byte "
            "header, which `datapack` stores once per part):"
        ),
        "",
    ]
    lines.append(", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in result["jpeg_files_bytes"].items()) + ".")
    lines += [
        "",
        "Re-encoding the stored pixels as JPEG (4:2:0, no other change) and decoding again:",
        "",
        "| quality | equal pixels | equal images | mean abs diff | max diff | PSNR dB |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["idempotence"]:
        lines.append(
            f"| {r['quality']} | {100 * r['equal_pixel_fraction']:.2f}% | "
            f"{100 * r['equal_image_fraction']:.2f}% | {r['mean_abs_diff']:.3f} | {r['max_abs_diff']} | "
            f"{fmt(r['psnr_db'], '.2f')} |"
        )
    d = result["default"]
    lines += [
        "",
        (
            f"Default: `{d['encoding']}`, {d['parts']} part(s) of {', '.join(f'{m:.2f}' for m in d['part_mib'])} "
            f"MiB at the {limit_mib:g} MiB limit, exact pixels; unpacked in {d['unpack_s']:.1f} s here."
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the .npz (x_train, y_train, x_test, y_test[, class_names])")
    ap.add_argument("--part-limit-mib", type=float, default=datapack.DEFAULT_PART_LIMIT_MIB)
    ap.add_argument(
        "--images",
        type=int,
        default=None,
        help="use only the first N training images (a quick look; the results say so)",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_data_encoding"))
    args = ap.parse_args(argv)
    from PIL import Image, features

    data = Path(args.data)
    limit = int(args.part_limit_mib * MIB)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = data
        with np.load(data) as z:
            arrays = {k: z[k] for k in z.files}
        if args.images:
            arrays["x_train"], arrays["y_train"] = arrays["x_train"][: args.images], arrays["y_train"][: args.images]
            src = tmp / data.name
            np.savez_compressed(src, **arrays)
        x_all = np.concatenate([arrays["x_train"], arrays["x_test"]])
        raw = {k: v for k, v in arrays.items() if k in ("x_train", "y_train", "x_test", "y_test")}
        rows = [
            lossless_row("raw uint8 (uncompressed)", sum(a.nbytes for a in raw.values()), None, limit),
            lossless_row("source .npz as stored (zlib)", src.stat().st_size, None, limit),
        ]
        t0 = time.perf_counter()
        packed = sum(len(zlib.compress(a.tobytes(), 9)) for a in raw.values())
        rows.append(lossless_row("zlib level 9, raw arrays", packed, time.perf_counter() - t0, limit))
        t0 = time.perf_counter()
        xz = sum(len(lzma.compress(a.tobytes(), preset=9 | lzma.PRESET_EXTREME)) for a in raw.values())
        rows.append(lossless_row("xz preset 9e, raw arrays", xz, time.perf_counter() - t0, limit))
        labels = sum(a.nbytes for k, a in raw.items() if k.startswith("y_"))
        t0 = time.perf_counter()
        rows.append(
            lossless_row(
                "PNG per image (optimize)",
                per_image_bytes(x_all, "PNG", optimize=True) + labels,
                time.perf_counter() - t0,
                limit,
                "labels raw",
            )
        )
        t0 = time.perf_counter()
        rows.append(
            lossless_row(
                "WebP lossless per image (method 4)",
                per_image_bytes(x_all, "WEBP", lossless=True, quality=100, method=4) + labels,
                time.perf_counter() - t0,
                limit,
                "labels raw",
            )
        )
        default = datapack_row(src, datapack.DEFAULT_ENCODING, limit, tmp, x_all)
        default["encoding"] += " (JPEG q75 4:2:0 + bzip2 residual)"
        rows.append(default)
        files = {}
        for q in JPEG_QUALITIES:
            for sub in ("420", "444"):
                enc = f"jpeg:{q}" + ("" if sub == "420" else ":444")
                rows.append(datapack_row(src, enc, limit, tmp, x_all))
                files[enc] = per_image_bytes(x_all, "JPEG", quality=q, subsampling=datapack._SUBSAMPLING[sub])
        idem = idempotence(x_all)
        header_bytes = len(datapack.jpeg_encode(x_all[:1], 75)[0])
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": f"python benchmarks/measure_data_encoding.py --data {data.name}"
        + (
            f" --part-limit-mib {args.part_limit_mib:g}"
            if args.part_limit_mib != datapack.DEFAULT_PART_LIMIT_MIB
            else ""
        )
        + (f" --images {args.images}" if args.images else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, numpy "
        f"{np.__version__}, Pillow {Image.__version__} (libjpeg-turbo {features.version('libjpeg_turbo')}, "
        f"libwebp {features.version('webp')})",
        "source": {
            "name": data.name,
            "sha256": datapack.file_sha256(data),
            "bytes": data.stat().st_size,
            "train": len(arrays["y_train"]),
            "test": len(arrays["y_test"]),
            "image_shape": "x".join(map(str, x_all.shape[1:])),
        },
        "part_limit_mib": args.part_limit_mib,
        "rows": rows,
        "jpeg_files_bytes": files,
        "jpeg_header_bytes": header_bytes,
        "idempotence": idem,
        "default": {
            "encoding": datapack.DEFAULT_ENCODING,
            "parts": default["parts"],
            "part_mib": default["part_mib"],
            "unpack_s": default["unpack_s"],
            "pack_s": default["encode_s"],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
