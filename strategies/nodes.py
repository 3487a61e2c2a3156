"""Which client (partition) each SuperNode holds: the ``query.info`` exchange.

Node ids are Flower's; partition ids are the experiment's clients. The ServerApp maps one to the other
before the first round, and the strategy again when a node comes back under a new node id (a SuperNode
restarted without a registered key gets a new one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedssl_wire import INFO_MESSAGE_TYPE



@dataclass(frozen=True)
class NodeInfo:
    node_id: int
    partition_id: int | None = None
    num_partitions: int | None = None
    host: str = ""
    error: str = ""  # why the node did not report, when it did not


def query_partitions(grid: Grid, nodes: Iterable[int], timeout: float) -> list[NodeInfo]:
    """Ask each node for its partition id; one entry per reply (errors included), in node order."""
    nodes = sorted(nodes)
    if not nodes:
        return []
    queries = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node, message_type=INFO_MESSAGE_TYPE)
               for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=timeout))
    sent_to = {getattr(m.metadata, "message_id", ""): m.metadata.dst_node_id for m in queries}  # ids: set on push
    out = []
    for reply in replies:
        if reply.has_error():
            node = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            out.append(NodeInfo(node, error=reply.error.reason))
            continue
        m, info = reply.content["metrics"], reply.content.config_records.get("info")
        out.append(NodeInfo(reply.metadata.src_node_id, int(m["partition-id"]), int(m["num-partitions"]),
                            str(info.get("host", "")) if info is not None else ""))
    return sorted(out, key=lambda i: i.node_id)
