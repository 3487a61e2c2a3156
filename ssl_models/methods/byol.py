"""BYOL (Grill et al., 2020), the base method of FedEMA (Zhuang et al., ICLR 2022).

The online branch (backbone -> projector -> predictor) regresses the target branch's projection of the
other view; the target branch is an EMA of the online one. Defaults follow FedEMA: projector
feature_dim -> 4096 -> 2048, predictor 2048 -> 4096 -> 2048, momentum 0.99, loss 2 - 2cos summed over both
view orders and averaged over the batch.

Ablation switches studied in the FedEMA paper:

- ``use_predictor=False``: no predictor module at all (the online projection regresses the target directly);
- ``use_ema=False``: no target modules; the targets are the online projections of the other view;
- ``stop_gradient=False``: targets are not detached. With ``use_ema=False`` this lets gradient flow through
  the target side of the loss into the online weights. With an EMA target it changes nothing observable in
  training, because the target parameters are frozen and only ever move by EMA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ssl_models.methods.base import SSLMethod, check_bool, check_momentum
from ssl_models.methods.losses import byol_regression_loss
from ssl_models.networks.heads import MLPHead


class BYOL(SSLMethod):
    name = "byol"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "proj_hidden_dim": 4096,  # hidden width of the projector (feature_dim -> hidden -> out)
            "proj_out_dim": 2048,  # projection size (also the predictor's input and output size)
            "pred_hidden_dim": 4096,  # hidden width of the predictor
            "momentum": 0.99,  # EMA momentum of the target branch after every step, in [0, 1] (1: frozen target)
            "use_predictor": True,  # false: no predictor, the online projection regresses the target directly
            "stop_gradient": True,  # false: the targets are not detached (changes training only without use_ema)
            "use_ema": True,  # false: no target branch, the targets are the online projections of the other view
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        for flag in ("use_predictor", "stop_gradient", "use_ema"):
            check_bool(flag, self.options[flag])
        check_momentum("momentum", self.options["momentum"])
        self.momentum = float(self.options["momentum"])
        self.stop_gradient: bool = self.options["stop_gradient"]
        out_dim = self.options["proj_out_dim"]
        self.projector = MLPHead(feature_dim, self.options["proj_hidden_dim"], out_dim)
        if self.options["use_predictor"]:
            self.predictor = MLPHead(out_dim, self.options["pred_hidden_dim"], out_dim)
        if self.options["use_ema"]:
            self.build_target_branch()

    def _predict(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(online prediction, online projection) of one view."""
        projection = self.projector(self.backbone(images))
        prediction = self.predictor(projection) if self.has_predictor else projection
        return prediction, projection

    def _targets(
        self, view1: torch.Tensor, view2: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Regression targets for both views: EMA-branch projections, or the online ones without EMA."""
        if self.has_target:
            return (
                self.target_embeddings(view1, self.stop_gradient),
                self.target_embeddings(view2, self.stop_gradient),
            )
        if self.stop_gradient:
            return z1.detach(), z2.detach()
        return z1, z2

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        p1, z1 = self._predict(view1)
        p2, z2 = self._predict(view2)
        t1, t2 = self._targets(view1, view2, z1, z2)
        return byol_regression_loss(p1, t2) + byol_regression_loss(p2, t1)

    def after_optimizer_step(self) -> None:
        self.update_target_branch(self.momentum)
