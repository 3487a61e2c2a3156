"""SimSiam (Chen & He, 2021): predict one view's projection from the other's, no negatives, no target net.

Collapse is avoided by the stop-gradient on the projection ``z`` alone. Head sizes default to the FedEMA
setting (projector feature_dim -> 4096 -> 2048, predictor 2048 -> 4096 -> 2048). ``stop_gradient=False``
is the collapse ablation of the FedEMA paper.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ssl_models.methods.base import SSLMethod, check_bool
from ssl_models.methods.losses import negative_cosine_similarity
from ssl_models.networks.heads import MLPHead


class SimSiam(SSLMethod):
    name = "simsiam"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "proj_hidden_dim": 4096,  # hidden width of the projector (feature_dim -> hidden -> out)
            "proj_out_dim": 2048,  # projection size (also the predictor's input and output size)
            "pred_hidden_dim": 4096,  # hidden width of the predictor
            "stop_gradient": True,  # false: no stop-gradient on the projections (the collapse ablation)
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        check_bool("stop_gradient", self.options["stop_gradient"])
        self.stop_gradient: bool = self.options["stop_gradient"]
        out_dim = self.options["proj_out_dim"]
        self.projector = MLPHead(feature_dim, self.options["proj_hidden_dim"], out_dim)
        self.predictor = MLPHead(out_dim, self.options["pred_hidden_dim"], out_dim)

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        # views go through the network separately so BatchNorm normalises each view with its own statistics,
        # as in the reference implementations
        z1 = self.projector(self.backbone(view1))
        z2 = self.projector(self.backbone(view2))
        p1, p2 = self.predictor(z1), self.predictor(z2)
        if self.stop_gradient:
            z1, z2 = z1.detach(), z2.detach()
        return 0.5 * negative_cosine_similarity(p1, z2) + 0.5 * negative_cosine_similarity(p2, z1)
