"""Each method's ``training_step`` against the loss written out again here, from the module's own sub-modules.

The loss formulas below are spelled out with plain tensor arithmetic (cosines as dot products over norms, the
cross-entropy as log-sum-exp minus the positive logit, NT-Xent as a loop over anchors), never by calling
``ssl_models.methods.losses``. Two different random views are used, and every branch that could be confused with
another one (online / target, view 1 / view 2) holds different values, so a wrong pairing, a wrong branch or a
wrong temperature changes the expected number. Each test also checks that the wrong pairing would give another
number, so it cannot pass by accident.

Both BatchNorm regimes are covered: ``eval`` (running statistics, set to non-trivial values) and ``train`` (batch
statistics; the test then repeats the batch composition the method must use: SimCLR one forward over the 2N
images, the others one forward per view).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ssl_models.methods import SSLMethod, build_method
from ssl_models.networks import build_backbone

HEADS: dict[str, dict[str, Any]] = {
    "simclr": {"proj_hidden_dim": 32, "proj_out_dim": 16},
    "moco": {"proj_hidden_dim": 32, "proj_out_dim": 16, "queue_size": 40},
    "byol": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32},
    "simsiam": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32},
}
BATCH = 8
MODES = ["eval", "train"]


def tiny(name: str, mode: str, seed: int = 0, **options: Any) -> SSLMethod:
    """A width-0.125 ResNet-18 method with small heads; BN running statistics and (if any) the target branch
    moved away from their initial values so that no two branches coincide."""
    torch.manual_seed(seed)
    backbone, feature_dim = build_backbone("resnet18", width=0.125)
    method = build_method(name, backbone, feature_dim, **{**HEADS[name], **options})
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for module in method.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=g))
                module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=g))
        for prefix in ("target_backbone", "target_projector"):
            target = getattr(method, prefix, None)
            if target is not None:
                for p in target.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
    method.train(mode == "train")
    return method


def views(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two different batches of 8 noise images; each image has its own colour cast, so the images (and the two
    views of one index) differ in more than noise."""
    g = torch.Generator().manual_seed(seed)

    def batch() -> torch.Tensor:
        return 0.2 * torch.rand(BATCH, 3, 16, 16, generator=g) + 0.8 * torch.rand(BATCH, 3, 1, 1, generator=g)

    return batch(), batch()


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity, in float64, written out."""
    a, b = a.double(), b.double()
    return (a * b).sum(dim=1) / (a.pow(2).sum(dim=1).sqrt() * b.pow(2).sum(dim=1).sqrt())


def unit(a: torch.Tensor) -> torch.Tensor:
    a = a.double()
    return a / a.pow(2).sum(dim=1, keepdim=True).sqrt()


def assert_loss(actual: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor) -> None:
    assert actual.dim() == 0 and actual.dtype == torch.float32
    assert float(actual.detach()) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    # the test can tell the right pairing from the wrong one: they differ by far more than the tolerance
    assert abs(float(expected) - float(wrong)) > 20 * (1e-5 * abs(float(expected)) + 1e-6)


# ---------------------------------------------------------------------------------------------- BYOL
@pytest.mark.parametrize("mode", MODES)
def test_byol_loss_is_2_minus_2cos_of_each_prediction_with_the_other_views_target(mode: str) -> None:
    method = tiny("byol", mode)
    v1, v2 = views()
    loss = method.training_step(v1, v2)
    with torch.no_grad():
        p1 = method.predictor(method.projector(method.backbone(v1)))
        p2 = method.predictor(method.projector(method.backbone(v2)))
        t1 = method.target_projector(method.target_backbone(v1))
        t2 = method.target_projector(method.target_backbone(v2))
        z1 = method.projector(method.backbone(v1))
    expected = (2 - 2 * cos(p1, t2)).mean() + (2 - 2 * cos(p2, t1)).mean()
    assert_loss(loss, expected, wrong=(2 - 2 * cos(p1, t1)).mean() + (2 - 2 * cos(p2, t2)).mean())
    # the regression target is the target branch, not the online projection
    assert abs(float(expected) - float((2 - 2 * cos(p2, z1)).mean() + (2 - 2 * cos(p1, t2)).mean())) > 1e-3
    # the target branch receives no gradient; the online branch does
    loss.backward()
    assert all(p.grad is None for p in method.target_backbone.parameters())
    assert method.backbone.stem[0].weight.grad is not None


@pytest.mark.parametrize("mode", MODES)
def test_byol_without_ema_regresses_the_other_views_detached_online_projection(mode: str) -> None:
    method = tiny("byol", mode, use_ema=False)
    v1, v2 = views(seed=2)
    loss = method.training_step(v1, v2)
    with torch.no_grad():
        z1 = method.projector(method.backbone(v1))
        z2 = method.projector(method.backbone(v2))
        p1, p2 = method.predictor(z1), method.predictor(z2)
    expected = (2 - 2 * cos(p1, z2)).mean() + (2 - 2 * cos(p2, z1)).mean()
    assert_loss(loss, expected, wrong=(2 - 2 * cos(p1, z1)).mean() + (2 - 2 * cos(p2, z2)).mean())


@pytest.mark.parametrize("mode", MODES)
def test_byol_without_predictor_regresses_the_online_projection_onto_the_target(mode: str) -> None:
    method = tiny("byol", mode, use_predictor=False)
    v1, v2 = views(seed=3)
    loss = method.training_step(v1, v2)
    with torch.no_grad():
        z1 = method.projector(method.backbone(v1))
        z2 = method.projector(method.backbone(v2))
        t1 = method.target_projector(method.target_backbone(v1))
        t2 = method.target_projector(method.target_backbone(v2))
    expected = (2 - 2 * cos(z1, t2)).mean() + (2 - 2 * cos(z2, t1)).mean()
    assert_loss(loss, expected, wrong=(2 - 2 * cos(z1, t1)).mean() + (2 - 2 * cos(z2, t2)).mean())


# ---------------------------------------------------------------------------------------------- SimSiam
@pytest.mark.parametrize("mode", MODES)
def test_simsiam_loss_is_half_d_p1_z2_plus_half_d_p2_z1_with_stop_gradient_on_z(mode: str) -> None:
    method = tiny("simsiam", mode)
    v1, v2 = views(seed=4)
    loss = method.training_step(v1, v2)
    method.zero_grad()
    loss.backward()
    grad_module = method.backbone.stem[0].weight.grad.clone()

    def recomputed(detach: bool) -> tuple[torch.Tensor, torch.Tensor]:
        method.zero_grad()
        z1 = method.projector(method.backbone(v1))
        z2 = method.projector(method.backbone(v2))
        p1, p2 = method.predictor(z1), method.predictor(z2)
        if detach:
            z1, z2 = z1.detach(), z2.detach()
        value = 0.5 * (-cos(p1, z2)).mean() + 0.5 * (-cos(p2, z1)).mean()
        value.backward()
        return value.detach(), method.backbone.stem[0].weight.grad.clone()

    expected, grad_stop = recomputed(detach=True)
    with torch.no_grad():
        z1 = method.projector(method.backbone(v1))
        z2 = method.projector(method.backbone(v2))
        wrong = 0.5 * (-cos(method.predictor(z1), z1)).mean() + 0.5 * (-cos(method.predictor(z2), z2)).mean()
    assert_loss(loss, expected, wrong)
    scale = float(grad_stop.abs().max())
    torch.testing.assert_close(grad_module, grad_stop.float(), rtol=1e-4, atol=1e-5 * scale)
    _, grad_through = recomputed(detach=False)  # without the stop-gradient the gradient would differ
    assert float((grad_through.float() - grad_module).abs().max()) > 0.05 * scale


# ---------------------------------------------------------------------------------------------- MoCo
def info_nce(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over the batch of -log softmax of the positive logit q.k among [q.k, q.queue], all / T."""
    q, k = unit(q), unit(k)
    logits = torch.cat([(q * k).sum(dim=1, keepdim=True), q @ queue.double()], dim=1) / temperature
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("version", [1, 2])
def test_moco_loss_is_the_symmetric_sum_of_two_info_nce_terms_and_enqueues_both_keys(mode: str, version: int) -> None:
    method = tiny("moco", mode, version=version)
    temperature = {1: 0.07, 2: 0.2}[version]
    method.queue_ptr.fill_(30)  # 2 x 8 keys from position 30 of 40: the write wraps around
    queue_before = method.queue.clone()
    v1, v2 = views(seed=5)
    loss = method.training_step(v1, v2)
    with torch.no_grad():
        q1 = method.projector(method.backbone(v1))
        q2 = method.projector(method.backbone(v2))
        k1 = method.target_projector(method.target_backbone(v1))
        k2 = method.target_projector(method.target_backbone(v2))
    expected = info_nce(q1, k2, queue_before, temperature) + info_nce(q2, k1, queue_before, temperature)
    wrong = info_nce(q1, k1, queue_before, temperature) + info_nce(q2, k2, queue_before, temperature)
    assert_loss(loss, expected, wrong)
    # keys of the momentum encoder (not the queries) are enqueued: first view 1's, then view 2's
    columns = [(30 + i) % 40 for i in range(2 * BATCH)]
    torch.testing.assert_close(
        method.queue[:, columns].double(), torch.cat([unit(k1), unit(k2)]).t(), rtol=1e-5, atol=1e-6
    )
    untouched = [c for c in range(40) if c not in columns]
    assert torch.equal(method.queue[:, untouched], queue_before[:, untouched])
    assert int(method.queue_ptr) == (30 + 2 * BATCH) % 40


