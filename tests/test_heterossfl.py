"""Hetero-SSFL: kernel transport and averaging, the local alignment term, the strategy (kernels of every client
under partial participation, encoder queries for evaluation), config checks; no `flwr run` (see the e2e test)."""

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app.app import app
from client_app.rounds.kernel import kernel_round
from client_app.rounds.public_set import PublicSetMismatch
from client_app.rounds.weights import initial_client_model, train_local_ssl
from fedssl_wire import KERNEL_RECORD, from_array_record, record_names, to_array_record
from server_app.experiment import load_experiment
from ssl_models.accounting import forward_flops, function_training_flops
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.augment import to_float_nchw
from ssl_models.data.datasets import load_dataset
from ssl_models.data.splits import client_images, federated_split, images_digest, public_images
from ssl_models.factory import build_ssl_model, state_to_numpy
from ssl_models.federated.cka import center_kernel, kernel_alignment_loss, linear_kernel
from ssl_models.federated.kernel_alignment import (
    KernelAligner,
    average_kernels,
    check_kernel_payload,
    client_kernel,
    decode_kernel,
    encode_kernel,
    eval_mode,
    kernel_cka,
    normalize_kernel,
    rad_forward_mode,
    rad_representations,
    rad_term_flops,
    representation_fn,
)
from ssl_models.training import train_ssl
from strategies import HeteroSSFL, Local
from wire_bytes import hand_bytes

TINY = {
    "rounds": 3,
    "data": {
        "dataset": "synthetic",
        "synthetic_train": 200,
        "synthetic_test": 40,
        "partition": "iid",
        "public_size": 40,
    },
    "model": {"arch": "resnet18", "width": 0.125, "client_archs": ["resnet18", "resnet34"]},
    "method": {"name": "byol", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2, "fast_path": False, "lr": 0.05},
    "strategy": {"name": "heterossfl", "options": {"mu": 1.0}},
    "eval": {"knn_every": 2},
}
OPTIONS = {**HeteroSSFL.default_options(), "mu": 1.0}
REPO = Path(__file__).resolve().parents[1]


def tiny(**changes):
    raw = yaml.safe_load(yaml.safe_dump(TINY))
    for dotted, value in changes.items():
        node = raw
        *path, last = dotted.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return ExperimentConfig.from_dict(raw)


@pytest.fixture()
def identity():
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


def sym(values):
    m = np.asarray(values, dtype=np.float32)
    return torch.from_numpy((m + m.T) / 2)


# ---------------------------------------------------------------------------------------------- transport
def test_kernel_transport_forms_and_their_sizes():
    g = torch.Generator().manual_seed(0)
    a = 300.0 * torch.randn(12, 5, generator=g)  # entries of A A^T far beyond float16's 65504
    k = a @ a.t()
    assert float(k.abs().max()) > 65504
    fp32 = encode_kernel(k, "dense-fp32")
    torch.testing.assert_close(decode_kernel(fp32, 12), k)  # exact
    assert float(fp32["scale"][0]) == 1.0 and fp32["values"].nbytes == 4 * 12 * 12
    fp16 = encode_kernel(k, "dense-fp16")
    assert fp16["values"].dtype == np.float16 and fp16["values"].nbytes == 2 * 12 * 12
    back = decode_kernel(fp16, 12)
    assert torch.isfinite(back).all()
    assert float((back - k).abs().max() / k.abs().max()) < 1e-3  # scaled to [-1, 1] before the cast
    top = encode_kernel(k, "topk", 0.25)  # floor(0.25 * 12) + 1 = 4 entries per row
    assert top["values"].shape == (12, 4) and top["indices"].dtype == np.uint8
    dense = decode_kernel(top, 12)
    assert int((dense != 0).sum()) == 12 * 4
    row0 = k[0].topk(4).indices
    torch.testing.assert_close(dense[0, row0], k[0, row0], rtol=1e-3, atol=0)
    with pytest.raises(ValueError, match="scale"):
        check_kernel_payload({"values": fp32["values"]}, 12)
    with pytest.raises(ValueError, match="expected \\(13, 13\\)"):
        check_kernel_payload(fp32, 13)
    with pytest.raises(ValueError, match="kernel encoding"):
        encode_kernel(k, "dense-int8")


def test_frobenius_normalization_gives_each_client_unit_centred_kernel_and_keeps_cka():
    g = torch.Generator().manual_seed(1)
    small_k, big_k = linear_kernel(torch.randn(10, 3, generator=g)), linear_kernel(50 * torch.randn(10, 4, generator=g))
    unit = normalize_kernel(big_k, "frobenius")
    assert float(torch.linalg.matrix_norm(center_kernel(unit))) == pytest.approx(1.0, rel=1e-5)
    assert kernel_cka(unit, small_k) == pytest.approx(kernel_cka(big_k, small_k), rel=1e-5)
    assert normalize_kernel(big_k, "none") is big_k
    # Raw kernels: the average follows the client with the larger representations; normalised, both count.
    raw = average_kernels([(encode_kernel(k, "dense-fp32"), 1.0) for k in (small_k, big_k)], 10)
    fair = average_kernels(
        [(encode_kernel(normalize_kernel(k, "frobenius"), "dense-fp32"), 1.0) for k in (small_k, big_k)], 10
    )
    assert kernel_cka(raw, big_k) > 0.99 and kernel_cka(raw, small_k) < kernel_cka(fair, small_k)
    with pytest.raises(ValueError, match="kernel normalization"):
        normalize_kernel(big_k, "l1")


