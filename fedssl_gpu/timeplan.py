"""The campaign's time plan: seconds per stage and per item, estimated before anything runs.

Each estimate is work over rate plus fixed costs, with every assumption in the plan file's ``assumed`` section:

- a run (a smoke config, or one run of a study): the FLOPs of its local training, counted on the run's own model
  with ``torch.utils.flop_counter`` (one SSL step's forward and backward per image, ``training_step_flops``, averaged
  over the clients' architectures), times the images trained (rounds x clients per round x local epochs x the
  images a client holds); plus its evaluations (the backbone's forward over the evaluation images, for every kNN
  monitor, the final scores and the random-init reference); over ``train_tflops``; plus ``run_start_s`` and
  ``round_overhead_s`` per round (a deployed ClientApp is a new process per message: Python, torch and CUDA start
  every round). Server-side training (FLESD's distillation, calibration) and Hetero-SSFL's RAD passes are not
  counted: the estimate is a floor for those strategies, and says so;
- the correctness stage's tests: ``pytest_s``;
- the throughput stage: its timed steps' FLOPs over ``train_tflops`` (fp32 counted at ``fp32_tflops``), plus
  ``throughput_overhead_s`` per configuration (model build, warm-up) and ``compile_s`` per compiled method.

``fedssl-campaign plan PLAN --write`` writes the table next to the plan file (``<plan>.timeplan.md``), and the
campaign checks each stage's estimate against the time left before starting it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Assumptions:
    """What the estimates assume (the plan file's ``assumed`` section)."""

    train_tflops: float  # achieved TFLOP/s of local training on the fast path (bf16 on a recent GPU)
    fp32_tflops: float  # achieved TFLOP/s of plain fp32 training (the throughput stage's baseline)
    run_start_s: float  # a run's fixed cost: the ServerApp's start, data loading, the first messages
    round_overhead_s: float  # per round: ClientApp processes starting, messages, aggregation
    pytest_s: float  # the CUDA tests
    throughput_overhead_s: float  # per timed configuration of the throughput stage
    compile_s: float  # torch.compile of one method's step (the throughput stage's compiled configuration)
    train_images: int  # images of the bundled training split (what a run without data.max_train holds)
    test_images: int  # images of the bundled test split

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "assumed") -> Assumptions:
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - names)
        missing = sorted(names - set(raw))
        if unknown or missing:
            raise ValueError(
                f"{where}: "
                + "; ".join(
                    ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
                    + ([f"missing key(s) {', '.join(missing)}"] if missing else [])
                )
            )
        values = {}
        for name in names:
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}.{name}: expected a positive number, got {value!r}")
            values[name] = int(value) if name in ("train_images", "test_images") else float(value)
        return cls(**values)


@functools.lru_cache(maxsize=64)
def _model_flops(method_key: str) -> tuple[float, float]:
    """(training FLOPs per image, backbone forward FLOPs per image) of the experiment ``method_key`` stands for
    (a JSON of the resolved config's model, method and federation sections, and the architecture)."""
    import json

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ssl_models.accounting.flops import training_step_flops
    from ssl_models.config import ExperimentConfig
    from ssl_models.factory import build_ssl_model

    raw = json.loads(method_key)
    cfg = ExperimentConfig.from_dict(raw["config"])
    method = build_ssl_model(cfg, seed=0, arch=raw["arch"])
    train = float(training_step_flops(method, (3, 32, 32), batch_size=2)["total"])
    backbone = method.backbone.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        backbone(torch.zeros(2, 3, 32, 32))
    return train, float(counter.get_total_flops()) / 2


def run_estimate(cfg, assumed: Assumptions) -> dict[str, float]:
    """Seconds and FLOPs of one run of the validated ExperimentConfig ``cfg`` under ``assumed``."""
    import json

    tree = cfg.to_dict()
    archs = [cfg.client_arch(i) for i in range(cfg.federation.num_clients)]
    # what the model depends on (client_archs needs the federation's size to validate)
    per_arch = {
        a: _model_flops(
            json.dumps(
                {"config": {k: tree[k] for k in ("model", "method", "federation")}, "arch": a},
                sort_keys=True,
                default=str,
            )
        )
        for a in sorted(set(archs))
    }
    train_flops = sum(per_arch[a][0] for a in archs) / len(archs)
    forward_flops = sum(per_arch[a][1] for a in archs) / len(archs)
    d, t, e, f = cfg.data, cfg.train, cfg.eval, cfg.federation
    available = min(d.max_train or assumed.train_images, assumed.train_images)
    public = d.public_size * available if 0 < d.public_size < 1 else d.public_size  # a fraction, or a count
    held = int(available - public)
    per_client = max(1, held // max(1, f.num_clients))
    per_round_clients = f.clients_per_round or f.num_clients
    if t.max_steps_per_epoch:
        per_client = min(per_client, t.max_steps_per_epoch * t.batch_size)
    central = cfg.strategy.name == "central"
    # Orchestra's first round only seeds its centroids (strategy.options.seed_round, on by default): nothing trains.
    seeding = cfg.strategy.name == "orchestra" and cfg.strategy.options.get("seed_round", True) is not False
    trained_rounds = cfg.rounds - 1 if seeding else cfg.rounds
    trained = trained_rounds * t.local_epochs * (held if central else per_round_clients * per_client)
    eval_images = min(e.max_train or assumed.train_images, assumed.train_images) + min(
        e.max_test or assumed.test_images, assumed.test_images
    )
    knn_runs = cfg.rounds // e.knn_every if e.knn_every else 0
    evaluations = knn_runs + 2  # the kNN monitors, the final scores, the random-init reference
    flops = trained * train_flops + evaluations * eval_images * forward_flops
    seconds = flops / (assumed.train_tflops * 1e12) + assumed.run_start_s + cfg.rounds * assumed.round_overhead_s
    return {
        "seconds": seconds,
        "flops": flops,
        "images_trained": float(trained),
        "train_flops_per_image": train_flops,
        "forward_flops_per_image": forward_flops,
        "evaluated_images": float(evaluations * eval_images),
    }


def throughput_estimate(
    methods_flops: Mapping[str, float], steps: int, configurations: int, assumed: Assumptions
) -> float:
    """Seconds of the throughput stage: ``steps`` timed steps (plus as many warm-up steps) of every method, once in
    fp32 and ``configurations - 1`` times on the fast path."""
    seconds = 0.0
    for flops_per_step in methods_flops.values():
        work = 2 * steps * flops_per_step
        seconds += work / (assumed.fp32_tflops * 1e12) + (configurations - 1) * work / (assumed.train_tflops * 1e12)
        seconds += configurations * assumed.throughput_overhead_s
    return seconds


def format_seconds(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
