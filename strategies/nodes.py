"""Which client (partition) each SuperNode holds: the ``query.info`` exchange.

Node ids are Flower's; partition ids are the experiment's clients. The ServerApp maps one to the other
before the first round, and the strategy again when a node comes back under a new node id (a SuperNode
restarted without a registered key gets a new one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedssl_wire import INFO_MESSAGE_TYPE, code_identity

FIRST_POLL_S, MAX_POLL_S = 0.05, 1.0  # reply polling: quick at first, then backing off


def send_and_receive(
    grid: Grid, messages: Iterable[Message], timeout: float | None, arrivals: dict[str, float] | None = None
) -> list[Message]:
    """``grid.send_and_receive`` with a shorter reply poll. Flower's deployed grid sleeps 3 s between pulls, so a
    round whose replies arrive in 0.5 s still waits up to 3 s; here the poll starts at 50 ms and doubles up to 1 s
    (a few requests per round on loopback). Grids without push/pull (test doubles) use their own method.
    ``arrivals``, if given, gets each reply's message id -> the epoch time the ServerApp pulled it."""
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        replies: list[Message] = list(grid.send_and_receive(messages, timeout=timeout))
        if arrivals is not None:
            arrivals.update((m.metadata.message_id, time.time()) for m in replies)
        return replies
    pending = set(grid.push_messages(messages))
    deadline = None if timeout is None else time.monotonic() + timeout
    replies = []
    wait = FIRST_POLL_S
    while pending:
        got = list(grid.pull_messages(pending))
        if arrivals is not None:
            arrivals.update((m.metadata.message_id, time.time()) for m in got)
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic())))
        wait = min(MAX_POLL_S, wait * 2)
    return replies


# The points of a client's handling of one training message, as the ClientApp reports them (client_app/timeline.py):
# its process started, the app's imports began and ended, the handler began, the reply was ready.
TIMELINE_POINTS = ("process_start", "import_start", "app_imported", "handler_start", "reply_ready")


def client_timeline(metrics, received_at: float | None) -> dict[str, float]:
    """Seconds from the server's creation of a client's message to each point of its handling and to the reply's
    arrival at the ServerApp (``received``), from the reply's ``t.*`` metrics; {} for a reply without them. The
    points come from the client's clock, so across machines they include the clocks' offset; on one host they
    split a deployed round into dispatch (until ``process_start``: the SuperLink, the SuperNode's poll, the
    executor starting a process), start-up, the handler's work and the way back. A ClientApp that did not start
    for this message (the simulation's) has a negative ``process_start``."""

    def number(key: str) -> float | None:  # a reply's metrics are the client's word: numbers only
        value = metrics.get(key) if key in metrics else None
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    sent = number("t.sent")
    if sent is None:
        return {}
    out = {p: round(t - sent, 3) for p in TIMELINE_POINTS if (t := number(f"t.{p}")) is not None}
    if received_at is not None:
        out["received"] = round(received_at - sent, 3)
    return out


@dataclass(frozen=True)
class NodeInfo:
    node_id: int
    partition_id: int | None = None
    num_partitions: int | None = None
    host: str = ""
    error: str = ""  # why the node did not report, when it did not


NODE_UNAVAILABLE_CODE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE: listed, but no heartbeat (yet)
UNAVAILABLE_RETRY_S = 2.0


def _unavailable(reply: Message) -> bool:
    return reply.has_error() and (
        reply.error.code == NODE_UNAVAILABLE_CODE or "Node Unavailable" in (reply.error.reason or "")
    )


def query_partitions(
    grid: Grid, nodes: Iterable[int], timeout: float, unavailable_wait_s: float | None = None
) -> list[NodeInfo]:
    """Ask each node for its partition id; one entry per node that replied (errors included), in node order.

    A node the SuperLink lists but reports unavailable (a SuperNode recreated a moment ago, registered but not
    yet sending heartbeats) is asked again every few seconds for up to ``unavailable_wait_s`` (default: ``timeout``),
    instead of failing the query at once; its last error is returned if it never comes up. ``timeout`` bounds
    each wait for replies."""
    nodes = sorted(nodes)
    if not nodes:
        return []
    deadline = time.monotonic() + (timeout if unavailable_wait_s is None else unavailable_wait_s)
    answered: dict[int, NodeInfo] = {}
    while True:
        pending = [n for n in nodes if n not in answered]
        retry = {}
        for info, unavailable in _query_once(grid, pending, timeout):
            answered[info.node_id] = info
            if unavailable:
                retry[info.node_id] = info
        if not retry or time.monotonic() + UNAVAILABLE_RETRY_S >= deadline:
            break
        time.sleep(UNAVAILABLE_RETRY_S)
        for node in retry:
            answered.pop(node)
    return [answered[n] for n in nodes if n in answered]


