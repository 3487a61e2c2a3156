"""CKA (ssl_models/federated/cka.py) against Kornblith et al.'s published values and its defining properties."""

import numpy as np
import pytest
import torch

from ssl_models.federated.cka import (
    center_kernel,
    cka,
    feature_alignment_loss,
    kernel_alignment_loss,
    linear_cka,
    linear_kernel,
    rbf_cka,
    rbf_kernel,
)


@pytest.fixture(scope="module")
def demo():
    """The data of Kornblith et al.'s representation_similarity demo notebook."""
    np.random.seed(1337)
    x = np.random.randn(100, 10)
    y = np.random.randn(100, 10) + x
    return torch.from_numpy(x), torch.from_numpy(y)


def test_published_reference_values(demo):
    x, y = demo
    assert float(linear_cka(x, y)) == pytest.approx(0.55761, abs=5e-6)
    assert float(cka(linear_kernel(x), linear_kernel(y))) == pytest.approx(0.55761, abs=5e-6)
    assert float(linear_cka(x, y, debiased=True)) == pytest.approx(0.51346, abs=5e-6)
    assert float(cka(linear_kernel(x), linear_kernel(y), debiased=True)) == pytest.approx(0.51346, abs=5e-6)
    assert float(rbf_cka(x, y, threshold=0.5)) == pytest.approx(0.65483, abs=5e-6)


def test_feature_form_equals_gram_form_for_different_widths():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 7, generator=g, dtype=torch.float64)
    y = torch.randn(50, 19, generator=g, dtype=torch.float64) + x @ torch.randn(7, 19, generator=g, dtype=torch.float64)
    for debiased in (False, True):
        feature = float(linear_cka(x, y, debiased=debiased))
        gram = float(cka(linear_kernel(x), linear_kernel(y), debiased=debiased))
        assert feature == pytest.approx(gram, rel=1e-10)
    assert 0.0 < float(linear_cka(x, y)) < 1.0


def test_identity_symmetry_and_invariances(demo):
    x, y = demo
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-12)
    assert float(cka(linear_kernel(x), linear_kernel(x))) == pytest.approx(1.0, abs=1e-12)
    assert float(rbf_cka(x, x, 0.5)) == pytest.approx(1.0, abs=1e-12)
    assert float(linear_cka(x, y)) == pytest.approx(float(linear_cka(y, x)), abs=1e-12)
    assert float(cka(rbf_kernel(x), linear_kernel(y))) == pytest.approx(float(cka(linear_kernel(y), rbf_kernel(x))))
    q, _ = torch.linalg.qr(torch.randn(10, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    base = float(linear_cka(x, y))
    assert float(linear_cka(x @ q, y)) == pytest.approx(base, abs=1e-10)  # orthogonal transform
    assert float(linear_cka(3.7 * x, 0.01 * y)) == pytest.approx(base, abs=1e-10)  # isotropic scaling
    assert float(rbf_cka(5.0 * (x @ q), y, 0.5)) == pytest.approx(float(rbf_cka(x, y, 0.5)), abs=1e-10)
    # ... but not to an anisotropic scaling, which changes the representation's geometry
    stretch = torch.diag(torch.tensor([10.0] + [1.0] * 9, dtype=torch.float64))
    assert abs(float(linear_cka(x @ stretch, y)) - base) > 1e-3


def test_centering_matches_the_centering_matrix():
    k = torch.randn(6, 6, dtype=torch.float64)
    h = torch.eye(6, dtype=torch.float64) - torch.full((6, 6), 1 / 6, dtype=torch.float64)
    torch.testing.assert_close(center_kernel(k), h @ k @ h)
    u = center_kernel(k + k.t(), unbiased=True)
    assert torch.all(torch.diagonal(u) == 0)
    with pytest.raises(ValueError, match="n > 3"):
        center_kernel(torch.ones(3, 3), unbiased=True)


def test_alignment_loss_values_and_gradient_only_through_the_client_kernel():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(30, 8, generator=g)
    k = linear_kernel(a)
    assert float(kernel_alignment_loss(k, k)) == pytest.approx(0.0, abs=1e-5)
    assert float(kernel_alignment_loss(k, -k)) == pytest.approx(2.0, abs=1e-5)
    assert float(kernel_alignment_loss(k, 4.0 * k)) == pytest.approx(0.0, abs=1e-5)
    kk = k.clone().requires_grad_(True)
    target = linear_kernel(torch.randn(30, 5, generator=g)).requires_grad_(True)
    loss = kernel_alignment_loss(kk, target)
    assert loss.dtype == torch.float32
    loss.backward()
    assert kk.grad is not None and float(kk.grad.abs().sum()) > 0
    assert target.grad is None  # K_bar is a constant target
    # bf16 inputs (the CPU/CUDA fast path) are computed in float32
    assert kernel_alignment_loss(k.bfloat16(), target.detach()).dtype == torch.float32


def test_alignment_loss_gradcheck_float64_through_the_kernel_and_the_features():
    g = torch.Generator().manual_seed(2)
    target = linear_kernel(torch.randn(12, 4, generator=g, dtype=torch.float64))
    k = linear_kernel(torch.randn(12, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda m: kernel_alignment_loss(m, target), (k,))
    assert torch.autograd.gradcheck(lambda m: kernel_alignment_loss(m, target, debiased=True), (k,))
    a = torch.randn(12, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: kernel_alignment_loss(linear_kernel(f), target), (a,))
    assert torch.autograd.gradcheck(
        lambda f, h: linear_cka(f, h), (a, torch.randn(12, 3, dtype=torch.float64, requires_grad=True))
    )


def test_collapsed_representation_gives_a_finite_loss_and_gradient():
    a = torch.ones(20, 4, requires_grad=True)  # every RAD image mapped to one point: centred kernel is 0
    loss = kernel_alignment_loss(linear_kernel(a), linear_kernel(torch.randn(20, 4)))
    loss.backward()
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(1.0)
    assert torch.isfinite(a.grad).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="same size"):
        cka(torch.eye(4), torch.eye(5))
    with pytest.raises(ValueError, match="square"):
        cka(torch.ones(4, 3), torch.ones(4, 3))
    with pytest.raises(ValueError, match="same inputs"):
        linear_cka(torch.ones(4, 3), torch.ones(5, 3))
    with pytest.raises(ValueError, match="threshold"):
        rbf_kernel(torch.ones(4, 3), threshold=0)


def test_feature_form_alignment_loss_equals_the_gram_form_and_its_gradient():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(25, 6, generator=g, dtype=torch.float64, requires_grad=True)
    target = linear_kernel(torch.randn(25, 9, generator=g, dtype=torch.float64))
    gram = kernel_alignment_loss(linear_kernel(a), target)
    feature = feature_alignment_loss(a, center_kernel(target))
    assert float(feature.detach()) == pytest.approx(float(gram.detach()), abs=1e-12)
    (g1,) = torch.autograd.grad(gram, a)
    (g2,) = torch.autograd.grad(feature, a)
    torch.testing.assert_close(g1, g2)
    assert torch.autograd.gradcheck(lambda f: feature_alignment_loss(f, center_kernel(target)), (a,))
    with pytest.raises(ValueError, match="features have 25 rows"):
        feature_alignment_loss(a, torch.eye(24, dtype=torch.float64))