def test_average_kernels_matches_hand_computation():
    k1, k2, k3 = sym([[1, 2], [2, 5]]), sym([[3, 0], [0, 1]]), sym([[-1, 4], [4, 2]])
    payloads = [encode_kernel(k1, "dense-fp32"), encode_kernel(k2, "dense-fp16"), encode_kernel(k3, "dense-fp32")]
    uniform = average_kernels(((p, 1.0) for p in payloads), 2)  # a generator, consumed once
    torch.testing.assert_close(uniform, torch.tensor([[1.0, 2.0], [2.0, 8 / 3]]), rtol=1e-3, atol=1e-3)
    weighted = average_kernels(zip(payloads, (1.0, 2.0, 1.0)), 2, chunk_rows=1)  # (k1 + 2 k2 + k3) / 4
    torch.testing.assert_close(weighted, torch.tensor([[1.5, 1.5], [1.5, 2.25]]), rtol=1e-3, atol=1e-3)
    # top-1 of 2 columns (fraction 0.1 keeps floor(0.2) + 1 = 1 entry per row): the row maxima only
    sparse = average_kernels([(encode_kernel(k1, "topk", 0.1), 1.0)], 2)
    torch.testing.assert_close(sparse, torch.tensor([[0.0, 2.0], [0.0, 5.0]]), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="weights must be > 0"):
        average_kernels([(payloads[0], 0.0)], 2)
    with pytest.raises(ValueError, match="at least one kernel"):
        average_kernels([], 2)


# ---------------------------------------------------------------------------------------------- alignment term
@pytest.fixture(scope="module")
def small():
    cfg = tiny()
    data = load_dataset("synthetic", synthetic_sizes=(160, 40, 10))
    rad, images = data.x_train[:40], data.x_train[40:104]
    other = build_ssl_model(cfg, seed=5, arch="resnet34")  # another architecture's kernel as the target
    return cfg, rad, images, client_kernel(rad_representations(other, rad, "predictor"))


@pytest.mark.parametrize(
    "refresh,extra",
    [
        ("epoch", {}),
        ("step", {"refresh_steps": 1}),
        ("minibatch", {"rad_batch_size": 16}),
        ("step", {"bn_mode": "train"}),
    ],
)
def test_alignment_term_moves_the_kernel_towards_kbar(small, refresh, extra):
    cfg, rad, images, target = small
    ckas = {}
    for mu in (0.0, 20.0):
        model = build_ssl_model(cfg, seed=1)
        aligner = KernelAligner(rad, target, mu=mu, refresh=refresh, forward_batch_size=16, **extra)
        train_ssl(
            model,
            images,
            epochs=3,
            batch_size=32,
            lr=0.05,
            fast_path=False,
            max_steps_per_epoch=1,
            seed=0,
            loss_hook=aligner.loss,
            epoch_hook=aligner.on_epoch_start,
        )
        bn_mode = extra.get("bn_mode", "eval")  # measured as aligned
        ckas[mu] = kernel_cka(client_kernel(rad_representations(model, rad, bn_mode=bn_mode)), target)
    # (batch-statistics representations move less in these 3 steps: the target was taken in eval mode)
    assert ckas[20.0] > ckas[0.0] + (0.1 if "bn_mode" in extra else 0.2), ckas


def test_chunked_alignment_gradient_equals_the_full_graph_gradient(small):
    cfg, rad, _, target = small
    model = build_ssl_model(cfg, seed=2)
    one_pass = KernelAligner(rad, target, mu=0.7, refresh="epoch", forward_batch_size=64)
    chunked = KernelAligner(rad, target, mu=0.7, refresh="epoch", forward_batch_size=16)  # 40 images, 3 chunks
    one_pass.on_epoch_start(model, 0)
    chunked.on_epoch_start(model, 0)
    params = [p for p in model.trainable_parameters()]
    with eval_mode(model):
        features = representation_fn(model, "predictor")(torch.from_numpy(rad).permute(0, 3, 1, 2).float() / 255)
        loss = 0.7 * kernel_alignment_loss(features @ features.t(), target)
    direct = torch.autograd.grad(loss, params, allow_unused=True)
    assert len(chunked._grads) == len([d for d in direct if d is not None]) > 0
    for (p, g1), (_, g2) in zip(one_pass._grads, chunked._grads):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    for (p, g), d in zip(chunked._grads, [d for d in direct if d is not None]):
        torch.testing.assert_close(g, d, rtol=1e-4, atol=1e-6)
    assert one_pass.stats.values[0] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert all(m.training for m in model.modules())  # modes restored after the eval-mode RAD passes


