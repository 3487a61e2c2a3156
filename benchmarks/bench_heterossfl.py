"""Hetero-SSFL communication and memory for a 5 000-image RAD: message bytes per form, server memory of K_bar.

Writes ``benchmarks/results/heterossfl_bytes_memory.json`` and ``.md`` (figures are reported, nothing asserted).
Kernels are ``A A^T`` of random (N, 256) representations (seeded): bytes do not depend on the values, and memory
and time only on N and the number of clients. Three parts:

1. bytes per client and round, each way, for every kernel form (``encode_kernel``: dense fp32, dense fp16, top-10 %,
   top-1 %), counted as the app counts them (``to_array_record(payload).count_bytes()``), against the weights a
   FedBYOL client exchanges each way for the paper's encoders (CIFAR ResNet-18 / ResNet-34 with the 4096/2048 BYOL
   heads: online encoder + projector + predictor);
2. server peak memory while forming K_bar from the kernels of K clients kept on disk: the strategy's own code
   (``HeteroSSFL.store_kernel`` writes each client's kernel file, then ``HeteroSSFL.update_kbar`` streams them
   back one at a time, averages and encodes K_bar), each case in a fresh process with the peak RSS (VmHWM)
   reset just before ``update_kbar`` (helpers shared with ``bench_flesd.py``);
3. client peak memory of the alignment term's N x N part: the kernel ``A A^T``, ``mu (1 - CKA(K, K_bar))`` and its
   gradient with respect to ``A`` (the network's share is the usual activations of one RAD chunk).

Usage: python benchmarks/bench_heterossfl.py [--quick] [--n 5000] [--clients 2 5 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_flesd import MIB, PeakWindow, flower_bytes, in_fresh_process, shown_command
from ssl_models.factory import split_state, state_to_numpy
from ssl_models.federated.cka import center_kernel, feature_alignment_loss, kernel_alignment_loss
from ssl_models.federated.kernel_alignment import client_kernel, encode_kernel
from ssl_models.federated.similarity import DENSE_FP16, DENSE_FP32, TOPK
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone

RESULTS = REPO / "benchmarks" / "results"
FEATURE_DIM = 256
FORMS: tuple[tuple[str, str, float | None], ...] = (
    ("dense fp32 (default, the paper)", DENSE_FP32, None),
    ("dense fp16", DENSE_FP16, None),
    ("top-10% (fp16 + uint16 index)", TOPK, 0.10),
    ("top-1% (fp16 + uint16 index)", TOPK, 0.01),
)


def random_kernel(n: int, seed: int) -> torch.Tensor:
    features = torch.randn(n, FEATURE_DIM, generator=torch.Generator().manual_seed(seed))
    return client_kernel(features)


# ------------------------------------------------------------------------------------------------ part 1
def byol_weights(arch: str) -> dict[str, Any]:
    """What a FedBYOL client exchanges each way for ``arch`` (width 1) with the paper's BYOL heads."""
    torch.manual_seed(0)
    backbone, dim = build_backbone(arch, 1.0)
    method = build_method("byol", backbone, dim, proj_hidden_dim=4096, proj_out_dim=2048, pred_hidden_dim=4096)
    shared, _ = split_state(method, method.shared_prefixes())
    state = state_to_numpy(shared)
    return {
        "model": f"{arch} + BYOL projector {dim}->4096->2048 + predictor 2048->4096->2048",
        "parameters": int(sum(v.size for v in state.values())),
        "flower_bytes": flower_bytes(state),
    }


def message_bytes(n: int) -> list[dict[str, Any]]:
    kernel = random_kernel(n, seed=0)
    rows = []
    for label, mode, fraction in FORMS:
        t0 = time.perf_counter()
        payload = encode_kernel(kernel, mode, fraction)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "n": n,
                "form": label,
                "mode": mode,
                "fraction": fraction,
                "dtypes": {k: str(v.dtype) for k, v in payload.items()},
                "raw_bytes": int(sum(v.nbytes for v in payload.values())),
                "flower_bytes": flower_bytes(payload),
                "encode_s": seconds,
            }
        )
        del payload
    return rows


# ------------------------------------------------------------------------------------------------ part 2
def server_case(n: int, clients: int, mode: str, fraction: float | None, threads: int) -> dict[str, Any]:
    """In a fresh process: K client kernels written to the strategy's disk store, then ``update_kbar`` measured."""
    from strategies.heterossfl import HeteroSSFL

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        strategy = HeteroSSFL(
            clients={pid: pid for pid in range(clients)},
            clients_per_round=clients,
            options={"kernel_encoding": mode, **({"topk_fraction": fraction} if fraction else {})},
            state_dir=tmp,
        )
        strategy.init_kernel_store(n)
        for pid in range(clients):  # the uploads of earlier rounds, already on the server's disk
            strategy.store_kernel(pid, encode_kernel(random_kernel(n, seed=pid), mode, fraction), 1, 100)
        on_disk = strategy.kernels.size_bytes()
        with PeakWindow() as window:
            strategy.update_kbar()
        sent = strategy.kbar_record.count_bytes()
    return {
        "n": n,
        "clients": clients,
        "mode": mode,
        "fraction": fraction,
        "kernels_on_disk_mib": on_disk / MIB,
        "kbar_record_mib": sent / MIB,
        **window.report(n),
    }


