"""Layer-wise federated SSL (LW-FedSSL, FedMoCo-LW, Prog-FedSSL, FLL+DD): the math and the model surgery.

Pure PyTorch/NumPy (no Flower): the strategy (``strategies/layerwise.py``) and the client task
(``client_app/rounds/layerwise.py: layerwise_round``) both call these functions, so the two sides agree on every rule.

**Stages.** Training is split into S stages over R rounds; stage s trains a ViT sub-model of s blocks (one block
per stage). ``stage_rounds(R, S, allocation)`` gives R_s per stage, every stage at least one round:

- ``uniform``: R_s = R / S (the remainder, if any, goes to the earliest stages);
- ``right_skewed``: rounds fall linearly with the stage (weights S, S-1, ..., 1): most rounds early, a long tail
  to the right, the statistical meaning of right (positive) skew;
- ``left_skewed``: rounds grow linearly with the stage (weights 1, 2, ..., S): most rounds late.

Each stage gets one round, and the other R - S rounds are apportioned by those weights (largest remainder, ties
to the earlier stage), so the R_s always sum to R. ``stage_of_round`` maps a round to its stage; the server and
the clients compute the stage from the round alone.

**Learning rate per round** (``round_lr``, constant within a round): ``fixed``; ``cosine`` over the whole run,
base * (1 + cos(pi (r - 1) / R)) / 2 (the same as ``train.lr_schedule: cosine``); ``cyclic``, a cosine within
each stage that restarts at every stage start, base * (1 + cos(pi (i - 1) / R_s)) / 2 for the i-th round of
the stage.

**What belongs to what** (state-dict keys of an SSL method whose backbone is ``ssl_models.networks.vit``):
the patch projection, CLS token and position embeddings (``backbone.patch_embed.*``, ``backbone.cls_token``,
``backbone.pos_embed``) belong to stage 1; ``backbone.blocks.<s-1>.*`` is block s; the final LayerNorm
(``backbone.norm.*``) is the output norm of whatever sub-model is current, so it trains (and travels) with the
active block in every stage; the heads are every non-backbone prefix the method shares (MoCo v3: ``projector.``,
``predictor.``). ``trained_prefixes(depth, mode)`` is what a client trains and uploads: in ``last_block`` mode
(LW-FedSSL, FedMoCo-LW, FLL+DD) block s + final norm + heads (+ the embeddings at s = 1), in ``all`` mode
(Prog-FedSSL) the whole sub-model. ``submodel_prefixes(depth)`` is the whole current sub-model.

**Weight transfer at a stage start** (``grow_online_state``): block s is appended as a copy of the trained
block s-1 (``init="copy"``) or freshly initialised (``"fresh"``, seeded).

**Representation alignment** (LW-FedSSL, Algorithm 2 line 12): ``alignment_loss(local, global_, tau)`` is the
InfoNCE term of the paper, the local model's representation of one view of image i against the received (frozen)
global model's representations of the other view of every image of the batch, the positive being image i's:
``l(z, g) = -mean_i log( exp(sim(z_i, g_i) / tau) / sum_j exp(sim(z_i, g_j) / tau) )`` with cosine similarity; the
representation is the encoder's output (the ViT's final-normed CLS token). The term is symmetric, as line 12 writes
it: ``l(z1_local, z2_global) + l(z2_local, z1_global)`` (``symmetric=False`` keeps only the first half).
``RepresentationAligner`` adds ``alpha`` times it to every local step through ``train_ssl``'s ``loss_hook``: a
forward hook on the online backbone keeps the step's own representations of both views, so nothing is computed
twice; the global copy runs on both views under ``no_grad``.

**Server-side calibration** (``calibrate``, Algorithm 1 lines 4-9): at the start of every round, after the stage's
new block is appended and before the clients train, the whole current sub-model (every block, embeddings, norm,
heads) trains end to end with the experiment's SSL method on the server's auxiliary images for E epochs with the
same settings as local training (the paper: "for the server-side calibration mechanism, we use the same settings as
local training"), through ``ssl_models.training.train_ssl``; its momentum branch starts as a copy of the online one.

**Resources** (``resource_account``): per-sample FLOPs of one local step (``training_step_flops`` on a deep
copy, plus the alignment's forward of the global copy), the analytic training memory of one step at the real
batch size (``analytic_training_memory``, the global copy's weights included) and, for FLL+DD, the expected
FLOPs given the depth-dropout rate.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ssl_models.accounting import analytic_training_memory, forward_flops, training_step_flops
from ssl_models.config import ExperimentConfig
from ssl_models.factory import (
    build_ssl_model,
    load_partial_state,
    reset_target_from_online,
    state_to_numpy,
    train_settings,
)
from ssl_models.methods.base import SSLMethod
from ssl_models.networks.vit import BLOCK_INITS, VisionTransformer, vit_depth_of_state
from ssl_models.training import TrainStats, train_ssl

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

ALLOCATIONS: tuple[str, ...] = ("uniform", "right_skewed", "left_skewed")
LR_STRATEGIES: tuple[str, ...] = ("fixed", "cosine", "cyclic")
TRAINABLE_MODES: tuple[str, ...] = ("last_block", "all")
NEW_BLOCK_INITS: tuple[str, ...] = BLOCK_INITS
ENCODER_PREFIX = "backbone."
EMBEDDING_PREFIXES: tuple[str, ...] = ("backbone.patch_embed.", "backbone.cls_token", "backbone.pos_embed")
FINAL_NORM_PREFIX = "backbone.norm."
IMAGE_SHAPE = (3, 32, 32)


# ---------------------------------------------------------------------- stage schedule


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def allocation_weights(stages: int, allocation: str) -> list[int]:
    """Relative rounds per stage: uniform 1, ..., 1; right_skewed S, ..., 1; left_skewed 1, ..., S."""
    stages = _positive_int("stages", stages)
    if allocation == "uniform":
        return [1] * stages
    if allocation == "right_skewed":
        return list(range(stages, 0, -1))
    if allocation == "left_skewed":
        return list(range(1, stages + 1))
    raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")


def stage_rounds(total_rounds: int, stages: int, allocation: str = "uniform") -> list[int]:
    """R_s for s = 1..S: one round each, the other R - S apportioned by ``allocation_weights`` (largest
    remainder, ties to the earlier stage). Sums to ``total_rounds``; needs R >= S."""
    total_rounds = _positive_int("total_rounds", total_rounds)
    weights = allocation_weights(stages, allocation)
    if total_rounds < stages:
        raise ValueError(f"{total_rounds} rounds cannot hold {stages} stages (every stage needs at least one round)")
    spare = total_rounds - stages
    total_weight = sum(weights)
    exact = [spare * w / total_weight for w in weights]
    counts = [math.floor(e) for e in exact]
    left = spare - sum(counts)
    order = sorted(range(stages), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return [1 + c for c in counts]


@dataclass(frozen=True)
class StagePosition:
    """Where a (1-based) round lies in the stage schedule."""

    stage: int  # 1-based stage = depth of the sub-model
    round_in_stage: int  # 1-based
    stage_rounds: int  # R_s
    first_round: int  # the stage's first round
    total_rounds: int  # R

    @property
    def is_stage_start(self) -> bool:
        """The first round of a stage (a new block was appended at its start, for s > 1)."""
        return self.round_in_stage == 1

    @property
    def progress(self) -> tuple[float, float]:
        """This round's window of the whole run, ((r - 1) / R, r / R): MoCo v3's momentum schedule."""
        r = self.first_round + self.round_in_stage - 1
        return (r - 1) / self.total_rounds, r / self.total_rounds


def stage_of_round(server_round: int, rounds_per_stage: Sequence[int]) -> StagePosition:
    """The stage of a 1-based ``server_round`` under ``rounds_per_stage`` (``stage_rounds``)."""
    server_round = _positive_int("server_round", server_round)
    total = int(sum(rounds_per_stage))
    if server_round > total:
        raise ValueError(f"round {server_round} is beyond the schedule's {total} rounds")
    first = 1
    for index, count in enumerate(rounds_per_stage):
        if server_round < first + count:
            return StagePosition(index + 1, server_round - first + 1, int(count), first, total)
        first += count
    raise AssertionError("unreachable")


def round_lr(base_lr: float, server_round: int, rounds_per_stage: Sequence[int], strategy: str) -> float:
    """The learning rate of a round (constant within it): ``fixed``, ``cosine`` over the run, ``cyclic``
    (a cosine within each stage, restarting at every stage start)."""
    pos = stage_of_round(server_round, rounds_per_stage)
    if strategy == "fixed":
        return float(base_lr)
    if strategy == "cosine":
        return float(base_lr) * 0.5 * (1.0 + math.cos(math.pi * (server_round - 1) / pos.total_rounds))
    if strategy == "cyclic":
        return float(base_lr) * 0.5 * (1.0 + math.cos(math.pi * (pos.round_in_stage - 1) / pos.stage_rounds))
    raise ValueError(f"lr strategy must be one of {', '.join(LR_STRATEGIES)}, got {strategy!r}")


# ---------------------------------------------------------------------- which keys belong to what


def block_prefix(index: int) -> str:
    """State-dict prefix of the 0-based ``index``-th block (block ``index + 1`` of the paper)."""
    return f"{ENCODER_PREFIX}blocks.{int(index)}."


def head_prefixes(method: SSLMethod) -> tuple[str, ...]:
    """The shared non-encoder prefixes of an SSL method (MoCo v3: projector, predictor)."""
    return tuple(p for p in method.shared_prefixes() if p != ENCODER_PREFIX)


def submodel_prefixes(depth: int, heads: Sequence[str]) -> tuple[str, ...]:
    """Every online key of the current sub-model: embeddings, blocks 1..depth, final norm, heads."""
    depth = _positive_int("depth", depth)
    return (*EMBEDDING_PREFIXES, *(block_prefix(i) for i in range(depth)), FINAL_NORM_PREFIX, *heads)


def trained_prefixes(depth: int, mode: str, heads: Sequence[str]) -> tuple[str, ...]:
    """What a client trains and uploads in stage ``depth``: ``last_block``: block s, the final norm and the heads
    (+ the stage-1 embeddings at s = 1); ``all`` (Prog-FedSSL): the whole sub-model."""
    depth = _positive_int("depth", depth)
    if mode == "all":
        return submodel_prefixes(depth, heads)
    if mode != "last_block":
        raise ValueError(f"trainable mode must be one of {', '.join(TRAINABLE_MODES)}, got {mode!r}")
    stage1 = EMBEDDING_PREFIXES if depth == 1 else ()
    return (*stage1, block_prefix(depth - 1), FINAL_NORM_PREFIX, *heads)


def select(state: Mapping[str, Any], prefixes: Iterable[str]) -> OrderedDict:
    """The entries of ``state`` whose key starts with one of ``prefixes``, in ``state``'s order."""
    prefixes = tuple(prefixes)
    return OrderedDict((k, v) for k, v in state.items() if k.startswith(prefixes))