def test_refresh_schedule_and_the_surrogate_gradient(small):
    cfg, rad, _, target = small
    model = build_ssl_model(cfg, seed=3)
    epoch = KernelAligner(rad, target, mu=0.5, refresh="epoch", forward_batch_size=64)
    epoch.on_epoch_start(model, 0)
    for _ in range(2):  # every step: the term's value at the refresh, and its gradient there
        model.zero_grad(set_to_none=True)
        term = epoch.loss(model)
        assert float(term.detach()) == pytest.approx(epoch.stats.values[0])
        term.backward()
        for p, g in epoch._grads:
            torch.testing.assert_close(p.grad, g)
    assert epoch.stats.refreshes == 1
    steps = KernelAligner(rad, target, mu=0.5, refresh="step", refresh_steps=2, forward_batch_size=64)
    for _ in range(3):
        steps.loss(model)
    assert steps.stats.refreshes == 2  # steps 1 and 3
    with pytest.raises(ValueError, match="refresh must be one of"):
        KernelAligner(rad, target, mu=0.5, refresh="sometimes")
    with pytest.raises(ValueError, match="target kernel has shape"):
        KernelAligner(rad, target[:10, :10], mu=0.5)


def test_the_term_counts_the_rad_images_it_passes_through_the_network(small):
    cfg, rad, _, target = small
    model = build_ssl_model(cfg, seed=3)
    n = len(rad)  # 40
    one_pass = KernelAligner(rad, target, mu=0.5, refresh="step", forward_batch_size=64)
    chunked = KernelAligner(rad, target, mu=0.5, refresh="step", forward_batch_size=16)
    minibatch = KernelAligner(rad, target, mu=0.5, refresh="minibatch", rad_batch_size=8)
    epoch = KernelAligner(rad, target, mu=0.5, refresh="epoch", forward_batch_size=64)
    epoch.on_epoch_start(model, 0)
    for _ in range(3):
        for aligner in (one_pass, chunked, minibatch, epoch):
            aligner.loss(model)
    assert (one_pass.stats.images_forward_backward, one_pass.stats.images_forward_only) == (3 * n, 0)
    # a RAD larger than a forward batch: a no-gradient pass, then the chunks again with their graphs
    assert (chunked.stats.images_forward_backward, chunked.stats.images_forward_only) == (3 * n, 3 * n)
    assert (minibatch.stats.images_forward_backward, minibatch.stats.images_forward_only) == (3 * 8, 0)
    assert (epoch.stats.images_forward_backward, epoch.stats.images_forward_only) == (n, 0)  # once per epoch
    per_image = {"forward": 10.0, "backward": 17.0}
    assert chunked.stats.flops(per_image) == 3 * n * (10 + 17) + 3 * n * 10
    # the per-image figures: the representation's forward and backward, as the accounting module counts them
    figures = rad_term_flops(model, "predictor", (3, 32, 32))
    assert figures == function_training_flops(model, lambda m: representation_fn(m, "predictor"), (3, 32, 32))
    assert figures["forward"] > forward_flops(model.backbone, (3, 32, 32)) > 0 and figures["backward"] > 0


def eq2_at(model, rad, target, mu, bn_mode="eval"):
    """mu (1 - CKA(A A^T, K_bar)) and its gradient, computed directly at the model's current weights (the RAD
    forward with the graph, no chunking, no surrogate): Eq. 2's alignment term by hand."""
    params = [p for p in model.trainable_parameters() if p.requires_grad]
    # The RAD as the aligner feeds it (contiguous NCHW: a channels-last copy takes other convolution kernels, whose
    # rounding batch-statistics gradients amplify past any tolerance)
    x = to_float_nchw(torch.from_numpy(rad)).contiguous()
    with rad_forward_mode(model, bn_mode):
        features = representation_fn(model, "predictor")(x)
        loss = mu * kernel_alignment_loss(features @ features.t(), target)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(loss.detach()), {id(p): g for p, g in zip(params, grads) if g is not None}


@pytest.mark.parametrize("bn_mode", ["eval", "train"])
def test_per_step_term_is_eq2_at_the_current_weights(small, bn_mode):
    """refresh "step" (the default): at every step of an optimisation, the term's value and the gradient it adds are
    Eq. 2's at the weights of that step (not those of an earlier refresh), chunked or not."""
    cfg, rad, _, target = small
    model = build_ssl_model(cfg, seed=4)
    # eval: 40 RAD images in 3 chunks (running statistics: chunking changes nothing); train: one chunk, since batch
    # statistics are those of each forward chunk
    aligner = KernelAligner(rad, target, mu=0.8, forward_batch_size=16 if bn_mode == "eval" else 64, bn_mode=bn_mode)
    assert aligner.refresh == "step" and aligner.refresh_steps == 1
    params = [p for p in model.trainable_parameters() if p.requires_grad]
    values = []
    for step in range(3):
        value, grads = eq2_at(model, rad, target, 0.8, bn_mode)
        model.zero_grad(set_to_none=True)
        term = aligner.loss(model)
        term.backward()
        assert float(term.detach()) == pytest.approx(value, rel=1e-5)
        assert grads and all(p.grad is not None for p in params if id(p) in grads)
        for p in params:
            if id(p) in grads:
                torch.testing.assert_close(p.grad, grads[id(p)], rtol=2e-3, atol=1e-6)
        with torch.no_grad():  # a plain gradient step moves the weights: the next term must follow them
            for p in params:
                if p.grad is not None:
                    p -= 0.1 * p.grad
        values.append(value)
    assert aligner.stats.refreshes == 3 and len(set(values)) == 3
    assert values[-1] < values[0]  # descending the exact term lowers it


