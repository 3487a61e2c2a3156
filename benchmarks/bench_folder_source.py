"""The image-folder data source (ssl_models.data.folder): decode speed, cached loads, and a client process's memory.

Generates ``--images`` pictures (default 50 000, ``--size`` 96 px, JPEG; smooth colour fields with noise, so that they
compress like photos rather than like pure noise) into ``--classes`` class subfolders of a folder under
``--workdir`` (default: a temporary folder, removed afterwards), then measures, each in a fresh Python process:

* first load: ``load_folder`` with an empty decoded cache (list, decode, write the memory-mapped cache), images/s;
* later load: ``load_folder`` from the cache in a new process (list and stat every file, hash, map the file), and
  reading every image once through the mapping, images/s;
* the same images as an ``.npz`` (written with numpy.savez, or savez_compressed with ``--npz-compressed``) loaded with
  ``ssl_models.data.datasets.load_npz`` without the decoded cache (the whole archive read into memory), images/s;
* memory of a client: a process that loads the data, selects a client's share (``--share`` of the images) as a
  simulated client's partition is selected (``ssl_models.data.rows.select_rows``: on disk through the folder's memory
  mapping, a copy of the share where the whole array is in memory, the .npz without the decoded cache) and reads it
  in seeded random batches of ``--batch``. Reported: the peak resident set (VmHWM) and, at the end, its
  anonymous part (the process's own memory) and its file-backed part (mapped pages of the cache file: page cache
  that every client process on the machine shares and that the kernel can reclaim).

The decoded cache lives under the work folder (``FEDSSL_DATA_CACHE``), never in the home folder. The OS page cache is
warm for every measurement (the files were just written): timings of a cold disk would be lower.

Usage (full size; takes minutes and about 2 GB of disk at 96 px):
    python benchmarks/bench_folder_source.py
    python benchmarks/bench_folder_source.py --images 300 --results-dir /tmp/bench   # a quick check
Writes <results-dir>/folder_source.json and .md (default results dir: benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CACHE_VARIABLE = "FEDSSL_DATA_CACHE"  # ssl_models.data.datasets.DECODED_CACHE_VARIABLE; the parent does not import it


# --------------------------------------------------------------------------------------------------
# Child processes: each measurement runs in a fresh interpreter (no in-process cache, its own peak memory)
# --------------------------------------------------------------------------------------------------


def public_argv(argv: list[str]) -> list[str]:
    """The command line as a results file shows it: the folders of the machine that ran it named by their option
    (``--workdir WORKDIR``), the script by its path in the repository."""
    folder_options = ("--workdir", "--results-dir")

    def placeholder(option: str) -> str:
        return option.lstrip("-").replace("-", "_").upper()

    out: list[str] = []
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if i > 0 and argv[i - 1] in folder_options:
            out.append(placeholder(argv[i - 1]))
        elif "=" in arg and name in folder_options:
            out.append(f"{name}={placeholder(name)}")
        else:
            out.append(arg)
    if out and out[0].endswith("bench_folder_source.py"):
        out[0] = "benchmarks/bench_folder_source.py"
    return out


def memory_status() -> dict[str, int]:
    """This process's VmHWM, VmRSS, RssAnon and RssFile in bytes (Linux; empty elsewhere)."""
    wanted = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    status: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in wanted:
                status[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return status


def read_share(images: np.ndarray, share: float, batch: int, seed: int) -> tuple[int, float]:
    """A client's share of the images, selected as a simulated client's partition is (``select_rows``: a large share
    of a memory map stays on disk, a share of an array in memory is copied), then read in random batches as local
    training reads it (``read_rows``); (images, seconds)."""
    from ssl_models.data.rows import read_rows, select_rows

    rng = np.random.default_rng(seed)
    count = max(1, int(images.shape[0] * share))
    checksum = 0
    started = time.perf_counter()
    part = select_rows(images, np.sort(rng.permutation(images.shape[0])[:count]))
    order = rng.permutation(count)
    for start in range(0, count, batch):
        checksum += int(read_rows(part, order[start : start + batch])[:, ::8, ::8].sum(dtype=np.int64))
    del checksum
    return count, time.perf_counter() - started


def child(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    os.environ[CACHE_VARIABLE] = spec["cache"]
    from ssl_models.data.datasets import load_npz
    from ssl_models.data.folder import load_folder

    result: dict[str, Any] = {}
    started = time.perf_counter()
    if spec["source"] == "folder":
        data = load_folder(spec["path"], image_size=spec["image_size"], labels="auto", unreadable="stop")
    else:
        data = load_npz(spec["path"])
    result["load_s"] = time.perf_counter() - started
    result["images"] = int(data.x_train.shape[0])
    result["memmap"] = isinstance(data.x_train, np.memmap)
    if spec["read"] == "all":
        count, seconds = read_share(data.x_train, 1.0, spec["batch"], seed=0)
        result.update(read_images=count, read_s=seconds)
    elif spec["read"] == "share":
        count, seconds = read_share(data.x_train, spec["share"], spec["batch"], seed=1)
        result.update(read_images=count, read_s=seconds)
    elif spec["read"] == "train":
        result.update(train_local(data.x_train, spec))
    result["memory"] = memory_status()
    return result


def train_local(images: np.ndarray, spec: dict[str, Any]) -> dict[str, Any]:
    """Local SSL training as a client runs it (``ssl_models.training.train_ssl``) on every loaded image: a node that
    trains on its own data. Memory-mapped images are read a batch at a time; an in-memory array is used as it is.
    The first ``warmup`` steps (allocations, first-touch of the model) are not timed."""
    import torch

    from ssl_models.config import ExperimentConfig
    from ssl_models.factory import build_augment, build_ssl_model
    from ssl_models.training import train_ssl

    torch.set_num_threads(spec["threads"])
    side = int(images.shape[1])
    cfg = ExperimentConfig.from_dict(
        {
            "data": {"dataset": "folder", "path": spec["path"], "image_size": side},
            "model": {"arch": "resnet18", "width": spec["width"]},
            "method": {"name": "simclr", "options": {"proj_hidden_dim": 128, "proj_out_dim": 64}},
        }
    )
    method = build_ssl_model(cfg, seed=0)
    common = {
        "batch_size": spec["batch"],
        "lr": 1e-3,
        "optimizer": "adam",
        "device": "cpu",
        "seed": 0,
        "augment": build_augment(cfg, side),
        "fast_path": False,
    }
    train_ssl(method, images, epochs=1, max_steps_per_epoch=spec["warmup"], **common)
    started = time.perf_counter()
    stats = train_ssl(method, images, epochs=1, max_steps_per_epoch=spec["train_steps"], **common)
    seconds = time.perf_counter() - started
    return {
        "train_steps": stats.steps,
        "train_images": stats.steps * spec["batch"],
        "train_s": seconds,
        "stem": cfg.resnet_stem(),
    }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if completed.returncode != 0:
        raise SystemExit(f"child {spec['source']} failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# The parent: generate, measure, report
# --------------------------------------------------------------------------------------------------


def generate(folder: Path, count: int, size: int, classes: int, image_format: str, seed: int) -> int:
    """Write ``count`` images; returns the bytes written."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    suffix = {"jpeg": ".jpg", "png": ".png"}[image_format]
    total = 0
    for index in range(count):
        where = folder / f"class_{index % classes:03d}" if classes > 1 else folder
        if index < max(classes, 1):
            where.mkdir(parents=True, exist_ok=True)
        field = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        picture = np.asarray(Image.fromarray(field).resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
        picture = np.clip(picture + rng.normal(0, 8, picture.shape), 0, 255).astype(np.uint8)
        path = where / f"{index:06d}{suffix}"
        Image.fromarray(picture).save(path, **({"quality": 90} if image_format == "jpeg" else {}))
        total += path.stat().st_size
    return total


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mib(value: float) -> float:
    return round(value / 2**20, 1)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    images_folder, cache, npz_path = work / "images", work / "cache", work / "images.npz"
    if images_folder.exists():
        shutil.rmtree(images_folder)
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    written = generate(images_folder, args.images, args.size, args.classes, args.format, args.seed)
    generate_s = time.perf_counter() - started
    print(f"generated {args.images} images ({mib(written)} MiB) in {generate_s:.1f} s", flush=True)

    common = {"image_size": args.image_size, "batch": args.batch, "share": args.share}
    folder_spec = {**common, "source": "folder", "path": str(images_folder), "cache": str(cache)}
    first = run_child({**folder_spec, "read": "none"})
    print(f"first load: {first['load_s']:.1f} s", flush=True)
    later = run_child({**folder_spec, "read": "all"})
    print(f"later load: {later['load_s']:.3f} s, read all in {later['read_s']:.2f} s", flush=True)

    # The .npz of the very same decoded images (written from the cache, in batches: the parent stays small).
    sys.path.insert(0, str(REPO))
    os.environ[CACHE_VARIABLE] = str(cache)
    from ssl_models.data.folder import load_folder

    data = load_folder(images_folder, image_size=args.image_size)
    saver = np.savez_compressed if args.npz_compressed else np.savez
    empty = np.zeros((0, args.image_size, args.image_size, 3), np.uint8)
    saver(npz_path, x_train=data.x_train, y_train=data.y_train, x_test=empty, y_test=np.zeros(0, np.int64))
    del data
    npz_spec = {**common, "source": "npz", "path": str(npz_path), "cache": "off"}
    npz = run_child({**npz_spec, "read": "none"})
    print(f"npz load: {npz['load_s']:.1f} s", flush=True)

    client_memmap = run_child({**folder_spec, "read": "share"})
    client_memory = run_child({**npz_spec, "read": "share"})
    train = {"train_steps": args.train_steps, "warmup": 2, "width": args.width, "threads": args.threads}
    train_memmap = run_child({**folder_spec, **train, "read": "train"})
    train_memory = run_child({**npz_spec, **train, "read": "train"})
    print(
        f"training: folder cache {train_memmap['train_images'] / train_memmap['train_s']:.1f} images/s, "
        f"npz in memory {train_memory['train_images'] / train_memory['train_s']:.1f} images/s",
        flush=True,
    )

    entry_bytes = folder_bytes(cache)
    array_bytes = args.images * args.image_size**2 * 3

    def rate(count: int, seconds: float) -> float | None:
        return round(count / seconds, 1) if seconds > 0 else None

    def train_client(result: dict[str, Any]) -> dict[str, Any]:
        memory = result["memory"]
        return {
            "images_per_s": rate(result["train_images"], result["train_s"]),
            "train_s": round(result["train_s"], 2),
            "peak_rss_mib": mib(memory.get("VmHWM", 0)),
            "end_rss_anon_mib": mib(memory.get("RssAnon", 0)),
            "end_rss_file_mib": mib(memory.get("RssFile", 0)),
        }

    def client(result: dict[str, Any]) -> dict[str, Any]:
        memory = result["memory"]
        return {
            "images_read": result["read_images"],
            "read_s": round(result["read_s"], 3),
            "peak_rss_mib": mib(memory.get("VmHWM", 0)),
            "end_rss_anon_mib": mib(memory.get("RssAnon", 0)),
            "end_rss_file_mib": mib(memory.get("RssFile", 0)),
        }

    return {
        "command": shlex.join([Path(sys.executable).name, *public_argv(sys.argv)]),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "pillow": __import__("PIL").__version__,
        },
        "setup": {
            "images": args.images,
            "generated_side": args.size,
            "image_size": args.image_size,
            "format": args.format,
            "classes": args.classes,
            "folder_mib": mib(written),
            "decoded_array_mib": mib(array_bytes),
            "cache_entry_mib": mib(entry_bytes),
            "npz_mib": mib(npz_path.stat().st_size),
            "npz_compressed": args.npz_compressed,
            "generate_s": round(generate_s, 1),
        },
        "first_load": {"seconds": round(first["load_s"], 3), "images_per_s": rate(first["images"], first["load_s"])},
        "later_load": {
            "seconds": round(later["load_s"], 3),
            "images_per_s": rate(later["images"], later["load_s"]),
            "memmap": later["memmap"],
            "read_all_s": round(later["read_s"], 3),
            "load_and_read_images_per_s": rate(later["images"], later["load_s"] + later["read_s"]),
        },
        "npz_load": {"seconds": round(npz["load_s"], 3), "images_per_s": rate(npz["images"], npz["load_s"])},
        "training": {
            "model": f"SimCLR, resnet18 width {args.width} ({train_memmap['stem']} stem), fp32, "
            f"{args.threads} torch threads",
            "batch": args.batch,
            "steps": train_memmap["train_steps"],
            "memory_mapped_folder": train_client(train_memmap),
            "whole_array_in_memory_npz": train_client(train_memory),
            "folder_over_npz": round(
                (train_memmap["train_images"] / train_memmap["train_s"])
                / (train_memory["train_images"] / train_memory["train_s"]),
                3,
            ),
        },
        "client_share": {
            "share": args.share,
            "batch": args.batch,
            "memory_mapped_folder": client(client_memmap),
            "whole_array_in_memory_npz": client(client_memory),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    setup, machine = result["setup"], result["machine"]
    first, later, npz = result["first_load"], result["later_load"], result["npz_load"]
    share = result["client_share"]
    mapped, held = share["memory_mapped_folder"], share["whole_array_in_memory_npz"]
    machine_line = (
        f"Machine: {machine['cpu']}, {machine['cores']} cores; {machine['platform']}; Python {machine['python']}, "
        f"numpy {machine['numpy']}, Pillow {machine['pillow']}."
    )
    npz_kind = "compressed" if setup["npz_compressed"] else "not compressed"
    setup_line = (
        f"{setup['images']} {setup['format'].upper()} images of {setup['generated_side']} px in {setup['classes']} "
        f"class subfolders ({setup['folder_mib']} MiB), decoded to {setup['image_size']} px: "
        f"{setup['decoded_array_mib']} MiB of pixels; cache entry {setup['cache_entry_mib']} MiB; .npz "
        f"{setup['npz_mib']} MiB ({npz_kind}). Each figure is one fresh process; the OS page cache is warm."
    )
    read_once_s = round(later["seconds"] + later["read_all_s"], 3)
    load_rows = [
        ("folder, first (list + decode + write cache)", first["seconds"], first["images_per_s"]),
        ("folder, later (list + stat + map the cache)", later["seconds"], later["images_per_s"]),
        ("folder, later, and every image read once", read_once_s, later["load_and_read_images_per_s"]),
        (".npz via load_npz (decoded cache off: whole archive read)", npz["seconds"], npz["images_per_s"]),
    ]
    client_rows = [("folder, memory-mapped cache", mapped), (".npz, whole array in memory", held)]
    lines = ["# Image-folder data source", "", f"Command: `{result['command']}`  ", machine_line, "", setup_line, ""]
    lines += ["| load | seconds | images/s |", "|---|---:|---:|"]
    lines += [f"| {name} | {seconds} | {per_s} |" for name, seconds, per_s in load_rows]
    client_line = (
        f"A simulated client's share, {share['share']:.0%} of the images ({mapped['images_read']}), selected as "
        "`client_images` selects a partition and read in random batches"
    )
    lines += [
        "",
        f"{client_line} of {share['batch']}:",
        "",
        "| client process | read s | peak RSS MiB | RSS anon at end MiB | RSS file-backed at end MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {row['read_s']} | {row['peak_rss_mib']} | {row['end_rss_anon_mib']} | {row['end_rss_file_mib']} |"
        for name, row in client_rows
    ]
    train = result["training"]
    lines += [
        "",
        (
            f"Local training on every loaded image, as a node with its own data trains ({train['model']}, batch "
            f"{train['batch']}, {train['steps']} timed steps after 2 untimed ones): the memory-mapped images are read a "
            f"batch at a time, the .npz's array is used as it is in memory. Folder over .npz: "
            f"{train['folder_over_npz']:.3f} of the training throughput."
        ),
        "",
        "| training process | images/s | peak RSS MiB | RSS anon at end MiB | RSS file-backed at end MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, key in (
        ("folder, memory-mapped cache", "memory_mapped_folder"),
        (".npz, whole array in memory", "whole_array_in_memory_npz"),
    ):
        row = train[key]
        lines.append(
            f"| {name} | {row['images_per_s']} | {row['peak_rss_mib']} | {row['end_rss_anon_mib']} | "
            f"{row['end_rss_file_mib']} |"
        )
    note = (
        "File-backed RSS is the pages of the cache file the process touched: page cache shared by every client "
        "process of the machine and reclaimable by the kernel; anonymous RSS is the process's own memory."
    )
    lines += ["", note, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=96, help="side of the generated images (px)")
    parser.add_argument("--image-size", type=int, default=0, help="side decoded to (default: --size)")
    parser.add_argument("--format", choices=("jpeg", "png"), default="jpeg")
    parser.add_argument("--classes", type=int, default=10, help="class subfolders (1: a flat, unlabelled folder)")
    parser.add_argument("--share", type=float, default=0.5, help="a client's share of the images")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--npz-compressed", action="store_true")
    parser.add_argument("--train-steps", type=int, default=30, help="timed local training steps (batch --batch)")
    parser.add_argument("--width", type=float, default=0.25, help="the trained ResNet-18's width")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the training child")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed afterwards")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    args.image_size = args.image_size or args.size
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="bench-folder-") as temporary:
            result = measure(args, Path(temporary))
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = measure(args, args.workdir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "folder_source.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.results_dir / "folder_source.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
