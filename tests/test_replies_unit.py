"""The reply checks of strategies/replies.py as plain functions: each names the first problem of a reply, or None."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from fedssl_wire import record_bytes, to_array_record
from strategies.replies import (
    NotEnoughValidReplies,
    RejectedReply,
    arrays_problem,
    metrics_problem,
    screen_replies,
    size_problem,
)


def content(**records):
    return SimpleNamespace(array_records={name: to_array_record(arrays) for name, arrays in records.items()})


@pytest.mark.parametrize(
    "metrics, expected, problem",
    [
        ({"partition-id": 1, "num-examples": 10, "train_loss": 0.5}, 1, None),
        (
            {"partition-id": 2, "num-examples": 10, "train_loss": 0.5},
            1,
            "partition-id 2 does not match the node's client 1",
        ),
        ({"partition-id": 1, "num-examples": 10, "train_loss": 0.5}, None, "partition-id 1 does not match"),
        ({"partition-id": 1, "num-examples": 0, "train_loss": 0.5}, 1, "num-examples must be an integer > 0, got 0"),
        (
            {"partition-id": 1, "num-examples": 2.0, "train_loss": 0.5},
            1,
            "num-examples must be an integer > 0, got 2.0",
        ),
        ({"partition-id": 1, "num-examples": 10, "train_loss": math.nan}, 1, "train_loss must be a finite number"),
        ({"partition-id": 1, "num-examples": 10}, 1, "train_loss must be a finite number, got None"),
    ],
)
def test_metrics_problem_names_the_first_bad_metric(metrics, expected, problem):
    got = metrics_problem(metrics, expected)
    assert got == problem if problem is None else got.startswith(problem)


def test_size_problem_counts_every_array_record():
    c = content(arrays={"w": np.zeros((256, 256), np.float32)}, state={"m": np.zeros(256, np.float32)})
    total = sum(record_bytes(r) for r in c.array_records.values())
    # both records count: 256 KiB + 1 KiB of values, plus the two small manifests of the packed records
    assert 257 * 1024 < total < 258 * 1024
    assert size_problem(c, max_bytes=total) is None
    assert size_problem(c, max_bytes=total - 1).startswith("0.3 MiB of arrays exceeds federation.max_reply_mb")
    assert size_problem(content(arrays={"w": np.zeros((256, 256), np.float32)}), max_bytes=257 * 1024) is None


def test_arrays_problem_wants_exactly_the_expected_arrays_and_finite_values():
    spec = {"arrays": {"w": ((2, 3), "float32"), "b": ((3,), "float32")}}
    good = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    assert arrays_problem(content(arrays=good), spec) is None
    assert arrays_problem(content(other=good), spec) == "no 'arrays' record"
    assert arrays_problem(content(arrays={"w": good["w"]}), spec) == "record 'arrays': missing arrays ['b']"
    assert arrays_problem(content(arrays={**good, "x": good["b"]}), spec) == "record 'arrays': unexpected arrays ['x']"
    assert (
        arrays_problem(content(arrays={**good, "b": np.zeros(3, np.float64)}), spec)
        == "record 'arrays': array 'b' has shape/dtype ((3,), 'float64'), expected ((3,), 'float32')"
    )
    bad = {**good, "w": np.array([[1, np.inf, 0]] * 2, np.float32)}
    assert arrays_problem(content(arrays=bad), None) == "record 'arrays': array 'w' holds non-finite values"
    assert arrays_problem(content(arrays={"n": np.arange(3)}), None) is None  # integers: nothing to check


class Reply:
    def __init__(self, node, error=None):
        self.metadata = SimpleNamespace(src_node_id=node)
        self.error = SimpleNamespace(code=0, reason=error or "")
        self.content = {}

    def has_error(self):
        return bool(self.error.reason)


def test_screen_replies_replaces_bad_replies_checks_each_once_and_stops_below_min_replies():
    good, bad, crashed = Reply(100), Reply(101), Reply(102, error="ClientApp crashed")
    checked = []

    def problem(r):
        checked.append(r.metadata.src_node_id)
        return "num-examples must be an integer > 0, got 0" if r is bad else None

    seen: set[int] = set()
    out = screen_replies(
        [good, bad, crashed],
        server_round=2,
        problem=problem,
        already_valid=seen,
        partition_of_node={100: 0, 101: 1, 102: 2},
        min_replies=1,
    )
    assert out[0] is good and out[2] is crashed
    assert isinstance(out[1], RejectedReply) and out[1].has_error()
    assert out[1].error.reason == "reply rejected: num-examples must be an integer > 0, got 0"
    assert checked == [100, 101] and seen == {id(good)}
    # a second screening of the same round (a subclass's base class) does not check the valid reply again
    screen_replies([good], server_round=2, problem=problem, already_valid=seen, partition_of_node={}, min_replies=1)
    assert checked == [100, 101]
    with pytest.raises(
        NotEnoughValidReplies,
        match=r"round 2: 1 valid replies, fewer than federation.min_replies=2 "
        r"\(.*num-examples.*ClientApp crashed",
    ):
        screen_replies(
            [good, bad, crashed],
            server_round=2,
            problem=problem,
            already_valid=set(),
            partition_of_node={},
            min_replies=2,
        )