@pytest.mark.parametrize("refresh", ["step", "minibatch"])
def test_train_precision_term_is_eq2_in_bf16_close_to_the_fp32_one(small, refresh):
    """rad_precision train on a bf16 fast path: the network part of the RAD forward runs under bf16 autocast in
    channels-last layout (so the value differs from fp32's by rounding only) while the CKA is taken in float32;
    the value and the gradient agree with Eq. 2 computed in float32 up to bf16 rounding."""
    cfg, rad, _, target = small
    model = build_ssl_model(cfg, seed=4).to(memory_format=torch.channels_last)
    params = [p for p in model.trainable_parameters() if p.requires_grad]
    extra = {"rad_batch_size": 40} if refresh == "minibatch" else {}  # the whole RAD: comparable with eq2_at
    terms = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        aligner = KernelAligner(
            rad,
            target,
            mu=0.8,
            refresh=refresh,
            forward_batch_size=64,
            bn_mode="train",
            forward_dtype=dtype,
            channels_last=dtype is not None,
            **extra,
        )
        model.zero_grad(set_to_none=True)
        term = aligner.loss(model)
        term.backward()
        assert term.dtype == torch.float32
        terms[name] = (float(term.detach()), torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
    value, grads = eq2_at(model, rad, target, 0.8, "train")
    exact = torch.cat([grads[id(p)].flatten() for p in params if id(p) in grads])
    assert terms["fp32"][0] == pytest.approx(value, rel=1e-4)
    assert terms["bf16"][0] != terms["fp32"][0]  # the forward did run in bf16
    assert terms["bf16"][0] == pytest.approx(value, rel=2e-2)
    # bf16 rounding through batch-statistics BatchNorm: on this tiny model the term's gradient keeps a cosine of
    # 0.85-0.94 to the fp32 one over init seeds 0-3, the SSL loss's own bf16 gradient 0.88-0.91 to its fp32 one
    # (benchmarks/results/heterossfl_rad_precision.md has the CPU-scale figures)
    cosine = torch.nn.functional.cosine_similarity(terms["bf16"][1], exact, dim=0)
    assert cosine > 0.8, float(cosine)
    with pytest.raises(ValueError, match="forward_dtype must be"):
        KernelAligner(rad, target, mu=0.5, forward_dtype=torch.float16)


def test_rad_precision_option_follows_the_local_steps_fast_path():
    from client_app.rounds.kernel import rad_precision
    from ssl_models.training import fast_path_for

    fast = fast_path_for(torch.device("cpu"), True)
    chosen = rad_precision(tiny(**{"train.fast_path": True}), {"rad_precision": "train"}, "cpu")
    assert chosen == {
        "forward_dtype": torch.bfloat16 if fast.autocast_dtype == torch.bfloat16 else None,
        "channels_last": fast.channels_last,
    }
    assert rad_precision(tiny(**{"train.fast_path": False}), {"rad_precision": "train"}, "cpu") == {
        "forward_dtype": None,
        "channels_last": False,
    }
    assert rad_precision(tiny(**{"train.fast_path": True}), {"rad_precision": "fp32"}, "cpu") == {
        "forward_dtype": None,
        "channels_last": False,
    }
    assert HeteroSSFL.default_options()["rad_precision"] == "train"
    with pytest.raises(ValueError, match="rad_precision"):
        HeteroSSFL.check_options({**HeteroSSFL.default_options(), "rad_precision": "fp16"})


def test_rad_forward_in_train_mode_uses_batch_statistics_and_leaves_the_running_ones(small):
    cfg, rad, images, _ = small
    model = build_ssl_model(cfg, seed=6)
    train_ssl(model, images, epochs=1, batch_size=32, lr=0.05, fast_path=False, max_steps_per_epoch=1, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    modes = {m: m.training for m in model.modules()}
    frozen = rad_representations(model, rad, bn_mode="eval", batch_size=16)
    batch = rad_representations(model, rad, bn_mode="train", batch_size=40)
    after = {k: v for k, v in model.state_dict().items() if k in before}
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)  # the RAD never touches them
    assert {m: m.training for m in model.modules()} == modes
    assert not torch.allclose(frozen, batch, atol=1e-3)
    with torch.no_grad():  # train mode = every BatchNorm normalising with this forward's own statistics
        work = copy.deepcopy(model).train()
        by_hand = work.predictor(work.projector(work.backbone(to_float_nchw(torch.from_numpy(rad)).contiguous())))
    torch.testing.assert_close(batch, by_hand, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="bn_mode"):
        rad_representations(model, rad, bn_mode="frozen")


def test_kbar_of_normalised_kernels_weighs_every_client_equally(identity, tmp_path):
    """The default kernel_normalization (frobenius): each client uploads K / ||H K H||_F, so K_bar's centred form is
    the plain mean of unit-norm centred kernels, whatever the clients' scales (by hand, two kernels 100x apart)."""
    g = torch.Generator().manual_seed(3)
    a1, a2 = torch.randn(8, 3, generator=g), 100 * torch.randn(8, 5, generator=g)
    k1, k2 = a1 @ a1.t(), a2 @ a2.t()
    payloads = [encode_kernel(normalize_kernel(k, "frobenius"), "dense-fp32") for k in (k1, k2)]
    kbar = average_kernels([(p, 1.0) for p in payloads], 8)
    hk1, hk2 = center_kernel(k1), center_kernel(k2)
    expected = (hk1 / torch.linalg.matrix_norm(hk1) + hk2 / torch.linalg.matrix_norm(hk2)) / 2
    torch.testing.assert_close(center_kernel(kbar), expected, rtol=1e-4, atol=1e-6)
    assert kernel_cka(kbar, k1) > 0.3 and kernel_cka(kbar, k2) > 0.3  # both count
    raw = average_kernels([(encode_kernel(k, "dense-fp32"), 1.0) for k in (k1, k2)], 8)
    assert kernel_cka(raw, k2) > 0.999  # raw: K_bar is the large client's kernel


# ---------------------------------------------------------------------------------------------- client rounds
def test_two_clients_of_different_architectures_train_together():
    cfg = tiny()
    rad = public_images(cfg)
    digest = images_digest(rad)
    opts = {**OPTIONS, "rad_forward_batch": 16}
    first = [
        kernel_round(
            cfg,
            client_images(cfg, pid),
            rad,
            None,
            None,
            server_round=1,
            partition_id=pid,
            lr=0.05,
            rad_digest=digest,
            options=opts,
        )
        for pid in (0, 1)
    ]
    assert [r.info["aligned"] for r in first] == [False, False]  # round 1: no K_bar yet, local SSL only
    assert "backbone.layer3.5.conv1.weight" in first[1].client_state  # ResNet-34's own weights
    assert "backbone.layer3.5.conv1.weight" not in first[0].client_state
    assert all(r.payload["values"].shape == (len(rad), len(rad)) for r in first)  # width-independent kernels
    kbar = average_kernels([(r.payload, 1.0) for r in first], len(rad))
    down = encode_kernel(kbar, "dense-fp32")
    second = [
        kernel_round(
            cfg,
            client_images(cfg, pid),
            rad,
            down,
            first[pid].client_state,
            server_round=2,
            partition_id=pid,
            lr=0.05,
            rad_digest=digest,
            options=opts,
        )
        for pid in (0, 1)
    ]
    for r in second:  # refresh "step": the term recomputed at every one of the round's steps
        assert r.info["aligned"] and r.info["refreshes"] == r.stats.steps == 2 and 0 < r.info["cka_start"] <= 1 + 1e-5
        assert np.isfinite(r.info["align_loss"]) and np.isfinite(r.stats.loss)
    # The round's FLOPs besides its SSL steps: the kernel's forward of the RAD (every round), and with K_bar the
    # term's passes at every step (a 40-image RAD in forward batches of 16: a no-gradient pass plus the chunks
    # with their graphs).
    n = len(rad)
    for pid in (0, 1):
        f = rad_term_flops(initial_client_model(cfg, pid), "predictor", (3, *rad.shape[1:3]))
        assert first[pid].stats.resources["flops_extra"] == pytest.approx(n * f["forward"])
        assert second[pid].stats.resources["flops_extra"] == pytest.approx(
            n * f["forward"] + 2 * (n * (f["forward"] + f["backward"]) + n * f["forward"])
        )
    assert second[1].stats.resources["flops_extra"] > second[0].stats.resources["flops_extra"]  # ResNet-34
    # No global model: each client continues from its own weights (a near-zero learning rate keeps them).
    still = kernel_round(
        cfg,
        client_images(cfg, 1),
        rad,
        down,
        first[1].client_state,
        server_round=2,
        partition_id=1,
        lr=1e-12,
        rad_digest=digest,
        options=opts,
    )
    key = "backbone.layer3.5.conv1.weight"
    np.testing.assert_allclose(still.client_state[key], first[1].client_state[key], atol=1e-9)
    fresh = state_to_numpy(initial_client_model(cfg, 1).state_dict())[key]
    assert np.abs(first[1].client_state[key] - fresh).max() > 1e-6
    with pytest.raises(PublicSetMismatch, match="public set mismatch"):
        kernel_round(
            cfg,
            client_images(cfg, 0),
            rad,
            None,
            None,
            server_round=1,
            partition_id=0,
            lr=0.05,
            rad_digest="0" * 64,
            options=opts,
        )


def test_local_strategy_runs_mixed_architectures_from_their_own_initial_models(tmp_path):
    cfg = tiny(**{"strategy.name": "local", "strategy.options": {}})
    strategy = Local(clients={0: 10, 1: 11}, clients_per_round=2, state_dir=str(tmp_path))
    strategy.prepare(cfg, None, None)
    initial = to_array_record({"backbone.w": np.zeros(2, np.float32)})
    assert record_names(strategy.arrays_for_client(1, 0, initial)) == [
        "backbone.w"
    ]  # ResNet-18 = model.arch: the shared initial model
    assert len(strategy.arrays_for_client(1, 1, initial)) == 0  # ResNet-34 builds its own
    res = train_local_ssl(cfg, client_images(cfg, 1), {}, None, server_round=1, partition_id=1, lr=1e-12, rule="local")
    key = "backbone.layer3.5.conv1.weight"
    expected = state_to_numpy(initial_client_model(cfg, 1).state_dict())[key]
    np.testing.assert_allclose(res.shared_state[key], expected, atol=1e-9)


# ---------------------------------------------------------------------------------------------- the strategy
class LoopbackGrid:
    """Routes messages to the real ClientApp in this process; one Context per node (client state in memory)."""

    def __init__(self, nodes: dict[int, int], fail: set[int] = frozenset()):
        self.nodes = nodes  # node id -> partition id
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": pid, "num-partitions": len(nodes)},
                state=RecordDict(),
                run_config={},
            )
            for node, pid in nodes.items()
        }
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        messages = list(messages)
        self.sent += messages
        return [app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]


