"""FedX's relational losses (Han et al., "FedX: Unsupervised Federated Learning with Cross Knowledge Distillation",
ECCV 2022) as pure functions on embeddings; the contrastive terms are SimCLR's NT-Xent
(``ssl_models.methods.losses.nt_xent_loss``), and ``ssl_models.methods.fedx`` puts the four terms together.

A relational loss compares how the two views of an image relate to a random reference batch (the anchors): each
view's embedding gets a similarity distribution over the anchors, r_i = softmax_k(cos(z_i, a_k) / tau), and the
two views' distributions are pulled together.

- ``form="js"`` (the paper): the Jensen-Shannon divergence JS(r, r~) = 1/2 KL(r || m) + 1/2 KL(r~ || m),
  m = (r + r~) / 2, with one temperature tau;
- ``form="code"`` (the authors' ``js_loss``): 1/2 [KL(m' || r) + KL(m' || r~)], the divergence *from* a mixture
  m' of the two views' distributions at a second temperature tau' (their ``--ts`` / ``--tt``); gradients flow
  through m' as in their code (the target is not detached).

Both are averaged over the batch (sum over anchors rows / number of images), natural logarithm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RELATIONAL_FORMS = ("js", "code")


def similarity_log_distribution(z: torch.Tensor, anchors: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax_k(cos(z_i, a_k) / temperature): row i is the log of image i's distribution over the anchors."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if z.dim() != 2 or anchors.dim() != 2 or z.shape[1] != anchors.shape[1]:
        raise ValueError(
            f"z and anchors must be 2-D with the same width, got {tuple(z.shape)} and {tuple(anchors.shape)}"
        )
    with torch.autocast(device_type=z.device.type, enabled=False):
        cosine = F.normalize(z.float(), dim=1) @ F.normalize(anchors.float(), dim=1).t()
        return F.log_softmax(cosine / temperature, dim=1)


def _kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_k p_k (log p_k - log q_k) per row, from log-probabilities (0 log 0 = 0)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=1)


def jensen_shannon(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Batch mean of JS(p_i, q_i) = 1/2 KL(p_i || m_i) + 1/2 KL(q_i || m_i), m_i = (p_i + q_i) / 2."""
    log_m = torch.logaddexp(log_p, log_q) - torch.log(torch.tensor(2.0, device=log_p.device))
    # >= 0 in exact arithmetic; the clamp keeps float rounding of near-identical rows from turning it negative
    return (0.5 * _kl_rows(log_p, log_m) + 0.5 * _kl_rows(log_q, log_m)).clamp_min(0.0).mean()


def relational_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    anchors: torch.Tensor,
    temperature: float,
    form: str = "js",
    target_temperature: float | None = None,
) -> torch.Tensor:
    """FedX's relational loss between the two views ``z1``, ``z2`` (N x d) of N images over ``anchors`` (B x d).

    ``form="js"``: JS(r_i, r~_i) at ``temperature`` (the paper). ``form="code"``: 1/2 [KL(m'_i || r_i) +
    KL(m'_i || r~_i)], r at ``temperature`` and the mixture m' of the distributions at ``target_temperature``
    (default: ``temperature``), the authors' code. A float32 scalar."""
    if form not in RELATIONAL_FORMS:
        raise ValueError(f"relational form must be one of {', '.join(RELATIONAL_FORMS)}, got {form!r}")
    if z1.shape != z2.shape:
        raise ValueError(f"z1 and z2 must have the same shape, got {tuple(z1.shape)} and {tuple(z2.shape)}")
    log_r1 = similarity_log_distribution(z1, anchors, temperature)
    log_r2 = similarity_log_distribution(z2, anchors, temperature)
    if form == "js":
        return jensen_shannon(log_r1, log_r2)
    sharp = temperature if target_temperature is None else target_temperature
    t1 = similarity_log_distribution(z1, anchors, sharp).exp()
    t2 = similarity_log_distribution(z2, anchors, sharp).exp()
    mixture = (t1 + t2) / 2
    log_mixture = mixture.clamp_min(torch.finfo(mixture.dtype).tiny).log()
    return (0.5 * (_kl_rows(log_mixture, log_r1) + _kl_rows(log_mixture, log_r2))).clamp_min(0.0).mean()
