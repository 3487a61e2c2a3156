"""The ServerApp's own reply polling: quick first pulls backing off, every reply collected, the timeout kept."""

from __future__ import annotations

import time
from types import SimpleNamespace

from strategies.nodes import send_and_receive


class PushPullGrid:
    """Replies to message i become available ``delays[i]`` seconds after the push."""

    def __init__(self, delays):
        self.delays, self.pulls = delays, 0

    def push_messages(self, messages):
        self.t0 = time.monotonic()
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        now = time.monotonic() - self.t0
        return [
            SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=f"m{i}", message_id=f"r{i}"))
            for i, d in enumerate(self.delays)
            if f"m{i}" in ids and d <= now
        ]


def test_replies_are_collected_soon_after_they_arrive():
    grid = PushPullGrid([0.0, 0.3])
    t0 = time.monotonic()
    replies = send_and_receive(grid, ["a", "b"], timeout=30)
    elapsed = time.monotonic() - t0
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1"]
    assert elapsed < 1.0  # Flower's own loop sleeps 3 s between pulls
    assert grid.pulls <= 8  # backing off: a handful of requests, not a busy loop


def test_the_timeout_ends_the_wait_with_what_has_arrived():
    grid = PushPullGrid([0.0, 60.0])
    t0 = time.monotonic()
    replies = send_and_receive(grid, ["a", "b"], timeout=0.5)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert 0.4 <= time.monotonic() - t0 < 2.0


def test_arrivals_record_when_each_reply_was_pulled():
    grid = PushPullGrid([0.0, 0.4])
    arrivals = {}
    before = time.time()
    send_and_receive(grid, ["a", "b"], timeout=30, arrivals=arrivals)
    after = time.time()
    assert sorted(arrivals) == ["r0", "r1"]
    assert before <= arrivals["r0"] < before + 0.3  # the first pull, right after the push
    assert arrivals["r0"] + 0.3 <= arrivals["r1"] <= after  # pulled once it existed, 0.4 s in
