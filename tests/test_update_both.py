"""Update-both with one meaning for every method with a target branch (BYOL, MoCo).

- default: the target stays the client's own; only the online encoder, projector (and predictor) travel;
- ``update_both`` (the FedEMA paper's): on download the target takes the global online weights too; the
  same online parts travel both ways and nothing else (no target upload, no target kept);
- ``aggregate_target`` (EasyFL's "aggregate the target too"): clients upload their targets, the server
  averages them, and clients take the averaged target.
The MoCo queue always stays on the client. Bytes up and down equal the arrays that travel.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from client_app.app import app
from client_app.rounds.weights import train_local_ssl
from client_app.rules.fedssl_family import fedssl_download
from fedssl_wire import MEMORY_STATE_KEY, from_array_record, record_names, to_array_record
from ssl_models.config import ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from strategies import FLESD, FedEMA, FedSSL, FedU
from strategies.local import Local
from wire_bytes import hand_bytes, raw_bytes

METHODS = {
    "byol": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32},
    "moco": {"proj_hidden_dim": 32, "proj_out_dim": 16, "queue_size": 64},
}
ONLINE = {"byol": ("backbone.", "projector.", "predictor."), "moco": ("backbone.", "projector.")}
TARGET = ("target_backbone.", "target_projector.")


pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


def make_cfg(method: str, **strategy_options) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "rounds": 2,
            "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 16, "partition": "iid"},
            "model": {"arch": "resnet18", "width": 0.125},
            "method": {"name": method, "options": METHODS[method]},
            "strategy": {"name": "fedssl", "options": strategy_options},
            "federation": {"num_clients": 2},
            "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False},
        }
    )


def strategy_for(cfg) -> FedSSL:
    options = {**FedSSL.default_options(), **cfg.strategy.options}
    strategy = FedSSL(clients={0: 100, 1: 101}, clients_per_round=2, seed=0, options=options)
    strategy.prepare(cfg, None, None)
    return strategy


def initial_arrays(cfg, strategy) -> dict[str, np.ndarray]:
    """What the ServerApp sends in round 1 (server_app/app.py: the exchanged parts of the initial model)."""
    model = build_ssl_model(cfg, seed=cfg.seed)
    return state_to_numpy(split_state(model, strategy.exchange_prefixes(model))[0])


def nbytes(state) -> int:
    """Bytes of one record carrying ``state``, from shapes and dtypes (tests/wire_bytes.py), not Flower's count."""
    return hand_bytes(state)


# ---------------------------------------------------------------------------------- download: what is used


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("variant", ["default", "update_both", "aggregate_target"])
def test_what_the_target_takes_on_download(method, variant):
    cfg = make_cfg(method)
    own = state_to_numpy(build_ssl_model(cfg, seed=1).state_dict())  # the client's last state
    donor = build_ssl_model(cfg, seed=2)
    with_target = variant == "aggregate_target"
    glob = state_to_numpy(split_state(donor, donor.shared_prefixes(with_target=with_target))[0])
    local = {k: v for k, v in own.items() if not k.startswith(ONLINE[method])}  # what the client kept
    model = build_ssl_model(cfg, seed=3)
    fedssl_download(model, glob, local, 2, {"update_both": variant == "update_both", "aggregate_target": with_target})
    now = state_to_numpy(model.state_dict())
    targets = [k for k in now if k.startswith(TARGET)]
    assert targets
    for key in targets:
        source = key[len("target_") :]
        expected = own[key] if variant == "default" else glob[source] if variant == "update_both" else glob[key]
        np.testing.assert_array_equal(now[key], expected, err_msg=f"{variant}: {key}")
    for key in glob:  # every array that travelled down is used as it is
        np.testing.assert_array_equal(now[key], glob[key])
    if method == "moco":  # the queue is the client's own in every variant
        np.testing.assert_array_equal(now["queue"], own["queue"])
        np.testing.assert_array_equal(now["queue_ptr"], own["queue_ptr"])


# ---------------------------------------------------------------------------------- what travels, in bytes


