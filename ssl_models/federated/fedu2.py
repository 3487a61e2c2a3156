"""FedU2 (Liao et al., "Rethinking the Representation in Federated Unsupervised Learning with Non-IID Data",
CVPR 2024, arXiv 2403.16398): the math of its two parts. Pure PyTorch and NumPy; no Flower.

Flexible uniform regulariser (FUR), on the client, added to the SSL loss of every local step:
- ``fur_uot`` (the paper's form): the representations of one batch, L2-normalised onto the unit hypersphere, are
  transported to as many samples of a spherical Gaussian projected onto the same sphere (uniform points,
  ``uniform_sphere_samples``) by *unbalanced* optimal transport: the marginals are only pushed towards the uniform
  masses by KL penalties (weight ``rho``), so a batch of a few classes need not spread its mass evenly ("flexible").
  The plan is the entropic UOT plan (``unbalanced_sinkhorn_plan``, Chizat et al. 2018 scaling iterations, in the
  log domain); the term is the transport cost <pi*, C> with C the squared Euclidean distances and pi* held fixed,
  whose gradient is the gradient of the UOT objective itself (envelope theorem).
- ``fur_sliced_tangent`` (the authors' released clients, ``RepresentationTagentCollapse``): a sliced Wasserstein-2
  distance between the log maps of the representations and of the uniform samples at random tangent points of the
  sphere.

Efficient unified aggregator (EUA), on the server: every client k is one objective of the global model,
f_k(theta_g) = ||theta_g - theta_k||^2, with gradient 2 (theta_g - theta_k) at the previous global model (divided by
its norm with ``normalize``, as the authors' code does). The common descent direction is the minimum-norm element
of the convex hull of these gradients (MGDA); its weights lambda solve the K-variable dual problem
min_{lambda in simplex} lambda^T G lambda over the K x K Gram matrix G of the gradients (``min_norm_weights``), so
the solver never works in parameter space (the "efficient" part). The global parameters then take one step,
theta_g <- theta_g - server_lr * sum_k lambda_k g_k (``eua_aggregate``); BatchNorm statistics, which have no
gradient, are averaged with the clients' (sharpened) example shares.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ssl_models.federated.model_merge import is_parameter_key

FUR_FORMS = ("uot", "sliced_tangent")


# ---------------------------------------------------------------------- FUR (client)
def uniform_sphere_samples(n: int, dim: int, *, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` points of a spherical Gaussian N(0, I_dim) projected onto the unit sphere: uniform on the sphere."""
    return F.normalize(torch.randn(n, dim, device=device, generator=generator), dim=1)


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """C_ij = ||x_i - y_j||^2 through one matrix product (the FLOPs a counter sees: 2 n m d)."""
    cost = (x * x).sum(1, keepdim=True) + (y * y).sum(1)[None, :] - 2.0 * x @ y.T
    return cost.clamp_min(0.0)


@torch.no_grad()
def unbalanced_sinkhorn_plan(
    cost: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, epsilon: float, rho: float, iterations: int
) -> torch.Tensor:
    """The plan of min_pi <pi, C> + epsilon KL(pi | a b^T) + rho KL(pi 1 | a) + rho KL(pi^T 1 | b), pi >= 0.

    Scaling iterations (Chizat et al. 2018): pi = diag(u) K diag(v), K = a b^T exp(-C / epsilon),
    u <- (a / K v)^(rho / (rho + epsilon)), v <- (b / K^T u)^(rho / (rho + epsilon)), in the log domain so a small
    epsilon does not underflow. ``rho = inf`` is the balanced problem (exact marginals)."""
    fi = 1.0 if math.isinf(rho) else rho / (rho + epsilon)
    log_a, log_b = a.log(), b.log()
    log_k = log_a[:, None] + log_b[None, :] - cost / epsilon
    log_u = torch.zeros_like(log_a)
    log_v = torch.zeros_like(log_b)
    for _ in range(iterations):
        log_u = fi * (log_a - torch.logsumexp(log_k + log_v[None, :], dim=1))
        log_v = fi * (log_b - torch.logsumexp(log_k + log_u[:, None], dim=0))
    return torch.exp(log_u[:, None] + log_k + log_v[None, :])


def fur_uot(
    z: torch.Tensor, samples: torch.Tensor, *, epsilon: float, rho: float, iterations: int, normalize: bool = True
) -> torch.Tensor:
    """The FUR term of one batch of representations ``z`` (n, d) against uniform ``samples`` (m, d): the transport
    cost <pi*, C> of their entropic unbalanced OT plan, uniform masses 1/n and 1/m, C the squared distances.
    The plan is held fixed: the gradient is that of the UOT objective (its other terms depend on pi only)."""
    if normalize:
        z = F.normalize(z, dim=1)
    cost = squared_distances(z, samples)
    a = torch.full((z.shape[0],), 1.0 / z.shape[0], dtype=cost.dtype, device=cost.device)
    b = torch.full((samples.shape[0],), 1.0 / samples.shape[0], dtype=cost.dtype, device=cost.device)
    plan = unbalanced_sinkhorn_plan(cost.detach(), a, b, epsilon=epsilon, rho=rho, iterations=iterations)
    return (plan * cost).sum()


