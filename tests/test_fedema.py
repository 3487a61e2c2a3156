"""FedEMA and FedU: the merge math against hand computations, and the client download rules."""

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from client_app.rounds.weights import train_local_ssl
from client_app.rules.fedssl_family import fedema_download, fedu_download
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.model_merge import (
    autoscaler_lambda,
    easyfl_conv_keys,
    easyfl_divergence,
    ema_merge,
    fedema_mu,
    l2_divergence,
)
from strategies import FedEMA, FedU

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "rounds": 3,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "byol", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False},
}
ENC = ("backbone.", "projector.")


def fedema_options(**kw):
    return {**FedEMA.default_options(), **kw}


# ------------------------------------------------------------------ pure math


def test_ema_merge_hand_computation():
    local = {
        "enc.w": np.array([1.0, 2.0], np.float32),
        "enc.bn.num_batches_tracked": np.array(5),
        "other.w": np.array([9.0]),
    }
    glob = {
        "enc.w": np.array([3.0, 6.0], np.float32),
        "enc.bn.num_batches_tracked": np.array(7),
        "other.w": np.array([0.0]),
    }
    out = ema_merge(local, glob, 0.25, ("enc.",))
    np.testing.assert_allclose(out["enc.w"], [0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6])  # [2.5, 5.0]
    assert out["enc.w"].dtype == np.float32
    assert int(out["enc.bn.num_batches_tracked"]) == 7 and "other.w" not in out
    with pytest.raises(ValueError, match=r"^ema_merge: mu must be in \[0, 1\], got 1.5"):
        ema_merge(local, glob, 1.5, ("enc.",))


def test_ema_merge_leaves_batchnorm_statistics_global_by_default():
    """The paper's EMA is over the weights W, EasyFL's over parameters(): BatchNorm running statistics take the
    global model's values (bn_stats "global", the default); "ema" moves them with the same mu."""
    local = {
        "enc.bn.weight": np.array([1.0]),
        "enc.bn.running_mean": np.array([1.0]),
        "enc.bn.running_var": np.array([2.0]),
    }
    glob = {
        "enc.bn.weight": np.array([3.0]),
        "enc.bn.running_mean": np.array([5.0]),
        "enc.bn.running_var": np.array([6.0]),
    }
    out = ema_merge(local, glob, 0.25, ("enc.",))
    np.testing.assert_allclose(out["enc.bn.weight"], [0.25 * 1 + 0.75 * 3])  # a parameter: EMA
    np.testing.assert_allclose(out["enc.bn.running_mean"], [5.0])  # statistics: global
    np.testing.assert_allclose(out["enc.bn.running_var"], [6.0])
    moved = ema_merge(local, glob, 0.25, ("enc.",), bn_stats="ema")
    np.testing.assert_allclose(moved["enc.bn.running_mean"], [0.25 * 1 + 0.75 * 5])
    np.testing.assert_allclose(moved["enc.bn.running_var"], [0.25 * 2 + 0.75 * 6])
    with pytest.raises(ValueError, match="bn_stats"):
        ema_merge(local, glob, 0.25, ("enc.",), bn_stats="none")
    assert FedEMA.default_options()["ema_bn_stats"] == "global"


def test_l2_divergence_counts_parameters_not_bn_statistics():
    g = {
        "backbone.w": np.array([0.0, 0.0]),
        "projector.b": np.array([1.0]),
        "backbone.bn.running_mean": np.array([100.0]),
        "predictor.w": np.array([50.0]),
    }
    k = {
        "backbone.w": np.array([3.0, 4.0]),
        "projector.b": np.array([1.0]),
        "backbone.bn.running_mean": np.array([0.0]),
        "predictor.w": np.array([0.0]),
    }
    assert l2_divergence(g, k, ENC) == pytest.approx(5.0)  # sqrt(3^2 + 4^2); BN stats and predictor ignored


