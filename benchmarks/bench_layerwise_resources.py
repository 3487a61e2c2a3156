"""Client resources of the layer-wise strategies against end-to-end FedMoCoV3, on the LW-FedSSL paper's schedule.

Writes ``benchmarks/results/layerwise_resources.json`` and ``.md`` (figures are reported, nothing asserted beyond the
consistency checks named below). The schedule is the paper configs' (``configs/lwfedssl/*.yaml``): ViT-Tiny/4 at
width 1.0 grown one block per stage, 12 stages x 15 rounds = 180 rounds, 10 clients in every round, 3 local epochs,
MoCo v3 with heads hidden 4096 / out 256, AdamW. Five variants: FedMoCoV3 (``strategy: fedssl``, all 12 blocks train
and travel), LW-FedSSL, FedMoCo-LW, Prog-FedSSL and FLL+DD (depth dropout 0.5).

1. **Compute, per client and stage** (one local training step, at ``--batch`` images; the paper trains at 1024):
   ``ssl_models.federated.layerwise.resource_account``, the call a layer-wise client makes before training
   (``client_app/rounds/layerwise.py: layerwise_round``), on the model the client builds for that stage: FLOPs per sample
   (image, both views) of the forward and of the backward that actually runs, with CPU attention counted, plus, for
   LW-FedSSL, the frozen global copy's forward for the alignment term; ``forward / 2`` (the fvcore-equivalent), and
   the same without the attention matmuls (``training_step_flops`` / ``forward_flops`` with
   ``count_cpu_attention=False``: what fvcore's tracing, which drops ``scaled_dot_product_attention``, would see);
   FLL+DD's expected FLOPs at its depth-dropout rate; the analytic training memory (parameters, buffers, gradients,
   AdamW state, saved activations measured with ``saved_tensors_hooks``; LW-FedSSL's global copy included).
   FedMoCoV3 is the same call on the 12-block model with everything trainable (what the layer-wise strategies
   report as ``resources.reference_e2e``). The figures are taken in worker processes (``worker_pool`` says why).
2. **Bytes per client over the run**: the strategies themselves (``get_strategy_class(...)``: ``configure_train``,
   ``aggregate_train``, LW-FedSSL's server-side calibration included, on a tiny synthetic auxiliary set) run with
   fake client replies that upload exactly the round's trained entries, on the paper configs' exact parameter
   shapes; the bytes are the strategy's own per-client records (``bytes_down_encoder`` ...; Flower's
   ``ArrayRecord.count_bytes()``). To stay CPU-cheap the schedule is simulated with 3 rounds per stage and
   ``--sim-clients`` clients (every client in every round, so every client's figures are equal, which is checked);
   a stage's second and third rounds must send the same bytes (checked), and the 180-round totals are the first
   round of each stage plus (R_s - 1) times its later rounds. FedMoCoV3: ``strategy: fedssl`` for 2 rounds, x 180.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_layerwise_resources.py [--batch 64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import sys
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import flwr
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedssl_wire import from_array_record, to_array_record
from server_app.experiment import load_experiment
from ssl_models.accounting import forward_flops, training_step_flops
from ssl_models.data.splits import federated_split, load_experiment_data
from ssl_models.factory import build_ssl_model, reset_target_from_online, split_state, state_to_numpy
from ssl_models.federated.layerwise import (
    IMAGE_SHAPE,
    RepresentationAligner,
    build_layerwise_model,
    configure_local_model,
    resource_account,
    stage_rounds,
)
from strategies import get_strategy_class
from strategies.layerwise import entry_bytes

RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20
GB = 1e9
VARIANTS: tuple[str, ...] = ("fedmocov3", "lwfedssl", "fedmoco_lw", "prog_fedssl", "fll_dd")
CONFIGS = {
    "fedmocov3": "configs/lwfedssl/fedmocov3.yaml",
    "lwfedssl": "configs/lwfedssl/lwfedssl.yaml",
    "fedmoco_lw": "configs/lwfedssl/fedmoco-lw.yaml",
    "prog_fedssl": "configs/lwfedssl/prog-fedssl.yaml",
    "fll_dd": "configs/lwfedssl/fll-dd.yaml",
}
LABELS = {
    "fedmocov3": "FedMoCoV3",
    "lwfedssl": "LW-FedSSL",
    "fedmoco_lw": "FedMoCo-LW",
    "prog_fedssl": "Prog-FedSSL",
    "fll_dd": "FLL+DD",
}
BYTE_FIELDS = ("bytes_down_encoder", "bytes_down_heads", "bytes_up_encoder", "bytes_up_heads")
SIM_ROUNDS_PER_STAGE = 3
# The pinned (calibration) version's claims, FedMoCoV3 / X, and v4's Table 2 (batch 512, no calibration;
# the arXiv v4 text): memory 8.72 / 2.61 / 8.69 GB, FLOPs 586 / 139 / 318 G, communication 8.40 / 1.66 / 5.04 GB.
PAPER = {
    "lwfedssl": {"memory": 3.3, "flops": 2.1, "comm": 3.2, "down": 1.8, "up": 12.0},
    "prog_fedssl": {"memory": 1.0, "flops": 1.8, "comm": 1.8},  # memory: "the same as end-to-end training"
}
V4_TABLE2 = {"fedmocov3": (8.72, 586.0, 8.40), "lwfedssl": (2.61, 139.0, 1.66), "prog_fedssl": (8.69, 318.0, 5.04)}


def experiment(variant: str, **overrides: Any):
    """The paper config of ``variant`` (synthetic data: nothing here looks at pixels)."""
    run_config = {
        "config": CONFIGS[variant],
        "data.dataset": "synthetic",
        "data.synthetic_train": 40,
        "data.synthetic_test": 10,
        **overrides,
    }
    return load_experiment(run_config)[0]


def trainable_mode(variant: str) -> str:
    return "all" if variant in ("fedmocov3", "prog_fedssl") else "last_block"


# ------------------------------------------------------------------------------------------------ part 1
def client_step(cfg, variant: str, stage: int, batch: int) -> dict[str, float]:
    """One client's per-step figures at ``stage``, set up as ``layerwise_round`` sets up its model."""
    o = cfg.strategy.options
    method = build_layerwise_model(cfg, stage, seed=cfg.seed)
    reset_target_from_online(method)
    configure_local_model(method, trainable_mode(variant), float(o.get("depth_dropout", 0.0)), dropout_seed=cfg.seed)
    alpha = float(o.get("alpha", 0.0))
    aligner = (
        RepresentationAligner(method.backbone, alpha, float(o.get("align_temperature", 0.2))) if alpha > 0 else None
    )
    t = cfg.train
    t0 = time.perf_counter()
    figures = resource_account(
        method, optimizer=t.optimizer, batch_size=batch, sgd_momentum=t.momentum, device="cpu", aligner=aligner
    )
    # fvcore's convention: forward only, attention matmuls dropped (its tracing skips scaled_dot_product_attention);
    # like resource_account, a step that skips no block (FLL+DD's rate is restored after)
    rate = float(method.backbone.depth_dropout)
    method.backbone.set_depth_dropout(0.0)
    plain = training_step_flops(method, IMAGE_SHAPE, batch_size=2, count_cpu_attention=False)
    method.backbone.set_depth_dropout(rate)
    align_plain = (
        forward_flops(aligner.global_backbone, IMAGE_SHAPE, 2, count_cpu_attention=False)
        if aligner is not None
        else 0.0
    )
    figures["flops_fvcore_no_attention"] = (plain["forward"] + align_plain) / 2.0
    figures["seconds"] = time.perf_counter() - t0
    figures["stage"] = stage
    return figures