def sphere_logmap(base: torch.Tensor, points: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Log map of the unit sphere at ``base`` (d,) of unit ``points`` (n, d): the tangent vector at ``base`` that
    points to each point, of length the geodesic distance arccos<base, point>."""
    cos = (points @ base).clamp(-1.0 + eps, 1.0 - eps)
    tangent = points - cos[:, None] * base[None, :]
    return tangent * (torch.arccos(cos) / tangent.norm(dim=1).clamp_min(eps))[:, None]


def sliced_wasserstein(x: torch.Tensor, y: torch.Tensor, projections: torch.Tensor) -> torch.Tensor:
    """Sliced Wasserstein-2 (squared) between equal-size point sets: the mean over directions (rows of
    ``projections``) and ranks of the squared difference of the sorted projections."""
    px = torch.sort(x @ projections.T, dim=0).values
    py = torch.sort(y @ projections.T, dim=0).values
    return ((px - py) ** 2).mean()


def fur_sliced_tangent(
    z: torch.Tensor,
    samples: torch.Tensor,
    tangent_points: torch.Tensor,
    projections: torch.Tensor,
    normalize: bool = True,
) -> torch.Tensor:
    """The released code's FUR: the mean over the tangent points t of the sliced Wasserstein distance between
    log_t(samples) and log_t(z)."""
    if normalize:
        z = F.normalize(z, dim=1)
    total = z.new_zeros(())
    for t in tangent_points:
        total = total + sliced_wasserstein(sphere_logmap(t, samples), sphere_logmap(t, z), projections)
    return total / tangent_points.shape[0]


@dataclass(frozen=True)
class FURSettings:
    form: str = "uot"
    epsilon: float = 0.05
    rho: float = 0.1
    iterations: int = 50
    tangent_points: int = 6
    projections: int = 6
    normalize: bool = True


def fur_term(z: torch.Tensor, settings: FURSettings, generator: torch.Generator | None = None) -> torch.Tensor:
    """The FUR of one batch of representations, with fresh uniform samples (and tangent points, projections) drawn
    from ``generator``; computed in float32 whatever the autocast context (the log-domain scaling needs it)."""
    with torch.autocast(z.device.type, enabled=False):
        z = z.float()
        n, d = z.shape
        samples = uniform_sphere_samples(n, d, device=z.device, generator=generator)
        if settings.form == "uot":
            return fur_uot(
                z,
                samples,
                epsilon=settings.epsilon,
                rho=settings.rho,
                iterations=settings.iterations,
                normalize=settings.normalize,
            )
        tangent = uniform_sphere_samples(settings.tangent_points, d, device=z.device, generator=generator)
        projections = torch.randn(settings.projections, d, device=z.device, generator=generator)
        return fur_sliced_tangent(z, samples, tangent, projections, normalize=settings.normalize)


def fur_matmul_flops(n: int, d: int, settings: FURSettings) -> float:
    """Forward + backward FLOPs of one FUR term on n representations of size d, counted as FlopCounterMode counts
    (matrix products only): uot, the cost matrix z s^T (2 n n d) and its gradient wrt z (2 n n d); sliced_tangent,
    per tangent point the projections of both point sets (2 x 2 n d P) and the gradient of z's (2 n d P)."""
    if settings.form == "uot":
        return 4.0 * n * n * d
    return 6.0 * n * d * settings.projections * settings.tangent_points


# ---------------------------------------------------------------------- EUA (server)
def sharpen(weights: Sequence[float], temperature: float) -> np.ndarray:
    """p_k^(1 / T) / sum_j p_j^(1 / T) of the normalised ``weights`` (T = 1: the weights themselves)."""
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    sharp = p ** (1.0 / temperature)
    return sharp / sharp.sum()


def project_to_simplex(y: np.ndarray) -> np.ndarray:
    """Euclidean projection of ``y`` onto {x >= 0, sum x = 1} (sort-based, Held et al. / Duchi et al. 2008)."""
    u = np.sort(y)[::-1]
    cumulative = np.cumsum(u) - 1.0
    ranks = np.arange(1, len(y) + 1)
    last = np.nonzero(u - cumulative / ranks > 0)[0][-1]
    return np.maximum(y - cumulative[last] / (last + 1), 0.0)


def min_norm_weights(
    gram: np.ndarray, init: Sequence[float] | np.ndarray | None = None, *, iterations: int = 2000, tol: float = 1e-12
) -> np.ndarray:
    """argmin over the simplex of lambda^T G lambda: the weights of the minimum-norm point of the convex hull of
    vectors whose Gram matrix is ``gram`` (MGDA's dual). Two vectors: the closed form; more: accelerated projected
    gradient from ``init`` (default uniform) with step 1 / (2 lambda_max(G)) until the weights move less than
    ``tol``."""
    g = np.asarray(gram, dtype=np.float64)
    k = g.shape[0]
    if k == 1:
        return np.ones(1)
    if k == 2:
        denominator = g[0, 0] + g[1, 1] - 2.0 * g[0, 1]
        if denominator <= 0:  # parallel, equal vectors: every combination has the same norm
            return np.full(2, 0.5) if init is None else np.asarray(init, dtype=np.float64) / np.sum(init)
        first = float(np.clip((g[1, 1] - g[0, 1]) / denominator, 0.0, 1.0))
        return np.array([first, 1.0 - first])
    x = np.full(k, 1.0 / k) if init is None else project_to_simplex(np.asarray(init, dtype=np.float64))
    lipschitz = 2.0 * float(np.linalg.eigvalsh(g).max())
    if lipschitz <= 0:
        return x
    y, t = x.copy(), 1.0
    for _ in range(iterations):
        x_next = project_to_simplex(y - (2.0 * g @ y) / lipschitz)
        t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
        y = x_next + ((t - 1.0) / t_next) * (x_next - x)
        moved = float(np.abs(x_next - x).sum())
        x, t = x_next, t_next
        if moved < tol:
            break
    return x


@dataclass
class EUAResult:
    state: OrderedDict  # the new global state
    weights: np.ndarray  # lambda: each client's weight in the common direction
    init_weights: np.ndarray  # the (sharpened) example shares: the solver's start and the BN statistics' weights
    update_norms: np.ndarray  # ||theta_g - theta_k|| over the parameters, per client
    direction_norm: float  # ||sum_k lambda_k g_k||: the step is server_lr times this
    gram: np.ndarray  # G_ij = <g_i, g_j> of the (normalised) gradients


def eua_gram(
    global_state: Mapping[str, np.ndarray], client_states: Sequence[Mapping[str, np.ndarray]], keys: Sequence[str]
) -> np.ndarray:
    """D_ij = <theta_g - theta_i, theta_g - theta_j> over ``keys``, accumulated one array at a time (float64) so
    memory stays at one array per client."""
    k = len(client_states)
    dots = np.zeros((k, k))
    for key in keys:
        base = np.asarray(global_state[key], dtype=np.float64).ravel()
        deltas = np.stack([base - np.asarray(s[key], dtype=np.float64).ravel() for s in client_states])
        dots += deltas @ deltas.T
    return dots


def eua_aggregate(
    global_state: Mapping[str, np.ndarray],
    client_states: Sequence[Mapping[str, np.ndarray]],
    num_examples: Sequence[float],
    *,
    server_lr: float,
    normalize: bool = True,
    sharpen_temperature: float = 1.0,
    two_client_shortcut: bool = False,
    iterations: int = 2000,
) -> EUAResult:
    """One EUA step from the previous global model ``global_state`` (the arrays the clients started from).

    g_k = 2 (theta_g - theta_k) (/ ||theta_g - theta_k|| with ``normalize``) over the floating parameters;
    lambda = argmin_{simplex} ||sum_k lambda_k g_k||^2 (``min_norm_weights``, from the sharpened example shares);
    theta_g <- theta_g - server_lr sum_k lambda_k g_k. BatchNorm statistics (no gradient) take the average with the
    sharpened example shares. ``two_client_shortcut``: with fewer than 3 clients lambda is the start point itself
    (what the authors' min-norm solver returns there)."""
    if not client_states:
        raise ValueError("eua_aggregate: no client states")
    keys = list(global_state.keys())
    for i, state in enumerate(client_states):
        if set(state) != set(keys):
            raise ValueError(f"eua_aggregate: client state {i} has other keys than the global model")
    init = sharpen(num_examples, sharpen_temperature)
    params = [k for k in keys if is_parameter_key(k) and np.issubdtype(np.asarray(global_state[k]).dtype, np.floating)]
    dots = eua_gram(global_state, client_states, params)
    norms = np.sqrt(np.clip(np.diag(dots), 0.0, None))
    # g_k = scale_k (theta_g - theta_k): 2 / ||theta_g - theta_k|| normalised (a client that did not move: 0)
    if normalize:
        scale = np.where(norms > 0, 2.0 / np.where(norms > 0, norms, 1.0), 0.0)
    else:
        scale = np.full(len(client_states), 2.0)
    gram = dots * np.outer(scale, scale)
    if two_client_shortcut and len(client_states) < 3:
        weights = init.copy()
    else:
        weights = min_norm_weights(gram, init, iterations=iterations)
    coefficients = weights * scale  # theta_g - server_lr * sum_k coefficients_k (theta_g - theta_k)
    out: OrderedDict = OrderedDict()
    for key in keys:
        base = np.asarray(global_state[key])
        if key in params:
            g = np.asarray(base, dtype=np.float64)
            direction = sum(c * (g - np.asarray(s[key], dtype=np.float64)) for c, s in zip(coefficients, client_states))
            out[key] = (g - server_lr * direction).astype(base.dtype)
        else:
            mean = sum(w * np.asarray(s[key], dtype=np.float64) for w, s in zip(init, client_states))
            out[key] = (
                np.rint(mean).astype(base.dtype) if np.issubdtype(base.dtype, np.integer) else mean.astype(base.dtype)
            )
    direction_norm = float(math.sqrt(max(float(weights @ gram @ weights), 0.0)))
    return EUAResult(out, weights, init, norms, direction_norm, gram)