def test_easyfl_divergence_is_the_mean_conv_weight_distance():
    start = {
        "backbone.conv1.weight": np.zeros((1, 1, 1, 2)),
        "backbone.conv2.weight": np.zeros((1, 1, 2, 1)),
        "backbone.bn.weight": np.zeros(3),
        "projector.0.weight": np.zeros((2, 2)),
    }
    end = {
        "backbone.conv1.weight": np.full((1, 1, 1, 2), 3.0),
        "backbone.conv2.weight": np.zeros((1, 1, 2, 1)),
        "backbone.bn.weight": np.ones(3),
        "projector.0.weight": np.ones((2, 2)),
    }
    # conv1 distance sqrt(9 + 9), conv2 distance 0; BN and projector weights are not conv weights.
    assert easyfl_divergence(start, end) == pytest.approx(math.sqrt(18) / 2)


def test_easyfl_divergence_leaves_out_the_shortcut_convolutions_as_easyfl_does():
    """A hand-made ResNet-like state: the stem convolution moves by a vector of norm 2, one block's conv1 by 3, its
    1x1 projection shortcut by 100; BatchNorm and projector weights move too. EasyFL averages the weights named
    ``conv`` (stem and residual branch) only: (2 + 3 + 0) / 3."""
    shapes = {
        "backbone.stem.0.weight": (2, 3, 3, 3),
        "backbone.layer2.0.conv1.weight": (4, 2, 3, 3),
        "backbone.layer2.0.conv2.weight": (4, 4, 3, 3),
        "backbone.layer2.0.shortcut.0.weight": (4, 2, 1, 1),
        "backbone.layer2.0.bn1.weight": (4,),
        "backbone.layer2.0.shortcut.1.weight": (4,),
        "projector.0.weight": (8, 4),
    }
    start = {k: np.zeros(v) for k, v in shapes.items()}
    end = {k: np.full(v, 100.0) for k, v in shapes.items()}  # everything not reset below moves a lot
    end["backbone.stem.0.weight"] = np.zeros(shapes["backbone.stem.0.weight"])
    end["backbone.stem.0.weight"][0, 0, 0, :2] = [1.2, 1.6]  # norm 2
    end["backbone.layer2.0.conv1.weight"] = np.zeros(shapes["backbone.layer2.0.conv1.weight"])
    end["backbone.layer2.0.conv1.weight"][1, 1, 1, 1] = -3.0  # norm 3
    end["backbone.layer2.0.conv2.weight"] = np.zeros(shapes["backbone.layer2.0.conv2.weight"])  # norm 0
    assert easyfl_divergence(start, end) == pytest.approx((2.0 + 3.0 + 0.0) / 3)
    # On the real encoders: EasyFL's ResNet-18 has 17 such convolutions (stem + 2 per block x 8), ResNet-34 33.
    for arch, count in (("resnet18", 17), ("resnet34", 33)):
        model = build_ssl_model(ExperimentConfig.from_dict({**TINY, "model": {"arch": arch, "width": 0.125}}))
        assert len(easyfl_conv_keys(model.state_dict())) == count, arch


def test_mu_and_autoscaler():
    assert fedema_mu(0.5, 1.2) == pytest.approx(0.6)
    assert fedema_mu(2.0, 1.0) == 1.0  # capped
    lam = autoscaler_lambda(0.7, 3.0)
    assert fedema_mu(lam, 3.0) == pytest.approx(0.7)


# ------------------------------------------------------------------ download rules on real models


@pytest.fixture()
def cfg():
    return ExperimentConfig.from_dict(TINY)


def model_state(cfg, seed):
    return state_to_numpy(build_ssl_model(cfg, seed=seed).state_dict())


def shared_of(state, method):
    prefixes = method.shared_prefixes(False)
    return {k: v for k, v in state.items() if k.startswith(prefixes)}


