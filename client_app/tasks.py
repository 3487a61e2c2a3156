"""Client tasks: decoded inputs in, plain results out. No Flower types here, so each task can be
called directly in tests and benchmarks; ``client_app.app`` only decodes and encodes messages.

A weight-exchanging local round (``train_local_ssl``) = the strategy's *client rule* (``client_app/rules/``: how
the received global weights enter the client's model, what it adds to the local loss and uploads besides its
weights), local SSL training, and the client state to keep until the next round. The similarity (FLESD), kernel
(Hetero-SSFL) and layer-wise rounds are below.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedssl_wire import RunStopped
from ssl_models.accounting import analytic_training_memory, process_peak_rss_bytes, reset_peak_rss, training_step_flops
from ssl_models.config import ExperimentConfig
from ssl_models.data.datasets import load_npz
from ssl_models.data.splits import client_images, images_digest, union_images
from ssl_models.factory import (
    build_augment,
    build_ssl_model,
    load_partial_state,
    reset_target_from_online,
    split_state,
    state_to_numpy,
)
from ssl_models.federated.kernel_alignment import (
    KernelAligner,
    centred_kernel_norm,
    client_kernel,
    decode_kernel,
    encode_kernel,
    kernel_cka,
    normalize_kernel,
    rad_representations,
    rad_term_flops,
)
from ssl_models.federated.layerwise import (
    RepresentationAligner,
    build_layerwise_model,
    configure_local_model,
    head_prefixes,
    resource_account,
    select,
    trained_prefixes,
)
from ssl_models.federated.model_merge import easyfl_divergence
from ssl_models.federated.similarity import client_similarity_payload, public_representations
from ssl_models.methods.base import TARGET_PREFIXES
from ssl_models.methods.losses import proximal_term
from ssl_models.training import TrainStats, fast_path_for, resolve_device, train_ssl

from .rules import get_rule
from .rules.base import META, ONLINE_ENCODER, PREDICTOR  # noqa: F401 (the names tests and other modules use)
from .rules.base import model_entries as _model_entries
from .rules.fedssl_family import fedema_download, fedssl_download, fedu_download, local_download  # noqa: F401


@dataclass
class LocalRoundResult:
    shared_state: dict[str, np.ndarray]  # uploaded to the server
    client_state: dict[str, np.ndarray]  # kept for the client's next round (model entries + meta.*)
    stats: TrainStats
    info: dict[str, Any] = field(default_factory=dict)  # what the download rule did (mu, divergence...)

    @property
    def local_state(self) -> dict[str, np.ndarray]:
        """The model entries of the client state (without meta)."""
        return {k: v for k, v in self.client_state.items() if not k.startswith(META)}


def local_images(
    cfg: ExperimentConfig, partition_id: int, data_path: str | None = None, scope: str = "partition"
) -> np.ndarray:
    """This client's training images: its partition of the experiment's data set, or, when the node
    has its own data (``data-path`` in the node config), that .npz file's whole training part, or every image of
    that folder (unlabelled, brought to the run's image side, decoded once into the node's disk cache).
    ``scope="union"``
    (the centralized reference, ``strategy: central``): the union of every client's partition."""
    if scope == "union":
        if data_path:
            raise ValueError(
                f"strategy 'central' trains on the union of the experiment's partitions, but client "
                f"{partition_id}'s node trains on its own data file ({data_path}); run the "
                "centralized reference on a node without data-path"
            )
        return union_images(cfg)
    if scope != "partition":
        raise ValueError(f"data-scope: must be 'partition' or 'union' (got {scope!r})")
    if data_path:
        if Path(data_path).expanduser().is_dir():
            from ssl_models.data.folder import load_folder

            side = cfg.image_side()
            return load_folder(data_path, image_size=side, labels="none", unreadable=cfg.data.unreadable).x_train
        return load_npz(data_path).x_train
    return client_images(cfg, partition_id)


