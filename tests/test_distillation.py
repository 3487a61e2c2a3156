"""FLESD server distillation: the indexed queue, the soft cross-entropy and one tiny ``distill`` run."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssl_models.federated.distillation import (
    IndexedQueue,
    build_key_encoder,
    distill,
    similarity_distillation_loss,
    warmup_iterations,
)
from ssl_models.federated.similarity import ensemble_similarity, similarity_matrix
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone


# ---------------------------------------------------------------------------------------------- queue
def _keys_for(indices: list[int]) -> torch.Tensor:
    """Unit keys that encode their own index: key(i) = normalise([i, 1]), so alignment can be checked."""
    return F.normalize(torch.tensor([[float(i), 1.0] for i in indices]), dim=1)


def _assert_aligned(queue: IndexedQueue) -> None:
    torch.testing.assert_close(queue.keys, _keys_for(queue.indices.tolist()).t())


def test_indexed_queue_is_fifo_and_keeps_indices_aligned_through_wraps() -> None:
    queue = IndexedQueue(dim=2, size=5)
    assert not queue.full and queue.indices.tolist() == [-1] * 5

    queue.enqueue(_keys_for([10, 11, 12]), torch.tensor([10, 11, 12]))
    assert not queue.full
    assert queue.indices.tolist() == [10, 11, 12, -1, -1]

    # 4 keys with 2 slots left: fills the end, then overwrites the oldest (10, 11) at the front
    queue.enqueue(_keys_for([13, 14, 15, 16]), torch.tensor([13, 14, 15, 16]))
    assert queue.full
    assert queue.indices.tolist() == [15, 16, 12, 13, 14]
    _assert_aligned(queue)

    # the next key replaces the oldest one left (12)
    queue.enqueue(_keys_for([17]), torch.tensor([17]))
    assert queue.indices.tolist() == [15, 16, 17, 13, 14]
    _assert_aligned(queue)

    # a batch larger than the queue keeps only its last 5 keys, still in FIFO positions
    queue.enqueue(_keys_for(list(range(20, 27))), torch.arange(20, 27))
    assert sorted(queue.indices.tolist()) == [22, 23, 24, 25, 26]
    # as if all 7 were written in turn from position 3 onwards: the oldest kept (22) sits at the pointer
    assert queue.indices.tolist() == [24, 25, 26, 22, 23]
    _assert_aligned(queue)
    queue.enqueue(_keys_for([30]), torch.tensor([30]))
    assert queue.indices.tolist() == [24, 25, 26, 30, 23]
    _assert_aligned(queue)


def test_indexed_queue_normalises_keys_and_rejects_bad_shapes() -> None:
    queue = IndexedQueue(dim=2, size=3)
    queue.enqueue(torch.tensor([[3.0, 4.0]]), torch.tensor([7]))
    torch.testing.assert_close(queue.keys[:, 0], torch.tensor([0.6, 0.8]))
    with pytest.raises(ValueError, match="keys"):
        queue.enqueue(torch.ones(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="indices"):
        queue.enqueue(torch.ones(2, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="size"):
        IndexedQueue(dim=2, size=0)


# ---------------------------------------------------------------------------------------------- loss
def test_loss_equals_hand_computed_soft_cross_entropy() -> None:
    # queue keys e1, e2, -e1; queries: e1 and [3, 4] (normalised to [.6, .8] inside the loss)
    queue = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    p = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])
    t = 0.5
    # logits row 0: (1, 0, -1) / .5 = (2, 0, -2); row 1: (.6, .8, -.6) / .5 = (1.2, 1.6, -1.2)
    lse0 = math.log(math.exp(2) + math.exp(0) + math.exp(-2))
    lse1 = math.log(math.exp(1.2) + math.exp(1.6) + math.exp(-1.2))
    row0 = -(0.5 * (2 - lse0) + 0.25 * (0 - lse0) + 0.25 * (-2 - lse0))
    row1 = -(1.6 - lse1)
    loss = similarity_distillation_loss(q, queue, p, t)
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-6)

    # = KL(p || softmax) + H(p), with H(p) = 1.5 log 2 for row 0 and 0 for row 1
    softmax = torch.softmax(F.normalize(q, dim=1) @ queue / t, dim=1)
    kl = (p * (torch.log(p.clamp_min(1e-30)) - torch.log(softmax))).sum(dim=1)
    entropy = torch.tensor([1.5 * math.log(2), 0.0])
    assert loss.item() == pytest.approx((kl + entropy).mean().item(), abs=1e-6)


def test_loss_is_float32_under_autocast_and_checks_shapes() -> None:
    q = torch.randn(4, 8, requires_grad=True)
    queue = F.normalize(torch.randn(8, 6), dim=0)
    p = torch.softmax(torch.randn(4, 6), dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = similarity_distillation_loss(q.bfloat16(), queue, p, 0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="target_probs"):
        similarity_distillation_loss(q, queue, p[:, :5], 0.1)
    with pytest.raises(ValueError, match="queue_keys"):
        similarity_distillation_loss(q, queue.t(), p, 0.1)
    with pytest.raises(ValueError, match="temperature"):
        similarity_distillation_loss(q, queue, p, 0.0)


# ---------------------------------------------------------------------------------------------- distill
NUM_PUBLIC = 24
# fp32 (fast_path=False) keeps these runs exact and quick on small CPUs; the fast path has its own test below
DISTILL_KWARGS = {
    "batch_size": 8,
    "queue_size": 32,
    "momentum": 0.75,
    "temperature": 0.1,
    "lr": 1e-2,
    "seed": 3,
    "fast_path": False,
}


def _tiny_method() -> torch.nn.Module:
    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", width=0.125)
    return build_method("simclr", backbone, dim, proj_hidden_dim=32, proj_out_dim=16)


def _public_set_and_ensemble() -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(NUM_PUBLIC, 16, 16, 3), dtype=np.uint8)
    generator = torch.Generator().manual_seed(1)
    clients = (similarity_matrix(torch.randn(NUM_PUBLIC, 16, generator=generator)) for _ in range(2))
    return images, ensemble_similarity(clients, 0.1)


def _online_params(method: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in list(method.backbone.parameters()) + list(method.projector.parameters())]


def test_distill_trains_student_and_moves_key_encoder_by_the_momentum_rule() -> None:
    images, ensemble = _public_set_and_ensemble()
    assert warmup_iterations(32, 8) == 4
    start = _tiny_method()
    theta0 = _online_params(start)

    # run A: 5 iterations = 4 warm-up + 1 step; the student after it is theta1
    method_a = copy.deepcopy(start)
    stats_a = distill(method_a, images, ensemble, iterations=5, **DISTILL_KWARGS)
    assert stats_a["steps"] == 1
    theta1 = _online_params(method_a)

    # run B: the same run continued for one more iteration, with an explicit key encoder to inspect.
    # Its key encoder saw theta0 during iterations 1-5 (so stayed at theta0) and, at iteration 6,
    # EMA-moved once towards theta1 before computing keys: key = m * theta0 + (1 - m) * theta1.
    method_b = copy.deepcopy(start)
    key_encoder = build_key_encoder(method_b)
    stats_b = distill(method_b, images, ensemble, iterations=6, key_encoder=key_encoder, **DISTILL_KWARGS)
    assert stats_b["steps"] == 2 and stats_b["warmup_iterations"] == 4 and stats_b["iterations"] == 6
    assert math.isfinite(stats_b["loss"]) and stats_b["loss"] > 0 and stats_b["seconds"] > 0

    momentum = DISTILL_KWARGS["momentum"]
    key_params = [p.detach() for p in key_encoder.parameters()]
    assert all(not p.requires_grad for p in key_encoder.parameters())
    for key, p0, p1 in zip(key_params, theta0, theta1):
        torch.testing.assert_close(key, momentum * p0 + (1 - momentum) * p1, atol=1e-6, rtol=1e-5)

    theta2 = _online_params(method_b)
    assert any(not torch.equal(p0, p2) for p0, p2 in zip(theta0, theta2)), "the student did not train"
    assert any(not torch.equal(p1, p2) for p1, p2 in zip(theta1, theta2)), "the second step changed nothing"
    assert any(not torch.equal(k, p0) for k, p0 in zip(key_params, theta0)), "the key encoder did not move"


def test_distill_on_the_fast_path_gives_a_finite_loss() -> None:
    images, ensemble = _public_set_and_ensemble()
    method = _tiny_method()
    theta0 = _online_params(method)
    stats = distill(method, images, ensemble, iterations=5, **{**DISTILL_KWARGS, "fast_path": True})
    assert stats["steps"] == 1 and math.isfinite(stats["loss"])
    assert any(not torch.equal(p0, p1) for p0, p1 in zip(theta0, _online_params(method)))


def test_distill_rejects_bad_arguments() -> None:
    images, ensemble = _public_set_and_ensemble()
    method = _tiny_method()
    with pytest.raises(ValueError, match="warm-up"):
        distill(method, images, ensemble, iterations=4, **DISTILL_KWARGS)
    with pytest.raises(ValueError, match="ensemble"):
        distill(method, images, ensemble[:-1, :-1], iterations=6, **DISTILL_KWARGS)
    with pytest.raises(ValueError, match="public_images"):
        distill(method, images.astype(np.float32), ensemble, iterations=6, **DISTILL_KWARGS)
