"""Waiting for the client nodes before a round (strategies/nodes.py wait_for_partitions, adopt_new_nodes): a client
back under a new node id is taken in, a node holding none of the experiment's clients is asked once, and a round
goes on with fewer clients only after the wait, never with none."""

import pytest

from strategies import nodes
from strategies.nodes import NodeInfo, adopt_new_nodes, wait_for_partitions


class FakeGrid:
    def __init__(self, connected):
        self.connected = set(connected)

    def get_node_ids(self):
        return sorted(self.connected)


@pytest.fixture
def answers(monkeypatch):
    """Node id -> what it answers to query.info; records which nodes were asked, per query."""
    table, asked = {}, []

    def fake_query(grid, unknown, timeout):
        asked.append(sorted(unknown))
        return [table[n] for n in sorted(unknown) if n in table]

    monkeypatch.setattr(nodes, "query_partitions", fake_query)
    return table, asked


def test_a_client_back_on_a_new_node_is_taken_in_and_a_foreign_node_is_asked_once(answers):
    table, asked = answers
    table[205] = NodeInfo(205, partition_id=1, num_partitions=2)  # client 1's SuperNode, restarted
    table[300] = NodeInfo(300, partition_id=7, num_partitions=9)  # another experiment's node
    clients, foreign = {0: 100, 1: 101}, set()
    grid = FakeGrid({100, 205, 300})

    assert wait_for_partitions(grid, clients, min_available=2, wait_s=0.0, foreign=foreign, server_round=3) == [0, 1]
    assert clients == {0: 100, 1: 205}
    assert foreign == {300}
    assert asked == [[205, 300]]

    # next round: everything known, nobody is asked again
    assert wait_for_partitions(grid, clients, min_available=2, wait_s=0.0, foreign=foreign, server_round=4) == [0, 1]
    assert asked == [[205, 300]]


def test_a_node_that_fails_the_query_or_claims_a_client_of_another_split_is_not_adopted(answers):
    table, _ = answers
    table[205] = NodeInfo(205, error="Node Unavailable")
    table[206] = NodeInfo(206, partition_id=1, num_partitions=5)  # partition 1, but of a 5-client split
    clients, foreign = {0: 100, 1: 101}, set()
    assert adopt_new_nodes(FakeGrid({100, 205, 206}), clients, {100, 205, 206}, foreign=foreign, server_round=1) == [0]
    assert clients == {0: 100, 1: 101}
    assert foreign == {205, 206}


def test_after_the_wait_a_round_goes_on_with_fewer_clients_but_never_with_none(answers):
    clients = {0: 100, 1: 101, 2: 102}
    assert wait_for_partitions(
        FakeGrid({102}), clients, min_available=3, wait_s=0.0, foreign=set(), server_round=2
    ) == [2]
    with pytest.raises(RuntimeError, match="round 5: no client node is connected"):
        wait_for_partitions(FakeGrid(set()), clients, min_available=1, wait_s=0.0, foreign=set(), server_round=5)
