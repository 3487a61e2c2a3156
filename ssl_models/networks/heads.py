"""MLP heads (projectors and predictors) placed on top of a backbone.

FedEMA/BYOL use a projector 512 -> 4096 -> 2048 and a predictor 2048 -> 4096 -> 2048, both "Linear -> BN ->
ReLU -> Linear". SimCLR v2/MoCo v2 style heads are the same shape with other sizes, and a MoCo v1 "head" is a
single linear layer (``num_layers=1``).
"""

from __future__ import annotations

import itertools

from torch import nn

FEDEMA_PROJ_HIDDEN_DIM = 4096
FEDEMA_PROJ_OUT_DIM = 2048
FEDEMA_PRED_HIDDEN_DIM = 4096


class MLPHead(nn.Sequential):
    """``num_layers`` linear layers; every hidden layer is followed by (BN ->) ReLU.

    The final linear layer has no activation and, when ``last_bn`` is set, an affine-free BatchNorm1d (the
    SimCLR v2 / SimSiam-projector convention, which keeps the output centred without learnable scale).
    Hidden linear layers drop their bias when followed by BN because BN's shift makes it redundant.
    """

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int,
        out_dim: int,
        num_layers: int = 2,
        batch_norm: bool = True,
        last_bn: bool = False,
    ) -> None:
        _check_positive_int("in_dim", in_dim)
        _check_positive_int("hidden_dim", hidden_dim)
        _check_positive_int("out_dim", out_dim)
        _check_positive_int("num_layers", num_layers)
        layers: list[nn.Module] = []
        dims = [in_dim] + [hidden_dim] * (num_layers - 1)
        for layer_in, layer_out in itertools.pairwise(dims):
            layers.append(nn.Linear(layer_in, layer_out, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm1d(layer_out))
            layers.append(nn.ReLU(inplace=True))
        layers.append(nn.Linear(dims[-1], out_dim, bias=not last_bn))
        if last_bn:
            layers.append(nn.BatchNorm1d(out_dim, affine=False))
        super().__init__(*layers)
        self.in_dim = in_dim
        self.out_dim = out_dim


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def projection_head(
    in_dim: int,
    hidden_dim: int = FEDEMA_PROJ_HIDDEN_DIM,
    out_dim: int = FEDEMA_PROJ_OUT_DIM,
    num_layers: int = 2,
    last_bn: bool = False,
) -> MLPHead:
    """Projector with FedEMA defaults (in -> 4096 -> 2048, BN + ReLU in between)."""
    return MLPHead(in_dim, hidden_dim, out_dim, num_layers=num_layers, last_bn=last_bn)


def prediction_head(
    in_dim: int = FEDEMA_PROJ_OUT_DIM,
    hidden_dim: int = FEDEMA_PRED_HIDDEN_DIM,
    out_dim: int | None = None,
) -> MLPHead:
    """Predictor with FedEMA defaults (2048 -> 4096 -> 2048); the output size defaults to the input size
    because the predictor must map a projection onto the space of the other view's projection."""
    return MLPHead(in_dim, hidden_dim, in_dim if out_dim is None else out_dim, num_layers=2)
