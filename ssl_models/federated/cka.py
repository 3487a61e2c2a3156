"""Centered kernel alignment (CKA) in PyTorch, with gradients, for Hetero-SSFL's representation alignment.

CKA (Kornblith et al., 2019, "Similarity of Neural Network Representations Revisited") compares two
representations ``X`` (n, d1) and ``Y`` (n, d2) of the same n inputs through their n x n kernels
``K = k(X)`` and ``L = k(Y)``:

    CKA(K, L) = <HKH, HLH>_F / (||HKH||_F ||HLH||_F),      H = I - 11^T / n (centring).

Forms implemented here (all differentiable, any float dtype; nothing is detached except the RBF bandwidth):

- **Gram form** ``cka(K, L)``: centres both kernels (O(n^2) each) and takes their normalised Frobenius inner
  product. Works for any kernel, so it is what the federated loss uses: clients exchange kernels, never
  features (their widths differ between architectures).
- **Feature form** ``linear_cka(X, Y)``: linear CKA without any n x n matrix, in O(n d^2):
  ``||Y_c^T X_c||_F^2 / (||X_c^T X_c||_F ||Y_c^T Y_c||_F)`` with column-centred features; equal to
  ``cka(linear_kernel(X), linear_kernel(Y))``.
- **Debiased** (``debiased=True``): the unbiased HSIC estimator (Song et al., 2012) in place of the biased one,
  i.e. the U-centred Gram matrices of Kornblith et al.'s code. This is the value minibatch CKA packages
  report; it can leave [0, 1].
- **RBF kernel** ``rbf_kernel(X, threshold)``: ``exp(-d_ij^2 / (2 threshold^2 median(d^2)))``, the median over
  all n^2 squared distances (diagonal included), as in the reference code; the bandwidth is treated as a
  constant (detached): a median has no useful gradient.

The reference values of Kornblith et al.'s demo notebook (``np.random.seed(1337); X = randn(100, 10);
Y = randn(100, 10) + X``): linear CKA 0.55761, debiased 0.51346, RBF (threshold 0.5) 0.65483; they are tested.

``kernel_alignment_loss(K_k, K_bar) = 1 - CKA(K_k, K_bar)`` is Hetero-SSFL's alignment term. The paper's Eq. 2
*adds* CKA itself to the loss, which minimised would push a client's representations away from the others';
the alignment the paper describes (and FedHeNN implements) needs the distance 1 - CKA. The loss is computed in
float32 with autocast off and a small epsilon in the denominator (a collapsed representation has a zero centred
kernel); the gradient flows through ``K_k`` only (``K_bar`` is a constant target).
"""

from __future__ import annotations

import torch

DEFAULT_EPS = 1e-8


def _check_square(name: str, matrix: torch.Tensor) -> int:
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{name} must be a square (n, n) kernel, got shape {tuple(matrix.shape)}")
    return int(matrix.shape[0])


def _check_features(name: str, features: torch.Tensor) -> int:
    if features.dim() != 2:
        raise ValueError(f"{name} must be a 2-D (n, d) tensor, got shape {tuple(features.shape)}")
    return int(features.shape[0])


# ------------------------------------------------------------------------------------------------ kernels
def linear_kernel(features: torch.Tensor) -> torch.Tensor:
    """``K = A A^T`` (n, n): the linear kernel of the rows of ``features`` (n, d)."""
    _check_features("features", features)
    return features @ features.t()


