"""FedU2's client rule: the flexible uniform regulariser (FUR) added to the local SSL loss.

Download as generalized FedSSL (``fedssl_download``): the global online encoder, projector (and predictor) replace
the client's, the target branch stays the client's own (``update_both`` / ``aggregate_target`` as for FedSSL).

FUR acts on the representations of the batch being trained, which a loss term (``loss_hook(method)``) cannot see.
Rather than wrap every SSL method, the rule captures them where they are made: a forward hook on the client's
projector keeps each output of the step (the online projections of the views; the target branch has its own
projector and is not seen), and the loss term turns each into one FUR term and clears them. So FUR is computed on
exactly the representations the SSL loss used, in the same step and graph, with no extra forward pass; the FUR's
own matrix products are counted analytically (``fur_flops_per_step``). The hook fires only for this model's
projector (not for the deep copies the resource accounting makes) and is removed after training.

Reported (``rule.*`` metrics): ``fur_mean`` (the FUR term per step, before its weight), ``fur_steps``,
``fur_weight`` and ``fur_flops_per_step``.
"""

from __future__ import annotations

from typing import Any

import torch

from ssl_models.federated.fedu2 import FURSettings, fur_matmul_flops, fur_term

from .base import ClientRule, register
from .fedssl_family import fedssl_download

_STATE = "_fedu2_fur"  # the running FUR record kept on the method for the round (read by upload_extra)


def fur_settings(options: dict[str, Any]) -> FURSettings:
    return FURSettings(
        form=str(options["fur_form"]),
        epsilon=float(options["fur_epsilon"]),
        rho=float(options["fur_rho"]),
        iterations=int(options["fur_iterations"]),
        tangent_points=int(options["fur_tangent_points"]),
        projections=int(options["fur_projections"]),
        normalize=bool(options["fur_normalize"]),
    )


class _FURRecorder:
    """The projector outputs of the current step, and the round's FUR sums."""

    def __init__(self, projector: torch.nn.Module, settings: FURSettings, weight: float) -> None:
        self.projector = projector
        self.settings = settings
        self.weight = weight
        self.captured: list[torch.Tensor] = []
        self.total = 0.0
        self.steps = 0
        self.flops_per_step = 0.0
        self.handle = projector.register_forward_hook(self._capture)

    def _capture(self, module, inputs, output) -> None:
        if module is self.projector and torch.is_grad_enabled():  # not the accounting's deep copies
            self.captured.append(output)

    def term(self, _method) -> torch.Tensor:
        if not self.captured:
            raise RuntimeError("fedu2: no projector output in this step; FUR needs the online projections")
        terms = [fur_term(z, self.settings) for z in self.captured]
        self.flops_per_step = sum(fur_matmul_flops(z.shape[0], z.shape[1], self.settings) for z in self.captured)
        self.captured = []
        value = torch.stack(terms).sum()
        self.total += float(value.detach())
        self.steps += 1
        return self.weight * value


def fedu2_loss_term(method, global_state, options, device):
    """The FUR term of every local step: ``fur_weight`` times the sum over the step's projector outputs (one per
    view for BYOL, SimSiam and MoCo; SimCLR projects both views in one call) of FUR(outputs)."""
    weight = float(options["fur_weight"])
    if weight == 0:
        return None
    recorder = _FURRecorder(method.projector, fur_settings(options), weight)
    setattr(method, _STATE, recorder)
    return recorder.term


def fedu2_upload_extra(method, images, cfg, options, device, info) -> dict:
    """Nothing travels besides the model (EUA needs only the uploads and the server's previous global model);
    the round's FUR figures go to the reply's ``rule.*`` metrics."""
    recorder = getattr(method, _STATE, None)
    info["fur_weight"] = float(options["fur_weight"])
    if recorder is not None:
        recorder.handle.remove()
        info["fur_mean"] = recorder.total / max(recorder.steps, 1)
        info["fur_steps"] = recorder.steps
        info["fur_flops_per_step"] = recorder.flops_per_step
        delattr(method, _STATE)
    return {}


register(ClientRule("fedu2", fedssl_download, keeps="own", loss_term=fedu2_loss_term, upload_extra=fedu2_upload_extra))
