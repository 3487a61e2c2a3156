"""FedX's local objective (Han et al., ECCV 2022): SimCLR's contrastive loss plus relational and cross (global)
knowledge distillation from the frozen global model received at the start of the round.

Per step, with the two augmented views v1, v2 of a batch and a reference batch B_r of other local images (the
anchors):

- local contrastive loss: NT-Xent(z1, z2), z = projector(backbone(.)) of the local model;
- local relational loss: relational_loss(z1, z2, z_r), z_r the local model's projections of B_r;
- global contrastive loss: NT-Xent(p1, g2), p = predictor(z) (the extra prediction head h), g2 = the global
  model's projection of v2 (no gradient);
- global relational loss: relational_loss(p1, p2, g_r), g_r the global model's projections of B_r.

The loss is their weighted sum (all weights 1 in the paper). The global model (the teacher: backbone + projector)
is a frozen copy taken in ``on_new_global`` (the client calls it right after loading the received weights); it
is kept out of ``state_dict`` (nothing about it is uploaded or stored between rounds) and runs in eval mode by
default (``teacher_mode``). The reference batch is the first view of the previous local step's batch (the first
step after ``on_new_global`` uses its own first view): the training loop hands a step only its own batch, and
the previous batch is a uniformly random batch of the client's data like the authors' independently shuffled
loader (docs/methods/fedx.md, Deviations).

``term_means()``: each term's mean over the steps since the last ``on_new_global`` (what the client reports).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ssl_models.federated.fedx import RELATIONAL_FORMS, relational_loss
from ssl_models.methods.base import SSLMethod, check_bool, check_positive
from ssl_models.methods.losses import nt_xent_loss
from ssl_models.networks.heads import MLPHead

TERMS = ("local_contrastive", "local_relational", "global_contrastive", "global_relational")
TEACHER_MODES = ("eval", "train")


def _check_weight(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"option {name!r} must be a number >= 0, got {value!r}")


class FedXMethod(SSLMethod):
    name = "fedx"

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            "proj_hidden_dim": 256,  # projector feature_dim -> hidden -> out (the authors' code: 512 -> 256 -> 256)
            "proj_out_dim": 256,  # projection size (the authors' --out_dim 256)
            "proj_batch_norm": False,  # BatchNorm in the projector's hidden layer (the authors' heads have none)
            "pred_hidden_dim": 256,  # hidden width of the prediction head h (out -> hidden -> out)
            "pred_batch_norm": False,  # BatchNorm in the predictor's hidden layer (the authors' heads have none)
            "temperature": 0.1,  # tau of the contrastive losses and of the relational distributions (> 0)
            "relational_form": "js",  # js: the paper's Jensen-Shannon divergence; code: the authors' js_loss
            "local_target_temperature": 0.1,  # relational_form code: tau' of the local term's mixture (--ts)
            "global_target_temperature": 0.1,  # relational_form code: tau' of the global term's mixture (--tt)
            "weight_local_contrastive": 1.0,  # weight of the local contrastive loss (>= 0)
            "weight_local_relational": 1.0,  # weight of the local relational loss (>= 0)
            "weight_global_contrastive": 1.0,  # weight of the global (cross) contrastive loss (>= 0)
            "weight_global_relational": 1.0,  # weight of the global (cross) relational loss (>= 0)
            "reference_gradient": True,  # the local relational loss backpropagates into the anchors (authors' code)
            "teacher_mode": "eval",  # the global model's BatchNorm: eval (running statistics, the code) | train
        }

    def __init__(self, backbone: nn.Module, feature_dim: int, **options: Any) -> None:
        super().__init__(backbone, feature_dim, **options)
        o = self.options
        for key in ("temperature", "local_target_temperature", "global_target_temperature"):
            check_positive(key, o[key])
        for key in TERMS:
            _check_weight(f"weight_{key}", o[f"weight_{key}"])
        for key in ("proj_batch_norm", "pred_batch_norm", "reference_gradient"):
            check_bool(key, o[key])
        if o["relational_form"] not in RELATIONAL_FORMS:
            raise ValueError(
                f"option 'relational_form' must be one of {RELATIONAL_FORMS}, got {o['relational_form']!r}"
            )
        if o["teacher_mode"] not in TEACHER_MODES:
            raise ValueError(f"option 'teacher_mode' must be one of {TEACHER_MODES}, got {o['teacher_mode']!r}")
        self.temperature = float(o["temperature"])
        self.projector = MLPHead(feature_dim, o["proj_hidden_dim"], o["proj_out_dim"], batch_norm=o["proj_batch_norm"])
        self.predictor = MLPHead(
            o["proj_out_dim"], o["pred_hidden_dim"], o["proj_out_dim"], batch_norm=o["pred_batch_norm"]
        )
        # Plain attributes, not submodules: the teacher is no part of the exchanged or stored state, and its
        # parameters never reach the optimizer. (A list hides the module from nn.Module's registration.)
        self._teacher: list[nn.Module] = []
        self._reference: torch.Tensor | None = None
        self._term_sums: torch.Tensor | None = None
        self._term_steps = 0

    # ------------------------------------------------------------------ the global model (teacher)
    def on_new_global(self) -> None:
        """Freeze a copy of the just-received global model (backbone + projector) as this round's teacher."""
        teacher = nn.Sequential(copy.deepcopy(self.backbone), copy.deepcopy(self.projector))
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        self._teacher = [teacher]
        self._reference = None
        self._term_sums = None
        self._term_steps = 0

    @property
    def teacher(self) -> nn.Module | None:
        return self._teacher[0] if self._teacher else None

    def _teacher_on(self, device: torch.device) -> nn.Module:
        if not self._teacher:  # used without a received global model: the model as it starts training
            self.on_new_global()
        teacher = self._teacher[0]
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        teacher.train(self.options["teacher_mode"] == "train")
        return teacher

    # ------------------------------------------------------------------ the step
    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        o = self.options
        n = view1.shape[0]
        reference = self._reference if self._reference is not None else view1.detach()
        self._reference = view1.detach()  # the next step's anchors: a random batch of this client's images
        # One online forward over both views and the anchors (BatchNorm sees all three, as in the authors' code).
        z = self.projector(self.backbone(torch.cat([view1, view2, reference], dim=0)))
        p = self.predictor(z[: 2 * n])
        z1, z2, z_ref = z[:n], z[n : 2 * n], z[2 * n :]
        p1, p2 = p[:n], p[n:]
        if not o["reference_gradient"]:
            z_ref = z_ref.detach()
        teacher = self._teacher_on(view1.device)
        with torch.no_grad():
            g = teacher(torch.cat([view2, reference], dim=0))
        g2, g_ref = g[:n], g[n:]
        form = o["relational_form"]
        terms = torch.stack(
            [
                nt_xent_loss(z1, z2, self.temperature),
                relational_loss(z1, z2, z_ref, self.temperature, form, o["local_target_temperature"]),
                nt_xent_loss(p1, g2, self.temperature),
                relational_loss(p1, p2, g_ref, self.temperature, form, o["global_target_temperature"]),
            ]
        )
        weights = torch.tensor([float(o[f"weight_{key}"]) for key in TERMS], device=terms.device)
        detached = terms.detach()
        self._term_sums = detached if self._term_sums is None else self._term_sums + detached
        self._term_steps += 1
        return (weights * terms).sum()

    def term_means(self) -> dict[str, float]:
        """Each loss term's mean (unweighted) over the steps since the last ``on_new_global``; empty before any."""
        if self._term_sums is None or not self._term_steps:
            return {}
        means = (self._term_sums / self._term_steps).tolist()
        return dict(zip(TERMS, (float(v) for v in means)))
