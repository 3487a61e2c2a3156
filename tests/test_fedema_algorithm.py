"""FedEMA as Algorithm 1 of its paper, and FedU on the divergence its threshold was tuned for.

- A client seen for the first time or not selected in the previous round takes the global model for its
  online encoder, predictor and target.
- The autoscaler's lambda_k = tau / ||W_g^{r+1} - W_k^r|| is set by the server once per client, right after the
  client's first training round (the new aggregate against its upload), and sent to it every later round;
  under partial participation that is not the lambda a client would compute at its first EMA.
- ``divergence: easyfl`` really is the size of the client's previous local update; FedU's threshold works both
  ways on it.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from client_app.app import app
from client_app.rounds.weights import train_local_ssl
from client_app.rules.fedssl_family import fedema_download, fedu_download
from fedssl_wire import MEMORY_STATE_KEY, from_array_record, to_array_record
from ssl_models.config import ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.model_merge import autoscaler_lambda, easyfl_divergence, l2_divergence
from strategies import FedEMA, FedU

TINY = {
    "rounds": 4,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "byol", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}},
    "federation": {"num_clients": 3},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False},
}
ONLINE = ("backbone.", "projector.")
TAU = 0.7


pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


@pytest.fixture(scope="module")
def cfg():
    return ExperimentConfig.from_dict(TINY)


def options(**kw):
    return {**FedEMA.default_options(), **kw}


def initial_global(cfg):
    model = build_ssl_model(cfg, seed=cfg.seed)
    return state_to_numpy(split_state(model, model.shared_prefixes())[0])


def make_strategy(cls=FedEMA, n=3, **opts):
    return cls(
        clients={pid: 100 + pid for pid in range(n)},
        clients_per_round=n,
        seed=0,
        options={**cls.default_options(), **opts},
    )


def reply(result, pid):
    """The reply a client sends after ``train_local_ssl`` (as client_app.app.train encodes it)."""
    metrics = {
        "partition-id": pid,
        "num-examples": result.stats.num_examples,
        "train_loss": result.stats.loss,
        "train_s": result.stats.seconds,
    }
    for key, value in result.info.items():
        if isinstance(value, bool):
            metrics[f"rule.{key}"] = int(value)
        elif isinstance(value, (int, float)):
            metrics[f"rule.{key}"] = float(value)
    request = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=100 + pid, message_type="train")
    return Message(
        RecordDict({"arrays": to_array_record(result.shared_state), "metrics": MetricRecord(metrics)}), reply_to=request
    )


def rule_inputs(strategy, server_round, pid):
    prefix = "rule-input."
    cfg = strategy.config_for_client(server_round, pid)
    return {k[len(prefix) :]: v for k, v in cfg.items() if k.startswith(prefix)}


class Federation:
    """Drives real client rounds (train_local_ssl) and the real strategy's aggregation, without Flower's loop."""

    def __init__(self, cfg, strategy, rule_options):
        self.cfg, self.strategy, self.rule_options = cfg, strategy, rule_options
        self.glob = initial_global(cfg)
        self.states: dict[int, dict] = {}
        self.history: list[dict] = []  # per round: {"global": arrays sent, "results": {pid: result}}

    def round(self, server_round, pids):
        sent = self.glob
        results = {}
        for pid in pids:
            results[pid] = train_local_ssl(
                self.cfg,
                client_images(self.cfg, pid),
                sent,
                self.states.get(pid),
                server_round=server_round,
                partition_id=pid,
                lr=0.05,
                rule=self.strategy.client_update,
                rule_options=self.rule_options,
                rule_inputs=rule_inputs(self.strategy, server_round, pid),
            )
            self.states[pid] = results[pid].client_state
        replies = [reply(results[p], p) for p in pids]
        arrays, _ = self.strategy.aggregate_train(server_round, replies)
        self.glob = from_array_record(arrays)
        self.history.append({"global": sent, "new_global": self.glob, "results": results, "replies": replies})
        return results


# ---------------------------------------------------------------------------------- (a) target reset


def test_after_a_skipped_round_online_predictor_and_target_restart_from_the_global_model(cfg):
    method = build_ssl_model(cfg, seed=1)
    own = state_to_numpy(build_ssl_model(cfg, seed=3).state_dict())
    glob = initial_global(cfg)  # online encoder, projector, predictor of another model
    state = {**own, "meta.last_round": np.array([2])}
    info = fedema_download(method, glob, state, 4, options())  # trained in round 2, not in round 3
    now = state_to_numpy(method.state_dict())
    assert info["ema"] is False and info["reason"] == "not selected in the previous round"
    targets = [k for k in now if k.startswith("target_")]
    assert targets and not np.array_equal(own["target_backbone.stem.0.weight"], glob["backbone.stem.0.weight"])
    for key in targets:  # every target entry (weights and BN statistics) is the global online one
        np.testing.assert_array_equal(now[key], glob[key[len("target_") :]])
    for key, value in glob.items():
        np.testing.assert_array_equal(now[key], value)
    # a client that trained in the previous round keeps its own target
    kept = build_ssl_model(cfg, seed=1)
    fedema_download(kept, glob, {**own, "meta.last_round": np.array([3])}, 4, options())
    np.testing.assert_array_equal(
        state_to_numpy(kept.state_dict())["target_backbone.stem.0.weight"], own["target_backbone.stem.0.weight"]
    )


# ---------------------------------------------------------------------------------- (b) server-side lambda


def test_full_participation_lambda_from_the_first_upload_gives_first_mu_tau(cfg):
    strategy = make_strategy(n=2)
    fed = Federation(cfg, strategy, options())
    fed.round(1, [0, 1])
    record = strategy.round_records[1]
    assert record["lambda_from"] == "server_first_round" and record["divergence_form"] == "paper"
    new_global = fed.history[0]["new_global"]
    for pid in (0, 1):
        upload = fed.history[0]["results"][pid].shared_state
        expected = TAU / l2_divergence(new_global, upload, ONLINE)
        assert strategy.autoscaler_lambdas[pid] == pytest.approx(expected, rel=1e-12)
        client = next(c for c in record["clients"] if c["id"] == pid)
        assert client["lambda_set"] == strategy.autoscaler_lambdas[pid]
        assert strategy.config_for_client(2, pid) == {"rule-input.server_lambda": strategy.autoscaler_lambdas[pid]}
    assert isinstance(strategy.autoscaler_lambdas, dict) and all(
        type(k) is int and type(v) is float for k, v in strategy.autoscaler_lambdas.items()
    )
    second = fed.round(2, [0, 1])
    for pid in (0, 1):  # the client's divergence is the server's: its first mu is tau
        info = second[pid].info
        assert info["lambda_from_server"] is True and info["lambda"] == strategy.autoscaler_lambdas[pid]
        assert info["mu"] == pytest.approx(TAU, abs=1e-9)
        assert "meta.lambda" not in second[pid].client_state  # the server holds it


def test_partial_participation_lambda_comes_from_the_first_round_not_the_first_ema(cfg):
    strategy = make_strategy(n=3)
    fed = Federation(cfg, strategy, options())
    fed.round(1, [0, 2])
    lam_2 = strategy.autoscaler_lambdas[2]
    round1 = fed.history[0]
    assert lam_2 == pytest.approx(
        TAU / l2_divergence(round1["new_global"], round1["results"][2].shared_state, ONLINE), rel=1e-12
    )
    fed.round(2, [0, 1])  # client 2 skips round 2; client 1's first upload sets its lambda now
    assert strategy.autoscaler_lambdas[2] == lam_2 and set(strategy.autoscaler_lambdas) == {0, 1, 2}
    third = fed.round(3, [1, 2])  # client 2 was not selected in round 2: it restarts from the global model
    assert third[2].info["ema"] is False and third[2].info["reason"] == "not selected in the previous round"
    fourth = fed.round(4, [2])  # its first EMA: lambda from round 1, so mu is not tau
    info = fourth[2].info
    assert info["ema"] and info["lambda_from_server"] and info["lambda"] == lam_2 == strategy.autoscaler_lambdas[2]
    assert info["mu"] == pytest.approx(min(1.0, lam_2 * info["divergence"]), rel=1e-12)
    at_first_ema = autoscaler_lambda(TAU, info["divergence"])  # what client_first_ema would have used
    assert abs(info["mu"] - TAU) > 1e-3 and lam_2 != pytest.approx(at_first_ema, rel=1e-3)

    # The earlier behaviour, as a named option: the server sets nothing, and the client sets lambda = tau / d at
    # its first EMA, so from the same state its first mu is tau.
    old = make_strategy(n=3, lambda_from="client_first_ema")
    old.aggregate_train(1, fed.history[0]["replies"])
    assert old.autoscaler_lambdas == {} and old.config_for_client(2, 2) == {}
    assert old.round_records[1]["lambda_from"] == "client_first_ema"
    state_after_3 = third[2].client_state
    method = build_ssl_model(cfg, seed=5)
    info_old = fedema_download(
        method, fed.history[3]["global"], state_after_3, 4, options(lambda_from="client_first_ema")
    )
    assert info_old["divergence"] == pytest.approx(info["divergence"], rel=1e-12)  # same client, same global
    assert info_old["mu"] == pytest.approx(TAU, abs=1e-9) and info_old["lambda_from_server"] is False


def test_only_the_clients_with_a_lambda_get_one_in_their_message(cfg):
    class Grid:
        def get_node_ids(self):
            return [100, 101, 102]

    strategy = make_strategy(n=3)
    strategy.autoscaler_lambdas = {0: 0.25, 2: 1.5}
    msgs = strategy.configure_train(2, to_array_record(initial_global(cfg)), ConfigRecord(), Grid())
    sent = {m.metadata.dst_node_id - 100: m.content["config"] for m in msgs}
    assert sent[0]["rule-input.server_lambda"] == 0.25 and sent[2]["rule-input.server_lambda"] == 1.5
    assert "rule-input.server_lambda" not in sent[1]
    constant = make_strategy(n=3, mu_mode="constant")  # no autoscaler: nothing is set or sent
    constant.autoscaler_lambdas = {0: 0.25}
    assert constant.config_for_client(2, 0) == {}


def test_the_clientapp_hands_the_servers_lambda_to_the_download_rule(cfg):
    ctx = Context(
        run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 3}, state=RecordDict(), run_config={}
    )
    fedema_cfg = ExperimentConfig.from_dict({**TINY, "strategy": {"name": "fedema"}})
    fedema_cfg.strategy.options = options()
    glob = initial_global(cfg)
    replies = []
    lam = None
    for server_round in (1, 2):
        extra = {} if lam is None else {"rule-input.server_lambda": lam}
        msg = Message(
            RecordDict(
                {
                    "arrays": to_array_record(glob),
                    "config": ConfigRecord(
                        {
                            "experiment": fedema_cfg.to_json(),
                            "server-round": server_round,
                            "lr": 0.05,
                            "client-update": "fedema",
                            "client-state": "memory",
                            **extra,
                        }
                    ),
                }
            ),
            dst_node_id=5,
            message_type="train",
        )
        replies.append(app(msg, ctx))
        assert not replies[-1].has_error(), replies[-1].error
        # a lambda that makes round 2's mu 0.3 exactly (not capped at 1): d = ||W_g - W_k||, W_k the round-1 upload
        d = l2_divergence(glob, from_array_record(replies[-1].content["arrays"]), ONLINE)
        lam = 0.3 / d
    m = replies[1].content["metrics"]
    assert m["rule.lambda"] == pytest.approx(0.3 / m["rule.divergence"], rel=1e-9)
    assert m["rule.lambda_from_server"] == 1 and m["rule.ema"] == 1
    assert m["rule.mu"] == pytest.approx(0.3, rel=1e-9)
    assert "meta.lambda" not in from_array_record(ctx.state.array_records[MEMORY_STATE_KEY])


# ---------------------------------------------------------------------------------- divergence: easyfl


def test_easyfl_divergence_is_the_size_of_the_previous_local_update_and_sets_the_servers_lambda(cfg):
    strategy = make_strategy(n=2, divergence="easyfl")
    fed = Federation(cfg, strategy, options(divergence="easyfl"))
    first = fed.round(1, [0, 1])
    for pid in (0, 1):
        # start = the global model the client received (a first participation takes it as it is), end = upload
        expected = easyfl_divergence(fed.history[0]["global"], first[pid].shared_state)
        assert expected > 0 and first[pid].info["update_size"] == pytest.approx(expected, rel=1e-12)
        assert strategy.autoscaler_lambdas[pid] == pytest.approx(TAU / expected, rel=1e-12)
    second = fed.round(2, [0, 1])
    for pid in (0, 1):
        expected = easyfl_divergence(fed.history[0]["global"], first[pid].shared_state)
        info = second[pid].info
        assert info["divergence"] == pytest.approx(expected, rel=1e-12)  # really used: not the paper form
        assert info["divergence"] != pytest.approx(info["divergence_paper"], rel=1e-3)
        assert info["mu"] == pytest.approx(TAU, abs=1e-9)  # lambda = tau / d_1 and d = d_1
    assert strategy.round_records[2]["divergence_form"] == "easyfl"


# ---------------------------------------------------------------------------------- FedU


def test_fedu_defaults_to_easyfl_divergence_and_its_threshold_works_both_ways(cfg):
    assert FedU.default_options()["divergence"] == "easyfl" and FedU.default_options()["threshold"] == 0.4
    own = state_to_numpy(build_ssl_model(cfg, seed=3).state_dict())
    glob = initial_global(cfg)
    pred = next(k for k in glob if k.startswith("predictor.") and k.endswith("weight"))
    for update_size, takes_global in ((0.3, True), (0.5, False)):
        method = build_ssl_model(cfg, seed=1)
        state = {**own, "meta.last_round": np.array([1]), "meta.update_size": np.array([update_size])}
        info = fedu_download(method, glob, state, 2, FedU.default_options())
        now = state_to_numpy(method.state_dict())
        assert info["divergence"] == update_size and info["predictor_updated"] is takes_global
        np.testing.assert_array_equal(now[pred], glob[pred] if takes_global else own[pred])
        np.testing.assert_array_equal(now["backbone.stem.0.weight"], glob["backbone.stem.0.weight"])


def test_fedu_over_real_rounds_uses_the_last_update_size(cfg):
    strategy = make_strategy(FedU, n=2)
    fed = Federation(cfg, strategy, strategy.options)
    first = fed.round(1, [0, 1])
    second = fed.round(2, [0, 1])
    for pid in (0, 1):
        expected = easyfl_divergence(fed.history[0]["global"], first[pid].shared_state)
        assert second[pid].info["divergence"] == pytest.approx(expected, rel=1e-12)
        assert second[pid].info["predictor_updated"] is (expected < 0.4)
    assert strategy.round_records[2]["divergence_form"] == "easyfl"


def test_options_are_validated_with_the_key_named():
    with pytest.raises(ValueError, match=r"^strategy.options.lambda_from: must be one of"):
        FedEMA.check_options(options(lambda_from="first_ema"))
    for cls in (FedEMA, FedU):
        for key in ("update_both", "aggregate_target"):
            with pytest.raises(ValueError, match=rf"^strategy.options.{key}: not supported by strategy"):
                cls.check_options({**cls.default_options(), key: True})
