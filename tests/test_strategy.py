"""Aggregation math against hand computations; FedSSL orchestration with a fake grid."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

from conftest import NodeGrid
from fedssl_wire import from_array_record, to_array_record
from strategies import FedSSL, get_strategy_class
from strategies.aggregation import sample_clients, weighted_average, weighted_mean
from wire_bytes import hand_bytes

pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


def test_weighted_average_matches_hand_computation():
    a = {"w": np.array([1.0, 2.0], dtype=np.float32), "n": np.array(2, dtype=np.int64)}
    b = {"w": np.array([3.0, 6.0], dtype=np.float32), "n": np.array(6, dtype=np.int64)}
    out = weighted_average([a, b], [100, 300])  # weights 1/4 and 3/4
    np.testing.assert_allclose(out["w"], [0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6])
    assert out["w"].dtype == np.float32
    assert out["n"].dtype == np.int64 and int(out["n"]) == 5  # 0.25*2 + 0.75*6


def test_weighted_average_rejects_mismatches():
    with pytest.raises(ValueError, match="different keys"):
        weighted_average([{"a": np.zeros(1)}, {"b": np.zeros(1)}], [1, 1])
    with pytest.raises(ValueError, match="shape"):
        weighted_average([{"a": np.zeros(1)}, {"a": np.zeros(2)}], [1, 1])
    with pytest.raises(ValueError, match="weights"):
        weighted_average([{"a": np.zeros(1)}], [0])
    with pytest.raises(ValueError, match="no states"):
        weighted_average([], [])


def test_weighted_mean():
    assert weighted_mean([1.0, 4.0], [1, 2]) == pytest.approx(3.0)


def test_sample_clients_is_seeded_and_partial():
    ids = list(range(10))
    a = sample_clients(ids, 3, seed=0, server_round=1)
    assert a == sample_clients(ids[::-1], 3, seed=0, server_round=1)
    assert len(set(a)) == 3 and set(a) <= set(ids)
    rounds = {tuple(sample_clients(ids, 3, seed=0, server_round=r)) for r in range(1, 8)}
    assert len(rounds) > 1  # participation changes across rounds
    assert sample_clients(ids, 10, seed=0, server_round=1) == ids
    with pytest.raises(ValueError, match=r"^sample_clients: cannot pick 11 of 10 clients"):
        sample_clients(ids, 11, seed=0, server_round=1)


def make_strategy(n=3, k=2, **kw):
    clients = {pid: 100 + pid for pid in range(n)}
    return FedSSL(clients=clients, clients_per_round=k, seed=1, round_config=lambda r: {"lr": 0.5 / r}, **kw)


def test_configure_train_builds_one_message_per_sampled_client():
    strategy = make_strategy()
    arrays = to_array_record({"backbone.w": np.ones((4, 4), np.float32)})
    base = ConfigRecord({"experiment": "{}"})
    msgs = list(strategy.configure_train(2, arrays, base, NodeGrid([100, 101, 102])))
    assert len(msgs) == 2
    assert len({m.metadata.dst_node_id for m in msgs}) == 2
    cfgs = [m.content["config"] for m in msgs]
    assert cfgs[0] is not cfgs[1]  # per-node config records, never one shared mutable record
    assert all(c["server-round"] == 2 and c["lr"] == 0.25 and c["update-both"] is False for c in cfgs)
    assert "server-round" not in base  # the caller's record is not mutated
    # by hand (tests/wire_bytes.py): one 4 x 4 float32 array (64 bytes) + its manifest line "backbone.w\t<f4\t4,4"
    # (18) + the packed record's frame (2 .npy headers of 128 + the keys "manifest" and "packed": 270)
    assert strategy._bytes_down[2] == 2 * (64 + 18 + 270)


def test_configure_train_samples_only_connected_clients():
    strategy = make_strategy(n=3, k=3, min_available=2, node_wait_s=0.0)
    msgs = list(strategy.configure_train(1, to_array_record({"w": np.zeros(1)}), ConfigRecord(), NodeGrid([100, 102])))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [100, 102]


def reply_to(node, arrays, pid, n, loss):
    request = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
    return Message(
        RecordDict(
            {
                "arrays": to_array_record(arrays),
                "metrics": MetricRecord({"partition-id": pid, "num-examples": n, "train_loss": loss, "train_s": 1.5}),
            }
        ),
        reply_to=request,
    )


def test_aggregate_train_weights_by_examples_and_skips_errors():
    strategy = make_strategy()
    r1 = reply_to(100, {"w": np.array([0.0, 4.0], np.float32)}, 0, 10, 2.0)
    r2 = reply_to(101, {"w": np.array([4.0, 0.0], np.float32)}, 1, 30, 4.0)
    failed = Message(
        Error(code=0, reason="boom"), reply_to=Message(RecordDict(), dst_node_id=102, message_type="train")
    )
    arrays, metrics = strategy.aggregate_train(1, iter([r1, r2, failed]))
    np.testing.assert_allclose(from_array_record(arrays)["w"], [3.0, 1.0])
    rec = strategy.round_records[1]
    assert rec["train_loss"] == pytest.approx((10 * 2.0 + 30 * 4.0) / 40)
    assert rec["num_clients"] == 2 and rec["num_failed"] == 1 and rec["num_examples"] == 40
    assert rec["bytes_up"] == 2 * (2 * 4 + len("w\t<f4\t2") + 270)  # the failed reply carries nothing
    assert [c["bytes_up"] for c in rec["clients"]] == [285, 285]
    assert [c["id"] for c in rec["clients"]] == [0, 1]
    assert metrics["num-examples"] == 40


def test_aggregate_train_with_no_success_keeps_the_global_model():
    strategy = make_strategy()
    strategy.min_replies = 0  # federation.min_replies: 0 lets a round without any valid reply go on
    failed = Message(
        Error(code=0, reason="boom"), reply_to=Message(RecordDict(), dst_node_id=100, message_type="train")
    )
    arrays, _ = strategy.aggregate_train(1, [failed])
    assert arrays is None and strategy.round_records[1]["num_clients"] == 0


def test_too_few_valid_replies_stop_the_run():
    strategy = make_strategy()  # min_replies 1 by default
    failed = Message(
        Error(code=0, reason="boom"), reply_to=Message(RecordDict(), dst_node_id=100, message_type="train")
    )
    with pytest.raises(RuntimeError, match=r"round 1: 0 valid replies, fewer than federation.min_replies=1 \(boom\)"):
        strategy.aggregate_train(1, [failed])


def test_aggregate_target_widens_what_is_exchanged_and_update_both_does_not():
    class Method:
        def shared_prefixes(self, with_target=False):
            return ("backbone.",) + (("target_backbone.",) if with_target else ())

    assert make_strategy().exchange_prefixes(Method()) == ("backbone.",)
    both = make_strategy(options={"update_both": True})  # the client copies the online weights into its target
    assert both.exchange_prefixes(Method()) == ("backbone.",)
    assert both.client_config(1)["update-both"] is True and both.client_config(1)["aggregate-target"] is False
    aggregated = make_strategy(options={"aggregate_target": True})
    assert aggregated.exchange_prefixes(Method()) == ("backbone.", "target_backbone.")
    assert aggregated.client_config(1)["aggregate-target"] is True


def test_registry():
    assert get_strategy_class("fedssl") is FedSSL
    with pytest.raises(ValueError, match="unknown strategy"):
        get_strategy_class("fedfoo")
    with pytest.raises(ValueError, match=r"^clients_per_round must be in \[1, 1\], got 2"):
        FedSSL(clients={0: 1}, clients_per_round=2)


def test_server_side_client_state_travels_with_the_messages(tmp_path):
    """Cross-device mode: the server stores each client's state and sends it back next time."""
    strategy = make_strategy(n=2, k=2, options={"client_state": "server"}, state_dir=str(tmp_path))
    arrays = to_array_record({"w": np.zeros(2, np.float32)})
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), NodeGrid([100, 101])))
    assert all(len(m.content["client-state"]) == 0 for m in msgs)  # nobody has state yet
    assert all(m.content["config"]["client-state"] == "server" for m in msgs)
    replies = []
    for m in msgs:
        r = reply_to(m.metadata.dst_node_id, {"w": np.ones(2, np.float32)}, m.metadata.dst_node_id - 100, 5, 1.0)
        r.content["client-state"] = to_array_record({"target.w": np.full(3, float(m.metadata.dst_node_id))})
        replies.append(r)
    strategy.aggregate_train(1, replies)
    # each reply: "w" 2 float32 (8 + manifest line 7 + frame 270) and the state "target.w" 3 float64 (24 + 14 + 270)
    assert strategy._bytes_down[1] == 2 * 285  # round 1: the empty state records cost nothing
    assert strategy.round_records[1]["bytes_up"] == 2 * (285 + 308) == hand_bytes_of(replies)
    msgs2 = {
        m.metadata.dst_node_id: m for m in strategy.configure_train(2, arrays, ConfigRecord(), NodeGrid([100, 101]))
    }
    np.testing.assert_array_equal(from_array_record(msgs2[101].content["client-state"])["target.w"], [101.0] * 3)
    assert strategy._bytes_down[2] == 2 * (285 + 308) == hand_bytes_of(msgs2.values())
    # The server keeps these states on disk, not in memory.
    assert sorted(p.name for p in (tmp_path / "server-side").iterdir()) == ["client_0.npz", "client_1.npz"]


