"""FedU2: FUR and EUA math against hand computations, the client rule's wiring, and one real `flwr run .`."""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from client_app.rounds.weights import train_local_ssl
from client_app.rules.fedu2 import fedu2_loss_term, fedu2_upload_extra
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.fedu2 import (
    FURSettings,
    eua_aggregate,
    fur_sliced_tangent,
    fur_uot,
    min_norm_weights,
    sharpen,
    sliced_wasserstein,
    sphere_logmap,
    unbalanced_sinkhorn_plan,
)
from strategies import FedU2

REPO = Path(__file__).resolve().parents[1]
E = math.e


def options(**kw):
    return {**FedU2.default_options(), **kw}


# ------------------------------------------------------------------ FUR: unbalanced OT to the uniform sphere


def test_unbalanced_plan_of_one_point_pair_is_the_closed_form():
    # One point each, masses 1: pi minimises c pi + (eps + 2 rho)(pi log pi - pi + 1), so pi = exp(-c / (eps + 2 rho)):
    # c = 2, eps = 0.5, rho = 0.75 -> pi = e^-1.
    plan = unbalanced_sinkhorn_plan(
        torch.tensor([[2.0]]), torch.ones(1), torch.ones(1), epsilon=0.5, rho=0.75, iterations=200
    )
    assert plan.item() == pytest.approx(1 / E, rel=1e-6)


def test_balanced_limit_keeps_the_marginals_and_weights_by_exp_minus_cost_over_eps():
    # rho = inf: exact marginals (0.5, 0.5); symmetric costs [[0, 1], [1, 0]] give pi proportional to exp(-C / eps),
    # so the diagonal is 0.5 / (1 + e^-2) at eps = 0.5.
    half = torch.full((2,), 0.5)
    plan = unbalanced_sinkhorn_plan(
        torch.tensor([[0.0, 1.0], [1.0, 0.0]]), half, half, epsilon=0.5, rho=float("inf"), iterations=200
    )
    diagonal, off = 0.5 / (1 + E**-2), 0.5 * E**-2 / (1 + E**-2)
    np.testing.assert_allclose(plan.numpy(), [[diagonal, off], [off, diagonal]], rtol=1e-6)
    np.testing.assert_allclose(plan.sum(1).numpy(), [0.5, 0.5], rtol=1e-6)


def test_fur_uot_value_and_its_envelope_gradient_by_hand():
    # z = (3, 0) normalises to (1, 0); the uniform sample is (0, 1): C = ||(1, -1)||^2 = 2, pi = e^-1 (as above),
    # FUR = pi C = 2 / e. The plan is held fixed, so d FUR / d z_hat = 2 pi (z_hat - s) = (2/e)(1, -1), and through
    # the normalisation at (3, 0) (Jacobian (I - z_hat z_hat^T) / 3) the gradient is (0, -2 / (3 e)).
    z = torch.tensor([[3.0, 0.0]], requires_grad=True)
    value = fur_uot(z, torch.tensor([[0.0, 1.0]]), epsilon=0.5, rho=0.75, iterations=200)
    assert value.item() == pytest.approx(2 / E, rel=1e-6)
    value.backward()
    np.testing.assert_allclose(z.grad.numpy(), [[0.0, -2 / (3 * E)]], rtol=1e-5, atol=1e-7)


def test_sphere_logmap_by_hand():
    base = torch.tensor([1.0, 0.0, 0.0])
    points = torch.tensor([[0.0, 1.0, 0.0], [2**-0.5, 2**-0.5, 0.0]])
    # the tangent direction towards each point, of length its geodesic distance (pi / 2 and pi / 4)
    np.testing.assert_allclose(
        sphere_logmap(base, points).numpy(), [[0, math.pi / 2, 0], [0, math.pi / 4, 0]], rtol=1e-5, atol=1e-6
    )


def test_sliced_wasserstein_by_hand():
    x, y = torch.tensor([[1.0], [0.0]]), torch.tensor([[3.0], [1.0]])
    # sorted projections (0, 1) vs (1, 3): squared gaps 1 and 4, mean 2.5; a direction of length 2 scales by 4.
    assert sliced_wasserstein(x, y, torch.tensor([[1.0]])).item() == pytest.approx(2.5)
    assert sliced_wasserstein(x, y, torch.tensor([[1.0], [2.0]])).item() == pytest.approx((2.5 + 10.0) / 2)


