"""MoCo v1 (He et al., 2020) and v2 (Chen et al., 2020): contrast queries against a queue of momentum keys.

- v1: linear projector feature_dim -> 128, temperature 0.07;
- v2: 2-layer MLP projector feature_dim -> hidden -> 128 (hidden defaults to feature_dim, with BN as in the
  EasyFL/FedEMA code), temperature 0.2.

The key encoder (``target_backbone`` + ``target_projector``) is an EMA of the query encoder (m = 0.99, the
FedEMA/EasyFL CIFAR setting). The loss is symmetric: each view serves once as query and once as key, and the
two InfoNCE terms are summed (as in the MoCo CIFAR demo and EasyFL). The keys of both orders are enqueued at
the end of :meth:`training_step`; the queue keeps the K most recent L2-normalised keys, writing circularly,
so K need not be a multiple of the batch size.

Shuffle-BN is omitted: on a single device BatchNorm statistics are computed over the whole batch, which a
permutation does not change, so shuffling would be a no-op here.

By default the key encoder and queue stay purely local across rounds (the FedMoCo of the FedEMA paper:
the momentum encoder is not replaced by the global model). ``reset_target_on_new_global=True`` instead copies
the freshly received query encoder into the key encoder at the start of each round: the same as the strategy
option ``update_both`` (which does it for every method with a target). Do not combine it with
``aggregate_target``: it would overwrite the averaged key encoder the client just received. The queue is
never exchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssl_models.methods.base import SSLMethod, check_bool, check_momentum, check_positive
from ssl_models.methods.losses import info_nce_loss
from ssl_models.networks.heads import MLPHead

VERSION_TEMPERATURES: dict[int, float] = {1: 0.07, 2: 0.2}


class MoCo(SSLMethod):
    name = "moco"
    queue: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    queue_ptr: torch.Tensor

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "version": 2,  # 1: linear projector; 2: two-layer MLP projector (with BatchNorm)
            "proj_hidden_dim": None,  # None: feature_dim (v2 only)
            "proj_out_dim": 128,  # size of the queries and keys
            "temperature": None,  # None: 0.07 for v1, 0.2 for v2
            "momentum": 0.99,  # EMA momentum of the key encoder after every step, in [0, 1]
            "queue_size": 4096,  # K, negative keys kept in the client's queue (it is never exchanged)
            # true: each view serves once as query and once as key, the two InfoNCE terms summed; false: view 1
            # is the query and view 2 the key only
            "symmetric": True,
            # true: the key encoder becomes a copy of the received query encoder at every round (as the strategy
            # option update_both); false: it stays the client's own
            "reset_target_on_new_global": False,
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        version = self.options["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version not in VERSION_TEMPERATURES:
            raise ValueError(f"option 'version' must be 1 or 2, got {version!r}")
        temperature = self.options["temperature"]
        if temperature is None:
            temperature = VERSION_TEMPERATURES[version]
        check_positive("temperature", temperature)
        check_momentum("momentum", self.options["momentum"])
        queue_size = self.options["queue_size"]
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"option 'queue_size' must be a positive integer, got {queue_size!r}")
        for flag in ("symmetric", "reset_target_on_new_global"):
            check_bool(flag, self.options[flag])

        self.version = version
        self.temperature = float(temperature)
        self.momentum = float(self.options["momentum"])
        self.symmetric: bool = self.options["symmetric"]
        self.projector = self._build_projector(feature_dim)
        self.build_target_branch()
        out_dim = self.options["proj_out_dim"]
        self.register_buffer("queue", F.normalize(torch.randn(out_dim, queue_size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def _build_projector(self, feature_dim: int) -> MLPHead:
        out_dim = self.options["proj_out_dim"]
        if self.version == 1:
            return MLPHead(feature_dim, out_dim, out_dim, num_layers=1)
        hidden_dim = self.options["proj_hidden_dim"] or feature_dim
        return MLPHead(feature_dim, hidden_dim, out_dim, num_layers=2)

    @property
    def queue_size(self) -> int:
        return self.queue.shape[1]

    def _query(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.backbone(images))

    def _key(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised float32 keys from the momentum encoder, without gradient."""
        return F.normalize(self.target_embeddings(images).float(), dim=1)

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        # a snapshot of the negatives: the live buffer is overwritten by the enqueue below, while autograd
        # still needs the values used in the logits
        negatives = self.queue.clone()
        q1, k2 = self._query(view1), self._key(view2)
        loss = info_nce_loss(q1, k2, negatives, self.temperature)
        keys = k2
        if self.symmetric:
            q2, k1 = self._query(view2), self._key(view1)
            loss = loss + info_nce_loss(q2, k1, negatives, self.temperature)
            keys = torch.cat([k1, k2], dim=0)
        self.enqueue(keys)
        return loss

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """Write ``keys`` (N, dim) circularly at ``queue_ptr``; with N > K only the last K keys are kept."""
        keys = keys.detach()[-self.queue_size :]
        num_keys = keys.shape[0]
        start = int(self.queue_ptr.item())
        columns = (start + torch.arange(num_keys, device=self.queue.device)) % self.queue_size
        self.queue[:, columns] = keys.t().to(self.queue.dtype)
        self.queue_ptr[0] = (start + num_keys) % self.queue_size

    def after_optimizer_step(self) -> None:
        self.update_target_branch(self.momentum)

    def on_new_global(self) -> None:
        if self.options["reset_target_on_new_global"]:
            self.reset_target_to_online()
