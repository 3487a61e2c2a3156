"""Every client reply is validated before it is used: faults injected into replies (NaN, a wrong shape, a missing
array, an oversized payload, a wrong partition id, no examples, a broken kernel or similarity payload) are dropped,
named in the round's failed clients with the reason, and never reach the global model."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from conftest import NodeGrid
from fedssl_wire import KERNEL_RECORD, SIMILARITY_RECORD, from_array_record, to_array_record
from strategies import FedSSL, get_strategy_class

pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


GLOBAL = {"backbone.w": np.zeros((2, 3), np.float32), "backbone.n": np.zeros((1,), np.int64)}


def round_messages(strategy, server_round=1):
    msgs = list(
        strategy.configure_train(
            server_round, to_array_record(GLOBAL), ConfigRecord(), NodeGrid(list(strategy.clients.values()))
        )
    )
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"m{server_round}-{i}"
    return {m.metadata.dst_node_id: m for m in msgs}


def reply(request, arrays=None, pid=0, n=10, loss=1.0, record="arrays", truncate=0):
    content = {"metrics": MetricRecord({"partition-id": pid, "num-examples": n, "train_loss": loss, "train_s": 0.1})}
    if arrays is not None:
        content[record] = to_array_record(arrays)
        if truncate:  # a packed buffer shorter than its manifest says (24 + 8 bytes of data)
            packed = content[record]["packed"].numpy()
            content[record] = ArrayRecord(
                {"manifest": content[record]["manifest"], "packed": Array(packed[:-truncate])}
            )
    msg = Message(RecordDict(content), reply_to=request)
    msg.metadata.__dict__["_src_node_id"] = request.metadata.dst_node_id
    return msg


def good(value):
    return {"backbone.w": np.full((2, 3), value, np.float32), "backbone.n": np.array([4], np.int64)}


FAULTS = {
    "nan": (
        lambda: {**good(1.0), "backbone.w": np.full((2, 3), np.nan, np.float32)},
        {},
        "array 'backbone.w' holds non-finite values",
    ),
    "wrong shape": (
        lambda: {**good(1.0), "backbone.w": np.ones((3, 2), np.float32)},
        {},
        "array 'backbone.w' has shape/dtype ((3, 2), 'float32'), expected ((2, 3), 'float32')",
    ),
    "wrong dtype": (
        lambda: {**good(1.0), "backbone.w": np.ones((2, 3), np.float64)},
        {},
        "expected ((2, 3), 'float32')",
    ),
    "missing array": (lambda: {"backbone.w": np.ones((2, 3), np.float32)}, {}, "missing arrays ['backbone.n']"),
    "extra array": (
        lambda: {**good(1.0), "projector.x": np.ones(1, np.float32)},
        {},
        "unexpected arrays ['projector.x']",
    ),
    "no examples": (lambda: good(1.0), {"n": 0}, "num-examples must be an integer > 0, got 0"),
    "infinite loss": (lambda: good(1.0), {"loss": float("inf")}, "train_loss must be a finite number"),
    "another client's id": (lambda: good(1.0), {"pid": 1}, "partition-id 1 does not match the node's client 0"),
    "no arrays": (lambda: None, {}, "no 'arrays' record"),
    "truncated buffer": (lambda: good(1.0), {"truncate": 4}, "buffer holds 28 bytes"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_reply_is_dropped_named_and_never_averaged(fault):
    strategy = FedSSL(clients={0: 100, 1: 101}, clients_per_round=2, seed=0)
    by_node = round_messages(strategy)
    make, kwargs, reason = FAULTS[fault]
    bad = reply(by_node[100], make(), **kwargs)
    fine = reply(by_node[101], good(3.0), pid=1, n=30)
    arrays, _ = strategy.aggregate_train(1, [bad, fine])
    record = strategy.round_records[1]
    assert record["num_clients"] == 1 and [c["id"] for c in record["clients"]] == [1]
    (failed,) = record["failed_clients"]
    assert failed["id"] == 0 and failed["reason"].startswith("reply rejected: ") and reason in failed["reason"]
    # The global model is the good client's alone: nothing of the bad reply entered the average.
    np.testing.assert_array_equal(from_array_record(arrays)["backbone.w"], np.full((2, 3), 3.0, np.float32))


def test_an_oversized_reply_is_refused():
    strategy = FedSSL(clients={0: 100, 1: 101}, clients_per_round=2, seed=0)
    strategy.max_reply_bytes = 30  # the good payload is 24 + 8 bytes of data plus headers
    by_node = round_messages(strategy)
    strategy.min_replies = 0
    arrays, _ = strategy.aggregate_train(1, [reply(by_node[100], good(1.0))])
    assert arrays is None
    assert "exceeds federation.max_reply_mb" in strategy.round_records[1]["failed_clients"][0]["reason"]


def test_the_round_stops_below_min_replies_and_names_the_reasons():
    strategy = FedSSL(clients={0: 100, 1: 101}, clients_per_round=2, seed=0)
    strategy.min_replies = 2
    by_node = round_messages(strategy)
    with pytest.raises(
        RuntimeError,
        match=r"round 1: 1 valid replies, fewer than federation.min_replies=2 "
        r"\(reply rejected: .*non-finite",
    ):
        strategy.aggregate_train(
            1,
            [
                reply(by_node[100], {**good(1.0), "backbone.w": np.full((2, 3), np.nan, np.float32)}),
                reply(by_node[101], good(2.0), pid=1),
            ],
        )


def test_heterossfl_and_flesd_check_their_payloads():
    hetero = get_strategy_class("heterossfl").__new__(get_strategy_class("heterossfl"))
    FedSSL.__init__(hetero, clients={0: 100}, clients_per_round=1, seed=0)
    hetero.rad_size = 4
    request = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=100, message_type="train.kernel")
    ok = reply(request, {"values": np.eye(4, dtype=np.float32), "scale": np.ones(1, np.float32)}, record=KERNEL_RECORD)
    assert hetero.validate_reply(1, ok) is None
    wrong = reply(
        request, {"values": np.eye(3, dtype=np.float32), "scale": np.ones(1, np.float32)}, record=KERNEL_RECORD
    )
    assert "kernel payload: dense kernel payload has shape (3, 3), expected (4, 4)" in hetero.validate_reply(1, wrong)
    assert hetero.validate_reply(1, reply(request, good(1.0))) == "no 'kernel' record"

    flesd = get_strategy_class("flesd").__new__(get_strategy_class("flesd"))
    FedSSL.__init__(flesd, clients={0: 100}, clients_per_round=1, seed=0)
    flesd.public = np.zeros((5, 2, 2, 3), np.uint8)
    sim = reply(request, {"values": np.eye(5, dtype=np.float16)}, record=SIMILARITY_RECORD)
    assert flesd.validate_reply(1, sim) is None
    small = reply(request, {"values": np.eye(4, dtype=np.float16)}, record=SIMILARITY_RECORD)
    assert "similarity payload is 4 x 4, the public set has 5 images" in flesd.validate_reply(1, small)
    nan = reply(request, {"values": np.full((5, 5), np.nan, np.float16)}, record=SIMILARITY_RECORD)
    assert "non-finite" in flesd.validate_reply(1, nan)
