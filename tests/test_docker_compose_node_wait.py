"""A SuperNode container recreated just before a run is listed by the SuperLink but unavailable until its first
heartbeat: the ServerApp's partition query asks it again instead of failing the run at once
(strategies/nodes.py). Found by the compose test (tests/test_docker_compose.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import ClassVar

import pytest

from strategies.nodes import NODE_UNAVAILABLE_CODE, query_partitions


class Content(dict):
    config_records: ClassVar[dict] = {}


def fake_message(content, dst_node_id, message_type):  # Flower's Message needs a run's task identity
    return SimpleNamespace(content=content, metadata=SimpleNamespace(dst_node_id=dst_node_id, message_id=""))


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr("strategies.nodes.Message", fake_message)


class FakeGrid:
    """Node 7 answers; node 9 is unavailable for its first ``down`` queries, then answers."""

    def __init__(
        self, down: int, error_code: int = NODE_UNAVAILABLE_CODE, reason: str = "Error: Node Unavailable — no heartbeat"
    ):
        self.down, self.asked, self.code, self.reason = down, [], error_code, reason

    def send_and_receive(self, messages, timeout):
        out = []
        for m in messages:
            node = m.metadata.dst_node_id
            self.asked.append(node)
            if node == 9 and self.asked.count(9) <= self.down:
                out.append(
                    SimpleNamespace(
                        has_error=lambda: True,
                        metadata=SimpleNamespace(reply_to_message_id="?", src_node_id=9),
                        error=SimpleNamespace(code=self.code, reason=self.reason),
                    )
                )
            else:
                out.append(
                    SimpleNamespace(
                        has_error=lambda: False,
                        metadata=SimpleNamespace(src_node_id=node),
                        content=Content(metrics={"partition-id": int(node == 9), "num-partitions": 2}),
                    )
                )
        return out


def test_an_unavailable_node_is_asked_again_until_it_answers():
    grid = FakeGrid(down=2)
    infos = query_partitions(grid, [9, 7], timeout=10)
    assert [(i.node_id, i.partition_id, i.error) for i in infos] == [(7, 0, ""), (9, 1, "")]
    assert grid.asked.count(9) == 3 and grid.asked.count(7) == 1  # only the unavailable node is asked again


def test_a_node_that_stays_unavailable_is_reported_after_the_timeout():
    grid = FakeGrid(down=10**6)
    t0 = time.monotonic()
    infos = query_partitions(grid, [7, 9], timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert infos[0].error == "" and "Node Unavailable" in infos[1].error


def test_other_errors_are_not_retried():
    grid = FakeGrid(down=1, error_code=0, reason="ClientApp raised an exception")
    infos = query_partitions(grid, [7, 9], timeout=10)
    assert grid.asked.count(9) == 1 and infos[1].error  # an app error is an answer: reported at once


def test_the_wait_for_an_unavailable_node_has_its_own_bound():
    # the ServerApp bounds it by federation.node_wait_s, not by the (longer) reply timeout of each query
    grid = FakeGrid(down=10**6)
    t0 = time.monotonic()
    infos = query_partitions(grid, [7, 9], timeout=600, unavailable_wait_s=0.5)
    assert time.monotonic() - t0 < 2.0 and grid.asked.count(9) == 1
    assert "Node Unavailable" in infos[1].error
    grid = FakeGrid(down=1)
    infos = query_partitions(grid, [7, 9], timeout=600, unavailable_wait_s=5)
    assert infos[1].error == "" and grid.asked.count(9) == 2
