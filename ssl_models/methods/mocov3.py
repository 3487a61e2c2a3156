"""MoCo v3 (Chen, Xie and He, ICCV 2021), the SSL method of LW-FedSSL; works with any backbone (ViT or ResNet).

- Query branch: backbone -> projector -> predictor. Projector: ``num_proj_layers`` (3) layers, hidden 4096, out
  256, "Linear (no bias), BN, ReLU" in between and a final affine-free BN; predictor: ``num_pred_layers`` (2)
  layers, hidden 4096, out 256, same pattern (docs/methods/lwfedssl.md, The encoder and MoCo v3).
- Key branch: ``target_backbone`` + ``target_projector``, a momentum (EMA) copy of backbone + projector; keys are
  computed under ``no_grad``.
- Loss: ``ctr(q1, k2) + ctr(q2, k1)`` with ``ctr(q, k) = CE(norm(q) @ norm(k).T / tau, arange(N)) * 2 tau``: in-batch
  negatives only, no queue (``losses.mocov3_contrastive_loss``); tau = 0.2, m = 0.99 (the LW-FedSSL pinned values).
- Momentum schedule: ``"constant"`` (m = m0) or ``"cosine"`` (MoCo v3: m = 1 - (1 - m0) (cos(pi p) + 1) / 2,
  from m0 at progress p = 0 to 1 at p = 1). The training loop reports its progress through
  :meth:`MoCoV3.set_progress` (``train_ssl`` calls it after every optimizer step with (step + 1) / total steps,
  before ``after_optimizer_step``, so the EMA after step t uses p = (t + 1) / T as MoCo v3's loop does). In a
  federated run the local fraction covers one round only: :meth:`MoCoV3.set_progress_range` maps it onto a
  window of the whole training, e.g. ``set_progress_range((r - 1) / R, r / R)`` before round r of R.

The key encoder stays local (not exchanged) unless the strategy shares targets; with
``reset_target_on_new_global=True`` it is reset to the freshly received online weights at every round (the same
as the strategy option ``update_both``). After growing a ViT backbone (LW-FedSSL stages) the target branch must be
rebuilt (``build_target_branch()``) or grown the same way, since the momentum copy has the old depth.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ssl_models.methods.base import SSLMethod, check_bool, check_momentum, check_positive
from ssl_models.methods.losses import mocov3_contrastive_loss
from ssl_models.networks.heads import MLPHead

MOMENTUM_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"option {name!r} must be a positive integer, got {value!r}")


def _check_fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def cosine_momentum(base_momentum: float, progress: float) -> float:
    """MoCo v3's schedule: 1 - (1 - m0) * (cos(pi * progress) + 1) / 2 (m0 at 0, 1 at 1)."""
    return 1.0 - (1.0 - base_momentum) * (math.cos(math.pi * progress) + 1.0) / 2.0


class MoCoV3(SSLMethod):
    name = "mocov3"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "proj_hidden_dim": 4096,  # hidden width of the projector
            "proj_out_dim": 256,  # size of the projections and predictions
            "pred_hidden_dim": 4096,  # hidden width of the predictor
            "num_proj_layers": 3,  # linear layers of the projector (>= 1)
            "num_pred_layers": 2,  # linear layers of the predictor (>= 1)
            "temperature": 0.2,  # tau of the contrastive loss (> 0)
            "momentum": 0.99,  # m0, EMA momentum of the key encoder, in [0, 1]
            # constant: m0 throughout; cosine: from m0 at the start of training to 1 at its end (MoCo v3)
            "momentum_schedule": "constant",
            # true: the key encoder becomes a copy of the received online weights at every round (as the strategy
            # option update_both); false: it stays the client's own
            "reset_target_on_new_global": False,
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        for name in ("proj_hidden_dim", "proj_out_dim", "pred_hidden_dim", "num_proj_layers", "num_pred_layers"):
            _check_positive_int(name, self.options[name])
        check_positive("temperature", self.options["temperature"])
        check_momentum("momentum", self.options["momentum"])
        schedule = self.options["momentum_schedule"]
        if schedule not in MOMENTUM_SCHEDULES:
            raise ValueError(f"option 'momentum_schedule' must be one of {list(MOMENTUM_SCHEDULES)}, got {schedule!r}")
        check_bool("reset_target_on_new_global", self.options["reset_target_on_new_global"])

        self.temperature = float(self.options["temperature"])
        self.base_momentum = float(self.options["momentum"])
        self.momentum_schedule: str = schedule
        self.progress = 0.0
        self.progress_range: tuple[float, float] = (0.0, 1.0)

        out_dim = self.options["proj_out_dim"]
        self.projector = MLPHead(
            feature_dim,
            self.options["proj_hidden_dim"],
            out_dim,
            num_layers=self.options["num_proj_layers"],
            last_bn=True,
        )
        self.predictor = MLPHead(
            out_dim, self.options["pred_hidden_dim"], out_dim, num_layers=self.options["num_pred_layers"], last_bn=True
        )
        self.build_target_branch()

    # ------------------------------------------------------------------ momentum schedule
    def momentum_at(self, progress: float) -> float:
        """EMA momentum at training ``progress`` in [0, 1] under this method's schedule."""
        progress = _check_fraction("progress", progress)
        if self.momentum_schedule == "cosine":
            return cosine_momentum(self.base_momentum, progress)
        return self.base_momentum

    @property
    def current_momentum(self) -> float:
        return self.momentum_at(self.progress)

    def set_progress_range(self, start: float, end: float) -> None:
        """Map the fractions later given to :meth:`set_progress` onto ``[start, end]`` of the whole training;
        also sets the current progress to ``start``."""
        start = _check_fraction("progress range start", start)
        end = _check_fraction("progress range end", end)
        if end < start:
            raise ValueError(f"progress range end ({end}) must not be below its start ({start})")
        self.progress_range = (start, end)
        self.progress = start

    def set_progress(self, fraction: float) -> None:
        """Training progress within the current range (``fraction`` in [0, 1]; 1 = the range's end)."""
        fraction = _check_fraction("progress fraction", fraction)
        start, end = self.progress_range
        self.progress = min(1.0, start + fraction * (end - start))

    # ------------------------------------------------------------------ training
    def _query(self, images: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.projector(self.backbone(images)))

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        q1, q2 = self._query(view1), self._query(view2)
        k1, k2 = self.target_embeddings(view1), self.target_embeddings(view2)  # under no_grad
        return mocov3_contrastive_loss(q1, k2, self.temperature) + mocov3_contrastive_loss(q2, k1, self.temperature)

    def after_optimizer_step(self) -> None:
        self.update_target_branch(self.current_momentum)

    def on_new_global(self) -> None:
        if self.options["reset_target_on_new_global"]:
            self.reset_target_to_online()
