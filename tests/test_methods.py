"""Tests for the momentum helpers, the SSL methods and their registry (tiny backbones, 8 images)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from ssl_models.methods import METHODS, SSLMethod, build_method, method_default_options
from ssl_models.methods.moco import MoCo
from ssl_models.networks import build_backbone
from ssl_models.networks.momentum import copy_as_target, ema_update_

SMALL_HEADS: dict[str, dict[str, Any]] = {
    "simclr": {"proj_hidden_dim": 64, "proj_out_dim": 32},
    "moco": {"proj_hidden_dim": 64, "proj_out_dim": 32, "queue_size": 40},
    "byol": {"proj_hidden_dim": 64, "proj_out_dim": 32, "pred_hidden_dim": 64},
    "simsiam": {"proj_hidden_dim": 64, "proj_out_dim": 32, "pred_hidden_dim": 64},
    "mocov3": {"proj_hidden_dim": 64, "proj_out_dim": 32, "pred_hidden_dim": 64},
    "fedx": {"proj_hidden_dim": 64, "proj_out_dim": 32, "pred_hidden_dim": 64},
    "orchestra": {
        "proj_hidden_dim": 64,
        "proj_out_dim": 32,
        "num_global_clusters": 4,
        "num_local_clusters": 2,
        "memory_size": 8,
    },
}
LOCAL_KEY_PREFIXES: dict[str, tuple[str, ...]] = {
    "simclr": (),
    "moco": ("target_backbone.", "target_projector.", "queue", "queue_ptr"),
    "byol": ("target_backbone.", "target_projector."),
    "simsiam": (),
    "mocov3": ("target_backbone.", "target_projector."),
    "fedx": (),  # the frozen teacher is not part of the state: it is the received global model
    "orchestra": ("target_backbone.", "target_projector.", "global_centroids", "memory", "memory_count"),
}


def tiny_method(name: str, seed: int = 0, **overrides: Any) -> SSLMethod:
    torch.manual_seed(seed)
    backbone, feature_dim = build_backbone("resnet18", width=0.125)
    return build_method(name, backbone, feature_dim, **{**SMALL_HEADS[name], **overrides})


def two_views(seed: int = 1, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.rand(batch_size, 3, 32, 32, generator=generator),
        torch.rand(batch_size, 3, 32, 32, generator=generator),
    )


# ---------------------------------------------------------------------------------------------- momentum
def test_ema_update_follows_formula_on_parameters_and_float_buffers() -> None:
    target = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    online = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        target[0].weight.fill_(1.0)
        online[0].weight.fill_(3.0)
        target[1].running_mean.fill_(0.0)
        online[1].running_mean.fill_(10.0)
    target[1].num_batches_tracked.fill_(2)
    online[1].num_batches_tracked.fill_(7)
    ema_update_(target, online, momentum=0.9)
    assert torch.allclose(target[0].weight, torch.full((2, 2), 0.9 * 1.0 + 0.1 * 3.0))  # 1.2
    assert torch.allclose(target[1].running_mean, torch.full((2,), 0.9 * 0.0 + 0.1 * 10.0))  # 1.0
    assert target[1].num_batches_tracked.item() == 7  # integer buffers are copied, not averaged
    assert torch.all(online[0].weight == 3.0)  # the online network is untouched


@pytest.mark.parametrize("momentum", [-0.1, 1.5])
def test_ema_update_rejects_momentum_outside_unit_interval(momentum: float) -> None:
    with pytest.raises(ValueError, match="momentum"):
        ema_update_(nn.Linear(2, 2), nn.Linear(2, 2), momentum)


def test_copy_as_target_is_a_frozen_independent_copy() -> None:
    online = nn.Linear(3, 2)
    target = copy_as_target(online)
    assert all(not p.requires_grad for p in target.parameters())
    assert all(p.requires_grad for p in online.parameters())
    assert torch.equal(target.weight, online.weight)
    with torch.no_grad():
        online.weight.add_(1.0)
    assert not torch.equal(target.weight, online.weight)


# ---------------------------------------------------------------------------------------------- every method
@pytest.mark.parametrize("name", sorted(METHODS))
def test_one_training_step_gives_finite_loss_and_updates_backbone(name: str) -> None:
    method = tiny_method(name)
    optimizer = torch.optim.SGD(method.trainable_parameters(), lr=0.1)
    before = method.backbone.stem[0].weight.detach().clone()
    loss = method.training_step(*two_views())
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    method.after_optimizer_step()
    assert not torch.equal(before, method.backbone.stem[0].weight)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_training_step_under_bf16_autocast_returns_finite_float32_loss(name: str) -> None:
    method = tiny_method(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = method.training_step(*two_views())
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_shared_prefixes_split_state_dict_into_shared_and_local(name: str) -> None:
    method = tiny_method(name)
    keys = list(method.state_dict())
    shared = [k for k in keys if k.startswith(method.shared_prefixes())]
    local = [k for k in keys if k not in shared]
    assert any(k.startswith("backbone.") for k in shared)
    assert any(k.startswith("projector.") for k in shared)
    assert not any("target_" in k or k.startswith("queue") for k in shared)
    # everything not shared is a target/queue key, and every expected kind of local key is present
    expected_local_prefixes = LOCAL_KEY_PREFIXES[name]
    assert all(k.startswith(expected_local_prefixes) for k in local)
    assert all(any(k.startswith(prefix) for k in local) for prefix in expected_local_prefixes)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_trainable_parameters_are_exactly_the_online_branch(name: str) -> None:
    method = tiny_method(name)
    online_modules = [method.backbone, method.projector] + ([method.predictor] if method.has_predictor else [])
    if name == "orchestra":
        online_modules.append(method.rotation_head)  # the degeneracy regulariser trains with the online branch
    expected = {id(p) for module in online_modules for p in module.parameters()}
    assert {id(p) for p in method.trainable_parameters()} == expected


def test_shared_prefixes_per_method_and_with_target() -> None:
    assert tiny_method("simclr").shared_prefixes(with_target=True) == ("backbone.", "projector.")
    assert tiny_method("simsiam").shared_prefixes() == ("backbone.", "projector.", "predictor.")
    byol = tiny_method("byol")
    assert byol.shared_prefixes() == ("backbone.", "projector.", "predictor.")
    assert byol.shared_prefixes(with_target=True) == (
        "backbone.",
        "projector.",
        "predictor.",
        "target_backbone.",
        "target_projector.",
    )
    assert tiny_method("moco").shared_prefixes(with_target=True) == (
        "backbone.",
        "projector.",
        "target_backbone.",
        "target_projector.",
    )


@pytest.mark.parametrize("name", ["byol", "moco"])
def test_after_optimizer_step_moves_target_by_momentum_formula(name: str) -> None:
    method = tiny_method(name, momentum=0.9)
    with torch.no_grad():  # make online and target differ, as after some optimizer steps
        method.projector[0].weight.add_(1.0)
        method.backbone.stem[1].running_var.fill_(4.0)
    target_weight = method.target_projector[0].weight.detach().clone()
    online_weight = method.projector[0].weight.detach().clone()
    target_running_var = method.target_backbone.stem[1].running_var.clone()
    method.after_optimizer_step()
    assert torch.allclose(method.target_projector[0].weight, 0.9 * target_weight + 0.1 * online_weight)
    assert torch.allclose(method.target_backbone.stem[1].running_var, 0.9 * target_running_var + 0.1 * 4.0)


# ---------------------------------------------------------------------------------------------- MoCo
def test_moco_queue_pointer_advances_and_wraps_with_non_multiple_queue_size() -> None:
    method = tiny_method("moco", queue_size=20)  # symmetric: 2 x 8 = 16 keys per step, 20 % 16 != 0
    assert isinstance(method, MoCo)
    method.training_step(*two_views(seed=1))
    assert method.queue_ptr.item() == 16
    method.training_step(*two_views(seed=2))
    assert method.queue_ptr.item() == (16 + 16) % 20  # 12
    assert torch.allclose(method.queue.norm(dim=0), torch.ones(20), atol=1e-5)


def test_moco_enqueue_writes_columns_circularly() -> None:
    method = tiny_method("moco", queue_size=5, proj_out_dim=2)
    method.queue_ptr.fill_(3)
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    method.enqueue(keys)
    assert torch.equal(method.queue[:, 3], keys[0])
    assert torch.equal(method.queue[:, 4], keys[1])
    assert torch.equal(method.queue[:, 0], keys[2])
    assert method.queue_ptr.item() == 1
    # more keys than slots: only the most recent K survive
    many = torch.arange(14.0).reshape(7, 2)
    method.enqueue(many)
    assert sorted(method.queue[0].tolist()) == [4.0, 6.0, 8.0, 10.0, 12.0]


def test_moco_versions_set_projector_and_temperature() -> None:
    v1 = tiny_method("moco", version=1)
    v2 = tiny_method("moco", version=2)
    assert [type(m) for m in v1.projector] == [nn.Linear]
    assert v1.temperature == pytest.approx(0.07) and v2.temperature == pytest.approx(0.2)
    assert sum(isinstance(m, nn.Linear) for m in v2.projector) == 2
    assert tiny_method("moco", version=1, temperature=0.5).temperature == pytest.approx(0.5)


def test_moco_on_new_global_copies_query_encoder_into_key_encoder_only_when_asked() -> None:
    method = tiny_method("moco", reset_target_on_new_global=True)
    with torch.no_grad():
        method.backbone.stem[0].weight.add_(1.0)
    method.on_new_global()
    assert torch.equal(method.target_backbone.stem[0].weight, method.backbone.stem[0].weight)
    keep = tiny_method("moco")  # default: the key encoder stays local (FedMoCo of the FedEMA paper)
    with torch.no_grad():
        keep.backbone.stem[0].weight.add_(1.0)
    keep.on_new_global()
    assert not torch.equal(keep.target_backbone.stem[0].weight, keep.backbone.stem[0].weight)


# ---------------------------------------------------------------------------------------------- BYOL / SimSiam
def test_byol_without_ema_has_no_target_modules() -> None:
    method = tiny_method("byol", use_ema=False)
    assert not method.has_target
    assert not any(k.startswith("target_") for k in method.state_dict())
    assert "target_backbone." not in method.shared_prefixes(with_target=True)
    loss = method.training_step(*two_views())
    assert torch.isfinite(loss)
    method.after_optimizer_step()  # nothing to update, must not fail


def test_byol_without_predictor_has_no_predictor_module() -> None:
    method = tiny_method("byol", use_predictor=False)
    assert not method.has_predictor
    assert not any(k.startswith("predictor.") for k in method.state_dict())
    assert "predictor." not in method.shared_prefixes()


def _backbone_gradient(method: SSLMethod) -> torch.Tensor:
    method.zero_grad()
    method.training_step(*two_views()).backward()
    return method.backbone.stem[0].weight.grad.clone()


@pytest.mark.parametrize(("name", "options"), [("byol", {"use_ema": False}), ("simsiam", {})])
def test_disabling_stop_gradient_changes_backbone_gradient(name: str, options: dict[str, Any]) -> None:
    # same seed, same data: the only difference is whether gradient also flows through the target side
    with_stop = _backbone_gradient(tiny_method(name, stop_gradient=True, **options))
    without_stop = _backbone_gradient(tiny_method(name, stop_gradient=False, **options))
    assert not torch.allclose(with_stop, without_stop, atol=1e-7)


def test_simsiam_has_no_target_branch_and_no_target_state() -> None:
    # SimSiam's loss value is checked against a formula in tests/test_method_losses_independent.py
    method = tiny_method("simsiam")
    assert not method.has_target and method.has_predictor
    assert not any(k.startswith("target_") for k in method.state_dict())
    assert method.shared_prefixes(with_target=True) == ("backbone.", "projector.", "predictor.")


# ---------------------------------------------------------------------------------------------- registry
def test_registry_lists_the_methods_and_rejects_unknown_name() -> None:
    assert sorted(METHODS) == ["byol", "fedx", "moco", "mocov3", "orchestra", "simclr", "simsiam"]
    with pytest.raises(ValueError, match="byol.*moco.*simclr.*simsiam"):
        build_method("swav", nn.Identity(), 8)
    with pytest.raises(ValueError, match="swav"):
        method_default_options("swav")


def test_unknown_option_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="tempreature"):
        tiny_method("simclr", tempreature=0.1)


def test_default_options_list_documented_defaults_and_are_fresh_copies() -> None:
    assert method_default_options("simclr") == {
        "proj_hidden_dim": 2048,
        "proj_out_dim": 128,
        "num_proj_layers": 2,
        "temperature": 0.5,
        "proj_batch_norm": True,
    }
    byol = method_default_options("byol")
    assert (byol["proj_hidden_dim"], byol["proj_out_dim"], byol["pred_hidden_dim"]) == (4096, 2048, 4096)
    assert byol["momentum"] == 0.99 and byol["use_ema"] and byol["use_predictor"] and byol["stop_gradient"]
    moco = method_default_options("moco")
    assert (moco["version"], moco["queue_size"], moco["momentum"], moco["proj_out_dim"]) == (2, 4096, 0.99, 128)
    byol["momentum"] = 0.5
    assert method_default_options("byol")["momentum"] == 0.99


@pytest.mark.parametrize(
    ("name", "options", "bad_name"),
    [
        ("simclr", {"temperature": 0.0}, "temperature"),
        ("byol", {"momentum": 1.5}, "momentum"),
        ("byol", {"stop_gradient": "false"}, "stop_gradient"),
        ("moco", {"version": 3}, "version"),
        ("moco", {"queue_size": 0}, "queue_size"),
    ],
)
def test_bad_option_values_are_rejected(name: str, options: dict[str, Any], bad_name: str) -> None:
    with pytest.raises(ValueError, match=bad_name):
        tiny_method(name, **options)


def test_full_size_byol_heads_follow_fedema_dimensions() -> None:
    method = build_method("byol", nn.Identity(), 512)
    linears = [m for m in method.projector if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(512, 4096), (4096, 2048)]
    linears = [m for m in method.predictor if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(2048, 4096), (4096, 2048)]
    assert math.isclose(method.momentum, 0.99)
