"""Orchestra's model and local objective (Lubana et al., "Orchestra: Unsupervised Federated Learning via Globally
Consistent Clustering", ICML 2022, arXiv 2205.11506).

Modules (the state-dict names are the contract with the federated code):

- ``backbone`` -> ``projector`` (feature_dim -> 512 -> 512, BN, affine-free BN at the output, as the authors'
  code): the online model; its L2-normalised output is the representation that is clustered;
- ``target_backbone`` / ``target_projector``: the target model, an EMA of the online one (m = 0.996, the authors' code);
- ``rotation_head``: the degeneracy regulariser, a linear 4-way rotation classifier on the online projection;
- buffer ``global_centroids`` (N_G, D): the server's global centroids of the round (unit rows), never trained here;
- buffers ``memory`` (M, D) / ``memory_count``: the last M target representations (FIFO), which the client clusters
  into its local centroids after training (``ssl_models.federated.orchestra.balanced_kmeans``).

Loss of one step (views x1, x2 of a batch; C the global centroids; T the temperature):
  L_cluster = -mean_i sum_j softmax(C t(x1_i) / T)_j log softmax(C z(x2_i) / T)_j
  (t: normalised target projection, z: normalised online projection; the target's assignment to the global
  clusters is the label of the online prediction of the other view), and
  L_deg = cross-entropy of ``rotation_head(projector(backbone(rot_k(x1))))`` against k (k uniform in 0..3, or all
  four turns with ``rotation_views: 4``); L = L_cluster + degeneracy_weight * L_deg.
The target projections t(x1) enter the memory after every step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssl_models.federated.orchestra import rotate_quarter_turns
from ssl_models.methods.base import ONLINE_PREFIXES, SSLMethod, check_bool, check_momentum, check_positive
from ssl_models.networks.heads import MLPHead

ROTATION_PREFIX = "rotation_head."
ROTATION_VIEWS = (1, 4)


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"option {name!r} must be a positive integer, got {value!r}")


class Orchestra(SSLMethod):
    name = "orchestra"
    global_centroids: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    memory: torch.Tensor
    memory_count: torch.Tensor

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "proj_hidden_dim": 512,  # hidden width of the projector (the authors' code: 512)
            "proj_out_dim": 512,  # D, the size of the clustered representation (the authors' code: 512)
            "temperature": 0.1,  # T of both softmax assignments (the authors' code: 0.1)
            "momentum": 0.996,  # EMA momentum of the target model after every step (the authors' code: 0.996)
            "num_global_clusters": 128,  # N_G (the authors' code: 128)
            "num_local_clusters": 16,  # N_L, the centroids each client uploads (the authors' code: 16)
            "memory_size": 128,  # M, target representations kept for the local clustering (code: 128)
            # 1: one rotated copy per image, its turn drawn uniformly (the authors' code); 4: all four turns of
            # every image (RotNet's form: 4x the rotated images, 2.5x the online images of a step)
            "rotation_views": 1,
            "degeneracy_weight": 1.0,  # weight of the rotation loss (the authors' code: a plain sum, 1)
            # false: the target assigns view 1, the online model predicts view 2 (the authors' code); true: both orders,
            # averaged
            "symmetric": False,
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        o = self.options
        for key in ("proj_hidden_dim", "proj_out_dim", "num_global_clusters", "num_local_clusters", "memory_size"):
            _check_count(key, o[key])
        check_positive("temperature", o["temperature"])
        check_momentum("momentum", o["momentum"])
        weight = o["degeneracy_weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise ValueError(f"option 'degeneracy_weight' must be a number >= 0, got {weight!r}")
        if o["rotation_views"] not in ROTATION_VIEWS or isinstance(o["rotation_views"], bool):
            raise ValueError(f"option 'rotation_views' must be 1 or 4, got {o['rotation_views']!r}")
        check_bool("symmetric", o["symmetric"])
        if o["memory_size"] < o["num_local_clusters"]:
            raise ValueError(
                f"option 'memory_size' ({o['memory_size']}) must be >= num_local_clusters "
                f"({o['num_local_clusters']}): the local clustering needs a point per cluster"
            )
        self.temperature = float(o["temperature"])
        self.momentum = float(o["momentum"])
        dim = o["proj_out_dim"]
        self.projector = MLPHead(feature_dim, o["proj_hidden_dim"], dim, last_bn=True)
        self.build_target_branch()
        self.rotation_head = nn.Linear(dim, 4)
        # Placeholder centroids until the client loads the server's: random unit rows.
        self.register_buffer("global_centroids", F.normalize(torch.randn(o["num_global_clusters"], dim), dim=1))
        self.register_buffer("memory", torch.zeros(o["memory_size"], dim))
        self.register_buffer("memory_count", torch.zeros((), dtype=torch.long))
        self.reset_loss_log()

    # ------------------------------------------------------------------ what is exchanged
    def shared_prefixes(self, with_target: bool = False) -> tuple[str, ...]:
        """The online model and the rotation head (the authors' FedAvg averages every trained weight); the target
        model too with ``with_target`` (the strategy's default: clients are stateless, Orchestra's cross-device
        setting). Centroids and memory are not averaged: the centroids travel separately."""
        prefixes = ONLINE_PREFIXES + (ROTATION_PREFIX,)
        return prefixes + ("target_backbone.", "target_projector.") if with_target else prefixes

    # ------------------------------------------------------------------ centroids and memory
    def set_global_centroids(self, centroids: torch.Tensor) -> None:
        expected = tuple(self.global_centroids.shape)
        if tuple(centroids.shape) != expected:
            raise ValueError(f"global centroids: shape {tuple(centroids.shape)} does not match the model's {expected}")
        with torch.no_grad():
            self.global_centroids.copy_(F.normalize(centroids.to(self.global_centroids).float(), dim=1))

    def reset_memory(self) -> None:
        with torch.no_grad():
            self.memory.zero_()
            self.memory_count.zero_()

    @torch.no_grad()
    def update_memory(self, representations: torch.Tensor) -> None:
        """FIFO: the newest representations replace the oldest; with more than M at once only the last M stay."""
        new = representations.detach().to(self.memory.dtype)[-self.memory.shape[0] :]
        n, size = new.shape[0], self.memory.shape[0]
        self.memory.copy_(torch.cat([self.memory[n:], new], dim=0))
        self.memory_count.copy_(torch.clamp(self.memory_count + n, max=size))

    def memory_bank(self) -> torch.Tensor:
        """The filled rows of the memory (the newest last)."""
        count = int(self.memory_count)
        return self.memory[self.memory.shape[0] - count :]

    @torch.no_grad()
    def target_representations(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.target_embeddings(images).float(), dim=1)

    # ------------------------------------------------------------------ the loss
    def reset_loss_log(self) -> None:
        """Running sums of the loss terms since the last reset (detached tensors: no device sync per step)."""
        self.loss_log: dict[str, Any] = {"cluster": 0.0, "degeneracy": 0.0, "rotation_correct": 0.0, "steps": 0}
        self.rotation_images = 0

    def _cluster_loss(self, online_view: torch.Tensor, target_view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(L_cluster, target representations of ``target_view``)."""
        centroids = self.global_centroids.detach()
        online = F.normalize(self.projector(self.backbone(online_view)).float(), dim=1)
        log_probs = F.log_softmax(online @ centroids.T / self.temperature, dim=1)
        target = self.target_representations(target_view)
        target_probs = F.softmax(target @ centroids.T / self.temperature, dim=1)
        return -(target_probs * log_probs).sum(dim=1).mean(), target

    def _degeneracy_loss(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotation cross-entropy, number of correctly predicted turns)."""
        n = images.shape[0]
        if self.options["rotation_views"] == 4:
            turns = torch.arange(4, device=images.device).repeat_interleave(n)
            rotated = rotate_quarter_turns(images.repeat(4, 1, 1, 1), turns)
        else:
            turns = torch.randint(0, 4, (n,), device=images.device)
            rotated = rotate_quarter_turns(images, turns)
        logits = self.rotation_head(self.projector(self.backbone(rotated))).float()
        self.rotation_images += int(turns.numel())
        return F.cross_entropy(logits, turns), (logits.argmax(dim=1) == turns).sum().detach()

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        cluster, target1 = self._cluster_loss(view2, view1)
        new_memory = target1
        if self.options["symmetric"]:
            cluster_swapped, target2 = self._cluster_loss(view1, view2)
            cluster = 0.5 * (cluster + cluster_swapped)
            new_memory = torch.cat([target1, target2], dim=0)
        degeneracy, correct = self._degeneracy_loss(view1)
        self.update_memory(new_memory)
        log = self.loss_log
        log["cluster"] = log["cluster"] + cluster.detach()
        log["degeneracy"] = log["degeneracy"] + degeneracy.detach()
        log["rotation_correct"] = log["rotation_correct"] + correct
        log["steps"] += 1
        return cluster + float(self.options["degeneracy_weight"]) * degeneracy

    def loss_summary(self) -> dict[str, float]:
        """Mean loss terms and rotation accuracy since the last ``reset_loss_log`` (empty before any step)."""
        log = self.loss_log
        steps = int(log["steps"])
        if steps == 0:
            return {}
        return {
            "loss_cluster": float(log["cluster"]) / steps,
            "loss_degeneracy": float(log["degeneracy"]) / steps,
            "rotation_acc": float(log["rotation_correct"]) / max(1, self.rotation_images),
        }

    def after_optimizer_step(self) -> None:
        self.update_target_branch(self.momentum)