def kernel_reply(request, pid, kernel, num_examples=50):
    return Message(
        RecordDict(
            {
                KERNEL_RECORD: to_array_record(encode_kernel(kernel, "dense-fp32")),
                "metrics": MetricRecord(
                    {"partition-id": pid, "num-examples": num_examples, "train_loss": 1.0, "train_s": 0.1}
                ),
            }
        ),
        reply_to=request,
    )


def make_strategy(cfg, tmp_path, clients, per_round, **options):
    data = load_dataset("synthetic", synthetic_sizes=(200, 40, 10))
    strategy = HeteroSSFL(
        clients=clients,
        clients_per_round=per_round,
        seed=3,
        options={**OPTIONS, **options},
        state_dir=str(tmp_path),
        round_config=lambda r: {"lr": 0.05},
    )
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    return strategy


@pytest.mark.parametrize("weights", ["uniform", "data_size"])
def test_kbar_averages_the_latest_kernel_of_every_client_under_partial_participation(identity, tmp_path, weights):
    cfg = tiny(
        **{"federation.num_clients": 4, "model.client_archs": ["resnet18", "resnet34"] * 2, "data.public_size": 6}
    )
    nodes = {100 + pid: pid for pid in range(4)}
    strategy = make_strategy(
        cfg, tmp_path, {pid: node for node, pid in nodes.items()}, 2, kernel_weights=weights, initial_kernels="none"
    )

    class Grid:
        def get_node_ids(self):
            return list(nodes)

    latest: dict[int, tuple[torch.Tensor, int]] = {}
    seen_rounds = []
    for rnd in (1, 2, 3, 4):
        msgs = list(strategy.configure_train(rnd, to_array_record({}), ConfigRecord(), Grid()))
        assert all(m.metadata.message_type == "train.kernel" for m in msgs)
        assert all(m.content["config"]["rad-digest"] == strategy.rad_digest for m in msgs)
        if latest:  # K_bar = weighted mean of every client's latest kernel, by hand
            w = {pid: (1.0 if weights == "uniform" else n) for pid, (_, n) in latest.items()}
            expected = sum(w[pid] * k for pid, (k, _) in latest.items()) / sum(w.values())
            for m in msgs:
                torch.testing.assert_close(
                    decode_kernel(from_array_record(m.content["arrays"]), 6), expected, rtol=1e-5, atol=1e-5
                )
        else:
            assert all(len(m.content["arrays"]) == 0 for m in msgs)  # round 1: nothing to align to yet
        chosen = [nodes[m.metadata.dst_node_id] for m in msgs]
        seen_rounds.append(chosen)
        replies = []
        for m, pid in zip(msgs, chosen):
            kernel = sym(np.arange(36).reshape(6, 6) * (pid + 1) + 100 * rnd)  # distinct per client and round
            latest[pid] = (kernel, 40 + 10 * pid)
            replies.append(kernel_reply(m, pid, kernel, 40 + 10 * pid))
        strategy.aggregate_train(rnd, replies)
        record = strategy.round_records[rnd]
        # by hand: a 6 x 6 float32 kernel (144) and its float32 scale (4), the manifest "values\t<f4\t6,6\nscale\t<f4\t1"
        # (26) and the packed record's frame (270)
        assert record["bytes_up"] == record["kernel_bytes_up"] == len(replies) * (144 + 4 + 26 + 270)
        sent = [hand_bytes(from_array_record(m.content["arrays"])) for m in msgs]  # K_bar, from shapes and dtypes
        assert record["bytes_down"] == sum(sent) == len(msgs) * record["kbar_bytes_per_client"]
        assert (sent[0] > 0) == (rnd > 1)
        assert record["kernels_stored"] == len(latest)
    assert len({pid for chosen in seen_rounds for pid in chosen}) > 2  # partial participation reached others
    assert any(set(a) != set(b) for a, b in itertools.pairwise(seen_rounds))
    files = sorted(p.name for p in (tmp_path / "server-kernels").glob("client_*.npz"))
    assert files == [f"client_{pid}.npz" for pid in sorted(latest)]  # kernels on disk, one per client
    assert all(isinstance(v, int) for info in strategy.kernel_info.values() for v in info.values())