def _query_once(grid: Grid, nodes: list[int], timeout: float) -> list[tuple[NodeInfo, bool]]:
    identity: dict[str, Any] = code_identity()  # str and int values: what a ConfigRecord holds
    queries = [
        Message(RecordDict({"config": ConfigRecord(identity)}), dst_node_id=node, message_type=INFO_MESSAGE_TYPE)
        for node in nodes
    ]
    replies = send_and_receive(grid, queries, timeout)
    sent_to = {getattr(m.metadata, "message_id", ""): m.metadata.dst_node_id for m in queries}  # ids: set on push
    out = []
    for reply in replies:
        if reply.has_error():
            node = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            out.append(
                (NodeInfo(node, error=reply.error.reason or f"error code {reply.error.code}"), _unavailable(reply))
            )
            continue
        m: Mapping[str, Any] = reply.content["metrics"]  # a MetricRecord: numbers
        info = reply.content.config_records.get("info")
        out.append(
            (
                NodeInfo(
                    reply.metadata.src_node_id,
                    int(m["partition-id"]),
                    int(m["num-partitions"]),
                    str(info.get("host", "")) if info is not None else "",
                ),
                False,
            )
        )
    return out


NODE_QUERY_TIMEOUT_S = 60.0  # a connected node answers query.info in seconds


def wait_for_partitions(
    grid: Grid,
    clients: dict[int, int],
    *,
    min_available: int,
    wait_s: float,
    foreign: set[int],
    server_round: int,
    query_timeout: float = NODE_QUERY_TIMEOUT_S,
) -> list[int]:
    """Partition ids whose nodes are connected, once at least ``min_available`` are, or when ``wait_s`` has passed
    (then with a warning, and an error if none is). ``clients`` (partition id -> node id) and ``foreign`` (nodes
    known to hold none of this experiment's clients) are updated in place by ``adopt_new_nodes``."""
    deadline = time.monotonic() + wait_s
    while True:
        connected = set(grid.get_node_ids())
        available = [pid for pid, node in clients.items() if node in connected]
        if len(available) < len(clients) and connected - set(clients.values()):
            available = adopt_new_nodes(
                grid, clients, connected, foreign=foreign, server_round=server_round, query_timeout=query_timeout
            )
        if len(available) >= min_available:
            return available
        if time.monotonic() > deadline:
            if not available:
                raise RuntimeError(f"round {server_round}: no client node is connected")
            log(
                WARNING,
                "round %d: only %d of the %d required clients are connected; going on with them",
                server_round,
                len(available),
                min_available,
            )
            return available
        time.sleep(1.0)


def adopt_new_nodes(
    grid: Grid,
    clients: dict[int, int],
    connected: set[int],
    *,
    foreign: set[int],
    server_round: int,
    query_timeout: float = NODE_QUERY_TIMEOUT_S,
) -> list[int]:
    """A client whose node is gone may be back under a new node id (a SuperNode restarted without a registered
    key): ask the unknown connected nodes which partition they hold and take them into ``clients``. A node that
    holds none of them goes to ``foreign`` and is not asked again. Returns the partition ids now connected."""
    unknown = connected - set(clients.values()) - foreign
    for info in query_partitions(grid, unknown, timeout=query_timeout):
        if info.error or info.partition_id not in clients or info.num_partitions != len(clients):
            log(
                WARNING,
                "round %d: ignoring node %d (%s)",
                server_round,
                info.node_id,
                info.error or f"partition {info.partition_id} of {info.num_partitions}",
            )
            foreign.add(info.node_id)
            continue
        if clients[info.partition_id] not in connected:
            log(INFO, "round %d: client %d is back on node %d", server_round, info.partition_id, info.node_id)
            clients[info.partition_id] = info.node_id
    return [pid for pid, node in clients.items() if node in connected]