# ------------------------------------------------------------------------------------------------ part 3
def client_case(n: int, form: str, threads: int) -> dict[str, Any]:
    """In a fresh process: K_bar as received (and, for the feature form, H K_bar H, centred once per round as
    ``KernelAligner`` does), then the alignment term and dL/dA measured, in the feature form (what the client
    runs for the linear kernel) or the Gram form (``kernel_alignment_loss`` on A A^T: the RBF path)."""
    torch.set_num_threads(threads)
    target = random_kernel(n, seed=1)
    centered = center_kernel(target) if form == "feature" else None
    features = torch.randn(n, FEATURE_DIM, generator=torch.Generator().manual_seed(2))
    with PeakWindow() as window:
        a = features.clone().requires_grad_(True)
        if form == "feature":
            loss = 0.5 * feature_alignment_loss(a, centered)
        else:
            loss = 0.5 * kernel_alignment_loss(client_kernel(a), target)
        (grad,) = torch.autograd.grad(loss, a)
    assert grad.shape == a.shape and bool(torch.isfinite(grad).all())
    return {"n": n, "form": form, "feature_dim": FEATURE_DIM, "loss": float(loss.detach()), **window.report(n)}


# ------------------------------------------------------------------------------------------------ report
def label(mode: str, fraction: float | None) -> str:
    return f"top-{round(100 * fraction)}%" if mode == TOPK else mode


