"""FedX: the relational losses against hand computations, the method's four terms and teacher, the client rule,
the strategy's config check, and one real `flwr run .` of configs/smoke-fedx.yaml."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from client_app.rounds.weights import train_local_ssl
from server_app.experiment import load_experiment
from ssl_models.accounting import training_step_flops
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.fedx import jensen_shannon, relational_loss, similarity_log_distribution
from ssl_models.methods import build_method
from ssl_models.methods.fedx import TERMS, FedXMethod
from ssl_models.methods.losses import nt_xent_loss
from ssl_models.networks import build_backbone
from strategies import FedX

REPO = Path(__file__).resolve().parents[1]
HEADS = {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}
TINY = {
    "rounds": 2,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "fedx", "options": HEADS},
    "strategy": {"name": "fedx"},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2, "fast_path": False},
}
E = math.e


def tiny_fedx(seed: int = 0, **options) -> FedXMethod:
    torch.manual_seed(seed)
    backbone, feature_dim = build_backbone("resnet18", width=0.125)
    return build_method("fedx", backbone, feature_dim, **{**HEADS, **options})  # type: ignore[return-value]


def views(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 32, 32, generator=g), torch.rand(n, 3, 32, 32, generator=g)


# ------------------------------------------------------------------ the relational losses, by hand
def test_similarity_distribution_is_a_softmax_of_cosines_over_the_anchors():
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # cos([3, 0], anchors) = [1, 0]; at tau 0.5 the logits are [2, 0]: softmax = [e^2, 1] / (e^2 + 1)
    log_r = similarity_log_distribution(torch.tensor([[3.0, 0.0]]), anchors, 0.5)
    np.testing.assert_allclose(log_r.exp().numpy(), [[E**2 / (E**2 + 1), 1 / (E**2 + 1)]], rtol=1e-6)
    with pytest.raises(ValueError, match="temperature must be positive"):
        similarity_log_distribution(torch.ones(1, 2), anchors, 0.0)


def test_jensen_shannon_relational_loss_hand_computation():
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # view 1 along anchor 1, view 2 along anchor 2, tau = 1: r = [a, b], r~ = [b, a], a = e / (1 + e); m = [1/2, 1/2]
    # JS = 1/2 KL(r || m) + 1/2 KL(r~ || m) = a ln(2a) + b ln(2b)
    a, b = E / (1 + E), 1 / (1 + E)
    expected_row1 = a * math.log(2 * a) + b * math.log(2 * b)  # 0.110944...
    # second image: view 1 along anchor 1, view 2 halfway (r~ = [1/2, 1/2] at any tau): m = [(a + 1/2) / 2, (b + 1/2) / 2]
    ma, mb = (a + 0.5) / 2, (b + 0.5) / 2
    expected_row2 = 0.5 * (a * math.log(a / ma) + b * math.log(b / mb)) + 0.5 * (
        0.5 * math.log(0.5 / ma) + 0.5 * math.log(0.5 / mb)
    )
    z1 = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    z2 = torch.tensor([[0.0, 5.0], [1.0, 1.0]])
    loss = relational_loss(z1, z2, anchors, temperature=1.0, form="js")
    assert loss.item() == pytest.approx((expected_row1 + expected_row2) / 2, rel=1e-6)  # the batch mean
    assert expected_row1 == pytest.approx(0.110944, abs=1e-6)
    # symmetric, and zero for identical views
    assert relational_loss(z2, z1, anchors, 1.0).item() == pytest.approx(loss.item(), rel=1e-6)
    assert relational_loss(z1, z1, anchors, 1.0).item() == pytest.approx(0.0, abs=1e-7)
    js = jensen_shannon(torch.tensor([[0.0, -math.inf]]), torch.tensor([[-math.inf, 0.0]]))
    assert js.item() == pytest.approx(math.log(2), rel=1e-6)  # disjoint supports: ln 2, finite (0 log 0 = 0)


def test_code_form_relational_loss_hand_computation():
    """The authors' js_loss: 1/2 [KL(m' || r) + KL(m' || r~)], m' the mixture at the target temperature."""
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z1, z2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    a, b = E / (1 + E), 1 / (1 + E)  # r at tau = 1; r~ = [1/2, 1/2]
    c, d = E**2 / (1 + E**2), 1 / (1 + E**2)  # view 1 at tau' = 0.5; view 2 stays uniform
    m = [(c + 0.5) / 2, (d + 0.5) / 2]
    kl_to_r1 = m[0] * math.log(m[0] / a) + m[1] * math.log(m[1] / b)
    kl_to_r2 = m[0] * math.log(m[0] / 0.5) + m[1] * math.log(m[1] / 0.5)
    loss = relational_loss(z1, z2, anchors, temperature=1.0, form="code", target_temperature=0.5)
    assert loss.item() == pytest.approx(0.5 * (kl_to_r1 + kl_to_r2), rel=1e-6)
    # at tau' = tau and mirrored views (r = [a, b], r~ = [b, a], m' = [1/2, 1/2]): 1/2 ln(1 / (4ab)), not the JS
    mirrored = relational_loss(z1, torch.tensor([[0.0, 1.0]]), anchors, 1.0, form="code")
    assert mirrored.item() == pytest.approx(0.5 * math.log(0.25 / (a * b)), rel=1e-6)  # 0.120115...
    with pytest.raises(ValueError, match="relational form must be one of js, code"):
        relational_loss(z1, z2, anchors, 1.0, form="kl")


# ------------------------------------------------------------------ the method
def test_fedx_step_is_the_weighted_sum_of_the_four_terms_on_the_right_heads():
    """In eval mode (per-image BatchNorm) the step's terms are recomputed here from the heads: local terms on the
    projector, global terms on the predictor against the teacher's projections; right after on_new_global the
    teacher is the model itself. The first step's anchors are its own first view, the next step's the previous
    step's first view."""
    method = tiny_fedx(weight_local_contrastive=2.0, weight_global_relational=0.0)
    method.on_new_global()
    method.eval()
    (v1, v2), (w1, w2) = views(1), views(2)
    with torch.no_grad():
        loss = method.training_step(v1, v2)
        second = method.training_step(w1, w2)

        def heads(x):
            z = method.projector(method.backbone(x))
            return z, method.predictor(z)

        (z1, p1), (z2, p2) = heads(v1), heads(v2)
        lc, gc = nt_xent_loss(z1, z2, 0.1), nt_xent_loss(p1, z2, 0.1)
        lr, gr = relational_loss(z1, z2, z1, 0.1), relational_loss(p1, p2, z1, 0.1)
        assert loss.item() == pytest.approx(2 * lc.item() + lr.item() + gc.item(), rel=1e-5)
        (y1, q1), (y2, q2) = heads(w1), heads(w2)
        second_terms = [
            nt_xent_loss(y1, y2, 0.1),
            relational_loss(y1, y2, z1, 0.1),  # anchors: the previous step's first view
            nt_xent_loss(q1, y2, 0.1),
            relational_loss(q1, q2, z1, 0.1),
        ]
    assert second.item() == pytest.approx(
        2 * second_terms[0].item() + second_terms[1].item() + second_terms[2].item(), rel=1e-5
    )
    means = method.term_means()  # unweighted means over the two steps
    for key, first, later in zip(TERMS, (lc, lr, gc, gr), second_terms):
        assert means[key] == pytest.approx((first.item() + later.item()) / 2, rel=1e-5)
    assert means["local_relational"] > 0 and means["global_relational"] > 0


def test_teacher_is_frozen_kept_out_of_the_state_and_refreshed_by_on_new_global():
    method = tiny_fedx()
    method.on_new_global()
    teacher = method.teacher
    assert teacher is not None
    start = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert not any(k.startswith("teacher") or "_teacher" in k for k in method.state_dict())
    assert method.shared_prefixes() == ("backbone.", "projector.", "predictor.")
    trainable = {id(p) for p in method.trainable_parameters()}
    assert not trainable & {id(p) for p in teacher.parameters()}
    optimizer = torch.optim.SGD(method.trainable_parameters(), lr=0.5)
    method.train()
    for seed in (1, 2):
        loss = method.training_step(*views(seed))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not teacher.training  # eval mode (teacher_mode: eval) although the method trains
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, start[key]), key  # neither SGD nor BatchNorm statistics moved it
    assert not torch.equal(method.backbone.stem[0].weight, teacher[0].stem[0].weight)
    method.on_new_global()  # a new round: the teacher is the model as received now, the term means restart
    assert torch.equal(method.teacher[0].stem[0].weight, method.backbone.stem[0].weight)
    assert method.term_means() == {}


