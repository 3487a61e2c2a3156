"""Layer-wise federated SSL on a growable ViT: LW-FedSSL, FedMoCo-LW, Prog-FedSSL and FLL+DD (Tun et al.,
*LW-FedSSL*, the version with server-side calibration and representation alignment; docs/methods/lwfedssl.md).

Training runs in S stages over R rounds (``stages``; R_s per ``allocation``: uniform, right_skewed, left_skewed).
The server learns the stage from the round; at a stage's first round it appends block s to the global encoder
(``new_block_init``: ``copy`` = weight transfer from block s-1, or ``fresh``), and every client builds its model
at the current depth. The patch projection, CLS token and position embeddings belong to stage 1; the final
LayerNorm is the current sub-model's output norm and trains with the active block in every stage.

| strategy | clients train | up | down | server |
|---|---|---|---|---|
| ``lwfedssl`` | block s + norm + heads (blocks 1..s-1 frozen, forward under no_grad) + alpha * symmetric alignment to the received global model | block s + norm + heads | blocks 1..s + heads (calibration changed them all) | at the round's start (after growth, before the clients) calibration of the whole sub-model on the auxiliary data for E epochs; FedAvg of the uploads |
| ``fedmoco_lw`` | block s + norm + heads | the same | block s + norm + heads (+ whatever the client lacks) | FedAvg |
| ``fll_dd`` | as ``fedmoco_lw``, each frozen block skipped with probability ``depth_dropout`` per step | the same | the same | FedAvg |
| ``prog_fedssl`` | blocks 1..s + embeddings + norm + heads | the whole sub-model | the whole sub-model | FedAvg |

End-to-end FedMoCoV3 is ``strategy: fedssl`` with ``method: mocov3`` and ``model.arch: vit_tiny``.

**What a client downloads** is counted, never assumed: the server keeps, per client, the version of every global
entry the client holds (entries it trained itself count as its own, not the global one). Each round it sends the
entries the client trains plus every entry whose global version the client does not hold. Within a stage of
FedMoCo-LW that is block s + norm + heads; at a stage start also block s-1 (its last aggregate replaced the client's
own copy); under LW-FedSSL calibration changes every entry before each round, so blocks 1..s + heads; a client that
missed stages, or whose last round failed, gets the whole current sub-model. The global model evaluated after a
round (and saved at the end) is that round's FedAvg: the next round's calibration belongs to the next round.

**Learning rate** per round: ``lr_strategy`` ``fixed``, ``cosine`` over the run or ``cyclic`` (a cosine within each
stage); it replaces ``train.lr_schedule``. MoCo v3's momentum schedule (``method.options.momentum_schedule``) runs
over the whole run: each round is its window ((r-1)/R, r/R).

**Resources** per client and round (``resource_accounting``): FLOPs of one local step per sample (forward and the
backward that runs; ``flops_fvcore_equivalent`` = forward / 2), the analytic training memory of one step, the
process's peak RSS during local training (and CUDA's max allocated on a GPU), the bytes of each message split into
encoder (``backbone.*``) and heads. ``summary.json`` has the per-client and per-run totals (``resources``) and the
same figures for an end-to-end client at the final depth (``resources.reference_e2e``: what a FedMoCoV3 client
would need).

Math and model surgery: ``ssl_models/federated/layerwise.py``; the client side: ``client_app/rounds/layerwise.py``
(``layerwise_round``).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Iterable
from logging import INFO
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedssl_wire import (
    LAYERWISE_MESSAGE_TYPE,
    entry_nbytes,
    from_array_record,
    record_bytes,
    record_manifest,
    record_names,
    to_array_record,
)
from ssl_models.data.splits import public_images
from ssl_models.factory import load_partial_state
from ssl_models.federated.layerwise import (
    ALLOCATIONS,
    LR_STRATEGIES,
    NEW_BLOCK_INITS,
    StagePosition,
    build_layerwise_model,
    calibrate,
    configure_local_model,
    grow_online_state,
    head_prefixes,
    is_encoder_key,
    online_state,
    resource_account,
    round_lr,
    select,
    stage_of_round,
    stage_rounds,
    state_depth,
    submodel_prefixes,
    trained_prefixes,
)
from ssl_models.training import resolve_device

from .aggregation import weighted_average
from .fedssl import FedSSL, ModelToEvaluate
from .options import check_choice, check_positive, check_unit
from .replies import array_spec

CLIENT_TARGETS = ("reset", "keep")
BYTE_KEYS = ("bytes_down", "bytes_up", "bytes_down_encoder", "bytes_down_heads", "bytes_up_encoder", "bytes_up_heads")
MAXIMA = (
    "flops_total",
    "flops_fvcore_equivalent",
    "flops_expected",
    "mem_total",
    "mem_activations",
    "mem_batch",
    "rss_peak_bytes",
    "cuda_peak_bytes",
)
LOCAL = -1  # the version of an entry a client trained itself (no global version)


def _check_int(options: dict[str, Any], key: str, minimum: int) -> None:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"strategy.options.{key}: must be an integer >= {minimum} (got {value!r})")


def _check_non_negative(options: dict[str, Any], key: str) -> None:
    if not options[key] >= 0:
        raise ValueError(f"strategy.options.{key}: must be >= 0 (got {options[key]!r})")


def entry_bytes(record: ArrayRecord) -> tuple[int, int]:
    """(encoder, rest) bytes of an ArrayRecord as sent: encoder = the raw bytes of its ``backbone.*`` arrays (what
    the paper counts); rest = everything else Flower counts for the record (the heads, the manifest, the headers
    and keys), so that encoder + rest = ``record_bytes``."""
    encoder = sum(entry_nbytes(dtype, shape) for name, dtype, shape in record_manifest(record) if is_encoder_key(name))
    return encoder, record_bytes(record) - encoder


class LayerwiseFedSSL(FedSSL):
    """Stage schedule, growth, per-client download bookkeeping and resource accounting shared by the variants."""

    name = "layerwise"  # not registered itself: the variants below are
    variant = ""
    trainable_mode = "last_block"  # what clients train: "last_block" or "all"
    calibrates = False
    client_update = "layerwise"
    message_type = LAYERWISE_MESSAGE_TYPE
    target_options = False  # the momentum encoder follows ``client_target``

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            "stages": 12,  # S, one ViT block per stage
            "allocation": "uniform",  # R_s per stage: uniform, right_skewed, left_skewed
            "new_block_init": "copy",  # copy = weight transfer from block s-1; fresh
            "lr_strategy": "cosine",  # fixed, cosine (over the run), cyclic (cosine within each stage)
            # reset: a client's momentum encoder starts every round as a copy of the model it assembled from the
            # download; keep: it keeps its own between rounds (a new block's target starts as the received block).
            "client_target": "reset",
            "resource_accounting": True,  # FLOPs / analytic memory per client and round, and the e2e reference
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        _check_int(options, "stages", 1)
        check_choice(options, "allocation", ALLOCATIONS)
        check_choice(options, "new_block_init", NEW_BLOCK_INITS)
        check_choice(options, "lr_strategy", LR_STRATEGIES)
        check_choice(options, "client_target", CLIENT_TARGETS)

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.model.arch != "vit_tiny":
            raise ValueError(
                f"model.arch: strategy {cls.name!r} grows a ViT block by block: set model.arch: vit_tiny "
                f"(got {cfg.model.arch!r})"
            )
        stages = cfg.strategy.options.get("stages", cls.default_options()["stages"])
        if cfg.rounds < stages:
            raise ValueError(
                f"rounds: {cfg.rounds} rounds cannot hold strategy.options.stages={stages} stages "
                "(every stage needs at least one round)"
            )
        depth = cfg.model.options.get("depth")
        if depth is not None and depth != stages:
            # The grown model has one block per stage: a different model depth would be silently ignored.
            raise ValueError(
                f"model.options.depth={depth} disagrees with strategy.options.stages={stages}: a "
                f"layer-wise run ends with one block per stage (drop model.options.depth or set it "
                f"to {stages})"
            )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.global_state: OrderedDict | None = None  # the whole current online sub-model (NumPy)
        self.key_version: dict[str, int] = {}
        self._next_version = 1
        self.client_versions: dict[int, dict[str, int]] = {}  # pid -> {key: global version the client holds}
        self._sent_versions: dict[int, dict[int, dict[str, int]]] = {}
        self._down: dict[int, dict[int, dict[str, Any]]] = {}  # round -> pid -> bytes and blocks sent
        self._positions: dict[int, StagePosition] = {}
        self._grown: dict[int, int] = {}  # round -> stage started there with a new block
        self.calibration_stats: dict[int, dict[str, Any]] = {}  # this round's, until its record takes it
        self.resources: dict[str, Any] = {
            "per_client": {},
            "by_stage_max": {},
            "run": {**{k: 0 for k in BYTE_KEYS if "encoder" in k or "heads" in k}, "flops_run": 0.0},
        }
        self._resumed = False
        self._reply_round = 0
        self._reply_spec: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}

    # ------------------------------------------------------------------ setup
    def prepare(self, cfg, data, split) -> None:
        super().prepare(cfg, data, split)
        o = self.options
        self.rounds_per_stage = stage_rounds(cfg.rounds, int(o["stages"]), str(o["allocation"]))
        self.device = resolve_device(cfg.train.device)
        self.heads = head_prefixes(build_layerwise_model(cfg, 1, seed=cfg.seed))
        log(
            INFO,
            "%s: %d stages, rounds per stage %s (%s), new blocks %s, lr %s",
            self.name,
            len(self.rounds_per_stage),
            self.rounds_per_stage,
            o["allocation"],
            o["new_block_init"],
            o["lr_strategy"],
        )

    def position(self, server_round: int) -> StagePosition:
        return stage_of_round(server_round, self.rounds_per_stage)

    def exchange_prefixes(self, method) -> tuple[str, ...]:
        """The initial global model is the stage-1 sub-model: embeddings, block 1, final norm, heads."""
        return submodel_prefixes(1, head_prefixes(method))

    def round_lr(self, server_round: int) -> float:
        return round_lr(self.cfg.train.lr, server_round, self.rounds_per_stage, str(self.options["lr_strategy"]))

    def trained_keys(self, depth: int) -> list[str]:
        assert self.global_state is not None
        return list(select(self.global_state, trained_prefixes(depth, self.trainable_mode, self.heads)))

    @property
    def depth(self) -> int:
        return state_depth(self.global_state or {})

    # ------------------------------------------------------------------ global model and versions
    def _bump(self, keys: Iterable[str]) -> None:
        version = self._next_version
        self._next_version += 1
        for key in keys:
            self.key_version[key] = version

    def _init_global(self, arrays: ArrayRecord) -> None:
        state = from_array_record(arrays)
        if self._resumed:  # the checkpoint's global arrays: the whole sub-model after its round, versions restored
            self.global_state = select(state, submodel_prefixes(state_depth(state), self.heads))
            return
        self.global_state = select(state, submodel_prefixes(1, self.heads))
        if state_depth(self.global_state) != 1:
            raise ValueError(
                f"the initial model must hold the stage-1 sub-model (1 block), got "
                f"{state_depth(self.global_state)} blocks"
            )
        self._bump(self.global_state)

    def _grow(self, server_round: int) -> None:
        assert self.global_state is not None
        depth = self.depth
        grown = grow_online_state(
            self.cfg, self.global_state, str(self.options["new_block_init"]), seed=self.seed * 7_919 + depth + 1
        )
        new_keys = [k for k in grown if k not in self.global_state]
        self.global_state = grown
        self._bump(new_keys)
        self._grown[server_round] = depth + 1
        log(
            INFO,
            "round %d: stage %d starts: block %d appended (%s)",
            server_round,
            depth + 1,
            depth + 1,
            self.options["new_block_init"],
        )

    def download_keys(self, partition_id: int, depth: int) -> list[str]:
        """What the client gets this round: the entries it trains, and every entry whose current global version it
        does not hold (all of them for a client the server knows nothing about)."""
        assert self.global_state is not None
        trained = set(self.trained_keys(depth))
        held = self.client_versions.get(partition_id, {})
        return [k for k in self.global_state if k in trained or held.get(k) != self.key_version[k]]

    # ------------------------------------------------------------------ train
    def client_config(self, server_round: int) -> dict[str, Any]:
        o = self.options
        pos = self._positions.get(server_round) or self.position(server_round)
        start, end = pos.progress
        return {
            **super().client_config(server_round),
            "lr": self.round_lr(server_round),
            "lw-variant": self.variant,
            "lw-stage": pos.stage,
            "lw-trainable": self.trainable_mode,
            "lw-depth-dropout": float(o.get("depth_dropout", 0.0)),
            "lw-alpha": float(o.get("alpha", 0.0)),
            "lw-align-temperature": float(o.get("align_temperature", 0.2)),
            "lw-align-symmetric": bool(o.get("align_symmetric", True)),
            "lw-client-target": str(o["client_target"]),
            "lw-accounting": bool(o["resource_accounting"]),
            "lw-progress-start": float(start),
            "lw-progress-end": float(end),
        }

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.global_state is None:
            self._init_global(arrays)
        assert self.global_state is not None
        pos = self.position(server_round)
        self._positions[server_round] = pos
        while self.depth < pos.stage:
            self._grow(server_round)
        if self.calibrates:  # Algorithm 1 lines 4-9: after the new block, before the clients train
            self._calibrate(server_round)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        pid_of_node = {node: pid for pid, node in self.clients.items()}
        down = self._down.setdefault(server_round, {})
        for m in messages:
            pid = pid_of_node[m.metadata.dst_node_id]
            record = cast(ArrayRecord, m.content["arrays"])
            encoder, heads = entry_bytes(record)
            names = record_names(record)
            blocks = sorted({int(k.split(".")[2]) + 1 for k in names if k.startswith("backbone.blocks.")})
            down[pid] = {
                "bytes_down": encoder + heads,
                "bytes_down_encoder": encoder,
                "bytes_down_heads": heads,
                "blocks_down": blocks,
                "full_submodel_down": len(names) == len(self.global_state),
            }
        return messages

    def arrays_for_client(self, server_round: int, partition_id: int, arrays: ArrayRecord) -> ArrayRecord:
        assert self.global_state is not None
        keys = self.download_keys(partition_id, self.depth)
        self._sent_versions.setdefault(server_round, {})[partition_id] = {k: self.key_version[k] for k in keys}
        return to_array_record(OrderedDict((k, self.global_state[k]) for k in keys))

    def expected_reply_arrays(
        self, server_round: int, partition_id: int
    ) -> dict[str, dict[str, tuple[tuple[int, ...], str]]] | None:
        """A reply carries exactly the round's trained entries (their names, shapes and dtypes)."""
        if server_round not in self._reply_spec:
            pos = self._positions.get(server_round)
            if pos is None or self.global_state is None:
                return None
            trained = select(self.global_state, trained_prefixes(pos.stage, self.trainable_mode, self.heads))
            self._reply_spec = {server_round: array_spec(to_array_record(trained))}
        return {"arrays": self._reply_spec[server_round]}

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> ArrayRecord:
        assert self.global_state is not None
        expected = self.trained_keys(self.depth)
        states = []
        for r, c in zip(replies, clients):
            state = from_array_record(cast(ArrayRecord, r.content["arrays"]))
            if set(state) != set(expected):
                extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
                raise RuntimeError(
                    f"round {server_round}: client {c['id']} uploaded other entries than the stage-"
                    f"{self.depth} round trains (unexpected {extra[:3]}, missing {missing[:3]})"
                )
            states.append(OrderedDict((k, state[k]) for k in expected))
        averaged = weighted_average(states, [c["num_examples"] for c in clients])
        self.global_state.update(averaged)
        self._bump(averaged)
        return to_array_record(self.global_state)

    def _calibrate(self, server_round: int) -> None:
        """Hook: LW-FedSSL calibrates the whole sub-model on the server at the start of every round."""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._reply_round = server_round
        arrays, metrics = super().aggregate_train(server_round, list(replies))
        record = self.round_records[server_round]
        ok = {c["id"] for c in record["clients"]}
        depth = self._positions[server_round].stage
        trained = set(self.trained_keys(depth))
        for pid, versions in self._sent_versions.pop(server_round, {}).items():
            if pid in ok:
                held = dict(self.client_versions.get(pid, {}))
                held.update(versions)
                held.update({k: LOCAL for k in trained})
                self.client_versions[pid] = held
            else:  # unknown what it holds now: it gets the whole sub-model next time
                self.client_versions.pop(pid, None)
        pos = self._positions[server_round]
        clients = record["clients"]
        record.update(
            {
                "variant": self.variant,
                "stage": pos.stage,
                "depth": depth,
                "round_in_stage": pos.round_in_stage,
                "stage_rounds": pos.stage_rounds,
                "stage_start": pos.is_stage_start,
                "new_block": self._grown.get(server_round),
                "trainable": self.trainable_mode,
                "lr": self.round_lr(server_round),
                "lr_strategy": self.options["lr_strategy"],
                "bytes_down_encoder": sum(d["bytes_down_encoder"] for d in self._down.get(server_round, {}).values()),
                "bytes_down_heads": sum(d["bytes_down_heads"] for d in self._down.get(server_round, {}).values()),
                "bytes_up_encoder": sum(c.get("bytes_up_encoder", 0) for c in clients),
                "bytes_up_heads": sum(c.get("bytes_up_heads", 0) for c in clients),
            }
        )
        if server_round in self.calibration_stats:
            record["calibration"] = self.calibration_stats.pop(server_round)
        self._down.pop(server_round, None)
        self._account_round(record)
        return arrays, metrics

    def client_record(self, reply: Message) -> dict[str, Any]:
        record = super().client_record(reply)
        m = reply.content["metrics"]
        for key in m:
            if key.startswith("lw."):
                record[key[len("lw.") :]] = m[key]
        encoder, heads = entry_bytes(cast(ArrayRecord, reply.content["arrays"]))
        record.update(bytes_up_encoder=encoder, bytes_up_heads=heads)
        record.update(self._down.get(self._reply_round, {}).get(record["id"], {}))
        return record

    def traffic(self, model_bytes: int) -> str:
        """The first progress line's words on what travels (``model_bytes``: the stage-1 sub-model's size)."""
        down = {"lwfedssl": "blocks 1..s + heads", "prog_fedssl": "blocks 1..s + heads"}.get(
            self.variant, "block s + heads, plus what a client lacks"
        )
        up = "blocks 1..s + heads" if self.trainable_mode == "all" else "block s + heads"
        return (
            f"{self.variant}: stage-1 sub-model {model_bytes / 2**20:.2f} MiB; per client and round down {down}, "
            f"up {up} (metrics.jsonl: bytes_*_encoder / bytes_*_heads)"
        )

    # ------------------------------------------------------------------ evaluation and summary
    def models_to_evaluate(self, arrays: ArrayRecord) -> dict[str, ModelToEvaluate]:
        return {"global": ModelToEvaluate(self.cfg.model.arch, arrays, depth=state_depth(record_names(arrays)))}

    def summary_extras(self, scores_by_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
        o = self.options
        extras = {
            **super().summary_extras(scores_by_model),
            "layerwise": {
                "variant": self.variant,
                "stages": int(o["stages"]),
                "allocation": o["allocation"],
                "rounds_per_stage": list(self.rounds_per_stage),
                "new_block_init": o["new_block_init"],
                "lr_strategy": o["lr_strategy"],
                "trainable": self.trainable_mode,
                "client_target": o["client_target"],
                "final_depth": self.depth,
                "stage_starts": {str(stage): rnd for rnd, stage in sorted(self._grown.items())},
            },
            "resources": self.resource_summary(),
        }
        return extras

    def _account_round(self, record: dict[str, Any]) -> None:
        """Add one finished round to the run's resource totals and maxima (kept incrementally, so a resumed run
        restores them from its checkpoint)."""
        acc = self.resources
        run = acc["run"]
        stage = str(record.get("stage"))
        for key in ("bytes_down_encoder", "bytes_down_heads", "bytes_up_encoder", "bytes_up_heads"):
            run[key] += int(record.get(key, 0))
        for c in record["clients"]:
            mine = acc["per_client"].setdefault(
                str(c["id"]), {"rounds": 0, **{k: 0 for k in BYTE_KEYS}, "flops_run": 0.0}
            )
            mine["rounds"] += 1
            for key in BYTE_KEYS:
                mine[key] += int(c.get(key, 0))
            flops_run = float(c.get("flops_expected", c.get("flops_total", 0.0))) * float(c.get("images_trained", 0))
            mine["flops_run"] += flops_run
            run["flops_run"] += flops_run
            for key in MAXIMA:
                if c.get(key) is not None:
                    value = float(c[key])
                    for where, name in (
                        (mine, f"{key}_max"),
                        (run, f"{key}_max"),
                        (acc["by_stage_max"].setdefault(stage, {}), key),
                    ):
                        where[name] = max(where.get(name, value), value)
        if "calibration" in record:
            cal = acc.setdefault("calibration", {"rounds": 0, "steps": 0, "seconds": 0.0})
            cal["rounds"] += 1
            cal["steps"] += int(record["calibration"]["steps"])
            cal["seconds"] += float(record["calibration"]["seconds"])
            cal["aux_images"] = int(record["calibration"]["aux_images"])

    def resource_summary(self) -> dict[str, Any]:
        """Per-client and per-run totals and maxima of the run's rounds, plus the end-to-end reference."""
        out = copy.deepcopy(self.resources)
        run = out["run"]
        run["bytes_down"] = run["bytes_down_encoder"] + run["bytes_down_heads"]
        run["bytes_up"] = run["bytes_up_encoder"] + run["bytes_up_heads"]
        out["units"] = (
            "bytes; FLOPs per sample (image, both views) of one local step; flops_run = FLOPs per sample "
            "(expected, with depth dropout) x images trained, summed; mem_* analytic bytes of one step"
        )
        if self.options["resource_accounting"] and self.global_state is not None:
            out["reference_e2e"] = self.end_to_end_reference()
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self):
        plain, arrays, stores = super().checkpoint_state()
        plain = {
            **plain,
            "layerwise": {
                "key_version": dict(self.key_version),
                "next_version": self._next_version,
                "client_versions": {str(pid): dict(v) for pid, v in self.client_versions.items()},
                "grown": {str(r): s for r, s in self._grown.items()},
                "resources": copy.deepcopy(self.resources),
            },
        }
        return plain, arrays, stores

    def restore_state(self, plain, arrays, stores) -> None:
        super().restore_state(plain, arrays, stores)
        state = plain["layerwise"]
        self.key_version = {k: int(v) for k, v in state["key_version"].items()}
        self._next_version = int(state["next_version"])
        self.client_versions = {
            int(pid): {k: int(v) for k, v in held.items()} for pid, held in state["client_versions"].items()
        }
        self._grown = {int(r): int(s) for r, s in state["grown"].items()}
        self.resources = copy.deepcopy(state["resources"])
        self._resumed = True  # the next round's arrays are the checkpoint's whole global sub-model

    def end_to_end_reference(self) -> dict[str, Any]:
        """One end-to-end client step (FedMoCoV3) on the final-depth model: what every layer-wise saving is
        measured against. Batch: the largest one a client trained with."""
        assert self.global_state is not None
        batch = int(self.resources["run"].get("mem_batch_max") or self.cfg.train.batch_size)
        method = build_layerwise_model(self.cfg, self.depth, seed=self.cfg.seed)
        load_partial_state(method, self.global_state)
        configure_local_model(method, "all")
        t = self.cfg.train
        figures = resource_account(
            method, optimizer=t.optimizer, batch_size=batch, sgd_momentum=t.momentum, device=self.device
        )
        encoder, heads = entry_bytes(to_array_record(self.global_state))
        return {
            "depth": self.depth,
            **figures,
            "bytes_per_message": encoder + heads,
            "bytes_per_message_encoder": encoder,
            "bytes_per_message_heads": heads,
            "what": "one FedMoCoV3 client step on the final-depth model (every block trains); its messages carry "
            "the whole model both ways",
        }