@pytest.mark.parametrize("mode", MODES)
def test_moco_asymmetric_loss_is_one_info_nce_term_with_a_custom_temperature(mode: str) -> None:
    method = tiny("moco", mode, symmetric=False, temperature=0.5)
    queue_before = method.queue.clone()
    v1, v2 = views(seed=6)
    loss = method.training_step(v1, v2)
    with torch.no_grad():
        q1 = method.projector(method.backbone(v1))
        k2 = method.target_projector(method.target_backbone(v2))
    expected = info_nce(q1, k2, queue_before, 0.5)
    assert_loss(loss, expected, wrong=info_nce(q1, k2, queue_before, 0.2))  # the v2 default temperature
    torch.testing.assert_close(method.queue[:, :BATCH].double(), unit(k2).t(), rtol=1e-5, atol=1e-6)
    assert int(method.queue_ptr) == BATCH


# ---------------------------------------------------------------------------------------------- SimCLR
def nt_xent_by_anchor(z1: torch.Tensor, z2: torch.Tensor, temperature: float, shift: int = 0) -> torch.Tensor:
    """Mean over the 2N anchors of -log( exp(s(i, pos)/T) / sum_{k != i} exp(s(i, k)/T) ), pos = i's other view.

    ``shift`` pairs anchor i with the other view of image i + shift instead (a wrong pairing for the check)."""
    z = unit(torch.cat([z1, z2]))
    n = z1.shape[0]
    sim = (z @ z.t()) / temperature
    total = torch.zeros((), dtype=torch.float64)
    for i in range(2 * n):
        image, other_half = i % n, n if i < n else 0
        positive = other_half + (image + shift) % n
        denominator = sum(torch.exp(sim[i, k]) for k in range(2 * n) if k != i)
        total = total - (sim[i, positive] - torch.log(denominator))
    return total / (2 * n)


@pytest.mark.parametrize("mode", MODES)
def test_simclr_loss_is_nt_xent_over_one_forward_of_both_views(mode: str) -> None:
    method = tiny("simclr", mode, temperature=0.3)
    v1, v2 = views(seed=7)
    loss = method.training_step(v1, v2)
    with torch.no_grad():
        z1, z2 = method.projector(method.backbone(torch.cat([v1, v2]))).chunk(2)
    expected = nt_xent_by_anchor(z1, z2, 0.3)
    assert_loss(loss, expected, wrong=nt_xent_by_anchor(z1, z2, 0.3, shift=1))
    assert abs(float(expected) - float(nt_xent_by_anchor(z1, z2, 0.5))) > 1e-3  # the option's temperature is used
    if mode == "train":  # BatchNorm statistics over the 2N batch, not per view
        with torch.no_grad():
            s1 = method.projector(method.backbone(v1))
            s2 = method.projector(method.backbone(v2))
        assert abs(float(expected) - float(nt_xent_by_anchor(s1, s2, 0.3))) > 1e-4