def test_flops_count_the_teacher_forward():
    """Per image a step forwards 3 images through the online encoder (two views + its anchor) and 2 through the
    teacher (view 2 + anchor): its forward FLOPs are at least 5 encoder passes, counted here separately."""
    method = tiny_fedx()
    method.on_new_global()
    batch = 4
    encoder = torch.nn.Sequential(method.backbone, method.projector).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        encoder(torch.rand(batch, 3, 32, 32))
    per_image_encoder = counter.get_total_flops() / batch
    flops = training_step_flops(method, (3, 32, 32), batch_size=batch)
    assert 5 * per_image_encoder <= flops["forward"] < 5.3 * per_image_encoder
    simclr_like = tiny_fedx(weight_global_contrastive=0.0)  # weights do not skip work: same FLOPs
    simclr_like.on_new_global()
    assert training_step_flops(simclr_like, (3, 32, 32), batch_size=batch)["forward"] == flops["forward"]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("relational_form", "kl", "option 'relational_form' must be one of"),
        ("teacher_mode", "frozen", "option 'teacher_mode' must be one of"),
        ("temperature", 0.0, "option 'temperature' must be a positive number"),
        ("global_target_temperature", -1.0, "option 'global_target_temperature' must be a positive number"),
        ("weight_global_relational", -0.5, "option 'weight_global_relational' must be a number >= 0"),
        ("reference_gradient", "yes", "option 'reference_gradient' must be true or false"),
    ],
)
def test_method_options_are_validated(option, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_fedx(**{option: value})


# ------------------------------------------------------------------ client rule and strategy
def test_client_round_uploads_the_shared_model_and_reports_the_loss_terms():
    cfg = ExperimentConfig.from_dict(TINY)
    method = build_ssl_model(cfg, seed=0)
    glob = state_to_numpy(split_state(method, method.shared_prefixes())[0])
    result = train_local_ssl(
        cfg, client_images(cfg, 0), glob, None, server_round=1, partition_id=0, lr=0.05, rule="fedx"
    )
    assert sorted(result.shared_state) == sorted(glob)  # backbone, projector, predictor: nothing else
    assert all(k.startswith("meta.") for k in result.client_state)  # no target, no teacher kept
    for term in TERMS:
        assert math.isfinite(result.info[f"loss_{term}"]) and result.info[f"loss_{term}"] >= 0
    total = sum(result.info[f"loss_{t}"] for t in TERMS)  # all weights 1
    assert total == pytest.approx(result.stats.loss, rel=1e-4)
    assert result.stats.resources["flops_total"] > 0
    simclr = ExperimentConfig.from_dict({**TINY, "method": {"name": "simclr", "options": {"proj_out_dim": 16}}})
    with pytest.raises(TypeError, match="client rule 'fedx' trains method 'fedx'"):
        train_local_ssl(
            simclr, client_images(simclr, 0), {}, None, server_round=1, partition_id=0, lr=0.05, rule="fedx"
        )


def test_strategy_needs_the_fedx_method_and_has_no_target_options(tmp_path):
    raw = yaml.safe_load((REPO / "configs/smoke-fedx.yaml").read_text())
    raw["method"] = {"name": "byol"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^method.name: strategy 'fedx' trains FedX's local objective"):
        load_experiment({"config": str(path), "data.dataset": "synthetic"})
    with pytest.raises(ValueError, match=r"^strategy.options.update_both: not supported by strategy 'fedx'"):
        FedX.check_options({**FedX.default_options(), "update_both": True})
    cfg, _ = load_experiment({"config": str(REPO / "configs/smoke-fedx.yaml"), "data.dataset": "synthetic"})
    assert cfg.method.name == "fedx" and cfg.strategy.name == "fedx"


def test_paper_study_holds_the_authors_setup():
    from conftest import study_experiments

    runs = study_experiments("paper/fedx-table1")
    fedx = runs["fedsimclr-fedx"]
    FedX.check_config(fedx)
    assert (fedx.rounds, fedx.federation.num_clients, fedx.train.local_epochs, fedx.train.batch_size) == (
        100,
        10,
        10,
        64,  # the code's batch_size 128 = a training batch of 64 + a random anchor batch of 64
    )
    assert fedx.train.lr_schedule == "constant"  # the code keeps lr 0.01
    assert (fedx.data.partition, fedx.data.alpha, fedx.train.lr, fedx.train.weight_decay) == (
        "dirichlet",
        0.5,
        0.01,
        1e-5,
    )
    assert fedx.model.width == 1.0 and fedx.data.max_train == 0 and fedx.eval.linear_probe
    assert fedx.method.options["proj_out_dim"] == 256 and fedx.method.options["temperature"] == 0.1
    assert runs["fedsimclr-fedx-code-relational"].method.options["relational_form"] == "code"
    baseline = runs["fedsimclr"]  # the same setup without FedX
    assert (baseline.method.name, baseline.strategy.name, baseline.train.lr) == ("simclr", "fedssl", 0.01)


# ------------------------------------------------------------------ a real run
@pytest.mark.e2e
def test_fedx_smoke_run_records_the_distillation_terms_and_resources(tmp_path):
    from flwr_harness import SHORT_EVAL, data_overrides, flwr_run, read_jsonl

    out = tmp_path / "out"
    proc = flwr_run(
        f"config='configs/smoke-fedx.yaml' output-dir='{out}' {data_overrides()} train.max_steps_per_epoch=3 {SHORT_EVAL}",
        tmp_path / "flwr",
    )
    assert (out / "summary.json").is_file(), (proc.stdout + proc.stderr)[-4000:]
    rounds = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["relational_form"] == "js" and sorted(c["id"] for c in r["clients"]) == [0, 1]
        assert r["bytes_up"] > 0 and r["bytes_down"] == r["bytes_up"]  # the model both ways, nothing else
        for c in r["clients"]:
            terms = [c[f"loss_{t}"] for t in TERMS]
            assert all(math.isfinite(v) and v >= 0 for v in terms)
            assert sum(terms) == pytest.approx(c["loss"], rel=1e-3)  # the client's loss is the four terms' sum
            assert c["flops_total"] > 0 and c["mem_total"] > 0
        weights = [c["num_examples"] for c in r["clients"]]
        for t in TERMS:  # the round's mean of each term: example-weighted over its clients
            expected = np.dot([c[f"loss_{t}"] for c in r["clients"]], weights) / sum(weights)
            assert r[f"fedx_loss_{t}"] == pytest.approx(expected, rel=1e-9)
        # The cross terms are computed and reported. At this scale the global relational term is tiny (the teacher's
        # projections of the anchors are nearly parallel, so the distributions over them are nearly uniform).
        assert r["fedx_loss_global_contrastive"] > 0 and r["fedx_loss_local_relational"] > 0
        assert 0 <= r["knn_acc"] <= 1  # eval.knn_every: 1
    # The total need not fall between rounds: the teacher of round 2 is the trained global model, so the global
    # terms start afresh. The teacher did change: round 2's cross terms are not round 1's.
    assert rounds[1]["fedx_loss_global_contrastive"] != rounds[0]["fedx_loss_global_contrastive"], rounds
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedx" and summary["rounds_completed"] == 2
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in rounds) > 0
    res = summary["resources"]
    assert sorted(res["per_client"]) == ["0", "1"]
    # the per-step FLOPs the clients report are this model's (teacher forward included), counted here
    cfg = ExperimentConfig.from_dict(summary["config"])
    method = build_ssl_model(cfg, seed=0)
    method.on_new_global()
    expected_flops = training_step_flops(method, (3, 32, 32), batch_size=min(cfg.train.batch_size, 8))["total"]
    for mine in res["per_client"].values():
        assert mine["flops_total_max"] == pytest.approx(expected_flops, rel=1e-9)
    assert res["run"]["flops_run"] == pytest.approx(
        expected_flops * sum(m["images_trained"] for m in res["per_client"].values())
    )
    assert 0 <= summary["knn_acc"] <= 1 and 0 <= summary["linear_probe_acc"] <= 1
