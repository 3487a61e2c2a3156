"""Client side: local state kept between rounds, target branch local, the handlers' replies."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app.app import app
from client_app.rounds.weights import train_local_ssl
from fedssl_wire import MEMORY_STATE_KEY, from_array_record, to_array_record
from ssl_models.config import ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.training import fast_path_for, resolve_device

TINY = {
    "rounds": 2,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {
        "name": "byol",
        "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32, "momentum": 0.9},
    },
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False},
}


@pytest.fixture()
def cfg():
    return ExperimentConfig.from_dict(TINY)


def global_shared(cfg, with_target=False):
    model = build_ssl_model(cfg, seed=123)
    shared, _ = split_state(model, model.shared_prefixes(with_target))
    return state_to_numpy(shared)


def test_first_participation_starts_target_from_the_global_online_branch(cfg):
    images = client_images(cfg, 0)
    g = global_shared(cfg)
    res = train_local_ssl(cfg, images, g, None, server_round=1, partition_id=0, lr=0.05)
    assert set(res.shared_state) == set(g)
    assert all(k.startswith("target_") for k in res.local_state)
    # One step with momentum 0.9: target = 0.9 * global + 0.1 * (updated online), so close to global.
    key = "backbone.stem.0.weight"
    tgt = res.local_state["target_" + key]
    assert np.abs(tgt - g[key]).max() < np.abs(res.shared_state[key] - g[key]).max() + 1e-12
    np.testing.assert_allclose(tgt, 0.9 * g[key] + 0.1 * res.shared_state[key], rtol=1e-4, atol=1e-6)


def test_local_target_is_restored_not_replaced_by_the_global_model(cfg):
    images = client_images(cfg, 1)
    g = global_shared(cfg)
    first = train_local_ssl(cfg, images, g, None, server_round=1, partition_id=1, lr=0.05)
    marked = {k: np.full_like(v, 0.5) if k.endswith("stem.0.weight") else v for k, v in first.local_state.items()}
    second = train_local_ssl(cfg, images, g, marked, server_round=2, partition_id=1, lr=0.05)
    key = "backbone.stem.0.weight"
    expected = 0.9 * 0.5 + 0.1 * second.shared_state[key]  # EMA from the client's own target, not the global
    np.testing.assert_allclose(second.local_state["target_" + key], expected, rtol=1e-4, atol=1e-6)


def test_simclr_has_no_local_state_and_only_aggregate_target_uploads_the_target():
    simclr = ExperimentConfig.from_dict(
        {**TINY, "method": {"name": "simclr", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16}}}
    )
    res = train_local_ssl(
        simclr, client_images(simclr, 0), global_shared(simclr), None, server_round=1, partition_id=0, lr=0.05
    )
    assert res.local_state == {} and res.stats.steps == 1 and np.isfinite(res.stats.loss)
    byol = ExperimentConfig.from_dict(TINY)
    res = train_local_ssl(
        byol,
        client_images(byol, 0),
        global_shared(byol, True),
        None,
        server_round=1,
        partition_id=0,
        lr=0.05,
        aggregate_target=True,
    )
    assert any(k.startswith("target_") for k in res.shared_state) and not res.local_state
    res = train_local_ssl(
        byol,
        client_images(byol, 0),
        global_shared(byol),
        None,
        server_round=1,
        partition_id=0,
        lr=0.05,
        update_both=True,
    )  # the paper's: no target upload, none kept
    assert not any(k.startswith("target_") for k in res.shared_state) and not res.local_state


@pytest.fixture()
def run_identity():
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def test_handlers_reply_and_keep_state_in_context(cfg, run_identity):
    ctx = Context(
        run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    info = app(Message(RecordDict({"config": ConfigRecord()}), dst_node_id=5, message_type="query.info"), ctx)
    assert info.content["metrics"]["partition-id"] == 1 and info.content["metrics"]["num-partitions"] == 2
    g = global_shared(cfg)
    for rnd in (1, 2):
        msg = Message(
            RecordDict(
                {
                    "arrays": to_array_record(g),
                    "config": ConfigRecord(
                        {"experiment": cfg.to_json(), "server-round": rnd, "lr": 0.05, "update-both": False}
                    ),
                }
            ),
            dst_node_id=5,
            message_type="train",
        )
        reply = app(msg, ctx)
        assert not reply.has_error(), reply.error
        m = reply.content["metrics"]
        assert m["partition-id"] == 1 and m["num-examples"] == len(client_images(cfg, 1))
        assert np.isfinite(m["train_loss"]) and m["train_s"] > 0
        # the precision the steps ran in, as the fast path chose it for this machine
        expected = fast_path_for(resolve_device(cfg.train.device), cfg.train.fast_path).precision
        assert [k for k in m if k.startswith("precision.")] == [f"precision.{expected}"]
        assert set(from_array_record(reply.content["arrays"])) == set(g)
        local = from_array_record(ctx.state.array_records[MEMORY_STATE_KEY])
        assert int(local.pop("meta.last_round")[0]) == rnd
        assert local and all(k.startswith("target_") for k in local)


def test_disk_mode_keeps_client_state_out_of_memory(cfg, run_identity, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_RAYLET_PID", "0")  # a simulated ClientApp: it takes the server's state-dir
    ctx = Context(
        run_id=9, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    msg = Message(
        RecordDict(
            {
                "arrays": to_array_record(global_shared(cfg)),
                "config": ConfigRecord(
                    {
                        "experiment": cfg.to_json(),
                        "server-round": 1,
                        "lr": 0.05,
                        "client-state": "disk",
                        "state-dir": str(tmp_path),
                    }
                ),
            }
        ),
        dst_node_id=5,
        message_type="train",
    )
    assert not app(msg, ctx).has_error()
    assert len(ctx.state.array_records) == 0  # nothing held in the node's memory between rounds
    files = list((tmp_path / "run-9").glob("client_*.npz"))
    assert [f.name for f in files] == ["client_0.r000001.npz"]  # one version per round (RoundStateStore)
    with np.load(files[0]) as saved:
        assert any(k.startswith("target_") for k in saved.files) and int(saved["meta.last_round"][0]) == 1


STEM = "backbone.stem.0.weight"


def train_message(cfg, rnd, **config):
    return Message(
        RecordDict(
            {
                "arrays": to_array_record(global_shared(cfg)),
                "config": ConfigRecord({"experiment": cfg.to_json(), "server-round": rnd, "lr": 0.05, **config}),
            }
        ),
        dst_node_id=5,
        message_type="train",
    )


def test_server_client_state_is_read_from_the_message_and_returned_in_the_reply(cfg, run_identity, tmp_path):
    """client_state: server on the client side: the state comes with the message and goes back in the reply;
    nothing stays on the node (memory or disk)."""
    ctx = Context(
        run_id=3, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    server_dir = tmp_path / "server-suggestion"
    first = train_message(cfg, 1, **{"client-state": "server", "state-dir": str(server_dir)})
    first.content["client-state"] = to_array_record({})  # what the strategy sends a client without state yet
    reply = app(first, ctx)
    assert not reply.has_error(), reply.error
    state = from_array_record(reply.content["client-state"])
    assert int(state["meta.last_round"][0]) == 1 and "target_" + STEM in state
    assert len(ctx.state.array_records) == 0 and not server_dir.exists()

    # Round 2: the server sends the state back, marked; the client's target must continue from the marked one
    # (BYOL, momentum 0.9, one step): target = 0.9 * 0.5 + 0.1 * online.
    state["target_" + STEM] = np.full_like(state["target_" + STEM], 0.5)
    second = train_message(cfg, 2, **{"client-state": "server", "state-dir": str(server_dir)})
    second.content["client-state"] = to_array_record(state)
    reply2 = app(second, ctx)
    assert not reply2.has_error(), reply2.error
    state2 = from_array_record(reply2.content["client-state"])
    online = from_array_record(reply2.content["arrays"])[STEM]
    np.testing.assert_allclose(state2["target_" + STEM], 0.9 * 0.5 + 0.1 * online, rtol=1e-4, atol=1e-6)
    assert int(state2["meta.last_round"][0]) == 2
    assert len(ctx.state.array_records) == 0 and not server_dir.exists()


def _saved_states(folder):
    """Every client-state file under ``folder`` (whatever the store's file layout), as dicts."""
    out = []
    for path in sorted(folder.glob("client_0*.npz")):
        with np.load(path) as npz:
            out.append((path, {k: npz[k] for k in npz.files}))
    return out


def test_a_nodes_own_state_dir_wins_over_the_servers_suggestion(cfg, run_identity, tmp_path):
    node_dir, server_dir = tmp_path / "node", tmp_path / "server"
    ctx = Context(
        run_id=9,
        node_id=5,
        state=RecordDict(),
        run_config={},
        node_config={"partition-id": 0, "num-partitions": 2, "state-dir": str(node_dir)},
    )
    config = {"client-state": "disk", "state-dir": str(server_dir)}
    assert not app(train_message(cfg, 1, **config), ctx).has_error()
    saved = _saved_states(node_dir / "run-9")
    assert saved and not server_dir.exists()
    # Round 2 loads from the node's folder: mark the target there and watch round 2 continue from it.
    for path, state in saved:
        state["target_" + STEM] = np.full_like(state["target_" + STEM], 0.5)
        np.savez(path, **state)
    reply = app(train_message(cfg, 2, **config), ctx)
    assert not reply.has_error(), reply.error
    after = [state for _, state in _saved_states(node_dir / "run-9") if int(state["meta.last_round"][0]) == 2]
    assert len(after) == 1 and not server_dir.exists()
    online = from_array_record(reply.content["arrays"])[STEM]
    np.testing.assert_allclose(after[0]["target_" + STEM], 0.9 * 0.5 + 0.1 * online, rtol=1e-4, atol=1e-6)


def test_a_deployed_clientapp_never_writes_under_a_folder_the_server_names(cfg, run_identity, tmp_path, monkeypatch):
    """Deployed (no Ray worker around it), the server's state-dir suggestion is ignored: the state goes to the
    node's own state-dir, or without one to the ClientApp's default under its home folder."""
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    server_dir = tmp_path / "server-named"
    ctx = Context(
        run_id=4, node_id=5, state=RecordDict(), run_config={}, node_config={"partition-id": 0, "num-partitions": 2}
    )
    assert not app(train_message(cfg, 1, **{"client-state": "disk", "state-dir": str(server_dir)}), ctx).has_error()
    assert not server_dir.exists()
    assert (tmp_path / "home" / ".cache" / "fedssl" / "client-state" / "run-4" / "client_0.r000001.npz").is_file()
