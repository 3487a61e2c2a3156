"""Screening of client replies before anything of them is used.

A reply is the client's word: its metrics, its size and its arrays are checked against what the round sent
before the strategy averages, distils or aligns anything. The checks are plain functions over one reply (each
returns why the reply is unusable, or None); ``screen_replies`` applies a strategy's check to a round's replies,
replaces each unusable one by a ``RejectedReply`` and stops the run when too few valid ones are left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import WARNING
from types import SimpleNamespace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.common.logger import log

from fedssl_wire import code_mismatch_reason, from_array_record, readable_reason, record_bytes, record_manifest

# Name -> (shape, dtype) of each array of a record.
ArraySpec = dict[str, tuple[tuple[int, ...], str]]


class NotEnoughValidReplies(RuntimeError):
    """Fewer valid replies than ``federation.min_replies`` in a round: the run stops, the global model unchanged."""


class CodeMismatchStop(RuntimeError):
    """A client runs other code than the ServerApp: the run stops with the client's reason."""


class RejectedReply:
    """Stands in for a client reply that failed validation: it reads as an error reply (``has_error()``, with the
    reason), so the round counts it among its failed clients and nothing of it is used."""

    def __init__(self, reply: Message, reason: str) -> None:
        self.metadata = reply.metadata
        self.error = SimpleNamespace(code=0, reason=f"reply rejected: {reason}")
        self.content = None

    def has_error(self) -> bool:
        return True


def array_spec(record: ArrayRecord) -> ArraySpec:
    """Name -> (shape, dtype) of the arrays of a record: what a reply must carry back."""
    return {name: (shape, str(dtype)) for name, dtype, shape in record_manifest(record)}


def metrics_problem(metrics: Mapping[str, Any], expected_partition: int | None) -> str | None:
    """Why a reply's metrics are unusable, or None: the partition id must be the one of the node the message went
    to, the example count an integer > 0 (it weights averages), the training loss a finite number."""
    pid = metrics.get("partition-id")
    if not isinstance(pid, int) or pid != expected_partition:
        return f"partition-id {pid!r} does not match the node's client {expected_partition!r}"
    n = metrics.get("num-examples")
    if not isinstance(n, int) or n <= 0:
        return f"num-examples must be an integer > 0, got {n!r}"
    loss = metrics.get("train_loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"train_loss must be a finite number, got {loss!r}"
    return None


def size_problem(content, max_bytes: int) -> str | None:
    """Why a reply is too large to use (its arrays over ``max_bytes``), or None."""
    size = sum(record_bytes(rec) for rec in content.array_records.values())
    if size > max_bytes:
        return f"{size / 2**20:.1f} MiB of arrays exceeds federation.max_reply_mb ({max_bytes / 2**20:.0f})"
    return None


def arrays_problem(content, expected: Mapping[str, ArraySpec] | None) -> str | None:
    """Why a reply's array records are unusable, or None: each expected record present with exactly the expected
    array names, shapes and dtypes (``expected`` None: no exact expectation), and every float array finite."""
    for name, spec in (expected or {}).items():
        if name not in content.array_records:
            return f"no {name!r} record"
        got = array_spec(content.array_records[name])
        missing, unexpected = sorted(set(spec) - set(got)), sorted(set(got) - set(spec))
        if missing or unexpected:
            parts = ([f"missing arrays {missing[:3]}"] if missing else []) + (
                [f"unexpected arrays {unexpected[:3]}"] if unexpected else []
            )
            return f"record {name!r}: " + ", ".join(parts)
        wrong = [k for k in spec if got[k] != spec[k]]
        if wrong:
            k = wrong[0]
            return f"record {name!r}: array {k!r} has shape/dtype {got[k]}, expected {spec[k]}"
    for name, record in content.array_records.items():
        for key, values in from_array_record(record).items():
            if values.dtype.kind in "fc" and not np.isfinite(values).all():
                return f"record {name!r}: array {key!r} holds non-finite values"
    return None


def screen_replies(
    replies: list,
    *,
    server_round: int,
    problem: Callable[[Message], str | None],
    already_valid: set[int],
    partition_of_node: Mapping[int, int],
    min_replies: int,
) -> list:
    """The round's replies with every one for which ``problem`` names a reason replaced by a ``RejectedReply``
    (logged with node, client and reason). ``already_valid``: ids of replies found valid earlier in the round (a
    subclass that screens before its base), skipped and extended with the new valid ones. Raises
    ``CodeMismatchStop`` if a client refused the round because it runs other code (no later round can be trusted
    either), ``NotEnoughValidReplies`` if fewer than ``min_replies`` valid replies remain."""
    for r in replies:
        refusal = code_mismatch_reason(r.error.reason) if r.has_error() else None
        if refusal:
            raise CodeMismatchStop(f"round {server_round}: a client refused the round: {refusal}")
    screened = []
    for r in replies:
        if not r.has_error() and id(r) not in already_valid:
            reason = problem(r)
            if reason is not None:
                log(
                    WARNING,
                    "round %d: reply of node %d (client %s) dropped: %s",
                    server_round,
                    r.metadata.src_node_id,
                    partition_of_node.get(r.metadata.src_node_id),
                    reason,
                )
                r = RejectedReply(r, reason)
            else:
                already_valid.add(id(r))
        screened.append(r)
    valid = sum(not r.has_error() for r in screened)
    if valid < min_replies:
        reasons = "; ".join(readable_reason(r.error.reason) for r in screened if r.has_error()) or "no reply"
        raise NotEnoughValidReplies(
            f"round {server_round}: {valid} valid replies, fewer than federation.min_replies={min_replies} "
            f"({reasons}); the global model is unchanged"
        )
    return screened