@pytest.mark.parametrize("state", ["memory", "disk", "server"])
def test_round_trip_through_the_client_app_and_encoder_queries(identity, tmp_path, state):
    cfg = tiny(
        **{
            "federation.num_clients": 3,
            "model.client_archs": ["resnet18", "resnet34", "resnet18"],
            "strategy.options": {**OPTIONS, "client_state": state, "rad_forward_batch": 16},
        }
    )
    nodes = {200 + pid: pid for pid in range(3)}
    grid = LoopbackGrid(nodes)
    strategy = make_strategy(
        cfg, tmp_path, {pid: node for node, pid in nodes.items()}, 2, client_state=state, rad_forward_batch=16
    )
    base = ConfigRecord({"experiment": cfg.to_json()})
    for rnd in (1, 2):
        msgs = list(strategy.configure_train(rnd, to_array_record({}), base, grid))
        replies = grid.send_and_receive(msgs)
        assert not any(r.has_error() for r in replies), [r.error for r in replies if r.has_error()]
        strategy.aggregate_train(rnd, replies)
        assert list(strategy.configure_evaluate(rnd, to_array_record({}), ConfigRecord(), grid)) == []
    record = strategy.round_records[2]
    aligned = [c for c in record["clients"] if c.get("aligned")]
    assert aligned and all(0 < c["cka_start"] <= 1 + 1e-5 and "cka_end" in c for c in aligned)
    assert {c["arch"] for c in record["clients"]} <= {"resnet18", "resnet34"}
    # Round 2 is a kNN round (knn_every 2): the encoders of the clients that trained were fetched, their bytes
    # recorded apart from the kernels' N^2 bytes of the round.
    queries = [m for m in grid.sent if m.metadata.message_type == "query.encoder"]
    trained = sorted(strategy.trained)
    assert record["eval_clients"] == len(trained)
    if state == "server":  # the server holds every client's state: no query, no bytes; the state rides along
        assert queries == [] and record["eval_bytes_up"] == 0 and record["bytes_up"] > record["kernel_bytes_up"]
    else:
        assert sorted(nodes[m.metadata.dst_node_id] for m in queries) == trained
        assert record["eval_bytes_up"] > 0 and record["bytes_up"] == record["kernel_bytes_up"]
    if state == "disk":
        assert not any(ctx.state.array_records for ctx in grid.contexts.values())  # nothing in node memory
    assert "eval_bytes_up" not in strategy.round_records[1]  # round 1 is no evaluation round
    models = strategy.models_to_evaluate(to_array_record({}))
    assert list(models) == [f"client_{pid}" for pid in trained]
    for name in models:
        model = models[name]
        pid = int(name.split("_")[1])
        assert model.arch == cfg.client_arch(pid)
        keys = record_names(model.arrays)
        assert keys and all(k.startswith("backbone.") for k in keys)
    extras = strategy.summary_extras(
        {f"client_{pid}": {"knn_acc": 0.1 * (pid + 1), "linear_probe_acc": None} for pid in trained}
    )
    assert extras["client_archs"] == ["resnet18", "resnet34", "resnet18"]
    assert extras["eval_bytes_up_total"] == record["eval_bytes_up"]
    by_arch = extras["scores_by_arch"]
    r18 = [0.1 * (pid + 1) for pid in trained if cfg.client_arch(pid) == "resnet18"]
    assert by_arch["resnet18"]["knn_acc_mean"] == pytest.approx(sum(r18) / len(r18))
    assert by_arch["resnet18"]["num_clients"] == len(r18)


