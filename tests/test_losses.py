"""Loss functions checked against hand computations on tiny vectors."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_models.methods.losses import (
    byol_regression_loss,
    info_nce_loss,
    negative_cosine_similarity,
    nt_xent_loss,
)


def _neg_log_softmax_first(positive: float, others: list[float], temperature: float) -> float:
    """-log( exp(pos/T) / (exp(pos/T) + sum exp(other/T)) ), written out in plain Python."""
    numerator = math.exp(positive / temperature)
    denominator = numerator + sum(math.exp(o / temperature) for o in others)
    return -math.log(numerator / denominator)


# ---------------------------------------------------------------------------------------------- NT-Xent
def test_nt_xent_matches_hand_computation_for_two_pairs() -> None:
    # after L2 normalisation: a=[1,0], b=[0,1] (view 1); c=[.6,.8], d=[-.8,.6] (view 2); pairs (a,c), (b,d)
    z1 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z2 = torch.tensor([[0.6, 0.8], [-0.8, 0.6]])
    t = 0.5
    # cosines: ab=0, ac=.6, ad=-.8, bc=.8, bd=.6, cd=0; each anchor sees its positive + the 2 others
    per_anchor = [
        _neg_log_softmax_first(0.6, [0.0, -0.8], t),  # a: positive c, negatives b, d
        _neg_log_softmax_first(0.6, [0.0, 0.8], t),  # b: positive d, negatives a, c
        _neg_log_softmax_first(0.6, [0.8, 0.0], t),  # c: positive a, negatives b, d
        _neg_log_softmax_first(0.6, [-0.8, 0.0], t),  # d: positive b, negatives a, c
    ]
    expected = sum(per_anchor) / 4
    assert nt_xent_loss(z1, z2, t).item() == pytest.approx(expected, abs=1e-6)


def test_nt_xent_is_symmetric_and_scale_invariant() -> None:
    generator = torch.Generator().manual_seed(0)
    z1 = torch.randn(5, 7, generator=generator)
    z2 = torch.randn(5, 7, generator=generator)
    loss = nt_xent_loss(z1, z2, 0.3)
    assert nt_xent_loss(z2, z1, 0.3).item() == pytest.approx(loss.item(), abs=1e-6)
    assert nt_xent_loss(3.0 * z1, 0.5 * z2, 0.3).item() == pytest.approx(loss.item(), abs=1e-6)


def test_nt_xent_identical_orthogonal_views_give_known_low_loss() -> None:
    # z1 = z2 = [e1, e2]: every anchor has positive cosine 1 and two negatives with cosine 0
    z = torch.eye(2)
    t = 0.1
    expected = -math.log(math.exp(1 / t) / (math.exp(1 / t) + 2.0))
    loss = nt_xent_loss(z, z.clone(), t).item()
    assert loss == pytest.approx(expected, abs=1e-6)
    assert loss < 1e-3
    # swapping the pairing makes the positives orthogonal and the loss large
    assert nt_xent_loss(z, z.flip(0), t).item() > 9.0


# ---------------------------------------------------------------------------------------------- InfoNCE
def test_info_nce_matches_hand_computation() -> None:
    q = torch.tensor([[2.0, 0.0], [0.0, 1.0]])  # normalised inside -> [1,0], [0,1]
    k = torch.tensor([[0.6, 0.8], [0.0, 3.0]])  # normalised inside -> [.6,.8], [0,1]
    queue = torch.tensor([[0.0, -0.6], [1.0, 0.8]])  # columns [0,1] and [-.6,.8], already unit length
    t = 0.1
    loss_first = _neg_log_softmax_first(0.6, [0.0, -0.6], t)
    loss_second = _neg_log_softmax_first(1.0, [1.0, 0.8], t)
    expected = (loss_first + loss_second) / 2
    assert info_nce_loss(q, k, queue, t).item() == pytest.approx(expected, abs=1e-5)


def test_info_nce_rejects_queue_of_wrong_dimension() -> None:
    with pytest.raises(ValueError, match="queue"):
        info_nce_loss(torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 10), 0.2)


# ---------------------------------------------------------------------------------------------- cosine losses
def test_cosine_losses_match_hand_computation() -> None:
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z = torch.tensor([[1.0, 1.0], [0.0, -1.0]])
    # cosines: 1/sqrt(2) and -1
    cos = [1 / math.sqrt(2), -1.0]
    assert negative_cosine_similarity(p, z).item() == pytest.approx(-(cos[0] + cos[1]) / 2, abs=1e-6)
    expected_byol = ((2 - 2 * cos[0]) + (2 - 2 * cos[1])) / 2
    assert byol_regression_loss(p, z).item() == pytest.approx(expected_byol, abs=1e-6)


def test_cosine_losses_of_identical_vectors_reach_their_minimum() -> None:
    x = torch.randn(4, 6)
    assert negative_cosine_similarity(x, 2.0 * x).item() == pytest.approx(-1.0, abs=1e-6)
    assert byol_regression_loss(x, 2.0 * x).item() == pytest.approx(0.0, abs=1e-6)


def test_cosine_losses_are_symmetric() -> None:
    p, z = torch.randn(4, 6), torch.randn(4, 6)
    assert byol_regression_loss(p, z).item() == pytest.approx(byol_regression_loss(z, p).item(), abs=1e-6)


# ---------------------------------------------------------------------------------------------- precision
def test_losses_return_float32_for_bfloat16_inputs() -> None:
    a = torch.randn(4, 8).bfloat16()
    b = torch.randn(4, 8).bfloat16()
    queue = torch.nn.functional.normalize(torch.randn(8, 16), dim=0)
    assert nt_xent_loss(a, b, 0.5).dtype == torch.float32
    assert info_nce_loss(a, b, queue, 0.2).dtype == torch.float32
    assert byol_regression_loss(a, b).dtype == torch.float32
    assert negative_cosine_similarity(a, b).dtype == torch.float32


def test_losses_compute_in_float32_inside_an_autocast_region() -> None:
    # under a bf16 autocast a plain matmul would run in bf16 (about 3 significant digits): the results would
    # differ from float32 by ~1e-3, far above the tolerance used here
    generator = torch.Generator().manual_seed(1)
    z1 = torch.randn(16, 64, generator=generator)
    z2 = torch.randn(16, 64, generator=generator)
    queue = torch.nn.functional.normalize(torch.randn(64, 256, generator=generator), dim=0)
    reference = (nt_xent_loss(z1, z2, 0.1), info_nce_loss(z1, z2, queue, 0.07))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = (nt_xent_loss(z1, z2, 0.1), info_nce_loss(z1, z2, queue, 0.07))
    for expected, actual in zip(reference, under_autocast):
        assert actual.dtype == torch.float32
        assert actual.item() == pytest.approx(expected.item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_non_positive_temperature_is_rejected(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        nt_xent_loss(torch.randn(2, 3), torch.randn(2, 3), temperature)


def test_mismatched_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="z1 and z2"):
        nt_xent_loss(torch.randn(2, 3), torch.randn(3, 3), 0.5)
    with pytest.raises(ValueError, match="p and z"):
        byol_regression_loss(torch.randn(2, 3), torch.randn(2, 4))
