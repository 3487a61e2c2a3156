"""The CUDA paths: bf16 autocast, fp16 with a gradient scaler, channels-last, the augmentation on the GPU against the
CPU, the CUDA peak-memory accounting, and the ClientApp's training and the server's evaluation placed on ``cuda``.

Every GPU test is marked ``cuda`` and skips without a CUDA device (CI has none); the GPU campaign's correctness stage
runs them (``pytest -m cuda tests/test_cuda.py``, fedssl_gpu/campaign.py), where a skip counts as a failure. Each
test's body is a ``check_*(device)`` helper that also runs on the CPU (with the CPU's own expectations), so that the
code the GPU runs has been run. Models and data are tiny: every test takes seconds on a GPU. The Flower apps are
imported inside the tests that use them, so this file collects wherever torch imports.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from ssl_models.config import ExperimentConfig
from ssl_models.data.augment import SSLAugment
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone
from ssl_models.training import FastPath, TrainStats, fast_path_for, train_ssl

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REPO = Path(__file__).resolve().parents[1]

BATCH = 16
STEPS = 4
TINY_SIMCLR = {"proj_hidden_dim": 32, "proj_out_dim": 16}


def random_images(num: int = BATCH * STEPS, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num, 32, 32, 3), dtype=np.uint8)


def tiny_simclr() -> nn.Module:
    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", 0.125)
    return build_method("simclr", backbone, dim, **TINY_SIMCLR)


class ConvOutputs:
    """Forward hooks on every convolution of a module: the dtype and memory format of each output, the last step's."""

    def __init__(self, module: nn.Module) -> None:
        self.convs = {name: m for name, m in module.named_modules() if isinstance(m, nn.Conv2d)}
        self.outputs: dict[str, tuple[torch.dtype, bool, bool]] = {}
        self.handles = [m.register_forward_hook(self.hook(name)) for name, m in self.convs.items()]

    def hook(self, name: str):
        def record(_module, _inputs, output: torch.Tensor) -> None:
            self.outputs[name] = (
                output.dtype,
                output.is_contiguous(memory_format=torch.channels_last),
                output.is_contiguous(),
            )

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def train_tiny(
    device: str, fast_path: bool, steps: int = STEPS
) -> tuple[nn.Module, TrainStats, ConvOutputs, dict[str, torch.Tensor]]:
    """A few steps of a tiny SimCLR on ``device``: (the method, its stats, its convolutions' outputs, its parameters
    before training)."""
    method = tiny_simclr()
    before = {k: p.detach().clone() for k, p in method.named_parameters()}
    convs = ConvOutputs(method.backbone)
    try:
        stats = train_ssl(
            method,
            random_images(BATCH * steps),
            epochs=1,
            batch_size=BATCH,
            lr=0.05,
            device=device,
            fast_path=fast_path,
            seed=0,
        )
    finally:
        convs.remove()
    return method, stats, convs, before


