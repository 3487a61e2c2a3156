"""FLESD communication and memory: upload bytes per client, server ensemble memory, client payload cost.

Writes ``benchmarks/results/flesd_bytes_memory.json`` and ``.md`` (nothing is asserted; figures are
reported). Representations are random 128-d unit vectors (seeded), not a trained model's: bytes do not
depend on the values, and memory and time depend only on N, k and the number of clients. Three parts:

1. upload bytes per client per round for a public set of N images, from real payloads
   (``client_similarity_payload``) in every transport mode (dense fp32, dense fp16, top-1 %, top-10 %),
   counted both as raw array bytes (``payload_bytes``) and as Flower counts them
   (``to_array_record(payload).count_bytes()``: serialised .npy data plus headers plus key names),
   against the CIFAR ResNet-18 + projector (512 -> 512 -> 128) weights a FedAvg client uploads, counted
   the same way;
2. peak memory and time of the server's ensemble (``ensemble_similarity`` fed by a generator that decodes
   one ``ArrayRecord`` at a time, as ``strategies.flesd.FLESD.aggregate`` does) of K clients' uploads;
3. peak memory and time of a client's ``client_similarity_payload`` (top-10 % against dense).

Each case of parts 2 and 3 runs in a fresh process (multiprocessing "spawn"): its inputs are built first,
freed memory is handed back to the OS (``malloc_trim``), then the peak resident set (VmHWM) is reset by
writing "5" to /proc/self/clear_refs, so the peak measured is that of the operation alone (if the reset
is refused, the absolute peak is reported beside the baseline).

Usage: python benchmarks/bench_flesd.py [--quick] [--out PATH_WITHOUT_EXTENSION]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedssl_wire import from_array_record, to_array_record
from ssl_models.factory import split_state, state_to_numpy
from ssl_models.federated.similarity import (
    DENSE_FP16,
    DENSE_FP32,
    TOPK,
    client_similarity_payload,
    ensemble_similarity,
    index_dtype,
    payload_bytes,
    topk_count,
)
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone

RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20
TARGET_TEMPERATURE = 0.1  # FLESD's default tau_T (strategies.flesd)

# (label, encode mode, top-k fraction) of every upload format measured in part 1
UPLOAD_FORMATS: tuple[tuple[str, str, float | None], ...] = (
    ("dense fp32", DENSE_FP32, None),
    ("dense fp16", DENSE_FP16, None),
    ("top-1% (fp16 + uint index)", TOPK, 0.01),
    ("top-10% (fp16 + uint index)", TOPK, 0.10),
)


# ------------------------------------------------------------------------------------------- helpers
def random_representations(n: int, dim: int, seed: int) -> torch.Tensor:
    """(n, dim) float32 rows of unit length, seeded: a stand-in for a client's public-set projections."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, dim, generator=generator)
    return rows / rows.norm(dim=1, keepdim=True)


def flower_bytes(state: dict[str, np.ndarray]) -> int:
    """Bytes as the app counts them on the wire: ``ArrayRecord.count_bytes()`` of ``to_array_record``."""
    return int(to_array_record(state).count_bytes())


def proc_status_kib(field: str) -> int:
    """A ``VmXXX`` field of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def release_freed_memory() -> None:
    """Collect garbage and return glibc's free heap pages to the OS, so they cannot hide later growth."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs "5"); True if the kernel accepted it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return proc_status_kib("VmHWM") <= proc_status_kib("VmRSS") + 1024  # reset took effect (1 MiB slack)


class PeakWindow:
    """Baseline RSS, then the peak RSS of what runs inside the ``with`` block (bytes), and its wall time."""

    def __enter__(self) -> Self:
        release_freed_memory()
        self.baseline = proc_status_kib("VmRSS") * 1024
        self.reset_ok = reset_peak_rss()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
        self.peak = proc_status_kib("VmHWM") * 1024

    def report(self, n: int) -> dict[str, Any]:
        n2_float32 = 4 * n * n
        delta = self.peak - self.baseline
        return {
            "baseline_rss_mib": self.baseline / MIB,
            "peak_rss_mib": self.peak / MIB,
            "delta_mib": delta / MIB,
            "delta_in_n2_float32": delta / n2_float32,
            "n2_float32_mib": n2_float32 / MIB,
            "seconds": self.seconds,
            "peak_reset_ok": self.reset_ok,
        }