def is_encoder_key(key: str) -> bool:
    """True for the encoder's (backbone's) entries, False for the heads'."""
    return key.startswith(ENCODER_PREFIX)


def state_depth(keys: Iterable[str]) -> int:
    """Blocks of the ViT encoder in a (shared) state: 0 when it has none."""
    return vit_depth_of_state(list(keys), ENCODER_PREFIX)


# ---------------------------------------------------------------------- models


def _vit(encoder: nn.Module) -> VisionTransformer:
    """A layer-wise model's encoder, typed: ``build_layerwise_model`` builds it as a growable ViT."""
    return cast(VisionTransformer, encoder)


def build_layerwise_model(cfg: ExperimentConfig, depth: int, seed: int | None = None) -> SSLMethod:
    """The experiment's SSL method with a ViT encoder of ``depth`` blocks (all active, all trainable)."""
    return build_ssl_model(cfg, seed=seed, depth=_positive_int("depth", depth))


def configure_local_model(
    method: SSLMethod, mode: str, depth_dropout: float = 0.0, dropout_seed: int | None = None
) -> None:
    """Set what trains (``last_block`` or ``all``) and the depth-dropout rate of the frozen blocks (FLL+DD) on the
    online encoder. The momentum encoder always runs every block."""
    if mode not in TRAINABLE_MODES:
        raise ValueError(f"trainable mode must be one of {', '.join(TRAINABLE_MODES)}, got {mode!r}")
    _vit(method.backbone).set_trainable(mode)
    _vit(method.backbone).set_depth_dropout(float(depth_dropout), seed=dropout_seed)