def hand_bytes_of(messages) -> int:
    """Bytes of every array record of the messages, counted from shapes and dtypes (tests/wire_bytes.py)."""
    return sum(hand_bytes(from_array_record(rec)) for m in messages for rec in m.content.array_records.values())


class ReplyingGrid(NodeGrid):
    """A grid that stamps message ids as Flower's does on push and answers query.info from a table."""

    def __init__(self, nodes, partitions, num_partitions):
        super().__init__(nodes)
        self.partitions, self.num = partitions, num_partitions
        self.queried = []

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"q{len(self.queried)}-{i}"
            node = m.metadata.dst_node_id
            self.queried.append(node)
            reply = Message(
                RecordDict(
                    {
                        "metrics": MetricRecord({"partition-id": self.partitions[node], "num-partitions": self.num}),
                        "info": ConfigRecord({"host": f"h{node}"}),
                    }
                ),
                reply_to=m,
            )
            reply.metadata.__dict__["_src_node_id"] = node
            replies.append(reply)
        return replies


def test_failed_clients_are_named_with_the_reason_or_the_missing_reply():
    strategy = make_strategy(n=3, k=3)
    msgs = list(
        strategy.configure_train(
            1, to_array_record({"w": np.zeros(1, np.float32)}), ConfigRecord(), NodeGrid([100, 101, 102])
        )
    )
    for i, m in enumerate(msgs):  # what the Grid does when it pushes them
        m.metadata.__dict__["_message_id"] = f"m{i}"
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    ok = Message(
        RecordDict(
            {
                "arrays": to_array_record({"w": np.ones(1, np.float32)}),
                "metrics": MetricRecord({"partition-id": 0, "num-examples": 5, "train_loss": 1.0, "train_s": 1.0}),
            }
        ),
        reply_to=by_node[100],
    )
    unavailable = Message(Error(code=0, reason="Node Unavailable"), reply_to=by_node[102])
    strategy.aggregate_train(1, [ok, unavailable])  # client 1 on node 101 never answered
    rec = strategy.round_records[1]
    assert rec["num_clients"] == 1 and rec["num_failed"] == 2
    assert {f["id"]: f["reason"] for f in rec["failed_clients"]} == {
        2: "Node Unavailable",
        1: "no reply before the round timeout (federation.round_timeout_s)",
    }


def test_a_client_back_under_a_new_node_id_is_taken_in():
    strategy = make_strategy(n=2, k=2, node_wait_s=5.0)  # clients 0 -> node 100, 1 -> node 101
    grid = ReplyingGrid([100, 205], partitions={100: 0, 205: 1}, num_partitions=2)
    msgs = list(strategy.configure_train(1, to_array_record({"w": np.zeros(1)}), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [100, 205]
    assert strategy.clients == {0: 100, 1: 205} and grid.queried == [205]


def test_an_unknown_node_with_another_partition_count_is_ignored():
    strategy = make_strategy(n=2, k=2, min_available=1, node_wait_s=0.0)
    grid = ReplyingGrid([100, 205], partitions={100: 0, 205: 1}, num_partitions=5)
    msgs = list(strategy.configure_train(1, to_array_record({"w": np.zeros(1)}), ConfigRecord(), grid))
    assert [m.metadata.dst_node_id for m in msgs] == [100] and strategy.clients == {0: 100, 1: 101}