def test_sliced_tangent_fur_is_zero_on_the_uniform_samples_and_positive_on_a_collapse():
    torch.manual_seed(0)
    samples = torch.nn.functional.normalize(torch.randn(16, 4), dim=1)
    tangent = torch.nn.functional.normalize(torch.randn(3, 4), dim=1)
    directions = torch.randn(5, 4)
    assert fur_sliced_tangent(samples, samples, tangent, directions).item() == pytest.approx(0.0, abs=1e-10)
    collapsed = torch.ones(16, 4)  # every representation at one point
    assert fur_sliced_tangent(collapsed, samples, tangent, directions).item() > 0.1


# ------------------------------------------------------------------ EUA: min-norm weights and the server step


def test_min_norm_weights_by_hand():
    # 4 a^2 + (1 - a)^2 is least at a = 0.2
    np.testing.assert_allclose(min_norm_weights(np.array([[4.0, 0.0], [0.0, 1.0]])), [0.2, 0.8])
    # v2 = 2 v1: the hull's closest point to the origin is v1
    np.testing.assert_allclose(min_norm_weights(np.array([[1.0, 2.0], [2.0, 4.0]])), [1.0, 0.0])
    # e1, e2, -(e1 + e2): the origin is (e1 + e2 - (e1 + e2)) / 3
    gram = np.array([[1.0, 0.0, -1.0], [0.0, 1.0, -1.0], [-1.0, -1.0, 2.0]])
    np.testing.assert_allclose(min_norm_weights(gram), [1 / 3, 1 / 3, 1 / 3], atol=1e-6)
    # (1, 0), (2, 1), (1, 2): the vertex (1, 0) is closest (<v1, v_j - v1> >= 0 for every j), whatever the start
    gram = np.array([[1.0, 2.0, 1.0], [2.0, 5.0, 4.0], [1.0, 4.0, 5.0]])
    np.testing.assert_allclose(min_norm_weights(gram, init=[0.1, 0.2, 0.7]), [1.0, 0.0, 0.0], atol=1e-6)


def test_sharpen_by_hand():
    # shares (1/4, 3/4) at T = 1/2: squares (1/16, 9/16), normalised (0.1, 0.9)
    np.testing.assert_allclose(sharpen([1, 3], 0.5), [0.1, 0.9])
    np.testing.assert_allclose(sharpen([1, 3], 1.0), [0.25, 0.75])


def eua_states():
    def state(w, mean, batches):
        return {
            "w": np.array(w, np.float32),
            "bn.running_mean": np.array([mean], np.float32),
            "bn.num_batches_tracked": np.array(batches, np.int64),
        }

    return state([0.0, 0.0], 0.0, 0), [state([3.0, 0.0], 1.0, 2), state([0.0, 4.0], 5.0, 6)], [1, 3]


def test_eua_step_with_normalised_updates_by_hand():
    start, clients, examples = eua_states()
    # theta_g - theta_k = (-3, 0), (0, -4); normalised gradients 2 (.)/||.|| = (-2, 0), (0, -2): Gram 4 I, so
    # lambda = (1/2, 1/2), direction (-1, -1), and at server_lr 1 the global weights become (1, 1). BN statistics:
    # the example shares (1/4, 3/4): running mean 1/4 + 15/4 = 4, batches tracked 1/2 + 9/2 = 5.
    result = eua_aggregate(start, clients, examples, server_lr=1.0, normalize=True)
    np.testing.assert_allclose(result.weights, [0.5, 0.5])
    np.testing.assert_allclose(result.gram, [[4.0, 0.0], [0.0, 4.0]])
    np.testing.assert_allclose(result.update_norms, [3.0, 4.0])
    np.testing.assert_allclose(result.state["w"], [1.0, 1.0])
    assert result.direction_norm == pytest.approx(math.sqrt(2))
    np.testing.assert_allclose(result.state["bn.running_mean"], [4.0])
    assert int(result.state["bn.num_batches_tracked"]) == 5 and result.state["w"].dtype == np.float32


