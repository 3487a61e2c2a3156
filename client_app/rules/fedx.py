"""FedX's client rule: the received global model replaces the client's (as ``fedssl``), and the method
(``ssl_models.methods.fedx``, method ``fedx``) keeps a frozen copy of it as the round's teacher.

The teacher is taken by the method's ``on_new_global``, which the ClientApp calls right after ``download``; the
cross-distillation terms need both views and the reference batch of each step, which a ``loss_term`` (it sees the
method only) cannot reach, so FedX's whole local objective lives in the method's ``training_step``. After training,
``upload_extra`` (called with the round's ``info``) adds each loss term's mean over the local steps to ``info``:
the reply's ``rule.loss_<term>`` metrics. Nothing beyond the shared weights is uploaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ssl_models.methods.fedx import FedXMethod

from .base import ClientRule, register
from .fedssl_family import fedssl_download


def fedx_download(method, global_state, client_state, server_round, options) -> dict[str, Any]:
    """The global online encoder, projector and predictor replace the client's (FedAvg's download)."""
    if not isinstance(method, FedXMethod):
        raise TypeError(
            f"client rule 'fedx' trains method 'fedx' (FedX's local objective), got {type(method).__name__}"
        )
    return fedssl_download(method, global_state, client_state, server_round, options)


def fedx_report_terms(method, images, cfg, options, device, info: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each loss term's mean over this round's local steps, into ``info`` (-> ``rule.loss_*``); uploads nothing."""
    for term, value in method.term_means().items():
        info[f"loss_{term}"] = value
    return {}


register(ClientRule("fedx", fedx_download, keeps="own", upload_extra=fedx_report_terms))