def rbf_kernel(features: torch.Tensor, threshold: float = 1.0) -> torch.Tensor:
    """Gaussian kernel ``exp(-||a_i - a_j||^2 / (2 threshold^2 m))`` with ``m`` the median squared distance.

    Kornblith et al.'s ``gram_rbf``: the median runs over every entry of the n x n distance matrix (the zero
    diagonal included) and the bandwidth is a constant for the gradient.
    """
    _check_features("features", features)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    dots = features @ features.t()
    sq_norms = torch.diagonal(dots)
    sq_distances = (sq_norms[:, None] + sq_norms[None, :] - 2.0 * dots).clamp_min(0.0)
    # numpy's median (the reference): the mean of the two middle values for an even count.
    flat = sq_distances.detach().flatten()
    m = flat.numel()
    median = torch.kthvalue(flat, (m + 1) // 2).values
    if m % 2 == 0:
        median = 0.5 * (median + torch.kthvalue(flat, m // 2 + 1).values)
    scale = 2.0 * float(threshold) ** 2 * median
    if not scale > 0:  # every point identical: the kernel is all ones
        return torch.ones_like(sq_distances)
    return torch.exp(-sq_distances / scale)


def center_kernel(kernel: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """``H K H`` (a new tensor; ``kernel`` is not modified).

    ``unbiased=True`` gives the U-centred kernel of the unbiased HSIC estimator (Kornblith et al.'s
    ``center_gram(..., unbiased=True)``): zero diagonal, column means taken over n - 2 and corrected by
    ``sum / (2 (n - 1))``; it needs n > 3 and a symmetric kernel.
    """
    n = _check_square("kernel", kernel)
    if unbiased:
        if n < 4:
            raise ValueError(f"the debiased estimator needs n > 3 samples, got n={n}")
        eye = torch.eye(n, dtype=torch.bool, device=kernel.device)
        off = kernel.masked_fill(eye, 0.0)
        means = off.sum(dim=0) / (n - 2)
        means = means - means.sum() / (2 * (n - 1))
        return (off - means[:, None] - means[None, :]).masked_fill(eye, 0.0)
    # H K H for any square K: subtract row means and column means, add back the grand mean.
    return kernel - kernel.mean(dim=0, keepdim=True) - kernel.mean(dim=1, keepdim=True) + kernel.mean()


def cka(kernel_x: torch.Tensor, kernel_y: torch.Tensor, *, debiased: bool = False, eps: float = 0.0) -> torch.Tensor:
    """CKA of two n x n kernels (Gram form): ``<HKH, HLH>_F / (||HKH||_F ||HLH||_F + eps)``.

    With ``debiased`` the U-centred kernels replace ``HKH`` and ``HLH``. Differentiable in both kernels.
    """
    n = _check_square("kernel_x", kernel_x)
    if _check_square("kernel_y", kernel_y) != n:
        raise ValueError(f"kernels must have the same size, got {n} and {kernel_y.shape[0]}")
    kx = center_kernel(kernel_x, unbiased=debiased)
    ky = center_kernel(kernel_y, unbiased=debiased)
    return (kx * ky).sum() / (_frobenius(kx) * _frobenius(ky) + eps)


def _frobenius(matrix: torch.Tensor) -> torch.Tensor:
    """``||M||_F`` whose gradient stays finite at M = 0 (a collapsed representation) instead of 0 * inf = NaN."""
    return torch.sqrt((matrix * matrix).sum().clamp_min(torch.finfo(matrix.dtype).tiny))


# ------------------------------------------------------------------------------------------------ features
def _debiased_dot(
    xty_sq: torch.Tensor, rows_x: torch.Tensor, rows_y: torch.Tensor, norm_x: torch.Tensor, norm_y: torch.Tensor, n: int
) -> torch.Tensor:
    """Kornblith et al.'s debiased dot-product similarity: the unbiased HSIC estimate up to a factor that
    cancels in CKA, from the squared norm of the cross product and the rows' squared norms."""
    return xty_sq - n / (n - 2.0) * (rows_x * rows_y).sum() + norm_x * norm_y / ((n - 1.0) * (n - 2.0))


def linear_cka(
    features_x: torch.Tensor, features_y: torch.Tensor, *, debiased: bool = False, eps: float = 0.0
) -> torch.Tensor:
    """Linear CKA of two representations of the same n inputs in feature form (O(n d^2), no n x n matrix).

    ``features_x`` (n, d1) and ``features_y`` (n, d2) may have different widths.
    """
    n = _check_features("features_x", features_x)
    if _check_features("features_y", features_y) != n:
        raise ValueError(f"features must describe the same inputs, got {n} and {features_y.shape[0]} rows")
    x = features_x - features_x.mean(dim=0, keepdim=True)
    y = features_y - features_y.mean(dim=0, keepdim=True)
    xty_sq = ((y.t() @ x) ** 2).sum()
    xtx_sq = ((x.t() @ x) ** 2).sum()
    yty_sq = ((y.t() @ y) ** 2).sum()
    if debiased:
        if n < 4:
            raise ValueError(f"the debiased estimator needs n > 3 samples, got n={n}")
        rows_x, rows_y = (x * x).sum(dim=1), (y * y).sum(dim=1)
        sq_x, sq_y = rows_x.sum(), rows_y.sum()
        xty_sq = _debiased_dot(xty_sq, rows_x, rows_y, sq_x, sq_y, n)
        xtx_sq = _debiased_dot(xtx_sq, rows_x, rows_x, sq_x, sq_x, n)
        yty_sq = _debiased_dot(yty_sq, rows_y, rows_y, sq_y, sq_y, n)
    return xty_sq / (torch.sqrt(xtx_sq) * torch.sqrt(yty_sq) + eps)


def rbf_cka(
    features_x: torch.Tensor, features_y: torch.Tensor, threshold: float = 1.0, *, debiased: bool = False
) -> torch.Tensor:
    """CKA of the RBF kernels of two representations (bandwidth ``threshold`` x median distance)."""
    return cka(rbf_kernel(features_x, threshold), rbf_kernel(features_y, threshold), debiased=debiased)


# ------------------------------------------------------------------------------------------------ the loss
def kernel_alignment_loss(
    kernel: torch.Tensor, target_kernel: torch.Tensor, *, debiased: bool = False, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """``1 - CKA(kernel, target_kernel)``, gradient through ``kernel`` only.

    Hetero-SSFL's alignment distance d(K_k, K_bar): 0 when the client's centred kernel is a positive multiple of
    the average one, up to 2 when it is a negative one. ``target_kernel`` (the server's K_bar) is detached.
    Computed in float32 (float64 when ``kernel`` is float64, for gradient checks), autocast off.
    """
    dtype = torch.float64 if kernel.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=kernel.device.type, enabled=False):
        k = kernel.to(dtype)
        target = target_kernel.detach().to(device=kernel.device, dtype=dtype)
        return 1.0 - cka(k, target, debiased=debiased, eps=eps)


def feature_alignment_loss(
    features: torch.Tensor, centered_target: torch.Tensor, *, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """``1 - CKA(A A^T, K_bar)`` for the linear kernel, from the features ``A`` (n, d) and ``H K_bar H``.

    Equal to ``kernel_alignment_loss(linear_kernel(A), K_bar)`` with ``centered_target = center_kernel(K_bar)``,
    without any n x n matrix of the client's own: ``<HAA^TH, K_c> = sum(A_c * (K_c A_c))`` and
    ``||A_c A_c^T||_F = ||A_c^T A_c||_F`` with ``A_c`` the column-centred features. Time O(n^2 d), memory
    O(n d + d^2) beyond the target (for a 5 000-image RAD that spares several 100 MB matrices and their autograd
    copies). Float32 (float64 for float64 features), autocast off; the gradient flows into ``features``.
    """
    n = _check_features("features", features)
    if _check_square("centered_target", centered_target) != n:
        raise ValueError(
            f"features have {n} rows but the target kernel is {centered_target.shape[0]} x {centered_target.shape[0]}"
        )
    dtype = torch.float64 if features.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=features.device.type, enabled=False):
        a = features.to(dtype)
        a = a - a.mean(dim=0, keepdim=True)
        target = centered_target.detach().to(device=features.device, dtype=dtype)
        hsic = (a * (target @ a)).sum()
        target_norm = torch.linalg.vector_norm(target)  # a constant; a reduction, no n x n temporary
        return 1.0 - hsic / (_frobenius(a.t() @ a) * target_norm + eps)