def changed_weights(method: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The parameters an optimizer step moved (not BatchNorm's statistics, which every forward moves)."""
    after = dict(method.named_parameters())
    return [k for k, v in before.items() if not torch.equal(after[k].detach().cpu(), v)]


# ---------------------------------------------------------------------------------------------------- autocast
def check_autocast_training(device: str, expected: FastPath) -> None:
    """The fast path's choice on ``device`` is ``expected``; a few steps train there in that precision."""
    assert fast_path_for(torch.device(device), True) == expected
    method, stats, convs, before = train_tiny(device, fast_path=True)
    assert stats.steps == STEPS and math.isfinite(stats.loss)
    assert stats.precision == expected.precision
    assert all(p.device.type == torch.device(device).type for p in method.parameters())
    conv_dtypes = {dtype for dtype, _, _ in convs.outputs.values()}
    assert conv_dtypes == {expected.autocast_dtype or torch.float32}, conv_dtypes  # the matrix work ran in it
    assert changed_weights(method, before)


@pytest.mark.cuda
@needs_cuda
def test_the_fast_path_trains_in_bf16_autocast_without_a_scaler_on_a_bf16_gpu():
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.fail(f"{torch.cuda.get_device_name()} has no native bf16: this test expects an Ampere or newer GPU")
    check_autocast_training("cuda", FastPath(torch.bfloat16, channels_last=True, grad_scaler=False))


# ---------------------------------------------------------------------------------------------------- fp16 + scaler
class CountingScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that counts its calls: proof that the training loop stepped through it."""

    made: ClassVar[list[CountingScaler]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initial_scale = self.get_scale()  # before its first scale(): the initial one
        self.calls: Counter[str] = Counter()
        CountingScaler.made.append(self)

    def scale(self, outputs):
        self.calls["scale"] += 1
        return super().scale(outputs)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


def check_fp16_training_with_a_scaler(device: str, monkeypatch) -> None:
    """With the fp16 path forced (the caller makes ``fast_path_for`` choose it): every step went through one
    GradScaler, its scale stayed finite, the loss stayed finite and the weights moved."""
    CountingScaler.made.clear()
    monkeypatch.setattr(torch.amp, "GradScaler", CountingScaler)
    assert fast_path_for(torch.device(device), True) == FastPath(torch.float16, True, True)
    steps = 8
    method, stats, convs, before = train_tiny(device, fast_path=True, steps=steps)
    assert stats.precision == "fp16" and stats.steps == steps and math.isfinite(stats.loss)
    assert len(CountingScaler.made) == 1
    scaler = CountingScaler.made[0]
    assert scaler.calls == {"scale": steps, "step": steps, "update": steps}
    # Every overflowing step is skipped and halves the scale (which grows only after 2000 good steps): fewer halvings
    # than steps means that some steps were taken.
    scale, initial = scaler.get_scale(), scaler.initial_scale
    assert math.isfinite(scale) and initial / 2 ** (steps - 1) <= scale <= initial, (scale, initial)
    assert {dtype for dtype, _, _ in convs.outputs.values()} == {torch.float16}
    assert changed_weights(method, before)


@pytest.mark.cuda
@needs_cuda
def test_a_gpu_without_native_bf16_trains_in_fp16_through_a_gradient_scaler(monkeypatch):
    # What an older GPU (V100, T4) says; the scaler's own arithmetic runs on this one.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    check_fp16_training_with_a_scaler("cuda", monkeypatch)


# ---------------------------------------------------------------------------------------------------- channels-last
def check_channels_last(device: str) -> None:
    """On the fast path the convolution weights and every convolution's output are channels-last; in plain fp32
    they are not (so the check can tell the two apart)."""
    _method, _, convs, _ = train_tiny(device, fast_path=True, steps=2)
    assert convs.outputs and set(convs.outputs) == set(convs.convs)
    assert all(channels_last for _, channels_last, _ in convs.outputs.values()), convs.outputs
    stem = next(iter(convs.outputs))  # the first convolution: 3 -> C channels at 32x32, so the formats differ
    assert not convs.outputs[stem][2]
    weights = [m.weight for m in convs.convs.values()]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert any(not w.is_contiguous() for w in weights)  # 3x3 kernels over several channels: really permuted

    _, _, plain, _ = train_tiny(device, fast_path=False, steps=2)
    assert all(contiguous for _, _, contiguous in plain.outputs.values())
    assert not plain.outputs[stem][1]


@pytest.mark.cuda
@needs_cuda
def test_the_fast_path_keeps_convolutions_channels_last_on_the_gpu():
    check_channels_last("cuda")


# ---------------------------------------------------------------------------------------------------- augmentation
AUGMENT_RECIPES = {  # the project's default, EasyFL's strong jitter (FedEMA), the LW-FedSSL recipe with blur
    "default": None,
    "fedema": "configs/fedema/fedbyol.yaml",
    "lwfedssl (blur)": "configs/lwfedssl/lwfedssl.yaml",
}


def augment_recipe(name: str) -> SSLAugment:
    path = AUGMENT_RECIPES[name]
    if path is None:
        return SSLAugment()
    return SSLAugment.from_config(ExperimentConfig.from_yaml(REPO / path).augment, 32)


def check_augmentation_matches_the_cpu(device: str, atol: float) -> dict[str, float]:
    """Both views of every recipe, drawn from equally seeded CPU generators, on ``device`` and on the CPU: equal
    within ``atol``. Returns the largest difference per recipe."""
    images = torch.from_numpy(random_images(64, seed=1))
    worst = {}
    for name in AUGMENT_RECIPES:
        augment = augment_recipe(name)
        on_cpu = augment.two_views(images, generator=torch.Generator().manual_seed(7))
        on_device = augment.two_views(images.to(device), generator=torch.Generator().manual_seed(7))
        worst[name] = 0.0
        for expected, got in zip(on_cpu, on_device):
            assert got.device.type == torch.device(device).type and got.dtype == torch.float32
            torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
            worst[name] = max(worst[name], float((got.cpu() - expected).abs().max()))
    return worst


@pytest.mark.cuda
@needs_cuda
def test_gpu_augmentation_equals_the_cpus_for_the_same_cpu_generator(monkeypatch):
    # The random draws come from the CPU generator on both sides, so only float arithmetic differs. In plain float32
    # (no TF32 in the blur's convolutions) that is rounding: 1e-4 is far above it.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    check_augmentation_matches_the_cpu("cuda", atol=1e-4)
    monkeypatch.undo()
    # With torch's defaults (cuDNN convolutions in TF32, a 10-bit mantissa) the blurred views stay within one 8-bit
    # grey level of the CPU's: below the images' own quantisation.
    check_augmentation_matches_the_cpu("cuda", atol=1 / 255)


# ---------------------------------------------------------------------------------------------------- peak memory
def layerwise_experiment(device: str) -> ExperimentConfig:
    """A LW-FedSSL round big enough that the analytic memory (hundreds of MB) dwarfs the fixed costs (cuBLAS
    workspace, the images, the augmentation's buffers): a width-1 ViT at batch 256, fp32 (the analytic count is
    fp32, hardware-independent), both blocks training, two local epochs of one step (270 images per client)."""
    from server_app.experiment import load_experiment

    return load_experiment(
        {
            "config": "configs/smoke-lwfedssl.yaml",
            "data.dataset": "synthetic",
            "data.synthetic_train": 600,
            "model.width": 1.0,
            "train.batch_size": 256,
            "train.local_epochs": 2,
            "train.fast_path": False,
            "train.device": device,
        }
    )[0]


def check_layerwise_round_accounts_memory(device: str) -> dict:
    """A layer-wise client round on ``device`` with its resource accounting: returns its info (analytic memory
    ``mem_*``, and on CUDA ``cuda_peak_bytes``)."""
    from client_app.rounds.layerwise import layerwise_round
    from ssl_models.data.splits import client_images
    from ssl_models.federated.layerwise import build_layerwise_model, online_state

    cfg = layerwise_experiment(device)
    images = client_images(cfg, 0)
    assert len(images) >= cfg.train.batch_size
    state = online_state(build_layerwise_model(cfg, 2, seed=0))
    plan = {"stage": 2, "trainable": "all", "alpha": 0.0, "accounting": True}
    result = layerwise_round(cfg, images, state, None, server_round=3, partition_id=0, lr=1e-3, plan=plan)
    info = result.info
    assert result.stats.steps == 2 and math.isfinite(result.stats.loss)
    assert info["mem_total"] > info["mem_activations"] > 0 and info["mem_batch"] == cfg.train.batch_size
    return info


@pytest.mark.cuda
@needs_cuda
def test_the_clients_cuda_peak_memory_is_of_the_order_of_the_analytic_count():
    info = check_layerwise_round_accounts_memory("cuda")
    peak, analytic = info["cuda_peak_bytes"], info["mem_total"]
    persistent = info["mem_parameters"] + info["mem_gradients"] + info["mem_optimizer_state"]
    figures = {
        k: f"{v / 2**20:.1f} MiB"
        for k, v in info.items()
        if k.startswith("mem_") and k != "mem_batch" or k == "cuda_peak_bytes"
    }
    assert peak >= persistent, figures  # weights, their gradients and AdamW's two moments all live on the GPU
    assert 0.5 <= peak / analytic <= 2.0, figures  # the same step, measured by the allocator and counted


# ---------------------------------------------------------------------------------------------------- the ClientApp
TINY_CLIENT = {
    "rounds": 1,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "byol", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2, "fast_path": True},
}


def check_clientapp_trains_on(device: str) -> tuple[dict, dict, int]:
    """One ``train`` message through the ClientApp with ``train.device: device``: (its metrics, its client-info, the
    bytes of the weights it was sent)."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from client_app.app import CLIENT_INFO_RECORD, app
    from fedssl_wire import from_array_record, to_array_record
    from ssl_models.factory import build_ssl_model, split_state, state_to_numpy

    cfg = ExperimentConfig.from_dict({**TINY_CLIENT, "train": {**TINY_CLIENT["train"], "device": device}})
    model = build_ssl_model(cfg, seed=123)
    arrays = state_to_numpy(split_state(model, model.shared_prefixes())[0])
    context = Context(
        run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(), run_config={}
    )
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1  # as Flower sets it per task
    try:
        message = Message(
            RecordDict(
                {
                    "arrays": to_array_record(arrays),
                    "config": ConfigRecord({"experiment": cfg.to_json(), "server-round": 1, "lr": 0.05}),
                }
            ),
            dst_node_id=5,
            message_type="train",
        )
        reply = app(message, context)
    finally:
        TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None
    assert not reply.has_error(), reply.error
    assert set(from_array_record(reply.content["arrays"])) == set(arrays)
    metrics = dict(reply.content["metrics"])
    assert metrics["steps"] == 2 and math.isfinite(metrics["train_loss"])
    return metrics, dict(reply.content[CLIENT_INFO_RECORD]), sum(v.nbytes for v in arrays.values())


@pytest.mark.cuda
@needs_cuda
def test_the_clientapp_trains_on_cuda_when_the_experiment_says_so(monkeypatch):
    monkeypatch.setenv("FEDSSL_RESOURCE_CACHE", "off")
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)  # a deployed ClientApp, as the campaign runs it
    allocated_before = torch.cuda.memory_stats().get("allocated_bytes.all.allocated", 0)  # cumulative, never falls
    metrics, where, weight_bytes = check_clientapp_trains_on("cuda")
    assert where["device"].startswith("cuda:") and torch.cuda.get_device_name() in where["device"], where
    assert [k for k in metrics if k.startswith("precision.")] == ["precision.bf16"]
    assert metrics["res.flops_total"] > 0
    # the round's work went through the GPU's allocator: at least the weights it was sent, moved there to train
    assert torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - allocated_before > weight_bytes


# ---------------------------------------------------------------------------------------------------- server eval
TINY_EVAL = {
    "data": {"dataset": "synthetic", "synthetic_train": 300, "synthetic_test": 100, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "simclr", "options": TINY_SIMCLR},
    "federation": {"num_clients": 2},
    "eval": {"knn_k": 20, "probe_epochs": 5, "max_train": 256, "max_test": 96},
}


def check_server_evaluation_on(device: str) -> tuple[dict, dict]:
    """The server's evaluator with ``eval.device: device`` scoring the initial global model: (its scores, the
    features of the protocol's first step from its encoder, as placed by the evaluation)."""
    from fedssl_wire import to_array_record
    from server_app.app import ServerEvaluator
    from ssl_models.evaluation.protocol import evaluate_backbone
    from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
    from strategies.fedssl import ModelToEvaluate

    cfg = ExperimentConfig.from_dict({**TINY_EVAL, "eval": {**TINY_EVAL["eval"], "device": device}})
    evaluator = ServerEvaluator(cfg)
    assert evaluator.device.type == device
    model = build_ssl_model(cfg, seed=cfg.seed)
    arrays = to_array_record(state_to_numpy(split_state(model, model.shared_prefixes())[0]))
    scores = evaluator.evaluate(ModelToEvaluate(cfg.model.arch, arrays), knn=True, linear=True)
    backbone = evaluator.models[(cfg.model.arch, None)].backbone
    assert all(p.device.type == device for p in backbone.parameters())  # the evaluation moved the encoder there
    assert 0.0 <= scores["knn_acc"] <= 1.0 and 0.0 <= scores["linear_probe_acc"] <= 1.0
    assert scores["num_train"] == 256 and scores["num_test"] == 96
    features = evaluate_backbone(
        backbone,
        evaluator.x_train,
        evaluator.y_train,
        evaluator.x_test,
        evaluator.y_test,
        evaluator.num_classes,
        device=device,
        knn=False,
        linear=False,
        return_features=True,
    )
    return scores, features


@pytest.mark.cuda
@needs_cuda
def test_the_server_evaluates_on_cuda_as_on_the_cpu(monkeypatch):
    # fp32 convolutions on both sides, so that the features differ by rounding only (not TF32's 10-bit mantissa)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    on_gpu, gpu_features = check_server_evaluation_on("cuda")
    on_cpu, cpu_features = check_server_evaluation_on("cpu")
    for split in ("train_features", "test_features"):
        torch.testing.assert_close(gpu_features[split], cpu_features[split], rtol=1e-3, atol=1e-4)
    # Equal features up to rounding: the kNN votes and the probe's predictions can differ only on a near-tie.
    num_test = on_cpu["num_test"]
    assert abs(on_gpu["knn_acc"] - on_cpu["knn_acc"]) <= 1 / num_test + 1e-9, (on_gpu, on_cpu)
    assert abs(on_gpu["linear_probe_acc"] - on_cpu["linear_probe_acc"]) <= 2 / num_test + 1e-9, (on_gpu, on_cpu)


# ---------------------------------------------------------------------------------------------------- this file
@pytest.mark.cuda
def test_every_test_here_is_marked_cuda_and_every_gpu_test_skips_without_cuda():
    """``pytest -m cuda`` selects exactly this file's tests, and each GPU test skips on a machine without CUDA."""
    tests = {name: fn for name, fn in globals().items() if name.startswith("test_") and callable(fn)}
    for name, fn in tests.items():
        marks = {mark.name: mark for mark in getattr(fn, "pytestmark", [])}
        assert "cuda" in marks, f"{name} is not marked cuda"
        if fn is test_every_test_here_is_marked_cuda_and_every_gpu_test_skips_without_cuda:
            assert "skipif" not in marks  # runs everywhere: the one test here that CI runs
            continue
        skip = marks.get("skipif")
        assert skip is not None and skip.args == (not torch.cuda.is_available(),), f"{name} does not skip without CUDA"
        assert skip.kwargs["reason"] == "needs a CUDA device"