def online_state(method: SSLMethod) -> OrderedDict:
    """The online sub-model (encoder + heads) of ``method`` as NumPy copies."""
    return state_to_numpy(select(method.state_dict(), method.shared_prefixes()))


def grow_online_state(
    cfg: ExperimentConfig, state: Mapping[str, np.ndarray], init: str = "copy", seed: int = 0
) -> OrderedDict:
    """Append one block to the online sub-model ``state`` (depth s-1 -> s): block s copies the trained block s-1
    (``copy``, the weight transfer) or is freshly initialised from ``seed`` (``fresh``). Everything else is
    unchanged. The global RNG is left as it was."""
    if init not in NEW_BLOCK_INITS:
        raise ValueError(f"new block init must be one of {', '.join(NEW_BLOCK_INITS)}, got {init!r}")
    depth = state_depth(state)
    if depth < 1:
        raise ValueError("the state holds no ViT block to grow from")
    with torch.random.fork_rng(devices=[]):
        method = build_layerwise_model(cfg, depth, seed=seed)
        load_partial_state(method, dict(state))
        torch.manual_seed(seed)
        _vit(method.backbone).grow(init)
    grown = select(method.state_dict(), submodel_prefixes(depth + 1, head_prefixes(method)))
    return state_to_numpy(grown)


