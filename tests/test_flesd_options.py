"""FLESD options of issue 9: sparsification named by what it does (the paper's zero-before-exp the default), the
official code's distillation schedule (queue warm-up at every epoch, a fresh key encoder every round) as
options, and SimCLR's projector without BatchNorm (FLESD's head)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import strategies.flesd as flesd_module
from conftest import study_experiments
from fedssl_wire import to_array_record
from server_app.experiment import load_experiment
from ssl_models.config import ExperimentConfig
from ssl_models.data.datasets import load_dataset
from ssl_models.data.splits import federated_split
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.distillation import distill
from ssl_models.federated.similarity import encode_similarity, ensemble_similarity, similarity_matrix
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone
from strategies import FLESD

TAU = 0.5
# One client, N = 3, top-1/3 fraction: k = floor(3 / 3) + 1 = 2 entries kept per row (itself and its best).
M = torch.tensor([[1.0, 0.5, -0.2], [0.5, 1.0, 0.1], [-0.2, 0.1, 1.0]])


# ---------------------------------------------------------------------------------- sparsification


def test_default_sparsify_zeroes_dropped_similarities_before_the_exp():
    payload = encode_similarity(M, "topk", fraction=1 / 3)
    # Row 0 keeps 1.0 and 0.5; the dropped -0.2 becomes 0 before the exp: exp((0 - 1) / 0.5) = e^-2.
    e = math.exp
    expected_zero_similarity = torch.tensor(
        [
            [1.0, e(-1.0), e(-2.0)],  # exp((0.5 - 1) / 0.5) = e^-1
            [e(-1.0), 1.0, e(-2.0)],  # kept 1.0, 0.5; dropped 0.1 -> 0
            [e(-2.0), e(-1.8), 1.0],  # kept 1.0, 0.1 (exp((0.1 - 1) / 0.5) = e^-1.8); dropped -0.2 -> 0
        ]
    )
    default = ensemble_similarity([payload], TAU)
    torch.testing.assert_close(default.double(), expected_zero_similarity.double(), atol=2e-3, rtol=2e-3)  # fp16
    masked = ensemble_similarity([payload], TAU, sparsify="zero_probability")
    expected_masked = expected_zero_similarity.clone()
    expected_masked[0, 2] = expected_masked[1, 2] = expected_masked[2, 0] = 0.0
    torch.testing.assert_close(masked.double(), expected_masked.double(), atol=2e-3, rtol=2e-3)
    assert FLESD.default_options()["sparsify"] == "zero_similarity"


def test_old_sparsify_names_are_refused_with_the_new_ones():
    for old in ("paper", "code"):
        with pytest.raises(
            ValueError,
            match=r"^strategy.options.sparsify: .* renamed .* zero_similarity .* "
            r"zero_probability",
        ):
            FLESD.check_options({**FLESD.default_options(), "sparsify": old})
    with pytest.raises(ValueError, match=r"^strategy.options.queue_warmup: must be one of start, every_epoch"):
        FLESD.check_options({**FLESD.default_options(), "queue_warmup": "never"})
    with pytest.raises(ValueError, match=r"^strategy.options.key_encoder: must be one of carry_over, fresh_each_round"):
        FLESD.check_options({**FLESD.default_options(), "key_encoder": "new"})
    with pytest.raises(ValueError, match=r"^strategy.options.distill_weight_decay: must be >= 0, got -1e-06"):
        FLESD.check_options({**FLESD.default_options(), "distill_weight_decay": -1e-6})
    cfg, _ = load_experiment({"config": "configs/smoke-flesd.yaml", "data.dataset": "synthetic"})
    assert cfg.strategy.options["sparsify"] == "zero_similarity"  # the resolved config records what was used
    assert cfg.strategy.options["queue_warmup"] == "start" and cfg.strategy.options["key_encoder"] == "carry_over"


# ---------------------------------------------------------------------------------- queue warm-up


def _tiny_simclr(**options) -> torch.nn.Module:
    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", width=0.125)
    return build_method("simclr", backbone, dim, proj_hidden_dim=16, proj_out_dim=8, **options)


def test_queue_warmup_every_epoch_skips_the_first_batches_of_every_epoch():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(32, 8, 8, 3), dtype=np.uint8)
    ensemble = ensemble_similarity(
        [similarity_matrix(torch.randn(32, 8, generator=torch.Generator().manual_seed(1)))], 0.1
    )
    kwargs = {
        "iterations": 7,
        "batch_size": 8,
        "queue_size": 16,
        "momentum": 0.9,
        "lr": 1e-3,
        "seed": 0,
        "fast_path": False,
    }
    # 32 images / 8 = 4 batches per epoch; warm-up ceil(16 / 8) = 2 batches.
    start = distill(_tiny_simclr(), images, ensemble, **kwargs)
    assert (start["steps"], start["warmup_iterations"], start["queue_warmup"]) == (5, 2, "start")
    every = distill(_tiny_simclr(), images, ensemble, queue_warmup="every_epoch", **kwargs)
    # iterations 0-1 and 4-5 only fill the queue: 4 skipped, 3 steps (iterations 2, 3 and 6)
    assert (every["steps"], every["warmup_iterations"], every["queue_warmup"]) == (3, 4, "every_epoch")
    with pytest.raises(ValueError, match=r"queue_warmup every_epoch: an epoch over 32 public images has 2 batches"):
        distill(
            _tiny_simclr(),
            images,
            ensemble,
            queue_warmup="every_epoch",
            **{**kwargs, "batch_size": 16, "queue_size": 32},
        )


# ---------------------------------------------------------------------------------- key encoder per round


@pytest.fixture()
def identity():
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def _flesd_cfg(**options) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {
            "rounds": 2,
            "data": {
                "dataset": "synthetic",
                "synthetic_train": 96,
                "synthetic_test": 16,
                "partition": "iid",
                "public_size": 24,
            },
            "model": {"arch": "resnet18", "width": 0.125},
            "method": {"name": "simclr", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8}},
            "federation": {"num_clients": 2},
            "train": {"fast_path": False},
            "strategy": {
                "name": "flesd",
                "options": {"distill_iterations": 4, "distill_batch_size": 8, "queue_size": 8, **options},
            },
        }
    )


@pytest.mark.parametrize("key_encoder", ["carry_over", "fresh_each_round"])
def test_key_encoder_carries_over_or_is_a_fresh_copy_of_each_rounds_student(key_encoder, identity, monkeypatch):
    calls = []

    def fake_distill(method, public, ensemble, *, key_encoder, augment, queue_warmup, **kwargs):
        # what the key encoder holds when the round's distillation starts, against the student's weights
        student = state_to_numpy(
            {
                **{f"backbone.{k}": v for k, v in method.backbone.state_dict().items()},
                **{f"projector.{k}": v for k, v in method.projector.state_dict().items()},
            }
        )
        keys = state_to_numpy(key_encoder.state_dict())
        calls.append(
            {
                "id": id(key_encoder),
                "equals_student": all(np.array_equal(keys[k], student[k]) for k in keys),
                "queue_warmup": queue_warmup,
            }
        )
        with torch.no_grad():  # the momentum encoder drifts during a distillation
            for p in key_encoder.parameters():
                p.add_(1.0)
        return {
            "loss": 1.0,
            "loss_first_quarter": 1.0,
            "loss_last_quarter": 1.0,
            "steps": 1,
            "iterations": 4,
            "warmup_iterations": 1,
            "queue_warmup": queue_warmup,
            "seconds": 0.0,
            "precision": "fp32",
        }

    monkeypatch.setattr(flesd_module, "distill", fake_distill)
    cfg = _flesd_cfg(key_encoder=key_encoder, queue_warmup="every_epoch")
    cfg.strategy.options = {**FLESD.default_options(), **cfg.strategy.options}
    data = load_dataset("synthetic", synthetic_sizes=(96, 16, 10))
    strategy = FLESD(clients={0: 10, 1: 11}, clients_per_round=2, options=cfg.strategy.options)
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    model = build_ssl_model(cfg, seed=cfg.seed)
    arrays = to_array_record(state_to_numpy(split_state(model, model.shared_prefixes())[0]))
    payload = encode_similarity(similarity_matrix(torch.randn(24, 8)), "dense-fp32")
    for server_round in (1, 2):
        strategy._global = arrays
        request = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=10, message_type="train.similarity")
        rep = Message(
            RecordDict(
                {
                    "similarity": to_array_record(payload),
                    "metrics": MetricRecord({"partition-id": 0, "num-examples": 30, "train_loss": 1.0, "train_s": 0.1}),
                }
            ),
            reply_to=request,
        )
        new, _ = strategy.aggregate_train(server_round, [rep])
        record = strategy.round_records[server_round]
        assert (record["key_encoder"], record["queue_warmup"], record["sparsify"]) == (
            key_encoder,
            "every_epoch",
            "zero_similarity",
        )
        arrays = new
    assert calls[0]["equals_student"] and calls[0]["queue_warmup"] == "every_epoch"
    if key_encoder == "carry_over":
        assert calls[1]["id"] == calls[0]["id"] and not calls[1]["equals_student"]  # it kept its drift
    else:
        assert calls[1]["equals_student"]  # a new copy of round 2's student


# ---------------------------------------------------------------------------------- projector without BatchNorm


def test_simclr_projector_without_batchnorm_is_linear_relu_linear():
    method = _tiny_simclr(proj_batch_norm=False)
    layers = list(method.projector)
    assert [type(m) for m in layers] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    assert layers[0].bias is not None  # no BatchNorm after it: the hidden layer keeps its bias
    h = torch.randn(5, method.feature_dim)
    first, last = layers[0], layers[2]
    expected = torch.relu(h @ first.weight.T + first.bias) @ last.weight.T + last.bias
    torch.testing.assert_close(method.projector(h), expected)
    with_bn = _tiny_simclr()
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in with_bn.projector)
    with pytest.raises(ValueError, match="proj_batch_norm"):
        _tiny_simclr(proj_batch_norm="no")


def test_flesd_configs_use_the_papers_head():
    cfg = study_experiments("paper/flesd-table1")["cifar10-alpha1-flesd"]
    method = build_ssl_model(cfg, seed=0)
    assert [type(m).__name__ for m in method.projector] == ["Linear", "ReLU", "Linear"]
    assert (method.projector[0].in_features, method.projector[0].out_features, method.projector[2].out_features) == (
        512,
        512,
        128,
    )