def worker_pool(fresh_per_task: bool) -> ProcessPoolExecutor:
    """Processes for ``client_step``. ``ssl_models.accounting.saved_activation_bytes`` (torch 2.14) leaves every
    measured step's saved activations alive after it returns: its pack hook returns the tensor itself, so a saved
    output and its grad_fn hold each other in a cycle Python's garbage collector cannot see. So the figures are
    taken in worker processes: one for all stages of a last_block variant (one block's activations left per
    step), a fresh one per figure where everything trains. The figures are the same either way."""
    return ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        max_tasks_per_child=1 if fresh_per_task else None,
    )


def _step_task(variant: str, stage: int, batch: int, threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    return client_step(experiment(variant), variant, stage, batch)


def compute_part(variant: str, batch: int, stages: int, log) -> list[dict[str, float]]:
    threads = torch.get_num_threads()
    with worker_pool(trainable_mode(variant) == "all") as pool:
        if variant == "fedmocov3":  # the full model every round
            row = pool.submit(_step_task, variant, stages, batch, threads).result()
            log(f"  {variant}: {row['flops_total'] / 1e9:.3f} GFLOP, {row['mem_total'] / MIB:.0f} MiB")
            return [dict(row, stage=s) for s in range(1, stages + 1)]
        rows = []
        for s in range(1, stages + 1):
            rows.append(pool.submit(_step_task, variant, s, batch, threads).result())
            log(
                f"  {variant} stage {s}: {rows[-1]['flops_total'] / 1e9:.3f} GFLOP, "
                f"{rows[-1]['mem_total'] / MIB:.0f} MiB, {rows[-1]['seconds']:.1f} s"
            )
    return rows


def activation_linearity(batch: int) -> dict[str, float]:
    """Saved activations of FedMoCoV3's step at ``batch`` and ``batch / 2``: linear in the batch?"""
    threads = torch.get_num_threads()
    half = max(2, batch // 2)
    with worker_pool(True) as pool:
        a = pool.submit(_step_task, "fedmocov3", 12, half, threads).result()["mem_activations"]
        b = pool.submit(_step_task, "fedmocov3", 12, batch, threads).result()["mem_activations"]
    return {
        "batch_small": half,
        "batch": batch,
        "activations_small": a,
        "activations": b,
        "ratio": b / a,
        "expected_ratio": batch / half,
    }


# ------------------------------------------------------------------------------------------------ part 2
class FakeGrid:
    """Every client's node is connected."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def reply_to(message: Message, upload: dict[str, np.ndarray], pid: int) -> Message:
    metrics = MetricRecord({"partition-id": pid, "num-examples": 100, "train_loss": 1.0, "train_s": 0.1})
    return Message(RecordDict({"arrays": to_array_record(upload), "metrics": metrics}), reply_to=message)


def make_strategy(cfg, clients: int):
    data = load_experiment_data(cfg)
    cls = get_strategy_class(cfg.strategy.name)
    strategy = cls(
        clients={pid: 100 + pid for pid in range(clients)},
        clients_per_round=clients,
        seed=cfg.seed,
        node_wait_s=0.0,
        round_config=lambda r: {"lr": cfg.round_lr(r)},
        options=cfg.strategy.options,
    )
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    initial = build_ssl_model(cfg, seed=cfg.seed)  # what the ServerApp builds
    arrays = to_array_record(state_to_numpy(split_state(initial, strategy.exchange_prefixes(initial))[0]))
    return strategy, arrays


def simulate_layerwise(variant: str, clients: int, stages: int, log) -> list[dict[str, Any]]:
    """Every simulated round's per-client bytes, as the strategy records them (all clients equal: checked)."""
    rounds = SIM_ROUNDS_PER_STAGE * stages
    cfg = experiment(
        variant,
        rounds=rounds,
        **{"federation.num_clients": clients, "train.batch_size": 4, "train.max_steps_per_epoch": 1},
    )
    strategy, arrays = make_strategy(cfg, clients)
    nodes = [100 + pid for pid in range(clients)]
    out = []
    for r in range(1, rounds + 1):
        messages = list(strategy.configure_train(r, arrays, ConfigRecord({"experiment": "{}"}), FakeGrid(nodes)))
        replies = []
        for m in messages:  # a client uploads exactly the round's trained entries
            upload = OrderedDict(
                (k, strategy.global_state[k]) for k in strategy.trained_keys(int(m.content["config"]["lw-stage"]))
            )
            replies.append(reply_to(m, upload, m.metadata.dst_node_id - 100))
        new, _ = strategy.aggregate_train(r, replies)
        arrays = new if new is not None else arrays
        record = strategy.round_records[r]
        per_client = [
            {k: int(c[k]) for k in BYTE_FIELDS} | {"blocks_down": list(c["blocks_down"])}
            for c in sorted(record["clients"], key=lambda c: c["id"])
        ]
        if any(p != per_client[0] for p in per_client) or len(per_client) != clients:
            raise RuntimeError(f"{variant} round {r}: clients' bytes differ: {per_client}")
        out.append({"round": r, "stage": int(record["stage"]), "calibrated": "calibration" in record, **per_client[0]})
        if r % SIM_ROUNDS_PER_STAGE == 0:
            log(
                f"  {variant} round {r}/{rounds} (stage {record['stage']}): down "
                f"{(out[-1]['bytes_down_encoder'] + out[-1]['bytes_down_heads']) / MIB:.1f} MiB"
            )
    return out


def simulate_fedmocov3(clients: int) -> list[dict[str, Any]]:
    """Two rounds of ``strategy: fedssl`` on the 12-block model: the whole model both ways."""
    cfg = experiment("fedmocov3", rounds=2, **{"federation.num_clients": clients})
    strategy, arrays = make_strategy(cfg, clients)
    nodes = [100 + pid for pid in range(clients)]
    out = []
    for r in (1, 2):
        messages = list(strategy.configure_train(r, arrays, ConfigRecord({"experiment": "{}"}), FakeGrid(nodes)))
        replies = [reply_to(m, from_array_record(m.content["arrays"]), m.metadata.dst_node_id - 100) for m in messages]
        rows = []
        for m, reply in zip(messages, replies):
            down_enc, down_heads = entry_bytes(m.content["arrays"])
            up_enc, up_heads = entry_bytes(reply.content["arrays"])
            rows.append(
                {
                    "bytes_down_encoder": down_enc,
                    "bytes_down_heads": down_heads,
                    "bytes_up_encoder": up_enc,
                    "bytes_up_heads": up_heads,
                    "blocks_down": list(range(1, 13)),
                }
            )
        new, _ = strategy.aggregate_train(r, replies)
        arrays = new if new is not None else arrays
        record = strategy.round_records[r]
        # the strategy's own totals agree with the per-entry split
        if record["bytes_down"] != sum(x["bytes_down_encoder"] + x["bytes_down_heads"] for x in rows) or record[
            "bytes_up"
        ] != sum(x["bytes_up_encoder"] + x["bytes_up_heads"] for x in rows):
            raise RuntimeError(f"fedmocov3 round {r}: the record's bytes differ from the messages'")
        if any(x != rows[0] for x in rows):
            raise RuntimeError(f"fedmocov3 round {r}: clients' bytes differ")
        out.append({"round": r, "stage": 12, "calibrated": False, **rows[0]})
    if {k: out[0][k] for k in BYTE_FIELDS} != {k: out[1][k] for k in BYTE_FIELDS}:
        raise RuntimeError("fedmocov3: rounds 1 and 2 differ")
    return out


def run_totals(sim: list[dict[str, Any]], variant: str, schedule: list[int]) -> dict[str, Any]:
    """Per-client bytes over the paper schedule from the simulated rounds (see the module docstring)."""
    totals = {k: 0 for k in BYTE_FIELDS}
    per_stage = []
    if variant == "fedmocov3":
        for k in BYTE_FIELDS:
            totals[k] = sim[0][k] * sum(schedule)
        return {
            "totals": totals,
            "per_stage": [
                {
                    "stage": s + 1,
                    "first": {k: sim[0][k] for k in BYTE_FIELDS},
                    "later": {k: sim[0][k] for k in BYTE_FIELDS},
                    "rounds": n,
                }
                for s, n in enumerate(schedule)
            ],
        }
    for s, n in enumerate(schedule, start=1):
        rows = [x for x in sim if x["stage"] == s]
        first, later = rows[0], rows[1]
        for other in rows[2:]:
            if {k: other[k] for k in BYTE_FIELDS} != {k: later[k] for k in BYTE_FIELDS}:
                raise RuntimeError(f"{variant} stage {s}: later rounds send different bytes")
        for k in BYTE_FIELDS:
            totals[k] += first[k] + (n - 1) * later[k]
        per_stage.append(
            {
                "stage": s,
                "rounds": n,
                "first": {k: first[k] for k in BYTE_FIELDS},
                "later": {k: later[k] for k in BYTE_FIELDS},
                "blocks_down_first": first["blocks_down"],
                "blocks_down_later": later["blocks_down"],
            }
        )
    return {"totals": totals, "per_stage": per_stage}


# ------------------------------------------------------------------------------------------------ summary
def weighted_mean(values: list[float], weights: list[int]) -> float:
    return float(sum(v * w for v, w in zip(values, weights)) / sum(weights))


def summarise(
    compute: dict[str, list[dict[str, float]]],
    comm: dict[str, dict[str, Any]],
    schedule: list[int],
    batch: int,
    paper_batches: tuple[int, ...],
) -> dict[str, dict[str, float]]:
    out = {}
    for v in VARIANTS:
        rows = compute[v]
        s: dict[str, float] = {}
        for key in (
            "flops_total",
            "flops_forward",
            "flops_backward",
            "flops_fvcore_equivalent",
            "flops_fvcore_no_attention",
            "flops_expected",
            "flops_align_forward",
            "mem_total",
            "mem_activations",
            "mem_parameters",
            "mem_gradients",
            "mem_optimizer_state",
        ):
            values = [float(r[key]) for r in rows]
            s[f"{key}_max"] = max(values)
            s[f"{key}_mean"] = weighted_mean(values, schedule)
        peak = max(rows, key=lambda r: r["mem_total"])
        s["mem_peak_stage"] = peak["stage"]
        s["mem_peak_activation_share"] = peak["mem_activations"] / peak["mem_total"]
        for b in paper_batches:  # saved activations scale with the batch (checked: activation_linearity)
            scaled = [r["mem_total"] - r["mem_activations"] + r["mem_activations"] * b / batch for r in rows]
            s[f"mem_total_max_at_{b}"] = max(scaled)
            s[f"mem_total_mean_at_{b}"] = weighted_mean(scaled, schedule)
        t = comm[v]["totals"]
        s.update({k: float(t[k]) for k in BYTE_FIELDS})
        s["down_encoder"] = t["bytes_down_encoder"]
        s["up_encoder"] = t["bytes_up_encoder"]
        s["total_encoder"] = t["bytes_down_encoder"] + t["bytes_up_encoder"]
        s["down_all"] = t["bytes_down_encoder"] + t["bytes_down_heads"]
        s["up_all"] = t["bytes_up_encoder"] + t["bytes_up_heads"]
        s["total_all"] = s["down_all"] + s["up_all"]
        out[v] = s
    return out


HEADLINE = {
    "mem_total_max": "memory",
    "flops_total_mean": "flops",
    "total_encoder": "comm",
    "down_encoder": "down",
    "up_encoder": "up",
}


def measures(paper_batches: tuple[int, ...]) -> list[tuple[str, str]]:
    """(summary key, words) of every ratio reported; the HEADLINE keys are the ones the paper gives."""
    return [
        ("mem_total_max", "peak memory (max over stages), at this run's batch"),
        *[(f"mem_total_max_at_{b}", f"peak memory at batch {b} (activations scaled linearly)") for b in paper_batches],
        ("mem_total_mean", "memory, mean over rounds"),
        ("flops_total_mean", "FLOPs fwd + bwd per sample, mean over rounds"),
        ("flops_fvcore_equivalent_mean", "FLOPs fvcore-equivalent (forward / 2), mean over rounds"),
        ("flops_fvcore_no_attention_mean", "FLOPs fvcore-equivalent without attention, mean over rounds"),
        ("flops_total_max", "FLOPs fwd + bwd, max over stages"),
        ("total_encoder", "communication, encoder only (down + up)"),
        ("down_encoder", "download, encoder only"),
        ("up_encoder", "upload, encoder only"),
        ("total_all", "communication, encoder + heads"),
        ("down_all", "download, encoder + heads"),
        ("up_all", "upload, encoder + heads"),
    ]


def ratio_rows(summary: dict[str, dict[str, float]], paper_batches: tuple[int, ...]) -> list[dict[str, Any]]:
    """FedMoCoV3 / X for every measure and variant, with the paper's value where it gives one."""
    e2e = summary["fedmocov3"]
    rows = []
    for key, what in measures(paper_batches):
        row: dict[str, Any] = {"key": key, "what": what, "ratio": {}, "paper": {}, "deviation": {}}
        for v in VARIANTS[1:]:
            row["ratio"][v] = e2e[key] / summary[v][key]
            paper = PAPER.get(v, {}).get(HEADLINE.get(key, ""))
            if paper:
                row["paper"][v] = paper
                row["deviation"][v] = row["ratio"][v] / paper - 1.0
        if key == "flops_total_mean":
            row["fll_dd_expected"] = e2e["flops_expected_mean"] / summary["fll_dd"]["flops_expected_mean"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ report
def gb(x: float) -> str:
    return f"{x / GB:.3f}"


def explanations(results: dict[str, Any]) -> list[str]:
    """One note, grounded in the measured figures, per headline ratio more than 15 % away from the paper's."""
    s = results["summary"]
    e2e = s["fedmocov3"]
    batch = results["batch"]
    notes = []
    for row in results["ratios"]:
        key = row["key"]
        for v, dev in row["deviation"].items():
            if abs(dev) <= 0.15:
                continue
            x = s[v]
            label = (
                f"**{LABELS[v]}, {row['what']}: {row['ratio'][v]:.2f}x** against the paper's "
                f"{row['paper'][v]}x ({dev:+.0%})"
            )
            if key == "mem_total_max":
                at = {b: e2e[f"mem_total_max_at_{b}"] / x[f"mem_total_max_at_{b}"] for b in (512, 1024)}
                fixed = x["mem_total_max"] * (1.0 - x["mem_peak_activation_share"])
                notes.append(
                    f"{label}. Batch and what is counted. At {batch} images saved activations are "
                    f"{e2e['mem_peak_activation_share']:.0%} of FedMoCoV3's {e2e['mem_total_max'] / MIB:,.0f} MiB but "
                    f"{x['mem_peak_activation_share']:.0%} of {LABELS[v]}'s {x['mem_total_max'] / MIB:,.0f} MiB: the "
                    f"rest, {fixed / MIB:,.0f} MiB (parameters of the online, momentum"
                    f"{' and global-copy' if v == 'lwfedssl' else ''} branches, "
                    f"{x['mem_parameters_max'] / MIB:,.0f} MiB, "
                    f"and the gradients and AdamW state of block s and the 4096-wide heads, "
                    f"{x['mem_gradients_max'] / MIB:,.0f} + {x['mem_optimizer_state_max'] / MIB:,.0f} MiB), does not "
                    f"shrink with layer-wise training. Activations scaled linearly to batch 512 and 1024 give "
                    f"{at[512]:.2f}x and {at[1024]:.2f}x: the ratio grows with the batch, and the analytic count "
                    f"shows the frozen blocks' saving (nothing saved under no_grad) in full. The paper's figure is a "
                    f"GPU peak, which adds what the analytic count leaves out (CUDA context, library workspaces, "
                    f"allocator caching and rounding, transient buffers of the backward) to both sides and so "
                    f"compresses the ratio: v4's Table 2 puts LW-FedSSL at 2.61 GB at batch 512 with heads 8x "
                    f"narrower, against {s['lwfedssl']['mem_total_max_at_512'] / GB:.2f} GB analytic here at batch "
                    f"512 with the 4096-wide heads."
                )
            elif key == "flops_total_mean":
                fwd = e2e["flops_fvcore_equivalent_mean"] / x["flops_fvcore_equivalent_mean"]
                fv = e2e["flops_fvcore_no_attention_mean"] / x["flops_fvcore_no_attention_mean"]
                no_align = e2e["flops_total_mean"] / (x["flops_total_mean"] - x["flops_align_forward_mean"])
                notes.append(
                    f"{label}. What is counted. Forward only gives {fwd:.2f}x (fvcore's convention, attention "
                    f"dropped: {fv:.2f}x); forward + backward without the alignment's forward of the global copy "
                    f"{no_align:.2f}x. The paper's figure lies between the forward-only and the forward + backward "
                    f"counts. A layer-wise step still runs the momentum encoder over both views and all s blocks "
                    f"and the frozen blocks' forward, while its backward shrinks to block s + heads "
                    f"({x['flops_backward_mean'] / x['flops_total_mean']:.0%} of {LABELS[v]}'s mean step against "
                    f"{e2e['flops_backward_mean'] / e2e['flops_total_mean']:.0%} of FedMoCoV3's); which parts the "
                    f"paper counts, and whether its backward is 2x the forward, is not stated."
                )
            elif key in ("total_encoder", "down_encoder", "up_encoder"):
                with_heads = e2e[key.replace("encoder", "all")] / x[key.replace("encoder", "all")]
                notes.append(
                    f"{label}. Encoder only here; with the 4096-wide MoCo v3 heads "
                    f"({results['heads_bytes_per_message'] / MIB:.1f} MiB per message against "
                    f"{results['encoder_bytes_per_message'] / MIB:.1f} MiB for the whole 12-block encoder) the ratio "
                    f"is {with_heads:.2f}x."
                )
            else:
                notes.append(f"{label}.")
    return notes


def write_markdown(results: dict[str, Any], path: Path) -> None:
    s = results["summary"]
    batch = results["batch"]
    sched = results["schedule"]
    lines = [
        (
            f"# Layer-wise FedSSL client resources: FedMoCoV3 vs LW-FedSSL, FedMoCo-LW, Prog-FedSSL, FLL+DD "
            f"({results['date']})"
        ),
        "",
        (
            f"Machine: {results['machine']}. Command: `{results['command']}`. Load average (1 min) at start "
            f"{results['load_start']:.2f}, at end {results['load_end']:.2f} on {results['cpu_count']} cores (another job "
            f"shared them; no figure here is a time). Total run time {results['total_s']:.0f} s."
        ),
        "",
        (
            f"Schedule and model: the paper configs (`configs/lwfedssl/*.yaml`): ViT-Tiny/4 width 1.0 "
            f"({results['encoder_parameters']:,} encoder parameters), {len(sched)} stages x {sched[0]} rounds = "
            f"{sum(sched)} rounds, 10 clients in every round, 3 local epochs, MoCo v3 heads hidden 4096 / out 256 "
            f"({results['heads_parameters']:,} head parameters, about 4x the encoder), AdamW. **Batch {batch}** for "
            f"memory (the paper: 1024; v4: 512); FLOPs are per sample. Every figure is per client (all clients are "
            f"equal under full participation). FLOPs: one local step, per image (both views), 2 FLOPs per "
            f"multiply-add, the backward that actually runs, CPU attention counted (as on CUDA); LW-FedSSL includes the "
            f"global copy's forward for the alignment term. Memory: analytic (parameters + buffers + gradients + AdamW "
            f"state + saved activations, LW-FedSSL's global copy included), not a device peak. Bytes: Flower's "
            f"`ArrayRecord.count_bytes()` of the messages the strategies build. How each figure is obtained: the "
            f"script's docstring."
        ),
        "",
        "What travels per client and round (as measured by running the strategies, section 4):",
        "",
        "| variant | trains on the client | down | up |",
        "|---|---|---|---|",
        "| FedMoCoV3 | all 12 blocks, embeddings, norm, heads | everything | everything |",
        (
            "| LW-FedSSL | block s + final norm + heads (+ embeddings at s = 1), + alignment to the global copy | "
            "blocks 1..s + embeddings + norm + heads (calibration changed them all) | block s + norm + heads |"
        ),
        (
            "| FedMoCo-LW, FLL+DD | as LW-FedSSL without alignment (FLL+DD: each frozen block skipped with p = 0.5) | "
            "block s + norm + heads; at a stage start also block s-1 (its last aggregate; at s = 2 the embeddings "
            "too) | block s + norm + heads |"
        ),
        "| Prog-FedSSL | blocks 1..s, embeddings, norm, heads | the whole sub-model | the whole sub-model |",
        "",
        "## 1. Summary per client",
        "",
        (
            f"Memory at batch {batch}; peak = maximum over stages (what a client must hold), mean = over the "
            f"{sum(sched)} rounds. FLOPs per sample of one local step, GFLOP. Bytes over the whole run, GB (10^9), "
            "encoder (`backbone.*`) and heads (projector + predictor) apart."
        ),
        "",
        (
            "| variant | peak memory MiB | mean memory MiB | activations in the peak | GFLOP fwd+bwd max | mean | "
            "fvcore-eq. mean | fvcore-eq. no attention, mean | down encoder GB | up encoder GB | encoder total GB | "
            "down heads GB | up heads GB | total with heads GB |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        x = s[v]
        flops_mean = f"{x['flops_total_mean'] / 1e9:.3f}"
        if v == "fll_dd":
            flops_mean += f" (expected with dropout {x['flops_expected_mean'] / 1e9:.3f})"
        lines.append(
            f"| {LABELS[v]} | {x['mem_total_max'] / MIB:,.0f} | {x['mem_total_mean'] / MIB:,.0f} | "
            f"{x['mem_peak_activation_share']:.0%} | {x['flops_total_max'] / 1e9:.3f} | {flops_mean} | "
            f"{x['flops_fvcore_equivalent_mean'] / 1e9:.3f} | {x['flops_fvcore_no_attention_mean'] / 1e9:.3f} | "
            f"{gb(x['down_encoder'])} | {gb(x['up_encoder'])} | {gb(x['total_encoder'])} | "
            f"{gb(x['bytes_down_heads'])} | {gb(x['bytes_up_heads'])} | {gb(x['total_all'])} |"
        )
    lin = results.get("activation_linearity")
    lines.append("")
    if lin:
        lines.append(
            f"Saved activations are linear in the batch: FedMoCoV3's step saves "
            f"{lin['activations'] / MIB:,.1f} MiB at batch {lin['batch']} and "
            f"{lin['activations_small'] / MIB:,.1f} MiB at {lin['batch_small']} (ratio {lin['ratio']:.3f} for "
            f"a batch ratio of {lin['expected_ratio']:.0f}); the 'at batch b' figures below scale them so."
        )
    lines += [
        (
            "FLL+DD's memory and FLOPs are those of a step that skips nothing (its peak); its expected FLOPs "
            "subtract the skipped frozen forwards at p = 0.5."
        ),
        "",
    ]

    cols = VARIANTS[1:]
    lines += [
        "## 2. Ratios FedMoCoV3 / variant, against the paper",
        "",
        "Paper: the pinned version, with calibration: LW-FedSSL 3.3x memory, 2.1x FLOPs, 3.2x communication, "
        "of which download 1.8x and upload 12x (these decompose exactly as the encoder alone would: 12 blocks "
        "against 1 up, 12 x 15 against 15 x (1 + ... + 12) blocks down); Prog-FedSSL 1.8x FLOPs and "
        "communication and the same memory as end to end. v4's Table 2 (batch 512, no calibration, heads "
        "hidden 512; arXiv v4), for the shape: "
        + "; ".join(
            f"{LABELS[v]} memory {V4_TABLE2['fedmocov3'][0] / V4_TABLE2[v][0]:.2f}x, FLOPs "
            f"{V4_TABLE2['fedmocov3'][1] / V4_TABLE2[v][1]:.2f}x, communication "
            f"{V4_TABLE2['fedmocov3'][2] / V4_TABLE2[v][2]:.2f}x"
            for v in ("lwfedssl", "prog_fedssl")
        )
        + ". Bold: the rows the paper reports; deviation = measured / paper - 1.",
        "",
        "| FedMoCoV3 / variant | " + " | ".join(LABELS[v] for v in cols) + " | paper LW-FedSSL (dev.) | "
        "paper Prog-FedSSL (dev.) |",
        "|---" * (3 + len(cols)) + "|",
    ]
    for row in results["ratios"]:
        what = f"**{row['what']}**" if row["key"] in HEADLINE else row["what"]
        cells = []
        for v in cols:
            cell = f"{row['ratio'][v]:.2f}x"
            if v == "fll_dd" and "fll_dd_expected" in row:
                cell += f" (expected {row['fll_dd_expected']:.2f}x)"
            cells.append(cell)
        for v in ("lwfedssl", "prog_fedssl"):
            cells.append(f"{row['paper'][v]}x ({row['deviation'][v]:+.0%})" if v in row["paper"] else "")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    notes = results.get("notes") or []
    lines += ["", "Paper ratios more than 15 % away from the measured ones, and why (from the figures above):", ""]
    lines += [f"- {n}" for n in notes] if notes else ["- none"]
    lines.append("")

    lines += [
        "## 3. Per stage (one client, one local step)",
        "",
        (
            f"GFLOP per sample, fwd + bwd (LW-FedSSL: of which the global copy's alignment forward, in brackets), "
            f"and analytic memory in MiB at batch {batch} (saved activations in brackets)."
        ),
        "",
        "| stage | "
        + " | ".join(f"{LABELS[v]} GFLOP" for v in VARIANTS)
        + " | "
        + " | ".join(f"{LABELS[v]} MiB" for v in VARIANTS)
        + " |",
        "|---" * (1 + 2 * len(VARIANTS)) + "|",
    ]
    for i in range(len(sched)):
        cells = []
        for v in VARIANTS:
            r = results["compute"][v][i]
            cell = f"{r['flops_total'] / 1e9:.3f}"
            if v == "lwfedssl":
                cell += f" ({r['flops_align_forward'] / 1e9:.3f})"
            cells.append(cell)
        for v in VARIANTS:
            r = results["compute"][v][i]
            cells.append(f"{r['mem_total'] / MIB:,.0f} ({r['mem_activations'] / MIB:,.0f})")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")

    lines += [
        "",
        "## 4. Encoder bytes per client and round, by stage (MiB)",
        "",
        (
            f"The heads add {results['heads_bytes_per_message'] / MIB:.2f} MiB each way in every round of every "
            "variant. First = the stage's first round, later = each of its other rounds (simulated: the second "
            "and third rounds of every stage sent the same bytes, for every variant)."
        ),
        "",
        "| stage | " + " | ".join(f"{LABELS[v]} down, first / later | {LABELS[v]} up" for v in cols) + " |",
        "|---" * (1 + 2 * len(cols)) + "|",
    ]
    for i in range(len(sched)):
        cells = []
        for v in cols:
            p = results["communication"][v]["per_stage"][i]
            cells.append(f"{p['first']['bytes_down_encoder'] / MIB:.2f} / {p['later']['bytes_down_encoder'] / MIB:.2f}")
            cells.append(f"{p['later']['bytes_up_encoder'] / MIB:.2f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    e = results["communication"]["fedmocov3"]["per_stage"][0]["later"]
    lines += [
        "",
        (
            f"FedMoCoV3: {e['bytes_down_encoder'] / MIB:.2f} MiB of encoder (+ "
            f"{e['bytes_down_heads'] / MIB:.2f} MiB of heads) each way in every round."
        ),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")


def shown_command(argv: list[str]) -> str:
    """The command line without this machine's paths."""
    shown = ["benchmarks/bench_layerwise_resources.py"]
    for arg in argv:
        if os.path.isabs(arg):
            p = Path(arg)
            arg = str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name
        shown.append(arg)
    env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    return env + "python " + " ".join(shown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="images per local step for the analytic memory")
    ap.add_argument("--sim-clients", type=int, default=2, help="clients in the simulated strategy runs (part 2)")
    ap.add_argument("--quick", action="store_true", help="batch 8 and no activation check: checks the script")
    ap.add_argument("--only", choices=("compute", "bytes"), help="one part only (the report needs both)")
    ap.add_argument("--out", default=str(RESULTS / "layerwise_resources"), help="output path without extension")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch = 8
    log = lambda msg: print(msg, flush=True)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # the strategies' per-round lines
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # Messages outside a Flower run
    cfg = experiment("lwfedssl")
    stages = int(cfg.strategy.options["stages"])
    schedule = stage_rounds(cfg.rounds, stages, str(cfg.strategy.options["allocation"]))
    paper_batches = (512, 1024)
    model = build_layerwise_model(cfg, stages, seed=0)
    shared = state_to_numpy(split_state(model, model.shared_prefixes())[0])
    enc_bytes, head_bytes = entry_bytes(to_array_record(shared))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": shown_command(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, Python "
        f"{platform.python_version()}, torch {torch.__version__}, flwr {flwr.__version__}, "
        f"numpy {np.__version__}",
        "cpu_count": os.cpu_count(),
        "load_start": os.getloadavg()[0],
        "batch": args.batch,
        "sim_clients": args.sim_clients,
        "sim_rounds_per_stage": SIM_ROUNDS_PER_STAGE,
        "schedule": schedule,
        "encoder_parameters": int(sum(p.numel() for p in model.backbone.parameters())),
        "heads_parameters": int(
            sum(p.numel() for n, p in model.named_parameters() if n.startswith(("projector.", "predictor.")))
        ),
        "encoder_bytes_per_message": enc_bytes,
        "heads_bytes_per_message": head_bytes,
        "paper": PAPER,
        "paper_v4_table2": V4_TABLE2,
    }
    del model, shared
    t0 = time.perf_counter()
    if args.only != "bytes":
        log(f"compute: resource_account per variant and stage at batch {args.batch} ...")
        results["compute"] = {v: compute_part(v, args.batch, stages, log) for v in VARIANTS}
        if not args.quick:
            results["activation_linearity"] = activation_linearity(args.batch)
    if args.only != "compute":
        log(f"bytes: the strategies over {SIM_ROUNDS_PER_STAGE} rounds per stage, {args.sim_clients} clients ...")
        sims = {"fedmocov3": simulate_fedmocov3(args.sim_clients)}
        for v in VARIANTS[1:]:
            sims[v] = simulate_layerwise(v, args.sim_clients, stages, log)
        results["simulated_rounds"] = sims
        results["communication"] = {v: run_totals(sims[v], v, schedule) for v in VARIANTS}
    results["load_end"] = os.getloadavg()[0]
    results["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if "compute" in results and "communication" in results:
        results["summary"] = summarise(
            results["compute"], results["communication"], schedule, args.batch, paper_batches
        )
        results["ratios"] = ratio_rows(results["summary"], paper_batches)
        results["notes"] = explanations(results)
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
        write_markdown(results, out.with_suffix(".md"))
        print(out.with_suffix(".md").read_text())
    else:
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