def round_seed(cfg: ExperimentConfig, server_round: int, partition_id: int) -> int:
    """A distinct, reproducible seed for each (round, client) pair."""
    return cfg.seed * 1_000_003 + server_round * 1_009 + partition_id


# ---------------------------------------------------------------------- the local round


# One measurement per process for each model structure, optimiser and batch: the figures depend on nothing else,
# and a simulation's actor (or a long-lived SuperNode process) trains the same model shape round after round.
_STEP_RESOURCES: dict[tuple, dict[str, float]] = {}
# A deployed SuperNode starts a new ClientApp process for every message, where that memo is always empty and every
# round measured again (forward and backward passes of their own: 0.5 s for the smoke config's model, 1.4 s for
# the FedEMA CPU comparison's, on a busy 2-core machine, against about 1 s of training per round). So the figures
# are also kept on the node's disk, one small JSON file per key, under a folder named by the accounting code's own
# digest (a changed way of counting never reads figures counted the old way).
RESOURCE_CACHE_VARIABLE = "FEDSSL_RESOURCE_CACHE"  # a folder, or "off"; default ~/.cache/fedssl/step-resources


def resource_cache_file(key: tuple) -> Path | None:
    """Where the figures of ``key`` are kept on this machine's disk (None: the disk cache is off)."""
    value = os.environ.get(RESOURCE_CACHE_VARIABLE, "")
    if value.strip().lower() == "off":
        return None
    root = Path(value).expanduser() if value.strip() else Path.home() / ".cache" / "fedssl" / "step-resources"
    return root / _accounting_digest() / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.json"


