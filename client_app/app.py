"""The ClientApp: message handlers that decode, call a task, and encode the reply."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from .timeline import timeline_metrics  # first: it marks when the app's own imports began

# isort: split
from . import placement

# Before anything can initialise CUDA in this process (CUDA reads CUDA_VISIBLE_DEVICES once): a simulated client that
# Ray gave 0 GPUs sees none; on a GPU machine it gets them back (client_app/placement.py, docs/running.md).
RAY_GPU_MASK_REMOVED = placement.unhide_gpus_hidden_by_ray()

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedssl_wire import (
    CLIENT_STATE_RECORD,
    KERNEL_RECORD,
    MEMORY_STATE_KEY,
    SIMILARITY_RECORD,
    RoundStateStore,
    RunStopped,
    check_same_code,
    from_array_record,
    run_stopped,
    to_array_record,
)
from ssl_models.config import ExperimentConfig
from ssl_models.data.splits import public_images
from ssl_models.training import TrainStats

from .rounds.kernel import client_encoder_state, initial_kernel, kernel_round
from .rounds.layerwise import layerwise_round
from .rounds.similarity import similarity_round
from .rounds.weights import local_images, set_stop_check, train_local_ssl

APP_IMPORTED_AT = time.time()
app = ClientApp()


CLIENT_INFO_RECORD = "client-info"  # where a round ran: host (in a simulation the Ray node) and device


def client_placement(requested: str) -> placement.Placement:
    """Where this client trains for ``train.device`` = ``requested`` (client_app/placement.py); raises
    ``DevicePlacementError`` naming the cause when ``cuda`` is asked and no GPU is usable: never a silent CPU run."""
    mask = "" if RAY_GPU_MASK_REMOVED else os.environ.get("CUDA_VISIBLE_DEVICES")  # as the process was started
    return placement.decide_client_device(
        requested,
        cuda_visible_devices=mask,
        in_ray_worker=placement.in_ray_worker(),
        gpus_on_machine=placement.physical_gpu_count(),
        cuda_available=torch.cuda.is_available(),
        keep_ray_mask=placement.keeps_ray_gpu_mask(),
    )


def where_this_runs(where: placement.Placement) -> ConfigRecord:
    """The host of this ClientApp and, inside a simulation's Ray worker, the Ray node's id and IP address (on a Ray
    cluster of several machines: which one trained this client's round); the device it trained on, why, and the
    NVIDIA GPUs of its machine (a CPU round on a GPU machine shows), for metrics.jsonl."""
    info = {
        "host": platform.node(),
        "device": placement.device_label(where.device),
        "device-reason": where.reason,
        "gpus-on-machine": placement.physical_gpu_count(),
    }
    if in_simulation():
        try:
            import ray

            # A Ray worker is connected; anywhere else (a test standing in for a simulation) the runtime context
            # would start a local Ray instance, seconds of CPU and a cluster left running, for a description.
            if ray.is_initialized():
                info["ray-node"] = str(ray.get_runtime_context().get_node_id())
                info["node-ip"] = str(ray.util.get_node_ip_address())
        except Exception:  # noqa: BLE001, S110 - a description, never a reason to fail a round
            pass
    return ConfigRecord(info)


def refuse_other_code(msg: Message) -> None:
    """Every handler's first step: a message from a ServerApp running other code is refused (``CodeMismatch``,
    an error reply naming both digests and where this ClientApp's code was loaded from)."""
    check_same_code(msg.content.config_records.get("config"))


def _partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


def in_simulation() -> bool:
    """True inside a simulation's ClientApp: Flower's simulation runs ClientApps in Ray workers (which carry the
    Ray raylet's pid in their environment); a deployed SuperNode runs them in its own processes."""
    return "RAY_RAYLET_PID" in os.environ


def _disk_store(config: ConfigRecord, context: Context) -> RoundStateStore:
    """The node's own ``state-dir`` wins over the server's suggestion; one folder per run (a resumed run keeps the
    folder of the run it continues: the server sends its id as ``state-run``)."""
    fallback = Path.home() / ".cache" / "fedssl" / "client-state"
    # Deployed, a ClientApp writes only under its node's own state-dir (or its default), never under a folder the
    # server names; in a simulation (Ray runs the ClientApps, on the server's machine) the server's suggestion, the
    # run's output folder, keeps each run's client state with its results.
    suggested = str(config.get("state-dir", "")) if in_simulation() else ""
    root = Path(str(context.node_config.get("state-dir", "") or suggested or fallback))
    folder = root.expanduser() / f"run-{config.get('state-run', '') or context.run_id}"
    try:  # the server's suggestion is a path on the server's machine: it may not be writable here
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = fallback / f"run-{context.run_id}"
        print(f"client state: cannot write under {root}; using {folder}", flush=True)
    return RoundStateStore(folder)


def load_client_state(msg: Message, context: Context, pid: int) -> dict[str, np.ndarray] | None:
    mode = str(msg.content["config"].get("client-state", "memory"))
    if mode == "server":
        record = msg.content.array_records.get(CLIENT_STATE_RECORD)
        return from_array_record(record) if record is not None and len(record) else None
    if mode == "disk":
        store = _disk_store(msg.content["config"], context)
        if not msg.metadata.message_type.startswith("train"):
            return store.load(pid)  # a query (the encoder for evaluation): the newest state
        # A training round reads the state of an earlier round (see RoundStateStore): exact after a resume.
        return store.load_before(pid, int(msg.content["config"]["server-round"]))
    record = context.state.array_records.get(MEMORY_STATE_KEY)
    return from_array_record(record) if record is not None else None


def stop_marker_root(msg: Message, context: Context) -> Path | None:
    """Where the ServerApp of this run leaves its stop marker for this client: the root of the run's client-state
    folders when they lie under the run's output folder (a simulation's "disk" mode), else None (nothing to check)."""
    config = msg.content.config_records.get("config")
    if config is None or str(config.get("client-state", "memory")) != "disk" or not in_simulation():
        return None
    suggested = str(config.get("state-dir", "") or "")
    return Path(suggested) if suggested else None


def refuse_stopped_run(msg: Message, context: Context) -> None:
    reason = run_stopped(stop_marker_root(msg, context))
    if reason:
        raise RunStopped(f"run {context.run_id} was stopped ({reason}): this client trains and writes nothing more")


def keep_client_state(msg: Message, context: Context, pid: int, state: dict, reply: RecordDict) -> None:
    refuse_stopped_run(msg, context)  # the server is gone: write nothing for its run
    mode = str(msg.content["config"].get("client-state", "memory"))
    if mode == "server":
        reply[CLIENT_STATE_RECORD] = to_array_record(state)
    elif mode == "disk":
        _disk_store(msg.content["config"], context).save_round(pid, int(msg.content["config"]["server-round"]), state)
    else:
        context.state[MEMORY_STATE_KEY] = to_array_record(state)


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds, so it can map node ids to clients."""
    refuse_other_code(msg)
    pid, num = _partition(context)
    return Message(
        RecordDict(
            {
                "metrics": MetricRecord({"partition-id": pid, "num-partitions": num}),
                "info": ConfigRecord(
                    {
                        "host": platform.node(),
                        "cuda": torch.cuda.is_available(),
                        "has-data-path": bool(context.node_config.get("data-path", "")),
                    }
                ),
            }
        ),
        reply_to=msg,
    )


@dataclass
class RoundInputs:
    config: ConfigRecord
    cfg: ExperimentConfig
    partition_id: int
    server_round: int
    images: np.ndarray  # this client's training images
    sent_at: float  # when the server created the message (its clock)
    started_at: float  # when this handler began
    device_placement: placement.Placement  # where this client trains (train.device, decided by client_placement)

    def timeline(self) -> dict[str, float]:
        """The reply's ``t.*`` metrics: where this message's time went before and in this process."""
        return timeline_metrics(self.sent_at, self.started_at, APP_IMPORTED_AT)

    def log(self, line: str) -> None:
        print(f"[client {self.partition_id} round {self.server_round}] {line}", flush=True)


def round_inputs(msg: Message, context: Context) -> RoundInputs:
    """Decode what every training round needs: the experiment, this client's id, the round, its images."""
    started_at = time.time()
    refuse_other_code(msg)
    refuse_stopped_run(msg, context)
    config = msg.content["config"]
    cfg = ExperimentConfig.from_json(str(config["experiment"]))
    where_to_train = client_placement(cfg.train.device)  # before the data: a client that cannot train fails at once
    pid, _ = _partition(context)
    data_path = str(context.node_config.get("data-path", "")) or None
    scope = str(config.get("data-scope", "partition"))
    images = local_images(cfg, pid, data_path, scope)
    r = RoundInputs(
        config, cfg, pid, int(config["server-round"]), images, msg.metadata.created_at, started_at, where_to_train
    )
    root = stop_marker_root(msg, context)  # checked before every local epoch too (rounds.weights.local_training)
    set_stop_check((lambda: run_stopped(root)) if root is not None else None)
    where = ("the union of all partitions of " if scope == "union" else "its partition of ") + (
        cfg.data.path or cfg.data.dataset
    )
    # Deployed, this goes to the SuperNode's (or its executor's) log: say where this client's output lives.
    r.log(
        f"run {context.run_id} on host {platform.node()}, device {placement.device_label(where_to_train.device)} "
        f"({where_to_train.reason}): {len(images)} images from {data_path or where}; "
        f"{state_location(config, context)}"
    )
    return r


def round_reply(
    msg: Message,
    context: Context,
    r: RoundInputs,
    upload: dict,
    metrics: dict,
    client_state: dict,
    record: str = "arrays",
) -> Message:
    """The reply to a training round: the upload under ``record``, the metrics and where the round ran; the client
    state is kept where its mode keeps it (in the reply itself with ``client-state: server``)."""
    reply = RecordDict(
        {
            record: to_array_record(upload),
            "metrics": MetricRecord(metrics),
            CLIENT_INFO_RECORD: where_this_runs(r.device_placement),
        }
    )
    keep_client_state(msg, context, r.partition_id, client_state, reply)
    return Message(reply, reply_to=msg)


def state_location(config: ConfigRecord, context: Context) -> str:
    """Where this client's state between rounds is kept, in words."""
    mode = str(config.get("client-state", "memory"))
    if mode == "disk":
        return f"client state in {_disk_store(config, context).root.resolve()}"
    if mode == "server":
        return "client state kept by the server"
    return "client state in this SuperNode's memory"


def train_metrics(pid: int, s: TrainStats) -> dict:
    """The reply's metrics of one local training: loss, size, time, and the resource figures as ``res.*``."""
    # A metric record holds numbers only: the precision the step ran in travels as its name ("precision.bf16": 1).
    return {
        "partition-id": pid,
        "num-examples": s.num_examples,
        "train_loss": s.loss,
        "train_s": s.seconds,
        "steps": s.steps,
        "images_per_s": s.images_per_s,
        "compiled": int(s.compiled),
        f"precision.{s.precision}": 1,
        **{f"res.{key}": float(value) for key, value in s.resources.items()},
    }


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Generalized FedSSL, FedProx, FedEMA, FedU, Min-Local, L-DAWA, FedX, Orchestra, FedU2: the strategy's client rule,
    local SSL, upload."""
    r = round_inputs(msg, context)
    config = r.config
    prefix = "rule-input."  # per-client values from the server for the download rule (FedEMA's lambda)
    rule_inputs = {key[len(prefix) :]: config[key] for key in config if key.startswith(prefix)}
    result = train_local_ssl(
        r.cfg,
        r.images,
        from_array_record(msg.content["arrays"]),
        load_client_state(msg, context, r.partition_id),
        server_round=r.server_round,
        partition_id=r.partition_id,
        lr=float(config["lr"]),
        update_both=bool(config.get("update-both", False)),
        aggregate_target=bool(config.get("aggregate-target", False)),
        rule=str(config.get("client-update", "fedssl")),
        rule_options=r.cfg.strategy.options,
        rule_inputs=rule_inputs,
        proximal_mu=float(config.get("proximal-mu", 0.0)),
        proximal_form=str(config.get("proximal-form", "paper")),
        log=r.log,
    )
    metrics = {**train_metrics(r.partition_id, result.stats), **r.timeline()}
    # What the download rule did (FedEMA's mu and divergence, FedU's predictor switch), for the audit log.
    for key, value in result.info.items():
        if isinstance(value, bool):
            metrics[f"rule.{key}"] = int(value)
        elif isinstance(value, (int, float)):
            metrics[f"rule.{key}"] = float(value)
    return round_reply(msg, context, r, result.shared_state, metrics, result.client_state)


@app.train("similarity")
def train_similarity(msg: Message, context: Context) -> Message:
    """FLESD: local SSL, then upload the similarity matrix of the public set's representations."""
    r = round_inputs(msg, context)
    config = r.config
    result = similarity_round(
        r.cfg,
        r.images,
        public_images(r.cfg, source=str(config["public-source"])),
        from_array_record(msg.content["arrays"]),
        load_client_state(msg, context, r.partition_id),
        server_round=r.server_round,
        partition_id=r.partition_id,
        lr=float(config["lr"]),
        public_digest=str(config["public-digest"]),
        similarity=str(config["similarity"]),
        topk_fraction=float(config.get("topk-fraction", 0.0)) or None,
        log=r.log,
    )
    metrics = {**train_metrics(r.partition_id, result.stats), **r.timeline()}
    return round_reply(msg, context, r, result.payload, metrics, result.client_state, record=SIMILARITY_RECORD)


@app.train("kernel")
def train_kernel(msg: Message, context: Context) -> Message:
    """Hetero-SSFL: local SSL on the client's own encoder aligned to the received K_bar, then upload the kernel
    of its RAD representations."""
    r = round_inputs(msg, context)
    config = r.config
    result = kernel_round(
        r.cfg,
        r.images,
        public_images(r.cfg),
        from_array_record(msg.content["arrays"]),
        load_client_state(msg, context, r.partition_id),
        server_round=r.server_round,
        partition_id=r.partition_id,
        lr=float(config["lr"]),
        rad_digest=str(config["rad-digest"]),
        options=r.cfg.strategy.options,
        log=r.log,
    )
    metrics = {**train_metrics(r.partition_id, result.stats), **r.timeline()}
    for key, value in result.info.items():  # CKA to K_bar before/after, the alignment term's mean value
        if isinstance(value, (bool, int, float)):
            metrics[f"align.{key}"] = float(value)
    return round_reply(msg, context, r, result.payload, metrics, result.client_state, record=KERNEL_RECORD)


@app.query("kernel")
def query_kernel(msg: Message, context: Context) -> Message:
    """Hetero-SSFL before round 1: the kernel of this client's current (initial) model on the RAD, from which the
    server forms K_bar(0) (Algorithm 1). Nothing trains."""
    refuse_other_code(msg)
    pid, _ = _partition(context)
    config = msg.content["config"]
    cfg = ExperimentConfig.from_json(str(config["experiment"]))
    client_placement(cfg.train.device)  # the kernel's forward runs on train.device: a GPU that is not there is named
    payload, norm = initial_kernel(
        cfg,
        public_images(cfg),
        load_client_state(msg, context, pid),
        partition_id=pid,
        rad_digest=str(config["rad-digest"]),
        options=cfg.strategy.options,
    )
    return Message(
        RecordDict(
            {
                KERNEL_RECORD: to_array_record(payload),
                "metrics": MetricRecord({"partition-id": pid, "align.kernel_norm": norm}),
            }
        ),
        reply_to=msg,
    )


@app.query("encoder")
def query_encoder(msg: Message, context: Context) -> Message:
    """Send this client's own encoder (online backbone) to the server, for evaluation only (Hetero-SSFL has no
    global model to score). Refused by a client that has not trained yet."""
    refuse_other_code(msg)
    pid, _ = _partition(context)
    state = load_client_state(msg, context, pid)
    encoder = client_encoder_state(state)
    if not encoder:
        raise RuntimeError(f"client {pid} has no encoder yet (it has not trained)")
    last = state.get("meta.last_round")
    metrics = {"partition-id": pid, "last-round": int(last.reshape(-1)[0]) if last is not None else 0}
    return Message(RecordDict({"arrays": to_array_record(encoder), "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.train("layerwise")
def train_layerwise(msg: Message, context: Context) -> Message:
    """LW-FedSSL, FedMoCo-LW, Prog-FedSSL, FLL+DD: assemble the stage's sub-model from the download and the client's
    own blocks, train its active part, upload that part (``lw-*`` config keys: the round's plan)."""
    r = round_inputs(msg, context)
    config = r.config
    plan = {key[len("lw-") :]: config[key] for key in config if key.startswith("lw-")}
    result = layerwise_round(
        r.cfg,
        r.images,
        from_array_record(msg.content["arrays"]),
        load_client_state(msg, context, r.partition_id),
        server_round=r.server_round,
        partition_id=r.partition_id,
        lr=float(config["lr"]),
        plan=plan,
        log=r.log,
    )
    metrics = {**train_metrics(r.partition_id, result.stats), **r.timeline()}
    for key, value in result.info.items():  # resources (FLOPs, memory, RSS), alignment loss: numbers only
        if isinstance(value, (bool, int)):
            metrics[f"lw.{key}"] = int(value)
        elif isinstance(value, float):
            metrics[f"lw.{key}"] = value
    return round_reply(msg, context, r, result.shared_state, metrics, result.client_state)