def test_eua_step_with_raw_updates_sharpening_and_the_two_client_shortcut_by_hand():
    start, clients, examples = eua_states()
    # Raw gradients (-6, 0), (0, -8): Gram diag(36, 64), lambda = (64, 36) / 100; direction
    # 0.64 (-6, 0) + 0.36 (0, -8) = (-3.84, -2.88), of norm 4.8; server_lr 0.5 -> (1.92, 1.44).
    raw = eua_aggregate(start, clients, examples, server_lr=0.5, normalize=False)
    np.testing.assert_allclose(raw.weights, [0.64, 0.36])
    np.testing.assert_allclose(raw.state["w"], [1.92, 1.44], rtol=1e-6)
    assert raw.direction_norm == pytest.approx(4.8)
    # T = 1/2 sharpens the shares to (0.1, 0.9): running mean 0.1 + 4.5 = 4.6, batches 0.2 + 5.4 = 5.6 -> 6.
    sharp = eua_aggregate(start, clients, examples, server_lr=0.5, normalize=False, sharpen_temperature=0.5)
    np.testing.assert_allclose(sharp.state["bn.running_mean"], [4.6], rtol=1e-6)
    assert int(sharp.state["bn.num_batches_tracked"]) == 6
    np.testing.assert_allclose(sharp.weights, [0.64, 0.36])  # the exact solver does not depend on its start
    # The authors' solver returns its start for fewer than 3 clients: lambda = (1/4, 3/4), direction
    # 1/4 (-2, 0) + 3/4 (0, -2) = (-0.5, -1.5), so at server_lr 1 the weights become (0.5, 1.5).
    short = eua_aggregate(start, clients, examples, server_lr=1.0, two_client_shortcut=True)
    np.testing.assert_allclose(short.weights, [0.25, 0.75])
    np.testing.assert_allclose(short.state["w"], [0.5, 1.5])


def test_strategy_options_are_validated(tmp_path):
    for bad, key in (
        ({"fur_form": "sinkhorn"}, "fur_form"),
        ({"aggregator": "mgda"}, "aggregator"),
        ({"fur_weight": -0.1}, "fur_weight"),
        ({"fur_epsilon": 0.0}, "fur_epsilon"),
        ({"fur_rho": -1.0}, "fur_rho"),
        ({"server_lr": 0.0}, "server_lr"),
        ({"sharpen_temperature": 0.0}, "sharpen_temperature"),
        ({"fur_iterations": 0}, "fur_iterations"),
        ({"solver_iterations": 2.5}, "solver_iterations"),
        ({"normalize_updates": "yes"}, "normalize_updates"),
    ):
        with pytest.raises(ValueError, match=rf"^strategy.options.{key}:"):
            FedU2.check_options(options(**bad))
    raw = yaml.safe_load((REPO / "configs/smoke-fedu2.yaml").read_text())
    raw["strategy"]["options"]["fur_rho"] = 0.0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^strategy.options.fur_rho: must be > 0"):
        load_experiment({"config": str(path), "data.dataset": "synthetic"})


def test_paper_study_pairs_each_fedu2_cell_with_plain_averaging_and_holds_the_authors_setting():
    from conftest import study_experiments

    cells = study_experiments("paper/fedu2-table1")
    for name, cfg in cells.items():
        assert (cfg.federation.num_clients, cfg.data.partition, cfg.data.alpha) == (10, "dirichlet", 0.1), name
        assert (cfg.rounds, cfg.train.local_epochs, cfg.train.lr, cfg.train.batch_size) == (100, 5, 0.048, 128), name
        if name.endswith("-fedavg"):
            twin = cells[name.replace("-fedavg", "-fedu2")]
            assert cfg.strategy.name == "fedssl" and cfg.method == twin.method and cfg.data == twin.data
    assert cells["cifar10-simclr-fur-only"].strategy.options["aggregator"] == "fedavg"
    assert cells["cifar10-simclr-eua-only"].strategy.options["fur_weight"] == 0.0
    assert cells["cifar10-simclr-fedu2"].strategy.options["server_lr"] == 8.0


# ------------------------------------------------------------------ the client rule


class TwoViewModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.projector = torch.nn.Linear(3, 4)


def test_rule_adds_fur_of_each_projector_output_only_of_this_model_and_removes_its_hook():
    method = TwoViewModel()
    opts = options(fur_weight=0.5)
    term = fedu2_loss_term(method, {}, opts, "cpu")
    copy.deepcopy(method).projector(torch.randn(5, 3))  # the resource accounting's copy: not this step's
    x1, x2 = torch.randn(6, 3), torch.randn(6, 3)
    z1, z2 = method.projector(x1), method.projector(x2)
    torch.manual_seed(7)
    value = term(method)
    # The same two terms, each against 6 uniform samples drawn in that order from the same seed.
    torch.manual_seed(7)
    settings = FURSettings(epsilon=0.05, rho=0.1, iterations=50)
    expected = 0.0
    for z in (z1, z2):
        samples = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
        expected += float(fur_uot(z.detach(), samples, epsilon=settings.epsilon, rho=settings.rho, iterations=50))
    assert value.item() == pytest.approx(0.5 * expected, rel=1e-5)
    value.backward()
    assert method.projector.weight.grad is not None and method.projector.weight.grad.abs().sum() > 0
    info = {}
    assert fedu2_upload_extra(method, None, None, opts, "cpu", info) == {}  # nothing but the model travels
    assert info["fur_steps"] == 1 and info["fur_mean"] == pytest.approx(expected, rel=1e-5)
    assert info["fur_flops_per_step"] == 2 * 4 * 6 * 6 * 4 and info["fur_weight"] == 0.5
    method.projector(x1)  # the hook is gone
    with pytest.raises(RuntimeError, match="no projector output"):
        term(method)