@functools.lru_cache(maxsize=1)
def _accounting_digest() -> str:
    from ssl_models import accounting

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(Path(accounting.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _read_cached_resources(path: Path | None) -> dict[str, float] | None:
    if path is None or not path.is_file():
        return None
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable (a torn write by another process): measure again
    ok = isinstance(figures, dict) and figures and all(isinstance(v, (int, float)) for v in figures.values())
    return {k: float(v) for k, v in figures.items()} if ok else None


def _write_cached_resources(path: Path | None, figures: dict[str, float]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only or full disk: the figures were measured, only not kept


def step_resources(
    method,
    *,
    optimizer: str,
    batch_size: int,
    sgd_momentum: float,
    device,
    image_shape: tuple[int, ...],
    context: str = "",
) -> dict[str, float]:
    """Per-step resources of local training (docs/methods/lwfedssl.md, Resource accounting), on deep copies of ``method``: FLOPs per sample
    (image, both views) of one step (``flops_forward``, ``flops_backward``, ``flops_total`` and the forward / 2
    ``flops_fvcore_equivalent`` that the LW-FedSSL paper tabulates), counted on a batch of at most 8, and the analytic
    memory of one step at ``batch_size`` (``mem_parameters``, ``mem_gradients``, ``mem_optimizer``,
    ``mem_activations``, ``mem_total``, bytes). Kept per process and on the node's disk (``$FEDSSL_RESOURCE_CACHE``),
    keyed by the model's parameter and buffer shapes, the optimiser, batch, device, image shape and ``context``
    (the caller's method and model settings: options such as a loss's symmetry change FLOPs, not shapes)."""
    structure = tuple((name, tuple(p.shape), p.requires_grad) for name, p in method.named_parameters())
    buffers = tuple((name, tuple(b.shape)) for name, b in method.named_buffers())
    key = (
        type(method).__name__,
        structure,
        buffers,
        optimizer,
        int(batch_size),
        float(sgd_momentum),
        str(device),
        tuple(image_shape),
        context,
    )
    if key not in _STEP_RESOURCES:
        cache = resource_cache_file(key)
        figures = _read_cached_resources(cache)
        if figures is None:
            flops = training_step_flops(method, image_shape, batch_size=max(2, min(int(batch_size), 8)), device=device)
            memory = analytic_training_memory(
                method, optimizer, int(batch_size), view_shape=image_shape, device=device, sgd_momentum=sgd_momentum
            )
            figures = {
                "flops_forward": float(flops["forward"]),
                "flops_backward": float(flops["backward"]),
                "flops_total": float(flops["total"]),
                "flops_fvcore_equivalent": float(flops["fvcore_equivalent"]),
                **{f"mem_{k}": float(v) for k, v in memory.items()},
            }
            _write_cached_resources(cache, figures)
        _STEP_RESOURCES[key] = figures
    return dict(_STEP_RESOURCES[key])


# Whether the run of the message being served was stopped (the ClientApp sets it per message: the stop marker of a
# simulation's run); checked before every local epoch, so a stopped run's clients stop training within an epoch.
_STOP_CHECK: Callable[[], str | None] | None = None


def set_stop_check(check: Callable[[], str | None] | None) -> None:
    global _STOP_CHECK
    _STOP_CHECK = check


def _with_stop_check(epoch_hook):
    def hook(method, epoch: int) -> None:
        reason = _STOP_CHECK() if _STOP_CHECK is not None else None
        if reason:
            raise RunStopped(f"the run was stopped ({reason}) before local epoch {epoch + 1}: training ends here")
        if epoch_hook is not None:
            epoch_hook(method, epoch)

    return hook


def local_step_resources(cfg: ExperimentConfig, method, images: np.ndarray, device) -> dict[str, float]:
    """``step_resources`` of one local step of this experiment's model, optimiser and batch on ``images``."""
    t = cfg.train
    return step_resources(
        method,
        optimizer=t.optimizer,
        batch_size=max(2, min(t.batch_size, len(images))),
        sgd_momentum=t.momentum,
        device=device,
        image_shape=(3, *np.shape(images)[1:3]),
        context=json.dumps(
            {"method": cfg.method.name, "options": cfg.method.options, "model": [cfg.model.arch, cfg.model.width]},
            sort_keys=True,
            default=str,
        ),
    )


def local_training(
    cfg: ExperimentConfig,
    method,
    images: np.ndarray,
    *,
    lr: float,
    seed: int,
    device,
    loss_hook=None,
    epoch_hook=None,
    log: Callable[[str], None] | None = None,
    account: bool = True,
) -> TrainStats:
    """``train_ssl`` with the experiment's local-training settings and augmentation recipe (``augment``).

    With ``account`` (every strategy but the layer-wise ones, which account their sub-models themselves) the
    returned stats carry ``resources``: ``step_resources`` of this model, the images trained, and the process's
    peak RSS during training (``rss_peak_reset`` 0: the process's lifetime peak, where the peak cannot be reset)."""
    t = cfg.train
    resources: dict[str, float] = {}
    if account:
        resources = local_step_resources(cfg, method, images, device)
        rss_reset = reset_peak_rss()
    stats = train_ssl(
        method,
        images,
        epochs=t.local_epochs,
        batch_size=t.batch_size,
        lr=lr,
        optimizer=t.optimizer,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        device=device,
        fast_path=t.fast_path,
        drop_last=t.drop_last,
        max_steps_per_epoch=t.max_steps_per_epoch,
        seed=seed,
        augment=build_augment(cfg, int(np.shape(images)[1])),
        loss_hook=loss_hook,
        epoch_hook=_with_stop_check(epoch_hook),
        log=log,
        compile_backend="inductor" if t.compile else None,
    )
    if account:
        resources["images_trained"] = float(stats.steps * min(t.batch_size, len(images)))
        rss = process_peak_rss_bytes()
        if rss is not None:
            resources["rss_peak_bytes"] = float(rss)
            resources["rss_peak_reset"] = float(bool(rss_reset))
        stats.resources = resources
    return stats


def train_local_ssl(
    cfg: ExperimentConfig,
    images: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    update_both: bool = False,
    aggregate_target: bool = False,
    rule: str = "fedssl",
    rule_options: Mapping[str, Any] | None = None,
    rule_inputs: Mapping[str, Any] | None = None,
    proximal_mu: float = 0.0,
    proximal_form: str = "paper",
    log: Callable[[str], None] | None = None,
) -> LocalRoundResult:
    """One round on one client: download rule, local SSL training, upload and client state.

    Upload: the online encoder and projector (+ predictor), plus the target branch only with
    ``aggregate_target``; with ``update_both`` the target is not kept either (the next download replaces it).
    ``rule_inputs``: per-client values from the server for the download rule (FedEMA's ``server_lambda``).
    ``proximal_mu > 0`` adds FedProx's proximal term towards the received global weights to every step."""
    client_rule = get_rule(rule)
    seed = round_seed(cfg, server_round, partition_id)
    method = build_ssl_model(cfg, seed=seed, arch=cfg.client_arch(partition_id))
    if rule == "local" and not global_state and not _model_entries(client_state):
        # Local SSL with mixed encoders: the server sends its initial model only to clients of model.arch; the
        # others start from the seeded initial model of their own architecture.
        global_state = state_to_numpy(split_state(initial_client_model(cfg, partition_id), method.shared_prefixes())[0])
    options = {**(rule_options or {}), "update_both": bool(update_both), "aggregate_target": bool(aggregate_target)}
    info = client_rule.download(method, global_state, client_state, server_round, options, **(rule_inputs or {}))
    method.on_new_global()
    with_update = client_rule.keeps == "model_and_update"
    start_state = state_to_numpy(method.state_dict()) if with_update else None
    device = resolve_device(cfg.train.device)
    terms = []
    if proximal_mu > 0:
        anchors = {k: torch.as_tensor(v).to(device) for k, v in global_state.items()}
        named = dict(method.named_parameters())
        params = {k: p for k, p in named.items() if k in anchors and p.requires_grad}
        terms.append(lambda _m: proximal_term(params, anchors, proximal_mu, half=proximal_form == "paper"))
    if client_rule.loss_term is not None:
        term = client_rule.loss_term(method, global_state, options, device)
        if term is not None:
            terms.append(term)
    hook = None
    if len(terms) == 1:
        hook = terms[0]
    elif terms:
        hook = lambda m: sum(term(m) for term in terms)
    # A rule may run its own round instead of local training (Orchestra's seeding round); None: train as usual.
    stats = (
        client_rule.replaces_training(method, images, cfg, options, device, server_round=server_round, seed=seed)
        if client_rule.replaces_training is not None
        else None
    )
    if stats is None:
        stats = local_training(cfg, method, images, lr=lr, seed=seed, device=device, loss_hook=hook, log=log)
    extra = (
        client_rule.upload_extra(method, images, cfg, options, device, info)
        if client_rule.upload_extra is not None
        else {}
    )
    bad = sorted(k for k in extra if not k.startswith(f"{rule}."))
    if bad:
        raise ValueError(f"client rule {rule!r} uploads arrays outside its prefix '{rule}.': {', '.join(bad)}")
    method.cpu()
    shared, local = split_state(method, method.shared_prefixes(with_target=aggregate_target))
    if client_rule.keeps == "own":
        # What the server does not hold: target branch (unless the next download replaces it), MoCo queue.
        kept = state_to_numpy({k: v for k, v in local.items() if not (update_both and k.startswith(TARGET_PREFIXES))})
    else:
        # Min-Local: the client's own model is all it has. FedEMA/FedU need the client's whole last model (online,
        # predictor, target) next time, and the size of this local update (EasyFL's divergence), which is also
        # reported: the server's autoscaler uses it.
        kept = state_to_numpy(method.state_dict())
    if with_update:
        info["update_size"] = easyfl_divergence(start_state, kept)
        kept[META + "update_size"] = np.array([info["update_size"]])
        if info.get("lambda") is not None and not info.get("lambda_from_server", False):
            kept[META + "lambda"] = np.array([float(info["lambda"])])  # computed here: keep it for later rounds
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    shared = {**state_to_numpy(shared), **{k: np.asarray(v) for k, v in extra.items()}}
    return LocalRoundResult(shared, kept, stats, info)


# ---------------------------------------------------------------------- FLESD: similarity upload


class PublicSetMismatch(ValueError):
    """The client's public set is not the server's (different data, split or file)."""


@dataclass
class SimilarityRoundResult:
    payload: dict[str, np.ndarray]  # the similarity matrix in transport form
    client_state: dict[str, np.ndarray]
    stats: TrainStats


def similarity_round(
    cfg: ExperimentConfig,
    images: np.ndarray,
    public: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    public_digest: str,
    similarity: str,
    topk_fraction: float | None = None,
    log: Callable[[str], None] | None = None,
) -> SimilarityRoundResult:
    """One FLESD client round: local SSL on the client's own encoder, then the similarity matrix of its
    representations of the public set. ``global_state`` is empty for a client whose architecture differs
    from the global model's: it continues from its own weights."""
    digest = images_digest(public)
    if digest != public_digest:
        raise PublicSetMismatch(
            f"public set mismatch on client {partition_id}: its {len(public)} public images hash to {digest[:16]}, "
            f"the server's to {public_digest[:16]}; both must load the same data file and config"
        )
    seed = round_seed(cfg, server_round, partition_id)
    method = build_ssl_model(cfg, seed=seed, arch=cfg.client_arch(partition_id))
    own = _model_entries(client_state)
    if global_state:
        fedssl_download(method, global_state, client_state, server_round, {})
    elif own:
        load_partial_state(method, own)
    device = resolve_device(cfg.train.device)
    stats = local_training(cfg, method, images, lr=lr, seed=seed, device=device, log=log)
    z = public_representations(method, public, device=device)
    payload = client_similarity_payload(z, similarity, topk_fraction if similarity == "topk" else None)
    kept = state_to_numpy(method.cpu().state_dict())
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    return SimilarityRoundResult(payload, kept, stats)


# ---------------------------------------------------------------------- Hetero-SSFL: kernel upload


@dataclass
class KernelRoundResult:
    payload: dict[str, np.ndarray]  # the client's RAD kernel in transport form
    client_state: dict[str, np.ndarray]
    stats: TrainStats
    info: dict[str, Any] = field(default_factory=dict)  # alignment figures (CKA to K_bar before/after, ...)


def initial_client_model(cfg: ExperimentConfig, partition_id: int):
    """A client's starting model when it has no state yet: its own architecture, initialised from the experiment
    seed, so every client of one architecture starts from the same weights (what a server would send) and a
    random-init reference is the same network."""
    return build_ssl_model(cfg, seed=cfg.seed, arch=cfg.client_arch(partition_id))


def check_public_set(public: np.ndarray, expected_digest: str, partition_id: int, what: str = "public set") -> None:
    """Refuse to work on a public set (FLESD's, Hetero-SSFL's RAD) that is not the server's."""
    digest = images_digest(public)
    if digest != expected_digest:
        raise PublicSetMismatch(
            f"public set mismatch on client {partition_id}: its {len(public)} {what} images hash to {digest[:16]}, "
            f"the server's to {expected_digest[:16]}; both must load the same data file and config"
        )


def _client_model(cfg: ExperimentConfig, partition_id: int, client_state: Mapping[str, np.ndarray] | None):
    """The client's own model: its initial one, overlaid with its kept state (if any)."""
    method = initial_client_model(cfg, partition_id)
    own = _model_entries(client_state)
    if own:
        load_partial_state(method, own)
    return method


def _rad_kernel(method, rad: np.ndarray, options: Mapping[str, Any], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(RAD representations, the client's raw kernel of them) with the strategy's options."""
    features = rad_representations(
        method,
        rad,
        str(options["representation"]),
        device=device,
        batch_size=int(options["rad_forward_batch"]),
        bn_mode=str(options["bn_mode"]),
    )
    return features, client_kernel(features, str(options["kernel"]), float(options["rbf_threshold"]))


def rad_precision(cfg: ExperimentConfig, options: Mapping[str, Any], device) -> dict[str, Any]:
    """The aligner's ``forward_dtype`` and ``channels_last`` for ``strategy.options.rad_precision``: ``train`` the
    local step's own (bf16 autocast and channels-last on the fast path; float32 where the step runs fp32 or fp16,
    since the term's gradient does not pass the fp16 gradient scaler), ``fp32`` float32 always."""
    if str(options.get("rad_precision", "train")) == "fp32":
        return {"forward_dtype": None, "channels_last": False}
    fp = fast_path_for(torch.device(device), cfg.train.fast_path)
    return {
        "forward_dtype": torch.bfloat16 if fp.autocast_dtype == torch.bfloat16 else None,
        "channels_last": fp.channels_last,
    }


def _kernel_payload(kernel: torch.Tensor, options: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], float]:
    """(the transport form of the normalised kernel, the raw kernel's ||H K H||_F)."""
    norm = centred_kernel_norm(kernel)
    k = normalize_kernel(kernel, str(options["kernel_normalization"]))
    encoding = str(options["kernel_encoding"])
    return encode_kernel(k, encoding, float(options["topk_fraction"]) if encoding == "topk" else None), norm


_RAD_PASS_FLOPS: dict[tuple, dict[str, float]] = {}


def _rad_pass_flops(method, representation: str, image_shape: tuple[int, ...]) -> dict[str, float]:
    """``rad_term_flops`` of this model, kept per process (keyed by its parameter shapes)."""
    shapes = tuple((name, tuple(p.shape), p.requires_grad) for name, p in method.named_parameters())
    key = (type(method).__name__, shapes, representation, tuple(image_shape))
    if key not in _RAD_PASS_FLOPS:
        _RAD_PASS_FLOPS[key] = rad_term_flops(method, representation, image_shape)
    return _RAD_PASS_FLOPS[key]


def initial_kernel(
    cfg: ExperimentConfig,
    rad: np.ndarray,
    client_state: Mapping[str, np.ndarray] | None,
    *,
    partition_id: int,
    rad_digest: str,
    options: Mapping[str, Any],
) -> tuple[dict[str, np.ndarray], float]:
    """Hetero-SSFL's K_k(0) (Algorithm 1 forms K_bar(0) from the initial models before round 1): the kernel of the
    client's current model (its initial one when it has no state) on the RAD, in transport form, and its raw
    ``||H K H||_F``. Nothing trains and nothing is kept."""
    check_public_set(rad, rad_digest, partition_id, "RAD")
    method = _client_model(cfg, partition_id, client_state)
    _, kernel = _rad_kernel(method, rad, options, resolve_device(cfg.train.device))
    return _kernel_payload(kernel, options)


def kernel_round(
    cfg: ExperimentConfig,
    images: np.ndarray,
    rad: np.ndarray,
    target_payload: Mapping[str, np.ndarray] | None,
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    rad_digest: str,
    options: Mapping[str, Any],
    log: Callable[[str], None] | None = None,
) -> KernelRoundResult:
    """One Hetero-SSFL client round: local SSL on the client's own encoder (its own architecture, its own weights
    kept between rounds) plus ``mu * (1 - CKA(K_k, K_bar))`` when the server sent a K_bar, then the kernel
    ``K_k = A_k A_k^T`` of its RAD representations in transport form.

    ``target_payload`` is the server's K_bar (an ``encode_kernel`` payload) or empty (no kernel yet: the round is
    local SSL only). ``options`` are the strategy options (``strategies/heterossfl.py``). With a K_bar the client
    reports its CKA to it on the whole RAD before and after local training (``cka_start``, ``cka_end``; also at
    ``mu: 0``, the no-alignment reference), and always its raw kernel's ``||H K H||_F`` (``kernel_norm``).
    """
    check_public_set(rad, rad_digest, partition_id, "RAD")
    seed = round_seed(cfg, server_round, partition_id)
    method = _client_model(cfg, partition_id, client_state)
    device = resolve_device(cfg.train.device)
    n = len(rad)
    aligner = None
    info: dict[str, Any] = {"aligned": False}
    target = None
    if target_payload:
        target = decode_kernel(target_payload, n)
        _, start_kernel = _rad_kernel(method, rad, options, device)
        info["cka_start"] = kernel_cka(start_kernel, target)
        del start_kernel
        if float(options["mu"]) > 0:
            aligner = KernelAligner(
                rad,
                target,
                mu=float(options["mu"]),
                representation=str(options["representation"]),
                kernel=str(options["kernel"]),
                rbf_threshold=float(options["rbf_threshold"]),
                refresh=str(options["refresh"]),
                refresh_steps=int(options["refresh_steps"]),
                rad_batch_size=int(options["rad_batch_size"]),
                forward_batch_size=int(options["rad_forward_batch"]),
                bn_mode=str(options["bn_mode"]),
                **rad_precision(cfg, options, device),
                device=device,
                seed=seed,
            )
    stats = local_training(
        cfg,
        method,
        images,
        lr=lr,
        seed=seed,
        device=device,
        loss_hook=aligner.loss if aligner else None,
        epoch_hook=aligner.on_epoch_start if aligner else None,
        log=log,
    )
    _, k = _rad_kernel(method, rad, options, device)
    if target is not None:
        info["cka_end"] = kernel_cka(k, target)
    if aligner is not None:
        info.update(aligned=True, align_loss=aligner.stats.mean_value, refreshes=aligner.stats.refreshes)
    if stats.resources:
        # What the round cost besides the SSL steps: the term's RAD passes and the forward of the kernel sent up
        # (the cka_start forward is a measurement, like the server's kNN monitor, and is left out).
        per_image = _rad_pass_flops(method, str(options["representation"]), (3, *np.shape(rad)[1:3]))
        extra = n * per_image["forward"] + (aligner.stats.flops(per_image) if aligner is not None else 0.0)
        stats.resources["flops_extra"] = float(extra)
    payload, info["kernel_norm"] = _kernel_payload(k, options)
    kept = state_to_numpy(method.cpu().state_dict())
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    return KernelRoundResult(payload, kept, stats, info)


def client_encoder_state(client_state: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """The online backbone entries of a client's state: what the server needs to score the client's encoder."""
    return {k: v for k, v in (client_state or {}).items() if k.startswith("backbone.")}


# ---------------------------------------------------------------------- layer-wise FedSSL (LW-FedSSL & co.)


def layerwise_round(
    cfg: ExperimentConfig,
    images: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    client_state: Mapping[str, np.ndarray] | None,
    *,
    server_round: int,
    partition_id: int,
    lr: float,
    plan: Mapping[str, Any],
    log: Callable[[str], None] | None = None,
) -> LocalRoundResult:
    """One client round of a layer-wise strategy (``strategies/layerwise.py``) at stage ``plan["stage"]``.

    The client builds the method with a ViT of s = stage blocks and fills it from its own last sub-model (the
    blocks it already holds) overlaid with what the server sent (the entries it trains, and every entry whose
    global version it lacks); an entry found in neither is an error (the server then sends the whole sub-model
    next time). ``plan`` (the round's ``lw-*`` config keys, prefix removed): ``trainable`` (``last_block``: block
    s + final norm + heads train, blocks 1..s-1 and the embeddings run frozen under no_grad; ``all``), ``alpha``
    and ``align-temperature`` (> 0: LW-FedSSL's representation alignment to the assembled global model, a frozen
    copy; ``align-symmetric``: both views' terms, Algorithm 2 line 12), ``depth-dropout`` (FLL+DD), ``client-target`` (``reset``: the momentum encoder starts as a copy of the
    assembled model; ``keep``: the client's own, new blocks from the received ones), ``progress-start/-end`` (this
    round's window of MoCo v3's momentum schedule), ``accounting`` (per-step FLOPs, analytic memory; the peak RSS
    and CUDA peak of local training are always measured). Uploads exactly the trained entries.
    """
    stage = int(plan["stage"])
    mode = str(plan.get("trainable", "last_block"))
    seed = round_seed(cfg, server_round, partition_id)
    method = build_layerwise_model(cfg, stage, seed=seed)
    heads = head_prefixes(method)
    model_state = method.state_dict()
    online_keys = [k for k in model_state if k.startswith(method.shared_prefixes())]
    own = _model_entries(client_state)
    merged = {k: v for k, v in own.items() if k in online_keys and tuple(np.shape(v)) == tuple(model_state[k].shape)}
    merged.update(global_state)
    missing = [k for k in online_keys if k not in merged]
    if missing:
        raise RuntimeError(
            f"client {partition_id}: the stage-{stage} sub-model lacks {len(missing)} entries "
            f"({', '.join(missing[:3])}...): neither the download nor this client's stored state holds "
            "them (state lost?); the server sends the whole sub-model next round"
        )
    load_partial_state(method, merged)
    reset_target_from_online(method)
    if str(plan.get("client-target", "reset")) == "keep":
        kept_target = {
            k: v
            for k, v in own.items()
            if k.startswith(TARGET_PREFIXES) and k in model_state and tuple(np.shape(v)) == tuple(model_state[k].shape)
        }
        load_partial_state(method, kept_target)
    method.on_new_global()
    configure_local_model(method, mode, float(plan.get("depth-dropout", 0.0)), dropout_seed=seed)
    if hasattr(method, "set_progress_range"):
        method.set_progress_range(float(plan.get("progress-start", 0.0)), float(plan.get("progress-end", 1.0)))
    alpha = float(plan.get("alpha", 0.0))
    aligner = (
        RepresentationAligner(
            method.backbone,
            alpha,
            float(plan.get("align-temperature", 0.2)),
            symmetric=bool(plan.get("align-symmetric", True)),
        )
        if alpha > 0
        else None
    )
    device = resolve_device(cfg.train.device)
    t = cfg.train
    batch = max(2, min(t.batch_size, len(images)))
    info: dict[str, Any] = {"stage": stage}
    if bool(plan.get("accounting", True)):
        info.update(
            resource_account(
                method, optimizer=t.optimizer, batch_size=batch, sgd_momentum=t.momentum, device=device, aligner=aligner
            )
        )
    rss_reset = reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if aligner is not None:
        aligner.attach(method)
    try:
        stats = local_training(
            cfg,
            method,
            images,
            lr=lr,
            seed=seed,
            device=device,
            loss_hook=aligner.loss if aligner else None,
            log=log,
            account=False,
        )
    finally:
        if aligner is not None:
            aligner.detach()
    if device.type == "cuda":
        info["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
    rss = process_peak_rss_bytes()
    if rss is not None:
        info["rss_peak_bytes"] = float(rss)
        info["rss_peak_reset"] = bool(rss_reset)  # False: the process's lifetime peak
    info["images_trained"] = float(stats.steps * min(t.batch_size, len(images)))
    if aligner is not None and aligner.mean_value is not None:
        info["align_loss"] = aligner.mean_value
    if getattr(method.backbone, "depth_dropout", 0.0):
        info["depth_dropout"] = float(method.backbone.depth_dropout)
    method.cpu()
    state = method.state_dict()
    shared = state_to_numpy(select(state, trained_prefixes(stage, mode, heads)))
    kept_prefixes = method.shared_prefixes() + (TARGET_PREFIXES if str(plan.get("client-target")) == "keep" else ())
    kept = state_to_numpy(select(state, kept_prefixes))
    kept[META + "last_round"] = np.array([server_round], dtype=np.int64)
    kept[META + "depth"] = np.array([stage], dtype=np.int64)
    return LocalRoundResult(shared, kept, stats, info)