@pytest.mark.parametrize("initial", ["query", "none"])
def test_round_one_aligns_to_kbar0_of_the_initial_models(identity, tmp_path, initial):
    """Algorithm 1 forms K_bar(0) from the initial models: before round 1 every client is asked (query.kernel) for
    the kernel of its initial model, and round 1's clients train against their average (by hand here: the
    initial models' normalised RAD kernels); ``initial_kernels: none`` keeps round 1 local."""
    options = {"rad_forward_batch": 16, "initial_kernels": initial, "client_state": "memory"}
    cfg = tiny(**{"strategy.options": {**OPTIONS, **options}})
    grid = LoopbackGrid({300: 0, 301: 1})
    strategy = make_strategy(cfg, tmp_path, {0: 300, 1: 301}, 2, **options)
    msgs = list(strategy.configure_train(1, to_array_record({}), ConfigRecord({"experiment": cfg.to_json()}), grid))
    queries = [m for m in grid.sent if m.metadata.message_type == "query.kernel"]
    rad = public_images(cfg)
    if initial == "none":
        assert queries == [] and all(len(m.content["arrays"]) == 0 for m in msgs)
        return
    assert sorted(m.metadata.dst_node_id for m in queries) == [300, 301]
    by_hand = []
    for pid in (0, 1):  # batch statistics per 16-image chunk (bn_mode train, rad_forward_batch 16)
        k = client_kernel(
            rad_representations(initial_client_model(cfg, pid), rad, "predictor", bn_mode="train", batch_size=16)
        )
        by_hand.append(normalize_kernel(k, "frobenius"))
    for m in msgs:
        torch.testing.assert_close(
            decode_kernel(from_array_record(m.content["arrays"]), len(rad)),
            (by_hand[0] + by_hand[1]) / 2,
            rtol=1e-4,
            atol=1e-5,
        )
    replies = grid.send_and_receive(msgs)
    strategy.aggregate_train(1, replies)
    record = strategy.round_records[1]
    assert all(c["aligned"] and c["refreshes"] > 0 for c in record["clients"])
    assert set(record["initial_kernel_norms"]) == {"0", "1"} and record["initial_kernel_clients"] == 2
    assert record["bytes_up"] == record["kernel_bytes_up"] + record["initial_kernel_bytes_up"]
    assert all(c["kernel_norm"] > 0 for c in record["clients"])  # every client's raw ||H K H||_F, logged


