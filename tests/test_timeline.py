"""A deployed round's timeline: the ClientApp's points (client_app/timeline.py) and the server's offsets from
them (strategies/nodes.py client_timeline), checked against hand values and a real new process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client_app.timeline import process_start_time, timeline_metrics
from strategies.nodes import client_timeline

REPO = Path(__file__).resolve().parents[1]


def test_client_timeline_is_each_point_minus_the_send_time():
    metrics = {
        "t.sent": 1000.0,
        "t.process_start": 1002.25,
        "t.import_start": 1003.0,
        "t.app_imported": 1004.5,
        "t.handler_start": 1005.0,
        "t.reply_ready": 1006.75,
        "train_loss": 1.0,
    }
    assert client_timeline(metrics, 1007.5) == {
        "process_start": 2.25,
        "import_start": 3.0,
        "app_imported": 4.5,
        "handler_start": 5.0,
        "reply_ready": 6.75,
        "received": 7.5,
    }
    assert client_timeline(metrics, None)["reply_ready"] == 6.75 and "received" not in client_timeline(metrics, None)


def test_client_timeline_ignores_replies_without_it_and_values_that_are_not_numbers():
    assert client_timeline({"train_loss": 1.0}, 5.0) == {}
    assert client_timeline({"t.sent": [1.0, 2.0], "t.reply_ready": 3.0}, 5.0) == {}
    got = client_timeline(
        {"t.sent": 10.0, "t.reply_ready": [1.0], "t.handler_start": float("nan"), "t.app_imported": 11}, 12.0
    )
    assert got == {"app_imported": 1.0, "received": 2.0}


def test_timeline_metrics_carry_the_given_points_and_end_now():
    before = time.time()
    m = timeline_metrics(sent_at=before - 3.0, handler_started_at=before - 1.0, app_imported_at=before - 2.0)
    assert (m["t.sent"], m["t.app_imported"], m["t.handler_start"]) == (before - 3.0, before - 2.0, before - 1.0)
    assert before <= m["t.reply_ready"] <= time.time()
    assert m["t.import_start"] <= before and all(isinstance(v, float) for v in m.values())


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_process_start_time_of_a_new_process_is_when_it_was_started():
    code = (
        "import json, time; from client_app.timeline import process_start_time, PROCESS_STARTED_AT; "
        "print(json.dumps([PROCESS_STARTED_AT, process_start_time(), time.time()]))"
    )
    spawned = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    started, again, now = json.loads(out.stdout.strip().splitlines()[-1])
    # /proc counts in clock ticks (10 ms here): allow a few ticks either side.
    assert spawned - 0.05 <= started <= now
    assert abs(again - started) <= 0.05  # the same process asked twice gives the same start
    assert process_start_time() < spawned - 0.5  # this test process is older: the start is per process