def write_markdown(results: dict[str, Any], path: Path) -> None:
    n = results["n"]
    n2 = 4 * n * n
    lines = [
        f"# Hetero-SSFL bytes and memory, RAD of {n:,} images ({results['date']})",
        "",
        (
            f"Machine: {results['machine']}. Command: `{results['command']}`. Load average (1 min) at start "
            f"{results['load_start']:.2f}, at end {results['load_end']:.2f} on {os.cpu_count()} cores: times are "
            "measured under load; memory figures are per process."
        ),
        "",
        (
            f"Kernels are A A^T of random (N, {FEATURE_DIM}) representations (seeded): bytes depend only on N and "
            f"the form. N^2 float32 = {n2 / 1e6:,.0f} MB ({n2 / MIB:,.1f} MiB)."
        ),
        "",
    ]
    if "message_bytes" in results:
        models = results["fedbyol_weights"]
        lines += [
            "## 1. Bytes per client and round, each way",
            "",
            (
                "The same form travels both ways: the client's kernel K_k up, K_bar down (round 1 has no K_bar: "
                "0 bytes down). Counted as the app counts them (`ArrayRecord.count_bytes()`: arrays + headers + "
                "key names); the raw column is the arrays' `nbytes`."
            ),
            "",
            "| N | form | dtypes | raw bytes | app bytes | MiB | vs FedBYOL ResNet-18 | vs FedBYOL ResNet-34 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        r18, r34 = models["resnet18"]["flower_bytes"], models["resnet34"]["flower_bytes"]
        for r in results["message_bytes"]:
            dtypes = ", ".join(f"{k} {v}" for k, v in r["dtypes"].items())
            lines.append(
                f"| {r['n']:,} | {r['form']} | {dtypes} | {r['raw_bytes']:,} | {r['flower_bytes']:,} | "
                f"{r['flower_bytes'] / MIB:.2f} | {r['flower_bytes'] / r18:.2f}x | "
                f"{r['flower_bytes'] / r34:.2f}x |"
            )
        for m in models.values():
            lines.append(
                f"| - | FedBYOL weights: {m['model']} ({m['parameters']:,} values) | float32 | - | "
                f"{m['flower_bytes']:,} | {m['flower_bytes'] / MIB:.2f} | - | - |"
            )
        dense = next(r for r in results["message_bytes"] if r["n"] == n and r["mode"] == DENSE_FP32)
        lines += [
            "",
            (
                f"Per round with the paper's federations at N = {n:,}, dense fp32 (up + down, every sampled "
                "client; the same whatever the encoders):"
            ),
            "",
            "| federation | clients per round | MiB per round, up + down | FedBYOL ResNet-34, MiB |",
            "|---|---|---|---|",
        ]
        for total, per_round in ((5, 5), (20, 5), (100, 10)):
            lines.append(
                f"| {total} clients | {per_round} | {2 * per_round * dense['flower_bytes'] / MIB:,.0f} | "
                f"{2 * per_round * r34 / MIB:,.0f} |"
            )
        lines.append("")
    if "server" in results:
        lines += [
            f"## 2. Server: K_bar from the kernels of K clients on disk (N = {n:,})",
            "",
            (
                "Each case in a fresh process; the window covers `HeteroSSFL.update_kbar`: stream each client's "
                "latest kernel from its file, add it into a float32 (N, N) accumulator row block by row block, "
                "then encode K_bar and build the ArrayRecord that is sent. The kernels themselves stay on disk."
            ),
            "",
            (
                "| clients K | form | kernels on disk MiB | K_bar record MiB | baseline RSS MiB | peak RSS MiB | "
                "peak - baseline MiB | in N^2 float32 | s (under load) |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["server"]:
            lines.append(
                f"| {r['clients']} | {label(r['mode'], r['fraction'])} | {r['kernels_on_disk_mib']:,.0f} | "
                f"{r['kbar_record_mib']:.1f} | {r['baseline_rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
                f"{r['delta_mib']:.0f} | {r['delta_in_n2_float32']:.2f} | {r['seconds']:.1f} |"
            )
        by_mode: dict[str, list[float]] = {}
        for r in results["server"]:
            by_mode.setdefault(label(r["mode"], r["fraction"]), []).append(r["delta_in_n2_float32"])
        lines += [
            "",
            "Growth over the baseline, by form: "
            + "; ".join(
                f"{m}: {min(v):.2f} to {max(v):.2f} N^2 float32 for K = "
                f"{', '.join(str(r['clients']) for r in results['server'] if label(r['mode'], r['fraction']) == m)}"
                for m, v in by_mode.items()
            )
            + ". Flat in K: the accumulator (1.0), one client's kernel as read "
            "from disk (fp32 1.0, fp16 0.5, top-n% small), the encoded K_bar and its serialised record.",
            "",
        ]
    if "client" in results:
        lines += [
            "## 3. Client: the alignment term's N x N part",
            "",
            (
                f"A ({n:,}, {FEATURE_DIM}) float32; the window covers 0.5 (1 - CKA(A A^T, K_bar)) and dL/dA. The "
                "received K_bar (1.0 N^2 float32) and, for the feature form, H K_bar H (1.0, centred once per "
                "round) are in the baseline. With `refresh: epoch` this runs once per local epoch; the network's "
                "backward then runs chunk by chunk of `rad_forward_batch` RAD images."
            ),
            "",
            "| form | peak - baseline MiB | in N^2 float32 | s (under load) |",
            "|---|---|---|---|",
        ]
        for c in results["client"]:
            what = (
                "feature form (linear kernel, what clients run)"
                if c["form"] == "feature"
                else "Gram form on A A^T (the RBF-kernel path)"
            )
            lines.append(f"| {what} | {c['delta_mib']:.0f} | {c['delta_in_n2_float32']:.2f} | {c['seconds']:.1f} |")
        lines.append("")
    lines.append(
        f"Total run time {results['total_s']:.0f} s. Peak reset accepted in every case: "
        f"{results.get('peak_reset_ok_all')}."
    )
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 500 and K = 2, 3: checks the script itself")
    ap.add_argument("--n", type=int, default=5000, help="RAD size")
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 5, 20], help="K of part 2")
    ap.add_argument("--out", default=str(RESULTS / "heterossfl_bytes_memory"), help="output path without extension")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.clients = 500, [2, 3]
    threads = torch.get_num_threads()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "n": args.n,
        "command": shown_command(sys.argv[1:] if argv is None else argv).replace("bench_flesd", "bench_heterossfl"),
        "machine": f"{platform.machine()}, {threads} torch threads, torch {torch.__version__}",
        "load_start": os.getloadavg()[0],
    }
    t0 = time.perf_counter()
    print("message bytes ...", flush=True)
    results["fedbyol_weights"] = {arch: byol_weights(arch) for arch in ("resnet18", "resnet34")}
    results["message_bytes"] = [row for n in sorted({args.n, 1000}, reverse=True) for row in message_bytes(n)]
    results["server"] = []
    for mode, fraction in ((DENSE_FP32, None), (DENSE_FP16, None), (TOPK, 0.10)):
        for k in args.clients:
            print(f"server K_bar, K={k} {label(mode, fraction)} ...", flush=True)
            row = in_fresh_process(server_case, args.n, k, mode, fraction, threads)
            results["server"].append(row)
            print(json.dumps(row), flush=True)
    print("client alignment term ...", flush=True)
    results["client"] = [in_fresh_process(client_case, args.n, form, threads) for form in ("feature", "gram")]
    cases = results["server"] + results["client"]
    results["peak_reset_ok_all"] = all(c["peak_reset_ok"] for c in cases)
    results["load_end"] = os.getloadavg()[0]
    results["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