@pytest.mark.parametrize("method", sorted(METHODS))
def test_update_both_sends_and_receives_the_online_parts_only(method):
    online = ONLINE[method]
    sizes = {}
    for variant, options in (
        ("default", {}),
        ("update_both", {"update_both": True}),
        ("aggregate_target", {"aggregate_target": True}),
    ):
        cfg = make_cfg(method, **options)
        strategy = strategy_for(cfg)
        down = initial_arrays(cfg, strategy)
        result = train_local_ssl(
            cfg,
            client_images(cfg, 0),
            down,
            None,
            server_round=1,
            partition_id=0,
            lr=0.05,
            update_both=bool(options.get("update_both")),
            aggregate_target=bool(options.get("aggregate_target")),
        )
        up = result.shared_state
        assert list(up) == list(down)  # the same parts both ways
        expected_prefixes = online + (TARGET if variant == "aggregate_target" else ())
        assert {k.split(".")[0] + "." for k in up} == set(expected_prefixes)
        kept = result.local_state
        if variant == "update_both":  # the target is replaced at the next download: it is not kept either
            assert not any(k.startswith(TARGET) for k in kept)
        if variant == "default":
            assert any(k.startswith(TARGET) for k in kept)
        assert ("queue" in kept) == (method == "moco") and "queue" not in up
        sizes[variant] = (raw_bytes(down), raw_bytes(up))  # the arrays' bytes add up (a record's frame does not)
    assert sizes["update_both"] == sizes["default"]  # the paper's update-both costs nothing extra
    down_agg, up_agg = sizes["aggregate_target"]
    model = build_ssl_model(make_cfg(method), seed=0)
    target_bytes = raw_bytes(state_to_numpy({k: v for k, v in model.state_dict().items() if k.startswith(TARGET)}))
    assert down_agg == up_agg == sizes["default"][0] + target_bytes


@pytest.mark.parametrize("method", sorted(METHODS))
def test_update_both_through_the_strategy_and_the_clientapp(method):
    cfg = make_cfg(method, update_both=True)
    cfg.strategy.options = {**FedSSL.default_options(), **cfg.strategy.options}
    strategy = strategy_for(cfg)

    class Grid:
        def get_node_ids(self):
            return [100, 101]

    arrays = to_array_record(initial_arrays(cfg, strategy))
    messages = list(
        strategy.configure_train(1, arrays, ConfigRecord({"experiment": cfg.to_json(), "lr": 0.05}), Grid())
    )
    sent = initial_arrays(cfg, strategy)
    assert strategy._bytes_down[1] == 2 * nbytes(sent)
    replies = []
    for msg in messages:
        pid = msg.metadata.dst_node_id - 100
        assert msg.content["config"]["update-both"] is True and msg.content["config"]["aggregate-target"] is False
        msg.content["config"]["client-state"] = "memory"
        ctx = Context(
            run_id=1,
            node_id=msg.metadata.dst_node_id,
            state=RecordDict(),
            run_config={},
            node_config={"partition-id": pid, "num-partitions": 2},
        )
        out = app(msg, ctx)
        assert not out.has_error(), out.error
        assert record_names(out.content["arrays"]) == record_names(arrays)  # same parts up as down
        kept = from_array_record(ctx.state.array_records[MEMORY_STATE_KEY])
        assert not any(k.startswith(TARGET) for k in kept) and ("queue" in kept) == (method == "moco")
        replies.append(out)
    new_global, _ = strategy.aggregate_train(1, replies)
    record = strategy.round_records[1]
    assert record["bytes_up"] == 2 * nbytes(sent) == record["bytes_down"]
    assert record_names(new_global) == record_names(arrays)


# ---------------------------------------------------------------------------------- validation


def test_update_both_and_aggregate_target_exclude_each_other_and_other_strategies_refuse_them():
    with pytest.raises(ValueError, match=r"^strategy.options.aggregate_target: cannot be combined with update_both"):
        FedSSL.check_options({**FedSSL.default_options(), "update_both": True, "aggregate_target": True})
    for cls in (FedEMA, FedU, FLESD, Local):
        for key in ("update_both", "aggregate_target"):
            with pytest.raises(ValueError, match=rf"^strategy.options.{key}: not supported by strategy"):
                cls.check_options({**cls.default_options(), key: True})