def test_a_real_local_round_reports_fur_and_uploads_only_the_model():
    cfg = ExperimentConfig.from_dict(
        {
            "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 16, "partition": "iid"},
            "model": {"arch": "resnet18", "width": 0.125},
            "method": {
                "name": "simsiam",
                "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32},
            },
            "strategy": {"name": "fedu2"},
            "federation": {"num_clients": 2},
            "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2, "fast_path": False},
        }
    )
    method = build_ssl_model(cfg, seed=0)
    glob = state_to_numpy(split_state(method, method.shared_prefixes())[0])
    result = train_local_ssl(
        cfg,
        client_images(cfg, 0),
        glob,
        None,
        server_round=1,
        partition_id=0,
        lr=0.05,
        rule="fedu2",
        rule_options=options(),
    )
    assert sorted(result.shared_state) == sorted(glob)  # EUA needs no extra upload
    # SimSiam projects each view separately: 2 terms per step over 16 x 16 representations, 2 steps
    assert result.info["fur_steps"] == 2 and result.info["fur_mean"] > 0
    assert result.info["fur_flops_per_step"] == 2 * 4 * 16 * 16 * 16


# ------------------------------------------------------------------ one real `flwr run .`


@pytest.mark.e2e
def test_fedu2_smoke_run_records_fur_and_eua_per_round(tmp_path):
    from flwr_harness import SHORT_EVAL, data_overrides, flwr_run, read_jsonl

    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke-fedu2.yaml' output-dir='{out}' {data_overrides()} train.max_steps_per_epoch=3 {SHORT_EVAL}",
        tmp_path / "flwr",
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        clients = r["clients"]
        assert sorted(c["id"] for c in clients) == [0, 1]
        for c in clients:  # FUR ran in every local step and is reported
            assert c["fur_steps"] > 0 and math.isfinite(c["fur_mean"]) and c["fur_mean"] > 0
            assert c["fur_weight"] == 0.01 and c["fur_flops_per_step"] > 0 and c["eua_update_norm"] > 0
        # EUA: the weights are the min-norm solution of the recorded Gram matrix (two clients: closed form)
        g = np.array(r["eua_gram"])
        first = min(max((g[1, 1] - g[0, 1]) / (g[0, 0] + g[1, 1] - 2 * g[0, 1]), 0.0), 1.0)
        assert [c["eua_weight"] for c in clients] == pytest.approx([first, 1 - first], abs=1e-9)
        assert r["eua_weights"] == {str(c["id"]): c["eua_weight"] for c in clients}
        lam = np.array([first, 1 - first])
        assert r["eua_direction_norm"] == pytest.approx(math.sqrt(lam @ g @ lam), rel=1e-9)
        assert np.diag(g) == pytest.approx([4.0, 4.0])  # normalised gradients 2 (theta_g - theta_k) / ||.||
        assert r["eua_step_norm"] == pytest.approx(8.0 * r["eua_direction_norm"])
        assert r["fur_mean"] == pytest.approx(
            sum(c["fur_mean"] * c["num_examples"] for c in clients) / sum(c["num_examples"] for c in clients)
        )
        # resources: the model both ways, nothing else
        assert r["bytes_up"] > 0 and r["bytes_down"] == r["bytes_up"] and 0 <= r["knn_acc"] <= 1
    summary = json.loads((out / "summary.json").read_text())
    res = summary["resources"]
    assert sorted(res["per_client"]) == ["0", "1"]
    for mine in res["per_client"].values():
        assert mine["flops_total_max"] > 0 and mine["images_trained"] > 0 and mine["bytes_up"] > 0
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in rounds)
    assert summary["config"]["strategy"]["options"]["fur_form"] == "uot"
