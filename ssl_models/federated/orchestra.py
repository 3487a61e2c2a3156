"""Orchestra's clustering math (Lubana et al., ICML 2022, arXiv 2205.11506), as pure functions.

- ``sinkhorn_knopp``: soft assignments of N points to K clusters under the equal-size constraint (every cluster
  receives N / K of the mass, every point exactly 1), the Sinkhorn-Knopp iteration on ``exp(lambda * scores)``;
- ``balanced_kmeans``: spherical K-means whose assignment step is Sinkhorn-Knopp (the paper's equally sized local
  clusters, its K-anonymity argument); the clients' local clustering and, by default, the server's global one;
- ``gradient_clustering``: the authors' code's server-side clustering (Genevay et al., 2019): centroids trained by
  SGD so that their softmax assignments match the Sinkhorn-Knopp ones (``global_clustering: gradient``);
- ``rotate_quarter_turns``: the degeneracy regulariser's input, each image turned by k x 90 degrees;
- ``cluster_size_summary``: how evenly points spread over clusters (for metrics.jsonl);
- ``is_seeding_round``: whether a round only seeds the global centroids (the server's and the client's one test);
- ``seed_memory``: the first round's memory without training (the authors' code's seeding round).

All inputs are torch tensors on any device; every point and centroid lives on the unit sphere.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F


def sinkhorn_knopp(scores: torch.Tensor, inverse_epsilon: float = 25.0, iterations: int = 10) -> torch.Tensor:
    """Equal-size soft assignment Q (N, K) of N points to K clusters from their similarity ``scores`` (N, K).

    Starts from ``exp(inverse_epsilon * scores)`` and alternately rescales the clusters' columns to a total of
    1 / K and the points' rows to 1 / N (the entropy-regularised transport of Cuturi 2013 with uniform
    marginals); returns N x the plan, so every row sums to 1 and every column to N / K after the final row step.
    """
    if scores.ndim != 2 or min(scores.shape) < 1:
        raise ValueError(f"sinkhorn_knopp: scores must be a non-empty (N, K) matrix, got shape {tuple(scores.shape)}")
    num_points, num_clusters = scores.shape
    with torch.no_grad():
        logits = inverse_epsilon * scores.float()
        plan = torch.exp(logits - logits.max())  # shifting by a constant does not change the rescaled plan
        plan = plan / plan.sum()
        for _ in range(iterations):
            plan = plan / plan.sum(dim=0, keepdim=True) / num_clusters
            plan = plan / plan.sum(dim=1, keepdim=True) / num_points
        return plan * num_points


def balanced_kmeans(
    points: torch.Tensor,
    num_clusters: int,
    *,
    iterations: int = 5,
    sinkhorn_iterations: int = 10,
    inverse_epsilon: float = 25.0,
    generator: torch.Generator | None = None,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical K-means with equal-size (Sinkhorn-Knopp) assignments: (centroids (K, D), assignments (N,)).

    ``points`` (N, D) are unit vectors. Initial centroids: ``initial`` (K, D) if given, else K distinct points drawn
    with ``generator``. Each iteration assigns every point to the argmax of its Sinkhorn-Knopp row on the scores
    ``points @ centroids.T``, then moves each centroid to the normalised mean of its points; a cluster left empty
    takes a randomly drawn point (so no centroid is lost). ``assignments`` are those of the last iteration.
    """
    num_points = points.shape[0]
    if initial is None and num_points < num_clusters:
        raise ValueError(f"balanced_kmeans: {num_points} points cannot seed {num_clusters} distinct clusters")
    points = points.float()
    if initial is not None:
        centroids = F.normalize(initial.float().clone(), dim=1)
    else:
        centroids = points[torch.randperm(num_points, generator=generator)[:num_clusters].to(points.device)].clone()
    assignments = torch.zeros(num_points, dtype=torch.long, device=points.device)
    for _ in range(iterations):
        assignments = sinkhorn_knopp(points @ centroids.T, inverse_epsilon, sinkhorn_iterations).argmax(dim=1)
        for k in range(num_clusters):
            members = points[assignments == k]
            if members.shape[0] == 0:
                members = points[torch.randint(num_points, (1,), generator=generator).to(points.device)]
            centroids[k] = F.normalize(members.mean(dim=0), dim=0)
    return centroids, assignments


