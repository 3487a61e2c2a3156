"""Tests for MoCo v3 (the LW-FedSSL method): loss, heads, momentum schedule; tiny ViT / ResNet, batch 4-8."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ssl_models.methods import METHODS, build_method, method_default_options
from ssl_models.methods.losses import mocov3_contrastive_loss
from ssl_models.methods.mocov3 import MoCoV3
from ssl_models.networks import build_backbone
from ssl_models.training import train_ssl

SMALL_HEADS: dict[str, Any] = {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}


def tiny(arch: str = "vit_tiny", seed: int = 0, **options: Any) -> MoCoV3:
    torch.manual_seed(seed)
    if arch == "vit_tiny":
        backbone, dim = build_backbone("vit_tiny", 0.0625, depth=2)
    else:
        backbone, dim = build_backbone(arch, 0.125)
    method = build_method("mocov3", backbone, dim, **{**SMALL_HEADS, **options})
    assert isinstance(method, MoCoV3)
    return method


def two_views(batch: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, 32, 32, generator=generator), torch.rand(batch, 3, 32, 32, generator=generator)


def hand_ctr(q: torch.Tensor, k: torch.Tensor, tau: float) -> torch.Tensor:
    """Softmax cross-entropy with the positive on the diagonal, written out with log-sum-exp, times 2 tau."""
    q = q.double() / q.double().pow(2).sum(dim=1, keepdim=True).sqrt()
    k = k.double() / k.double().pow(2).sum(dim=1, keepdim=True).sqrt()
    losses = []
    for i in range(q.shape[0]):
        logits = torch.stack([(q[i] * k[j]).sum() / tau for j in range(k.shape[0])])
        top = logits.max()
        log_sum_exp = top + torch.log(torch.exp(logits - top).sum())
        losses.append(log_sum_exp - logits[i])
    return torch.stack(losses).mean() * 2 * tau


# ---------------------------------------------------------------------------------------------- loss
def test_pure_loss_matches_hand_computation() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 7, generator=generator), torch.randn(5, 7, generator=generator)
    for tau in (0.2, 1.0):
        assert torch.allclose(mocov3_contrastive_loss(q, k, tau).double(), hand_ctr(q, k, tau), atol=1e-5)
    # N-way: the positive of query i is key i, so shuffling the keys changes the loss
    assert not torch.allclose(mocov3_contrastive_loss(q, k.flip(0), 0.2), mocov3_contrastive_loss(q, k, 0.2))
    with pytest.raises(ValueError, match="temperature must be positive"):
        mocov3_contrastive_loss(q, k, 0.0)
    with pytest.raises(ValueError, match="same shape"):
        mocov3_contrastive_loss(q, k[:4], 0.2)


def test_training_step_equals_symmetric_hand_loss_on_two_different_views() -> None:
    method = tiny(temperature=0.2)
    with torch.no_grad():  # a target that differs from the online branch, so the pairing matters
        for p in method.target_backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    view1, view2 = two_views()
    assert not torch.equal(view1, view2)
    loss = method.training_step(view1, view2)

    # the same forwards, spelled out: queries through backbone -> projector -> predictor, keys through the target
    q1 = method.predictor(method.projector(method.backbone(view1)))
    q2 = method.predictor(method.projector(method.backbone(view2)))
    with torch.no_grad():
        k1 = method.target_projector(method.target_backbone(view1))
        k2 = method.target_projector(method.target_backbone(view2))
    expected = hand_ctr(q1, k2, 0.2) + hand_ctr(q2, k1, 0.2)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss.double(), expected, atol=1e-5)
    wrong_pairing = hand_ctr(q1, k1, 0.2) + hand_ctr(q2, k2, 0.2)
    assert not torch.allclose(loss.double(), wrong_pairing, atol=1e-3)


@pytest.mark.parametrize("arch", ["vit_tiny", "resnet18"])
def test_training_step_runs_on_tiny_vit_and_resnet(arch: str) -> None:
    method = tiny(arch)
    optimizer = torch.optim.AdamW(method.trainable_parameters(), lr=1e-3)
    target_before = [p.detach().clone() for p in method.target_backbone.parameters()]
    loss = method.training_step(*two_views(4))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is None for p in method.target_backbone.parameters())  # keys carry no gradient
    optimizer.step()
    method.after_optimizer_step()
    moved = [not torch.equal(a, b) for a, b in zip(target_before, method.target_backbone.parameters())]
    assert any(moved)


def test_training_step_under_bf16_autocast_returns_float32_loss() -> None:
    method = tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = method.training_step(*two_views(4))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------- structure
def test_heads_follow_mocov3() -> None:
    method = tiny(num_proj_layers=3)
    linears = [m for m in method.projector if isinstance(m, nn.Linear)]
    norms = [m for m in method.projector if isinstance(m, nn.BatchNorm1d)]
    assert len(linears) == 3 and all(layer.bias is None for layer in linears)
    assert len(norms) == 3 and norms[0].affine and norms[1].affine and not norms[2].affine
    assert isinstance(method.projector[-1], nn.BatchNorm1d)
    assert [layer.out_features for layer in linears] == [32, 32, 16]
    pred_linears = [m for m in method.predictor if isinstance(m, nn.Linear)]
    pred_norms = [m for m in method.predictor if isinstance(m, nn.BatchNorm1d)]
    assert len(pred_linears) == 2 and all(layer.bias is None for layer in pred_linears)
    assert [layer.out_features for layer in pred_linears] == [32, 16]
    assert pred_norms[0].affine and not pred_norms[-1].affine
    defaults = method_default_options("mocov3")
    assert (defaults["proj_hidden_dim"], defaults["proj_out_dim"], defaults["pred_hidden_dim"]) == (4096, 256, 4096)
    assert (defaults["temperature"], defaults["momentum"], defaults["momentum_schedule"]) == (0.2, 0.99, "constant")
    assert "mocov3" in METHODS


def test_target_branch_is_not_trainable_and_not_shared() -> None:
    method = tiny()
    target_ids = {id(p) for m in (method.target_backbone, method.target_projector) for p in m.parameters()}
    trainable_ids = {id(p) for p in method.trainable_parameters()}
    assert target_ids and not target_ids & trainable_ids
    online = [method.backbone, method.projector, method.predictor]
    assert trainable_ids == {id(p) for m in online for p in m.parameters()}
    assert method.shared_prefixes() == ("backbone.", "projector.", "predictor.")
    assert "target_backbone." in method.shared_prefixes(with_target=True)


def test_reset_target_on_new_global_copies_online_weights() -> None:
    method = tiny(reset_target_on_new_global=True)
    with torch.no_grad():
        method.backbone.blocks[0].mlp.fc1.weight.add_(1.0)
    method.on_new_global()
    assert torch.equal(method.target_backbone.blocks[0].mlp.fc1.weight, method.backbone.blocks[0].mlp.fc1.weight)


# ---------------------------------------------------------------------------------------------- momentum
def test_constant_momentum_schedule() -> None:
    method = tiny(momentum=0.99)
    for progress in (0.0, 0.5, 1.0):
        method.set_progress(progress)
        assert method.current_momentum == 0.99


def test_cosine_momentum_schedule_values() -> None:
    method = tiny(momentum=0.99, momentum_schedule="cosine")
    assert method.current_momentum == pytest.approx(0.99)  # progress starts at 0
    expected = {0.0: 0.99, 0.5: 0.995, 1.0: 1.0}  # 1 - 0.01 * (cos(pi p) + 1) / 2
    for progress, value in expected.items():
        method.set_progress(progress)
        assert method.current_momentum == pytest.approx(value, abs=1e-12)
        assert method.momentum_at(progress) == pytest.approx(1 - 0.01 * (math.cos(math.pi * progress) + 1) / 2)


def test_progress_range_maps_local_progress_onto_the_whole_training() -> None:
    method = tiny(momentum=0.9, momentum_schedule="cosine")
    method.set_progress_range(0.5, 0.75)  # e.g. round 3 of 4
    assert method.progress == 0.5
    method.set_progress(1.0)
    assert method.progress == pytest.approx(0.75)
    method.set_progress(0.5)
    assert method.current_momentum == pytest.approx(1 - 0.1 * (math.cos(math.pi * 0.625) + 1) / 2)
    with pytest.raises(ValueError, match=r"progress fraction must be a number in \[0, 1\]"):
        method.set_progress(1.5)
    with pytest.raises(ValueError, match="must not be below its start"):
        method.set_progress_range(0.6, 0.2)


def test_cosine_ema_step_uses_the_scheduled_momentum() -> None:
    method = tiny(momentum=0.9, momentum_schedule="cosine")
    with torch.no_grad():
        online, target = method.projector[0].weight, method.target_projector[0].weight
        online.fill_(1.0)
        target.fill_(0.0)
    method.set_progress(0.5)  # m = 0.95
    method.after_optimizer_step()
    assert torch.allclose(target, torch.full_like(target, 0.05))


def test_train_ssl_reports_progress_to_the_method() -> None:
    method = tiny(momentum=0.99, momentum_schedule="cosine")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(8, 32, 32, 3), dtype=np.uint8)
    stats = train_ssl(method, images, epochs=2, batch_size=4, lr=1e-3, optimizer="adamw", fast_path=False)
    assert stats.steps == 4 and math.isfinite(stats.loss)
    assert method.progress == pytest.approx(1.0)
    assert method.current_momentum == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"momentum": 1.5}, "momentum"),
        ({"momentum_schedule": "linear"}, "momentum_schedule"),
        ({"proj_hidden_dim": 0}, "proj_hidden_dim"),
        ({"num_proj_layers": 1.5}, "num_proj_layers"),
        ({"reset_target_on_new_global": "false"}, "reset_target_on_new_global"),
        ({"queue_size": 10}, "queue_size"),
    ],
)
def test_invalid_options_are_rejected(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny(**options)