def test_a_client_without_state_refuses_the_encoder_query(identity):
    cfg = tiny()
    ctx = Context(
        run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    msg = Message(
        RecordDict({"config": ConfigRecord({"experiment": cfg.to_json(), "client-state": "memory"})}),
        dst_node_id=5,
        message_type="query.encoder",
    )
    with pytest.raises(RuntimeError, match="client 0 has no encoder yet"):  # an error reply in a real run
        app(msg, ctx)


# ---------------------------------------------------------------------------------------------- configuration
def write(tmp_path, raw):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return {"config": str(path)}


def test_config_checks_name_the_key(tmp_path):
    base = yaml.safe_load((REPO / "configs" / "smoke-heterossfl.yaml").read_text())
    base["data"]["dataset"] = "synthetic"
    cfg, _ = load_experiment(write(tmp_path, base))
    assert cfg.strategy.options["refresh"] == "step" and cfg.strategy.options["mu"] == 0.5
    assert cfg.strategy.options["kernel_normalization"] == "frobenius"
    assert cfg.strategy.options["initial_kernels"] == "query" and cfg.strategy.options["bn_mode"] == "train"
    cases = [
        ({"data": {**base["data"], "public_size": 0}}, r"^data.public_size: Hetero-SSFL needs the RAD"),
        ({"strategy": {"name": "heterossfl", "options": {"refresh": "sometimes"}}}, r"^strategy.options.refresh"),
        ({"strategy": {"name": "heterossfl", "options": {"mu": -1.0}}}, r"^strategy.options.mu: must be >= 0"),
        ({"strategy": {"name": "heterossfl", "options": {"update_both": True}}}, r"^strategy.options.update_both"),
        (
            {"strategy": {"name": "heterossfl", "options": {"aggregate_target": True}}},
            r"^strategy.options.aggregate_target: not supported by strategy 'heterossfl'",
        ),
        ({"strategy": {"name": "heterossfl", "options": {"rad_batch_size": 2}}}, r"^strategy.options.rad_batch"),
        (
            {"strategy": {"name": "heterossfl", "options": {"kernel_encoding": "int8"}}},
            r"^strategy.options.kernel_encoding",
        ),
        (
            {"strategy": {"name": "heterossfl", "options": {"kernel_normalization": "l1"}}},
            r"^strategy.options.kernel_normalization",
        ),
        ({"strategy": {"name": "heterossfl", "options": {"bn_mode": "frozen"}}}, r"^strategy.options.bn_mode"),
        (
            {"strategy": {"name": "heterossfl", "options": {"initial_kernels": "zero"}}},
            r"^strategy.options.initial_kernels",
        ),
        (
            {"model": {**base["model"], "client_arch_pool": ["resnet18", "resnet34"]}},
            r"^model.client_arch_pool: cannot be combined",
        ),
        (
            {"model": {"arch": "resnet18", "client_arch_pool": ["resnet18", "resnet99"]}},
            r"^model.client_arch_pool: unknown architecture 'resnet99'",
        ),
        (
            {"strategy": {"name": "fedssl"}, "model": {"arch": "resnet18", "client_arch_pool": ["resnet34"]}},
            r"^model.client_archs: strategy 'fedssl' averages weights",
        ),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_experiment(write(tmp_path, {**base, **change}))


def test_architectures_drawn_from_the_pool_with_the_seed():
    def archs(seed):
        cfg = ExperimentConfig.from_dict(
            {"seed": seed, "federation": {"num_clients": 20}, "model": {"client_arch_pool": ["resnet18", "resnet34"]}}
        )
        return [cfg.client_arch(i) for i in range(20)]

    assert archs(0) == archs(0)  # the server and every client draw the same list
    assert archs(0) != archs(1)
    assert set(archs(0)) == {"resnet18", "resnet34"}


def test_without_alignment_a_client_trains_exactly_as_local_ssl():
    """mu = 0: the same initial weights, data order and steps as `strategy: local`, so any difference between the
    two strategies' encoders comes from the alignment term alone."""
    cfg = tiny()
    rad = public_images(cfg)
    opts = {**OPTIONS, "mu": 0.0, "rad_forward_batch": 16}
    for pid in (0, 1):
        hetero = kernel_round(
            cfg,
            client_images(cfg, pid),
            rad,
            None,
            None,
            server_round=1,
            partition_id=pid,
            lr=0.05,
            rad_digest=images_digest(rad),
            options=opts,
        )
        kbar = encode_kernel(decode_kernel(hetero.payload, len(rad)), "dense-fp32")
        hetero = kernel_round(
            cfg,
            client_images(cfg, pid),
            rad,
            kbar,
            hetero.client_state,
            server_round=2,
            partition_id=pid,
            lr=0.05,
            rad_digest=images_digest(rad),
            options=opts,
        )
        local = train_local_ssl(
            cfg, client_images(cfg, pid), {}, None, server_round=1, partition_id=pid, lr=0.05, rule="local"
        )
        local = train_local_ssl(
            cfg,
            client_images(cfg, pid),
            {},
            local.client_state,
            server_round=2,
            partition_id=pid,
            lr=0.05,
            rule="local",
        )
        assert not hetero.info["aligned"]
        for key, value in local.local_state.items():
            np.testing.assert_allclose(hetero.client_state[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