def client_state_from(state, last_round, lam=None):
    out = dict(state)
    out["meta.last_round"] = np.array([last_round])
    if lam is not None:
        out["meta.lambda"] = np.array([lam])
    return out


def test_fedema_first_participation_takes_the_global_model(cfg):
    method = build_ssl_model(cfg, seed=1)
    glob = shared_of(model_state(cfg, 2), method)
    info = fedema_download(method, glob, None, 1, fedema_options())
    now = state_to_numpy(method.state_dict())
    for key, value in glob.items():
        np.testing.assert_array_equal(now[key], value)
    np.testing.assert_array_equal(now["target_backbone.stem.0.weight"], glob["backbone.stem.0.weight"])
    assert info["ema"] is False and info["mu"] is None


def test_fedema_ema_update_matches_hand_computation_and_keeps_own_target(cfg):
    method = build_ssl_model(cfg, seed=1)
    own = model_state(cfg, 3)
    glob = shared_of(model_state(cfg, 4), method)
    d = l2_divergence(glob, own, ENC)
    # The option's lambda gives mu = 0.4 (not capped at 1); the client's stored lambda (an autoscaler leftover)
    # differs and must not be used.
    lam = 0.4 / d
    info = fedema_download(
        method,
        glob,
        client_state_from(own, last_round=4, lam=0.8 / d),
        5,
        fedema_options(mu_mode="lambda", **{"lambda": lam}),
    )
    mu = min(lam * d, 1.0)
    assert mu == pytest.approx(0.4)
    assert info["ema"] and info["mu"] == pytest.approx(mu) and info["divergence"] == pytest.approx(d)
    now = state_to_numpy(method.state_dict())
    for key in (
        "backbone.stem.0.weight",
        "projector.net.0.weight"
        if "projector.net.0.weight" in now
        else next(k for k in now if k.startswith("projector.") and k.endswith("weight")),
        next(k for k in now if k.startswith("predictor.") and k.endswith("weight")),
    ):
        np.testing.assert_allclose(now[key], mu * own[key] + (1 - mu) * glob[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(now["target_backbone.stem.0.weight"], own["target_backbone.stem.0.weight"])


def test_fedema_autoscaler_first_ema_uses_tau_and_stores_lambda(cfg):
    method = build_ssl_model(cfg, seed=1)
    own, glob = model_state(cfg, 3), shared_of(model_state(cfg, 4), method)
    info = fedema_download(method, glob, client_state_from(own, last_round=1), 2, fedema_options(tau=0.7))
    assert info["mu"] == pytest.approx(0.7, abs=1e-12)
    assert info["lambda"] == pytest.approx(0.7 / l2_divergence(glob, own, ENC))


def test_fedema_divergence_easyfl_uses_the_stored_update_size_not_the_paper_form(cfg):
    method = build_ssl_model(cfg, seed=1)
    own, glob = model_state(cfg, 3), shared_of(model_state(cfg, 4), method)
    d_paper = l2_divergence(glob, own, ENC)
    state = {**client_state_from(own, last_round=1), "meta.update_size": np.array([0.8])}
    assert abs(d_paper - 0.8) > 0.1
    info = fedema_download(
        method, glob, state, 2, fedema_options(divergence="easyfl", mu_mode="lambda", **{"lambda": 0.5})
    )
    assert info["divergence"] == 0.8 and info["divergence_paper"] == pytest.approx(d_paper)
    assert info["mu"] == pytest.approx(0.4)  # lambda * d = 0.5 * 0.8
    now = state_to_numpy(method.state_dict())
    enc = "backbone.stem.0.weight"
    np.testing.assert_allclose(now[enc], 0.4 * own[enc] + 0.6 * glob[enc], rtol=1e-5, atol=1e-7)
    paper = build_ssl_model(cfg, seed=1)  # the same state under divergence: paper uses ||W_g - W_k||
    info_paper = fedema_download(paper, glob, state, 2, fedema_options(mu_mode="lambda", **{"lambda": 0.5}))
    assert info_paper["divergence"] == pytest.approx(d_paper) and info_paper["mu"] == pytest.approx(
        min(0.5 * d_paper, 1)
    )


def test_fedema_easyfl_divergence_over_real_rounds_is_the_last_local_update_computed_here(cfg):
    opts = fedema_options(divergence="easyfl", mu_mode="lambda", **{"lambda": 0.5})
    method = build_ssl_model(cfg, seed=0)
    glob = state_to_numpy(split_state(method, method.shared_prefixes())[0])
    images = client_images(cfg, 0)
    r1 = train_local_ssl(
        cfg, images, glob, None, server_round=1, partition_id=0, lr=0.05, rule="fedema", rule_options=opts
    )
    # a first participation takes the global model as it is: the local update is glob -> the kept model; EasyFL's
    # convolutions are the stem's and the residual branches' (no 1x1 shortcut)
    keys = [k for k in glob if k.startswith("backbone.") and glob[k].ndim == 4 and ".shortcut." not in k]
    expected = float(
        np.mean([np.linalg.norm(glob[k].astype(np.float64) - r1.client_state[k].astype(np.float64)) for k in keys])
    )
    assert len(keys) > 10 and expected > 0
    assert float(r1.client_state["meta.update_size"][0]) == pytest.approx(expected, rel=1e-9)
    r2 = train_local_ssl(
        cfg, images, glob, r1.client_state, server_round=2, partition_id=0, lr=0.05, rule="fedema", rule_options=opts
    )
    assert r2.info["divergence"] == pytest.approx(expected, rel=1e-9)
    assert r2.info["divergence_paper"] != pytest.approx(expected, rel=1e-3)
    assert r2.info["mu"] == pytest.approx(min(0.5 * expected, 1.0), rel=1e-9)


def test_fedema_client_skipped_last_round_restarts_from_global(cfg):
    method = build_ssl_model(cfg, seed=1)
    own, glob = model_state(cfg, 3), shared_of(model_state(cfg, 4), method)
    info = fedema_download(method, glob, client_state_from(own, last_round=1, lam=0.3), 3, fedema_options())
    now = state_to_numpy(method.state_dict())
    assert info["ema"] is False and "not selected" in info["reason"]
    for key, value in glob.items():
        np.testing.assert_array_equal(now[key], value)
    # Algorithm 1, lines 13-14: the target restarts from the global model too.
    np.testing.assert_array_equal(now["target_backbone.stem.0.weight"], glob["backbone.stem.0.weight"])


def test_fedema_constant_mu_and_scopes(cfg):
    method = build_ssl_model(cfg, seed=1)
    own, glob = model_state(cfg, 3), shared_of(model_state(cfg, 4), method)
    pred = next(k for k in glob if k.startswith("predictor.") and k.endswith("weight"))
    enc = "backbone.stem.0.weight"
    fedema_download(
        method, glob, client_state_from(own, 1), 2, fedema_options(mu_mode="constant", mu_encoder=0.3, mu_predictor=0.6)
    )
    now = state_to_numpy(method.state_dict())
    np.testing.assert_allclose(now[enc], 0.3 * own[enc] + 0.7 * glob[enc], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(now[pred], 0.6 * own[pred] + 0.4 * glob[pred], rtol=1e-5, atol=1e-7)
    for scope, enc_mu, pred_mu in (("encoder", 0.3, 0.0), ("predictor", 0.0, 0.6)):
        m = build_ssl_model(cfg, seed=1)
        fedema_download(
            m,
            glob,
            client_state_from(own, 1),
            2,
            fedema_options(mu_mode="constant", mu_encoder=0.3, mu_predictor=0.6, ema_scope=scope),
        )
        s = state_to_numpy(m.state_dict())
        np.testing.assert_allclose(s[enc], enc_mu * own[enc] + (1 - enc_mu) * glob[enc], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(s[pred], pred_mu * own[pred] + (1 - pred_mu) * glob[pred], rtol=1e-5, atol=1e-7)


def test_fedu_threshold_switches_the_predictor(cfg):
    own, glob_full = model_state(cfg, 3), model_state(cfg, 4)
    method = build_ssl_model(cfg, seed=1)
    glob = shared_of(glob_full, method)
    d = l2_divergence(glob, own, ENC)
    pred = next(k for k in glob if k.startswith("predictor.") and k.endswith("weight"))
    for threshold, takes_global in ((d * 2, True), (d / 2, False)):
        m = build_ssl_model(cfg, seed=1)
        info = fedu_download(m, glob, client_state_from(own, 1), 2, {"threshold": threshold, "divergence": "paper"})
        s = state_to_numpy(m.state_dict())
        assert info["predictor_updated"] is takes_global and info["divergence"] == pytest.approx(d)
        np.testing.assert_array_equal(s[pred], glob[pred] if takes_global else own[pred])
        np.testing.assert_array_equal(s["backbone.stem.0.weight"], glob["backbone.stem.0.weight"])
        np.testing.assert_array_equal(s["target_backbone.stem.0.weight"], own["target_backbone.stem.0.weight"])


def test_every_client_first_mu_equals_tau_over_real_rounds(cfg):
    # lambda_from client_first_ema: the client sets lambda at its first EMA (the server-side default is
    # tested in tests/test_fedema_algorithm.py).
    options = fedema_options(lambda_from="client_first_ema")
    method = build_ssl_model(cfg, seed=0)
    glob = state_to_numpy(split_state(method, method.shared_prefixes())[0])
    for pid in range(2):
        images = client_images(cfg, pid)
        r1 = train_local_ssl(
            cfg, images, glob, None, server_round=1, partition_id=pid, lr=0.05, rule="fedema", rule_options=options
        )
        assert r1.info["mu"] is None and "meta.lambda" not in r1.client_state
        r2 = train_local_ssl(
            cfg,
            images,
            glob,
            r1.client_state,
            server_round=2,
            partition_id=pid,
            lr=0.05,
            rule="fedema",
            rule_options=options,
        )
        assert r2.info["mu"] == pytest.approx(0.7, abs=1e-9)
        lam = float(r2.client_state["meta.lambda"][0])
        r3 = train_local_ssl(
            cfg,
            images,
            glob,
            r2.client_state,
            server_round=3,
            partition_id=pid,
            lr=0.05,
            rule="fedema",
            rule_options=options,
        )
        assert float(r3.client_state["meta.lambda"][0]) == lam  # computed once, then kept
        assert r3.info["mu"] == pytest.approx(min(lam * r3.info["divergence"], 1.0))
        assert r3.client_state["meta.update_size"][0] > 0  # EasyFL divergence of the last local update


def test_strategy_options_are_validated(tmp_path):
    for bad, key in (
        ({"mu_mode": "adaptive"}, "mu_mode"),
        ({"tau": 0.0}, "tau"),
        ({"mu_encoder": 1.5}, "mu_encoder"),
        ({"ema_scope": "all"}, "ema_scope"),
        ({"divergence": "plato"}, "divergence"),
        ({"client_state": "cloud"}, "client_state"),
    ):
        with pytest.raises(ValueError, match=rf"^strategy.options.{key}:"):
            FedEMA.check_options(fedema_options(**bad))
    with pytest.raises(ValueError, match=r"^strategy.options.threshold:"):
        FedU.check_options({**FedU.default_options(), "threshold": -1.0})
    # Through the ServerApp's loader, the same check stops the run with a ConfigError naming the key.
    raw = yaml.safe_load((REPO / "configs/smoke-fedema.yaml").read_text())
    raw["strategy"]["options"]["tau"] = 0.0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^strategy.options.tau: must be > 0"):
        load_experiment({"config": str(path), "data.dataset": "synthetic"})