def gradient_clustering(
    points: torch.Tensor,
    initial: torch.Tensor,
    *,
    steps: int = 500,
    lr: float = 0.01,
    temperature: float = 0.1,
    sinkhorn_iterations: int = 100,
    inverse_epsilon: float = 25.0,
) -> torch.Tensor:
    """The authors' code's global clustering: centroids (K, D), warm-started at ``initial``, trained by SGD
    (momentum 0.9, weight decay 1e-4, as their code) to maximise the cosine between each point's softmax assignment
    ``softmax(points @ C.T / temperature)`` and its Sinkhorn-Knopp assignment; renormalised after every step."""
    points = F.normalize(points.float(), dim=1)
    centroids = torch.nn.Parameter(F.normalize(initial.float().clone(), dim=1))
    optimizer = torch.optim.SGD([centroids], lr=lr, momentum=0.9, weight_decay=1e-4)
    for _ in range(steps):
        targets = sinkhorn_knopp(points @ centroids.detach().T, inverse_epsilon, sinkhorn_iterations)
        probs = F.softmax(points @ centroids.T / temperature, dim=1)
        loss = -F.cosine_similarity(targets, probs, dim=1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            centroids.copy_(F.normalize(centroids, dim=1))
    return centroids.detach()


def random_unit_centroids(num_clusters: int, dim: int, seed: int) -> torch.Tensor:
    """K seeded random unit vectors: the global centroids before the first global clustering."""
    generator = torch.Generator().manual_seed(int(seed))
    return F.normalize(torch.randn(num_clusters, dim, generator=generator), dim=1)


def rotate_quarter_turns(images: torch.Tensor, quarter_turns: torch.Tensor) -> torch.Tensor:
    """Each NCHW image turned counter-clockwise by ``quarter_turns[i]`` x 90 degrees (values 0..3)."""
    rotated = images.clone()
    for k in range(1, 4):
        chosen = quarter_turns == k
        if bool(chosen.any()):
            rotated[chosen] = torch.rot90(images[chosen], k, dims=(2, 3))
    return rotated


def cluster_size_summary(assignments: torch.Tensor, num_clusters: int) -> dict[str, float]:
    """How many of ``num_clusters`` clusters hold a point, and the min / max / std of the cluster sizes."""
    sizes = torch.bincount(assignments.reshape(-1).long().cpu(), minlength=num_clusters).double()
    return {
        "used": float((sizes > 0).sum()),
        "size_min": float(sizes.min()),
        "size_max": float(sizes.max()),
        "size_std": float(sizes.std(unbiased=False)),
    }


def is_seeding_round(strategy_options, server_round: int) -> bool:
    """Whether ``server_round`` trains nothing and only seeds the global centroids from data: round 1 when the
    strategy's ``seed_round`` is on (the authors' code). The server keeps that round's model and clusters the
    uploaded centroids; the client fills its memory (``seed_memory``) instead of training."""
    return bool(strategy_options.get("seed_round")) and int(server_round) == 1


@torch.no_grad()
def seed_memory(method, images, augment, *, batch_size: int, seed: int, device) -> dict[str, float]:
    """Orchestra's first round as the authors' code runs it: no training step; the memory is filled with the
    target projections of view 1 of the first M images of a seeded shuffle, so that the first local (and global)
    centroids come from data instead of random vectors.

    ``method`` is an Orchestra model, ``images`` NHWC uint8 (array or memory map), ``augment`` an ``SSLAugment``.
    The batches run through ``method.training_step`` without gradients, in training mode as local training does
    (batch statistics); every weight and buffer but the memory is put back afterwards (the authors' code restores
    its BatchNorm statistics), so only the memory and the loss log change. Returns the mean loss of the received
    model over those batches, the images seen and the seconds taken.
    """
    device = torch.device(device)
    n = int(np.shape(images)[0])
    size = int(method.memory.shape[0])
    keep = {name: value.detach().clone() for name, value in method.state_dict().items()}
    augment = augment.to(device)
    method.to(device)
    method.train()
    method.reset_memory()
    generator = torch.Generator(device=device).manual_seed(seed)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    bs = max(2, min(int(batch_size), n))
    start = time.perf_counter()
    losses, seen, wanted = [], 0, min(size, n)
    while wanted - seen >= 2:  # one image left over cannot form a batch of pairs; its slot stays empty
        picked = np.sort(order[seen : seen + min(bs, wanted - seen)])
        seen += len(picked)
        batch = torch.from_numpy(np.ascontiguousarray(images[picked])).to(device)
        view1, view2 = augment.two_views(batch, generator=generator)
        losses.append(float(method.training_step(view1, view2)))
    seconds = time.perf_counter() - start
    memory_names = ("memory", "memory_count")
    method.load_state_dict({k: v for k, v in keep.items() if k not in memory_names}, strict=False)
    if not losses:
        raise ValueError(f"orchestra: {n} image(s) cannot seed the memory (a pair of views needs 2)")
    return {"loss": sum(losses) / len(losses), "images": float(seen), "seconds": seconds}
