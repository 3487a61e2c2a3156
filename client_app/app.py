"""The ClientApp: message handlers that decode, call a task, and encode the reply."""

from __future__ import annotations

import platform

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ssl_models.config import ExperimentConfig
from strategies.records import from_array_record, to_array_record

from .tasks import local_images, train_local_ssl

app = ClientApp()

LOCAL_STATE_KEY = "local-state"


def _partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds, so it can map node ids to clients."""
    pid, num = _partition(context)
    return Message(RecordDict({
        "metrics": MetricRecord({"partition-id": pid, "num-partitions": num}),
        "info": ConfigRecord({"host": platform.node(), "cuda": torch.cuda.is_available(),
                              "has-data-path": bool(context.node_config.get("data-path", ""))}),
    }), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    cfg = ExperimentConfig.from_json(str(config["experiment"]))
    pid, _ = _partition(context)
    server_round = int(config["server-round"])
    images = local_images(cfg, pid, str(context.node_config.get("data-path", "")) or None)
    local = context.state.array_records.get(LOCAL_STATE_KEY)
    result = train_local_ssl(
        cfg, images, from_array_record(msg.content["arrays"]),
        from_array_record(local) if local is not None else None,
        server_round=server_round, partition_id=pid, lr=float(config["lr"]),
        update_both=bool(config.get("update-both", False)),
        log=lambda line: print(f"[client {pid} round {server_round}] {line}", flush=True),
    )
    context.state[LOCAL_STATE_KEY] = to_array_record(result.local_state)
    s = result.stats
    return Message(RecordDict({
        "arrays": to_array_record(result.shared_state),
        "metrics": MetricRecord({"partition-id": pid, "num-examples": s.num_examples, "train_loss": s.loss,
                                 "train_s": s.seconds, "steps": s.steps, "images_per_s": s.images_per_s}),
    }), reply_to=msg)