def warm_up(mode: str, fraction: float | None, dim: int, server: bool) -> None:
    """The same path on 64 images first, so one-time costs (thread pools, kernels) stay out of the window."""
    payload = client_similarity_payload(random_representations(64, dim, seed=99), mode, fraction)
    if server:
        ensemble_similarity(iter([from_array_record(to_array_record(payload))]), TARGET_TEMPERATURE, n=64)


def in_fresh_process(function, *args: Any) -> dict[str, Any]:
    """``function(*args)`` in a new interpreter (spawn), so no earlier allocation inflates its figures."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


# ------------------------------------------------------------------------------------------- part 1
def model_upload(proj_hidden_dim: int = 512, proj_out_dim: int = 128) -> dict[str, Any]:
    """What a FedAvg client uploads for SimCLR on a CIFAR ResNet-18: the shared (online) state dict."""
    torch.manual_seed(0)
    backbone, feature_dim = build_backbone("resnet18", 1.0)
    method = build_method("simclr", backbone, feature_dim, proj_hidden_dim=proj_hidden_dim, proj_out_dim=proj_out_dim)
    shared, local = split_state(method, method.shared_prefixes())
    state = state_to_numpy(shared)
    return {
        "model": f"resnet18 (width 1.0) + projector {feature_dim}->{proj_hidden_dim}->{proj_out_dim}",
        "arrays": len(state),
        "not_uploaded_arrays": len(local),
        "parameters": int(sum(p.numel() for p in method.parameters())),
        "raw_bytes": payload_bytes(state),
        "flower_bytes": flower_bytes(state),
    }


def upload_bytes(n: int, dim: int, model_flower_bytes: int) -> list[dict[str, Any]]:
    """One row per upload format: real payload of N random representations, its raw and Flower bytes."""
    representations = random_representations(n, dim, seed=0)
    rows = []
    for label, mode, fraction in UPLOAD_FORMATS:
        t0 = time.perf_counter()
        payload = client_similarity_payload(representations, mode, fraction)
        seconds = time.perf_counter() - t0
        flower = flower_bytes(payload)
        rows.append(
            {
                "n": n,
                "format": label,
                "mode": mode,
                "fraction": fraction,
                "k_per_row": topk_count(n, fraction) if mode == TOPK else n,
                "dtypes": {key: str(array.dtype) for key, array in payload.items()},
                "raw_bytes": payload_bytes(payload),
                "flower_bytes": flower,
                "flower_mib": flower / MIB,
                "ratio_to_resnet18": flower / model_flower_bytes,
                "payload_s": seconds,
            }
        )
        del payload
    return rows


# ------------------------------------------------------------------------------------------- part 2
def server_ensemble_case(
    n: int, num_clients: int, mode: str, fraction: float | None, dim: int, threads: int
) -> dict[str, Any]:
    """Run in a fresh process: K uploads as ArrayRecords (the server's replies), then the measured ensemble."""
    torch.set_num_threads(threads)
    records = []
    for client in range(num_clients):  # built before the measurement window: the replies already received
        payload = client_similarity_payload(random_representations(n, dim, seed=client), mode, fraction)
        records.append(to_array_record(payload))
        del payload
    received_mib = sum(r.count_bytes() for r in records) / MIB
    warm_up(mode, fraction, dim, server=True)
    with PeakWindow() as window:
        # as FLESD.aggregate: decode one upload at a time while the ensemble accumulates
        payloads = (from_array_record(record) for record in records)
        ensemble = ensemble_similarity(payloads, TARGET_TEMPERATURE, sparsify="zero_probability", n=n)
    assert ensemble.shape == (n, n) and bool(torch.isfinite(ensemble[:8]).all())
    return {
        "n": n,
        "clients": num_clients,
        "mode": mode,
        "fraction": fraction,
        "received_uploads_mib": received_mib,
        **window.report(n),
    }


# ------------------------------------------------------------------------------------------- part 3
def client_payload_case(n: int, mode: str, fraction: float | None, dim: int, threads: int) -> dict[str, Any]:
    """Run in a fresh process: a client's ``client_similarity_payload``, then its ArrayRecord, measured."""
    torch.set_num_threads(threads)
    representations = random_representations(n, dim, seed=0)
    warm_up(mode, fraction, dim, server=False)
    with PeakWindow() as window:
        payload = client_similarity_payload(representations, mode, fraction)
    result = {
        "n": n,
        "mode": mode,
        "fraction": fraction,
        "payload_mib": payload_bytes(payload) / MIB,
        **window.report(n),
    }
    record = to_array_record(payload)  # what the client then sends: its serialised copy
    result["peak_with_record_mib"] = proc_status_kib("VmHWM") * 1024 / MIB
    result["delta_with_record_in_n2_float32"] = (
        (result["peak_with_record_mib"] - result["baseline_rss_mib"]) * MIB / (4 * n * n)
    )
    del record
    return result


# ------------------------------------------------------------------------------------------- report
def formula_bytes(n: int, mode: str, fraction: float | None) -> int:
    """Raw upload bytes from the transport table of ``ssl_models.federated.similarity`` (checked against part 1)."""
    if mode == DENSE_FP32:
        return 4 * n * n
    if mode == DENSE_FP16:
        return 2 * n * n
    return n * topk_count(n, fraction) * (2 + index_dtype(n).itemsize)


def break_even_n(mode: str, fraction: float | None, model_bytes: int) -> int:
    """Largest public-set size N whose upload is at most ``model_bytes`` (bisection; bytes grow with N)."""
    low, high = 1, 1 << 20
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if formula_bytes(mid, mode, fraction) <= model_bytes else (low, mid - 1)
    return low


def span(values) -> str:
    """ "a to b", or "a" when every value rounds to the same figure."""
    values = sorted(values)
    low, high = f"{values[0]:.2f}", f"{values[-1]:.2f}"
    return low if low == high else f"{low} to {high}"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """A few sentences read off the figures (computed, so they follow the numbers)."""
    lines = ["## Reading these figures", ""]
    if "upload_bytes" in results:
        model = results["model_upload"]
        for r in results["upload_bytes"]:
            assert r["raw_bytes"] == formula_bytes(r["n"], r["mode"], r["fraction"]), r
        lines.append(
            "- Break-even public-set size (upload = ResNet-18 + projector weights, raw bytes): "
            + ", ".join(
                f"{label} N = {break_even_n(mode, fraction, model['raw_bytes']):,}"
                for label, mode, fraction in UPLOAD_FORMATS
            )
            + ". Dense uploads grow as N^2, top-k as k N with "
            "k = 0.1 N or 0.01 N, so also quadratically; the raw byte counts match the formula table of "
            "`ssl_models/federated/similarity.py` exactly, and Flower adds 134 to 269 bytes of headers and key names."
        )
    server = results.get("server_ensemble", [])
    if server:
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for r in server:
            by_mode.setdefault(mode_label(r["mode"], r["fraction"]), []).append(r)
        parts = [
            f"{label}: {span(r['delta_in_n2_float32'] for r in rows)} N^2 float32 for K = "
            f"{', '.join(str(r['clients']) for r in rows)}"
            for label, rows in by_mode.items()
        ]
        n = server[0]["n"]
        lines.append(
            "- Server ensemble, growth over the baseline: " + "; ".join(parts) + ". It hardly depends on "
            "K: the accumulator (1.0) plus one decoded upload (top-10 %: 0.1; dense fp16 decoded from "
            f"its record: 0.5) plus a float32 row block (1,024 rows: {min(1.0, 1024 / n):.2f} at "
            f"N = {n:,}). The K received uploads themselves sit in the baseline (the replies), K times "
            "the per-client upload."
        )
    client = {mode_label(r["mode"], r["fraction"]): r for r in results.get("client_payload", [])}
    if "top-10%" in client and DENSE_FP32 in client:
        top, dense = client["top-10%"], client[DENSE_FP32]
        lines.append(
            f"- Client: the top-10 % payload peaks at {top['delta_in_n2_float32']:.2f} N^2 float32 "
            f"({top['delta_mib']:.0f} MiB) against {dense['delta_in_n2_float32']:.2f} "
            f"({dense['delta_mib']:.0f} MiB) for dense fp32 (which holds the matrix), "
            f"{dense['delta_with_record_in_n2_float32']:.2f} once its ArrayRecord copy is made; "
            f"top-k takes {top['seconds']:.2f} s against {dense['seconds']:.2f} s "
            f"({top['seconds'] / dense['seconds']:.1f}x; k = {topk_count(top['n'], top['fraction']):,} "
            "per row)."
        )
    return lines + [""]


def fmt_bytes_table(rows: list[dict[str, Any]], model: dict[str, Any]) -> list[str]:
    lines = [
        "| N | mode | k per row | dtypes | raw bytes | Flower bytes | MiB | ratio to ResNet-18 weights |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dtypes = ", ".join(f"{k} {v}" for k, v in r["dtypes"].items())
        lines.append(
            f"| {r['n']:,} | {r['format']} | {r['k_per_row']:,} | {dtypes} | {r['raw_bytes']:,} | "
            f"{r['flower_bytes']:,} | {r['flower_mib']:.2f} | {r['ratio_to_resnet18']:.3f} |"
        )
    lines.append(
        f"| - | FedAvg: ResNet-18 + projector weights (fp32) | - | float32 (+ int64 BN counters) | "
        f"{model['raw_bytes']:,} | {model['flower_bytes']:,} | {model['flower_bytes'] / MIB:.2f} | 1.000 |"
    )
    return lines


def fmt_memory_table(rows: list[dict[str, Any]], first_col: str, first) -> list[str]:
    lines = [
        f"| {first_col} | baseline RSS MiB | peak RSS MiB | peak - baseline MiB | in N^2 float32 | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {first(r)} | {r['baseline_rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
            f"{r['delta_mib']:.0f} | {r['delta_in_n2_float32']:.2f} | {r['seconds']:.2f} |"
        )
    return lines


def mode_label(mode: str, fraction: float | None) -> str:
    return f"top-{round(100 * fraction)}%" if mode == TOPK else mode


def write_markdown(results: dict[str, Any], path: Path) -> None:
    lines = [
        f"# FLESD upload bytes and memory ({results['date']})",
        "",
        f"Machine: {results['machine']}. Command: `{results['command']}`",
        "",
        f"Load average (1 min) at start {results['load_start']:.2f}, at end {results['load_end']:.2f}"
        f" on {os.cpu_count()} cores."
        + (
            " Another job was running at the same time: times may be inflated "
            "(memory figures are per process and unaffected)."
            if max(results["load_start"], results["load_end"]) > 1.5
            else ""
        ),
        "",
        (
            "Representations are random 128-d unit vectors (seeded), not a trained model's: bytes depend only on "
            "N and k, and memory and time only on N, k and K."
        ),
        "",
    ]
    model = results.get("model_upload")
    if "upload_bytes" in results:
        lines += [
            "## 1. Upload per client per round",
            "",
            (
                f"FedAvg reference: {model['model']}, {model['parameters']:,} parameters, "
                f"{model['arrays']} arrays (SimCLR uploads its whole state; {model['not_uploaded_arrays']} "
                "arrays stay local)."
            ),
            "",
            *fmt_bytes_table(results["upload_bytes"], model),
            "",
            (
                "Raw bytes: the arrays' `nbytes` (`payload_bytes`). Flower bytes: "
                "`to_array_record(payload).count_bytes()`, the app's count (serialised .npy data with its "
                "header, plus key names); the ratio uses Flower bytes on both sides. Top-k keeps "
                "k = floor(fraction * N) + 1 entries per row (the image itself is free), values float16 and "
                "indices in the smallest unsigned type holding N - 1 (uint16 up to N = 65,536)."
            ),
            "",
            (
                "Download: a client of the global architecture receives the distilled model each round, the "
                "same bytes as a FedAvg download (the ResNet-18 row above); a client of another architecture "
                "receives nothing but the round's config."
            ),
            "",
        ]
    if "server_ensemble" in results:
        n = results["server_ensemble"][0]["n"]
        lines += [
            f"## 2. Server: ensembling the uploads of K clients (N = {n:,})",
            "",
            (
                "Each case in a fresh process. Before the measurement the process holds the K received "
                "ArrayRecords (the replies, as the server does: they are part of the baseline); the window "
                "covers decoding one upload at a time through a generator and `ensemble_similarity` "
                f"(tau_T = {TARGET_TEMPERATURE}, paper sparsification). N^2 float32 = "
                f"{4 * n * n / 1e6:,.0f} MB ({4 * n * n / MIB:,.0f} MiB)."
            ),
            "",
            *fmt_memory_table(
                results["server_ensemble"],
                "uploads",
                lambda r: (
                    f"K = {r['clients']}, {mode_label(r['mode'], r['fraction'])} "
                    f"({r['received_uploads_mib']:.1f} MiB received)"
                ),
            ),
            "",
            (
                "Expected: the float32 (N, N) accumulator (1.0 N^2 float32) plus one decoded upload plus one "
                "row block; independent of K."
            ),
            "",
        ]
    if "client_payload" in results:
        n = results["client_payload"][0]["n"]
        lines += [
            f"## 3. Client: computing the upload (`client_similarity_payload`, N = {n:,})",
            "",
            *fmt_memory_table(
                results["client_payload"],
                "mode",
                lambda r: f"{mode_label(r['mode'], r['fraction'])} ({r['payload_mib']:.1f} MiB payload)",
            ),
            "",
            "| mode | peak incl. `to_array_record` MiB | in N^2 float32 |",
            "|---|---|---|",
        ]
        lines += [
            f"| {mode_label(r['mode'], r['fraction'])} | {r['peak_with_record_mib']:.0f} | "
            f"{r['delta_with_record_in_n2_float32']:.2f} |"
            for r in results["client_payload"]
        ]
        lines += [
            "",
            (
                "The top-k path computes similarities 1,024 rows at a time and never holds the (N, N) "
                "matrix; the dense path holds it (float32) before encoding."
            ),
            "",
        ]
    lines += [
        (
            f"Peak reset via /proc/self/clear_refs accepted in every case: {results.get('peak_reset_ok_all')}. "
            f"Total run time {results['total_s']:.0f} s."
        ),
        "",
    ]
    lines += summary_lines(results)
    path.write_text("\n".join(lines))


def shown_command(argv: list[str]) -> str:
    """The command line without this machine's paths: paths outside the repository by name only."""
    shown = ["benchmarks/bench_flesd.py"]
    for arg in argv:
        if os.path.isabs(arg):
            p = Path(arg)
            arg = str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name
        shown.append(arg)
    return "python " + " ".join(shown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 1,000 everywhere, to check the script itself")
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 5_000], help="public-set sizes for part 1")
    ap.add_argument("--memory-n", type=int, default=10_000, help="public-set size for parts 2 and 3")
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 5], help="K of part 2")
    ap.add_argument("--dim", type=int, default=128, help="representation dimension")
    ap.add_argument("--only", choices=("bytes", "server", "client"), action="append")
    ap.add_argument("--out", default=str(RESULTS / "flesd_bytes_memory"), help="output path without extension")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.memory_n = [1_000], 1_000
    threads = torch.get_num_threads()
    only = set(args.only or ("bytes", "server", "client"))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": shown_command(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {threads} torch threads, torch {torch.__version__}, numpy {np.__version__}",
        "representations": f"random {args.dim}-d unit vectors (seeded)",
        "load_start": os.getloadavg()[0],
    }
    t_start = time.perf_counter()
    if "bytes" in only:
        print("upload bytes ...", flush=True)
        results["model_upload"] = model_upload()
        results["upload_bytes"] = [
            row for n in args.n for row in upload_bytes(n, args.dim, results["model_upload"]["flower_bytes"])
        ]
        print(json.dumps(results["model_upload"]), flush=True)
        for row in results["upload_bytes"]:
            print(json.dumps(row), flush=True)
    if "server" in only:
        results["server_ensemble"] = []
        for mode, fraction in ((TOPK, 0.10), (DENSE_FP16, None)):
            for k in args.clients:
                print(f"server ensemble K={k} {mode_label(mode, fraction)} ...", flush=True)
                row = in_fresh_process(server_ensemble_case, args.memory_n, k, mode, fraction, args.dim, threads)
                results["server_ensemble"].append(row)
                print(json.dumps(row), flush=True)
    if "client" in only:
        results["client_payload"] = []
        for mode, fraction in ((TOPK, 0.10), (DENSE_FP32, None), (DENSE_FP16, None)):
            print(f"client payload {mode_label(mode, fraction)} ...", flush=True)
            row = in_fresh_process(client_payload_case, args.memory_n, mode, fraction, args.dim, threads)
            results["client_payload"].append(row)
            print(json.dumps(row), flush=True)
    cases = results.get("server_ensemble", []) + results.get("client_payload", [])
    results["peak_reset_ok_all"] = all(c["peak_reset_ok"] for c in cases) if cases else None
    results["load_end"] = os.getloadavg()[0]
    results["total_s"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, out.with_suffix(".md"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} ({results['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
