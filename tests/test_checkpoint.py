"""Checkpoints and resume: atomic round checkpoints with pruning, the results writer continuing a run, the clients'
per-round state versions, and every strategy's state surviving a checkpoint round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedssl_wire import DiskStateStore, RoundStateStore
from server_app.checkpoint import CheckpointDamaged, complete_checkpoints, load_latest_checkpoint, save_checkpoint
from server_app.results import ResultsWriter
from strategies import get_strategy_class


def test_checkpoints_are_complete_or_absent_and_pruned(tmp_path):
    store = DiskStateStore(tmp_path / "client_state" / "server-side")
    store.save(0, {"w": np.ones(2, np.float32)})
    for rnd in (1, 2, 3):
        save_checkpoint(
            tmp_path,
            rnd,
            {"config": {"name": "x"}, "stores": ["server-side"]},
            {"backbone.w": np.full(3, rnd, np.float32)},
            {"key": np.arange(rnd)},
            {"server-side": store.root},
            keep=2,
        )
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["round-000002", "round-000003"]
    # A folder left by a crash before its rename is not a checkpoint.
    (tmp_path / "checkpoints" / ".tmp-round-000004-dead").mkdir()
    (tmp_path / "checkpoints" / "round-000005").mkdir()  # no meta.json: incomplete
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.round == 3 and ckpt.meta["config"] == {"name": "x"}
    np.testing.assert_array_equal(ckpt.global_arrays["backbone.w"], np.full(3, 3, np.float32))
    np.testing.assert_array_equal(ckpt.strategy_arrays["key"], np.arange(3))
    # The store snapshot does not follow later changes of the store.
    store.save(0, {"w": np.zeros(2, np.float32)})
    restored = DiskStateStore(tmp_path / "restored")
    restored.replace_with(ckpt.store_snapshot("server-side"))
    np.testing.assert_array_equal(restored.load(0)["w"], np.ones(2, np.float32))


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"resume: .* holds no complete checkpoint"):
        load_latest_checkpoint(tmp_path)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    for rnd in (1, 2):
        save_checkpoint(
            tmp_path,
            rnd,
            {"config": {"name": "x"}},
            {"w": np.full(64, rnd, np.float32)},
            {"key": np.arange(rnd)},
            {},
            keep=2,
        )
    newest = tmp_path / "checkpoints" / "round-000002" / "global.npz"
    newest.write_bytes(newest.read_bytes()[:40])  # a copy cut short, a disk that filled
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.round == 1
    np.testing.assert_array_equal(ckpt.global_arrays["w"], np.full(64, 1, np.float32))
    assert len(ckpt.damaged) == 1 and str(tmp_path / "checkpoints" / "round-000002") in ckpt.damaged[0]
    # A member whose bytes changed (its CRC no longer matches) is damage too, found when the arrays are read.
    older = tmp_path / "checkpoints" / "round-000001" / "strategy.npz"
    data = bytearray(older.read_bytes())
    data[data.index(b"\x93NUMPY") + 130] ^= 0xFF
    older.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged) as err:
        load_latest_checkpoint(tmp_path)
    message = str(err.value)
    assert "every checkpoint" in message and "round-000002" in message and "round-000001" in message
    assert isinstance(err.value, FileNotFoundError)  # the ServerApp's one-line error for a resume that cannot start


def test_a_resumed_writer_keeps_the_rounds_up_to_the_checkpoint(tmp_path):
    writer = ResultsWriter(tmp_path)
    for rnd in (1, 2, 3):
        writer.write_round({"round": rnd, "train_loss": 1.0 / rnd, "bytes_up": 10})
    writer.progress("round 3/5")
    resumed = ResultsWriter(tmp_path, resume_round=2)  # round 3 was cut off after its line was written
    assert [r["round"] for r in resumed.records] == [1, 2]
    assert [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    resumed.write_round({"round": 3, "train_loss": 0.3, "bytes_up": 10})
    assert resumed.totals()["bytes_up_total"] == 30 and resumed.totals()["rounds_completed"] == 3
    assert "round 3/5" in (tmp_path / "progress.log").read_text()  # the log is appended to, never emptied


def test_round_state_store_reads_an_earlier_round_and_keeps_two(tmp_path):
    store = RoundStateStore(tmp_path)
    assert store.load_before(0, 1) is None
    for rnd in (1, 2, 3):
        store.save_round(0, rnd, {"r": np.array([rnd])})
    assert [r for r, _ in store.versions(0)] == [2, 3]  # the last two
    assert int(store.load_before(0, 4)["r"][0]) == 3
    # A run resumed at round 3 after round 3 had already saved: the client starts from round 2's state.
    assert int(store.load_before(0, 3)["r"][0]) == 2
    assert int(store.load(0)["r"][0]) == 3  # a query reads the newest


def test_strategy_state_round_trips_through_a_checkpoint(tmp_path):
    fedema = get_strategy_class("fedema")(clients={0: 10, 1: 11}, clients_per_round=2, state_dir=str(tmp_path))
    fedema.autoscaler_lambdas = {0: 0.25, 1: 1.5}
    plain, arrays, stores = fedema.checkpoint_state()
    other = get_strategy_class("fedema")(clients={0: 10, 1: 11}, clients_per_round=2, state_dir=str(tmp_path))
    other.restore_state(json.loads(json.dumps(plain)), arrays, stores)
    assert other.autoscaler_lambdas == {0: 0.25, 1: 1.5}

    server = get_strategy_class("fedssl")(
        clients={0: 10}, clients_per_round=1, state_dir=str(tmp_path / "s"), options={"client_state": "server"}
    )
    server.server_store.save(0, {"target.w": np.full(2, 7.0)})
    plain, arrays, stores = server.checkpoint_state()
    save_checkpoint(
        tmp_path / "run",
        1,
        {"strategy": plain, "stores": sorted(stores)},
        {},
        arrays,
        {k: v for k, v in stores.items()},
        keep=1,
    )
    server.server_store.save(0, {"target.w": np.zeros(2)})  # what round 2 wrote before the server died
    ckpt = load_latest_checkpoint(tmp_path / "run")
    server.restore_state(
        ckpt.meta["strategy"], ckpt.strategy_arrays, {n: str(ckpt.store_snapshot(n)) for n in ckpt.meta["stores"]}
    )
    np.testing.assert_array_equal(server.server_store.load(0)["target.w"], np.full(2, 7.0))
