"""SimCLR (Chen et al., 2020): contrast two views of each image against all other images in the batch.

Defaults: projector feature_dim -> 2048 -> 128 (Linear-BN-ReLU-Linear) and temperature 0.5, the SimCLR
CIFAR-10 setting (the paper reports 0.5 as best for batch sizes of a few hundred on CIFAR).
``proj_batch_norm: false`` drops the BatchNorm of the hidden layers (Linear(bias)-ReLU-Linear): FLESD's
projector, 512 -> 512 -> ReLU -> 128 without BatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ssl_models.methods.base import SSLMethod, check_bool, check_positive
from ssl_models.methods.losses import nt_xent_loss
from ssl_models.networks.heads import MLPHead


class SimCLR(SSLMethod):
    name = "simclr"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "proj_hidden_dim": 2048,  # hidden width of the projector
            "proj_out_dim": 128,  # projection size
            "num_proj_layers": 2,  # linear layers of the projector (>= 1)
            "temperature": 0.5,  # tau of the NT-Xent loss (> 0)
            "proj_batch_norm": True,  # BatchNorm after each hidden layer of the projector
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        check_positive("temperature", self.options["temperature"])
        check_bool("proj_batch_norm", self.options["proj_batch_norm"])
        self.temperature = float(self.options["temperature"])
        self.projector = MLPHead(
            feature_dim,
            self.options["proj_hidden_dim"],
            self.options["proj_out_dim"],
            num_layers=self.options["num_proj_layers"],
            batch_norm=self.options["proj_batch_norm"],
        )

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        # one forward over both views so BatchNorm sees the whole 2N batch, like the reference implementation
        z = self.projector(self.backbone(torch.cat([view1, view2], dim=0)))
        z1, z2 = z.chunk(2, dim=0)
        return nt_xent_loss(z1, z2, self.temperature)