class LWFedSSL(LayerwiseFedSSL):
    """LW-FedSSL: server-side calibration at every round's start, layer-wise clients with representation
    alignment, FedAvg."""

    name = "lwfedssl"
    variant = "lwfedssl"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            "alpha": 0.01,  # weight of the representation alignment term (0 = off)
            "align_temperature": 0.2,  # tau of the alignment term
            # l(z1_local, z2_global) + l(z2_local, z1_global), Algorithm 2 line 12 (false: the first term only)
            "align_symmetric": True,
            # passes over the auxiliary data at the start of every round: null = train.local_epochs ("the same
            # settings as local training"); 0 = no calibration
            "calibration_epochs": None,
            "calibration_lr": 0.0,  # 0: the round's learning rate (as the clients')
            "calibration_batch_size": 0,  # 0: train.batch_size
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        _check_non_negative(options, "alpha")
        check_positive(options, "align_temperature")
        if not isinstance(options["align_symmetric"], bool):
            raise ValueError(  # noqa: TRY004 - a config error, as a ValueError
                f"strategy.options.align_symmetric: must be true or false (got {options['align_symmetric']!r})"
            )
        if options["calibration_epochs"] is not None:
            _check_int(options, "calibration_epochs", 0)
        _check_non_negative(options, "calibration_lr")
        _check_int(options, "calibration_batch_size", 0)
        if options["calibration_batch_size"] == 1:
            raise ValueError(
                "strategy.options.calibration_batch_size: must be 0 (train.batch_size) or >= 2 "
                "(contrastive losses need pairs)"
            )

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.strategy.options.get("calibration_epochs") != 0 and not cfg.data.public_size:
            raise ValueError(
                "data.public_size: LW-FedSSL calibrates on the server's auxiliary data, the server-held "
                "split (never given to a client): set a fraction (the paper: 0.1) or a count, or turn "
                "calibration off with strategy.options.calibration_epochs: 0"
            )

    @property
    def calibration_epochs(self) -> int:
        """E: the configured epochs, or train.local_epochs (the paper: the same settings as local training)."""
        epochs = self.options["calibration_epochs"]
        return int(self.cfg.train.local_epochs) if epochs is None else int(epochs)

    @property
    def calibrates(self) -> bool:  # type: ignore[override]
        return self.calibration_epochs > 0

    def prepare(self, cfg, data, split) -> None:
        super().prepare(cfg, data, split)
        self.aux = public_images(cfg, data) if self.calibrates else None
        if self.aux is not None:
            log(INFO, "LW-FedSSL auxiliary data for calibration: %d server-held images (labels unused)", len(self.aux))

    def _calibrate(self, server_round: int) -> None:
        assert self.global_state is not None and self.aux is not None  # calibrates: the server holds images
        o = self.options
        pos = self._positions[server_round]
        lr = float(o["calibration_lr"]) or self.round_lr(server_round)
        method = build_layerwise_model(self.cfg, self.depth, seed=self.cfg.seed)
        load_partial_state(method, self.global_state)
        t0 = time.perf_counter()
        stats = calibrate(
            self.cfg,
            method,
            self.aux,
            epochs=self.calibration_epochs,
            lr=lr,
            seed=self.seed * 1_009 + server_round,
            device=self.device,
            batch_size=int(o["calibration_batch_size"]),
            progress=pos.progress,
        )
        method.cpu()
        calibrated = online_state(method)
        self.global_state = OrderedDict((k, calibrated[k]) for k in self.global_state)
        self._bump(self.global_state)
        self.calibration_stats[server_round] = {
            "loss": stats.loss,
            "steps": stats.steps,
            "seconds": stats.seconds,
            "wall_s": time.perf_counter() - t0,
            "lr": lr,
            "epochs": self.calibration_epochs,
            "aux_images": len(self.aux),
            "depth": self.depth,
        }
        log(
            INFO,
            "round %d: calibrated the %d-block sub-model on %d auxiliary images before the clients train: "
            "%d epochs, %d steps, loss %.4f, %.1f s",
            server_round,
            self.depth,
            len(self.aux),
            self.calibration_epochs,
            stats.steps,
            stats.loss,
            stats.seconds,
        )


class FedMoCoLW(LayerwiseFedSSL):
    """FedMoCo-LW: pure layer-wise training (no calibration, no alignment)."""

    name = "fedmoco_lw"
    variant = "fedmoco_lw"


class FLLDD(LayerwiseFedSSL):
    """FLL+DD: layer-wise training with depth dropout of the frozen blocks (rate ``depth_dropout``)."""

    name = "fll_dd"
    variant = "fll_dd"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        # depth_dropout: probability, in [0, 1], that a frozen block is skipped in a local training forward.
        return {**super().default_options(), "depth_dropout": 0.5}

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_unit(options, "depth_dropout")


class ProgFedSSL(LayerwiseFedSSL):
    """Prog-FedSSL: the same stages, nothing frozen: blocks 1..s, embeddings, norm and heads train and travel."""

    name = "prog_fedssl"
    variant = "prog_fedssl"
    trainable_mode = "all"


LAYERWISE_STRATEGIES = (LWFedSSL, FedMoCoLW, ProgFedSSL, FLLDD)