# ---------------------------------------------------------------------- representation alignment


def alignment_loss(local: torch.Tensor, global_: torch.Tensor, temperature: float) -> torch.Tensor:
    """LW-FedSSL's representation alignment: ``-mean_i log softmax_j(cos(local_i, global_j) / tau)[i]``.

    ``local``: (N, D) representations of view 1 by the local model; ``global_``: (N, D) representations of view 2
    by the received global model (the positive of row i is row i, the other rows are its negatives). Computed in
    float32; the global side should carry no gradient (the caller's job)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if local.shape != global_.shape or local.ndim != 2:
        raise ValueError(
            f"local and global representations must both be (N, D), got {tuple(local.shape)} and {tuple(global_.shape)}"
        )
    z = F.normalize(local.float(), dim=1)
    g = F.normalize(global_.float(), dim=1)
    logits = z @ g.t() / temperature
    return F.cross_entropy(logits, torch.arange(z.shape[0], device=z.device))


class RepresentationAligner:
    """alpha * the representation alignment term against a frozen copy of the received global encoder, as
    ``train_ssl``'s ``loss_hook``.

    ``attach(method)`` puts a forward hook on ``method.backbone`` that keeps, during a step, what the online encoder
    was given and what it returned: the first call is view 1, the second view 2 (each output with its graph); the
    global copy encodes both inputs under ``no_grad``. The term is ``l(z1, g2) + l(z2, g1)`` (Algorithm 2 line 12;
    ``symmetric=False``: ``l(z1, g2)`` only). Every SSL method here runs the online encoder on view 1 and then view
    2; a step that does not is refused. ``loss(method)`` returns the weighted term of the step and forgets the step.
    """

    def __init__(self, global_backbone: nn.Module, alpha: float, temperature: float, symmetric: bool = True) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.global_backbone = copy.deepcopy(global_backbone)
        self.global_backbone.requires_grad_(False)
        if hasattr(self.global_backbone, "set_depth_dropout"):
            self.global_backbone.set_depth_dropout(0.0)  # type: ignore[operator]  # hasattr-checked (a ViT)
        self.global_backbone.eval()
        self.alpha = float(alpha)
        self.temperature = float(temperature)
        self.symmetric = bool(symmetric)
        self.values: list[float] = []  # unweighted alignment loss of every step
        self._calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handle: RemovableHandle | None = None

    @property
    def global_views(self) -> int:
        """How many views the global copy encodes per step (2 symmetric, 1 not): its share of a step's FLOPs."""
        return 2 if self.symmetric else 1

    def _record(self, _module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # the online encoder inside a training step (not an evaluation forward)
            self._calls.append((args[0], output))

    def attach(self, method: SSLMethod) -> RepresentationAligner:
        self.detach()
        self._handle = method.backbone.register_forward_hook(self._record)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._calls.clear()

    def _global(self, images: torch.Tensor) -> torch.Tensor:
        reference = next(self.global_backbone.parameters())
        if reference.device != images.device:
            self.global_backbone.to(images.device)
        with torch.no_grad():
            return self.global_backbone(images)

    def loss(self, method: SSLMethod) -> torch.Tensor:
        calls, self._calls = self._calls, []
        if len(calls) < 2:
            raise RuntimeError(
                f"representation alignment needs the online encoder to run on both views in a step "
                f"(it ran {len(calls)} time(s)); is the aligner attached to this method?"
            )
        (view1, local1), (view2, local2) = calls[0], calls[1]
        value = alignment_loss(local1, self._global(view2), self.temperature)
        if self.symmetric:
            value = value + alignment_loss(local2, self._global(view1), self.temperature)
        self.values.append(float(value.detach()))
        return self.alpha * value

    def step(self, method: SSLMethod, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        """One complete aligned training step's loss (for accounting): the method's loss + alpha * alignment."""
        handle = method.backbone.register_forward_hook(self._record)
        try:
            loss = method.training_step(view1, view2)
            return loss + self.loss(method)
        finally:
            handle.remove()
            self._calls.clear()

    @property
    def mean_value(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


# ---------------------------------------------------------------------- server-side calibration


def calibrate(
    cfg: ExperimentConfig,
    method: SSLMethod,
    images: np.ndarray,
    *,
    epochs: int,
    lr: float,
    seed: int,
    device: torch.device | str = "cpu",
    batch_size: int = 0,
    progress: tuple[float, float] | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainStats:
    """Train the whole current sub-model of ``method`` end to end on ``images`` (LW-FedSSL's calibration).

    Every block, the embeddings, the final norm and the heads train (``set_trainable("all")``, no depth dropout);
    the momentum branch restarts as a copy of the online one. ``epochs`` passes with the experiment's local-training
    settings (``ssl_models.factory.train_settings``: optimizer, momentum, weight decay, fast path, augmentations,
    ``max_steps_per_epoch``), batch ``batch_size`` (0: ``train.batch_size``). ``progress``: this round's window of
    the run for MoCo v3's momentum schedule."""
    epochs = _positive_int("epochs", epochs)
    _vit(method.backbone).set_trainable("all")
    _vit(method.backbone).set_depth_dropout(0.0)
    reset_target_from_online(method)
    if progress is not None and hasattr(method, "set_progress_range"):
        method.set_progress_range(*progress)  # type: ignore[operator]  # hasattr-checked (MoCo v3)
    return train_ssl(
        method,
        images,
        epochs=epochs,
        batch_size=int(batch_size) or cfg.train.batch_size,
        lr=lr,
        device=device,
        seed=seed,
        log=log,
        **train_settings(cfg, int(np.shape(images)[1])),
    )


# ---------------------------------------------------------------------- resource accounting


def _nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def frozen_block_forward_flops(backbone: VisionTransformer, batch_size: int = 2) -> float:
    """Forward FLOPs per image of one ViT block (all blocks have the same shape): (f(s blocks) - f(1 block)) /
    (s - 1), on a deep copy; 0 for a one-block encoder."""
    depth = int(backbone.num_active_blocks)
    if depth < 2:
        return 0.0
    work = copy.deepcopy(backbone)
    full = forward_flops(work, IMAGE_SHAPE, batch_size, count_cpu_attention=True)
    work.set_num_active_blocks(1)
    one = forward_flops(work, IMAGE_SHAPE, batch_size, count_cpu_attention=True)
    return (full - one) / (depth - 1)


def resource_account(
    method: SSLMethod,
    *,
    optimizer: str,
    batch_size: int,
    sgd_momentum: float = 0.9,
    device: torch.device | str | None = None,
    aligner: RepresentationAligner | None = None,
    flops_batch: int = 8,
) -> dict[str, float]:
    """Per-step resources of a local round of ``method`` as configured (trainable mode, depth dropout).

    FLOPs per sample (image; both views): ``training_step_flops`` with CPU attention counted (so CPU and CUDA
    agree) on a batch of ``min(batch_size, flops_batch)``, measured with no block skipped; with an aligner, plus
    the global copy's forward of the views it encodes (both, symmetric; ``flops_align_forward``). ``flops_fvcore_equivalent`` = forward / 2.
    With depth dropout, ``flops_expected`` subtracts the expected skipped frozen forwards (rate x frozen blocks x
    one block's forward x 2 views). Memory: ``analytic_training_memory`` of one step at ``batch_size`` (the
    aligned step with an aligner; the global copy's weights are added to ``mem_parameters``)."""
    backbone: Any = method.backbone  # a ViT's depth-dropout attributes where it has them (getattr below)
    rate = float(getattr(backbone, "depth_dropout", 0.0))
    if rate:
        backbone.set_depth_dropout(0.0)  # measure a step that skips nothing (the peak); restored below
    try:
        flops = training_step_flops(
            method,
            IMAGE_SHAPE,
            batch_size=max(2, min(int(batch_size), flops_batch)),
            device=device,
            count_cpu_attention=True,
        )
        align_forward = 0.0
        if aligner is not None:  # the global copy's forward of one image, per view it encodes
            align_forward = aligner.global_views * forward_flops(
                aligner.global_backbone, IMAGE_SHAPE, 2, count_cpu_attention=True
            )
        memory = analytic_training_memory(
            method,
            optimizer,
            int(batch_size),
            view_shape=IMAGE_SHAPE,
            device=device,
            sgd_momentum=sgd_momentum,
            step_fn=aligner.step if aligner else None,
        )
    finally:
        if rate:
            backbone.set_depth_dropout(rate)
    forward = flops["forward"] + align_forward
    total = flops["total"] + align_forward
    out = {
        "flops_forward": forward,
        "flops_backward": flops["backward"],
        "flops_total": total,
        "flops_fvcore_equivalent": forward / 2.0,
        "flops_align_forward": align_forward,
        "flops_batch": float(flops["batch_size"]),
    }
    frozen = int(getattr(backbone, "num_frozen_blocks", 0))
    if rate and frozen:
        out["flops_expected"] = total - rate * frozen * 2 * frozen_block_forward_flops(backbone)
    else:
        out["flops_expected"] = total
    extra_params = _nbytes(aligner.global_backbone) if aligner is not None else 0
    memory = dict(memory)
    memory["parameters"] += extra_params
    memory["total"] += extra_params
    out.update({f"mem_{k}": float(v) for k, v in memory.items()})
    out["mem_batch"] = float(batch_size)
    return out


__all__ = [
    "ALLOCATIONS",
    "LR_STRATEGIES",
    "NEW_BLOCK_INITS",
    "TRAINABLE_MODES",
    "RepresentationAligner",
    "StagePosition",
    "alignment_loss",
    "allocation_weights",
    "block_prefix",
    "build_layerwise_model",
    "calibrate",
    "configure_local_model",
    "frozen_block_forward_flops",
    "grow_online_state",
    "head_prefixes",
    "is_encoder_key",
    "online_state",
    "resource_account",
    "round_lr",
    "select",
    "stage_of_round",
    "stage_rounds",
    "state_depth",
    "submodel_prefixes",
    "trained_prefixes",
]
