"""Local-training options, each run with and checked by its effect: drop_last, several local epochs, AdamW, a
non-finite loss, and the fast path's precision choice by device capability.

``train_ssl`` is driven with a tiny recording method (a linear encoder on 16x16 images) that notes the batch size and
the autocast state of every step; the options that come from the experiment config are also run through
``client_app.rounds.weights.train_local_ssl`` on a width-0.125 ResNet, so the config really reaches the loop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from client_app.rounds.weights import train_local_ssl
from ssl_models import training
from ssl_models.config import ExperimentConfig
from ssl_models.data.splits import client_images
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.methods import SSLMethod
from ssl_models.training import FastPath, fast_path_for, make_optimizer, train_ssl


class Recorder(SSLMethod):
    """A linear encoder whose training_step records (batch size, autocast on, autocast dtype) of every call."""

    name = "recorder"

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 6)), 6)
        self.projector = nn.Linear(6, 4)
        self.calls: list[tuple[int, bool, torch.dtype]] = []

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        self.calls.append((int(view1.shape[0]), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        z1, z2 = self.projector(self.backbone(view1)), self.projector(self.backbone(view2))
        return ((z1.float() - z2.float()) ** 2).mean()


def images(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(n, 16, 16, 3), dtype=np.uint8)


def run(n: int, **kwargs) -> tuple[Recorder, training.TrainStats]:
    method = Recorder()
    options = {"epochs": 1, "batch_size": 8, "lr": 0.01, "fast_path": False, **kwargs}
    return method, train_ssl(method, images(n), **options)


# ---------------------------------------------------------------------------------------------- drop_last, epochs
def test_drop_last_drops_the_partial_batch_and_keeps_it_otherwise() -> None:
    method, stats = run(20, drop_last=True)
    assert [c[0] for c in method.calls] == [8, 8] and stats.steps == 2
    method, stats = run(20, drop_last=False)
    assert [c[0] for c in method.calls] == [8, 8, 4] and stats.steps == 3
    method, stats = run(17, drop_last=False)  # a last batch of one image cannot form pairs: skipped
    assert [c[0] for c in method.calls] == [8, 8] and stats.steps == 2


def test_several_local_epochs_repeat_the_pass_over_the_images() -> None:
    seen = []
    method, stats = run(20, epochs=3, drop_last=False, epoch_hook=lambda _m, epoch: seen.append(epoch))
    assert [c[0] for c in method.calls] == [8, 8, 4] * 3 and stats.steps == 9
    assert seen == [0, 1, 2]
    method, stats = run(20, epochs=3, drop_last=False, max_steps_per_epoch=2)
    assert [c[0] for c in method.calls] == [8, 8] * 3 and stats.steps == 6


CFG = {
    "rounds": 1,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 16, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "byol", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8, "pred_hidden_dim": 16}},
    "federation": {"num_clients": 2},
}


def config(**train) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**CFG, "train": {"fast_path": False, "batch_size": 20, **train}})


def local_round(cfg: ExperimentConfig, lr: float = 0.05):
    model = build_ssl_model(cfg, seed=cfg.seed)
    glob = state_to_numpy(split_state(model, model.shared_prefixes())[0])
    return glob, train_local_ssl(cfg, client_images(cfg, 0), glob, None, server_round=1, partition_id=0, lr=lr)


@pytest.mark.parametrize(("drop_last", "local_epochs", "steps"), [(True, 1, 2), (False, 1, 3), (False, 2, 6)])
def test_drop_last_and_local_epochs_from_the_config_reach_the_client_loop(drop_last, local_epochs, steps) -> None:
    cfg = config(drop_last=drop_last, local_epochs=local_epochs)
    assert len(client_images(cfg, 0)) == 48  # 48 images in batches of 20: 2 full batches and 8 left over
    _, result = local_round(cfg)
    assert result.stats.steps == steps and result.stats.num_examples == 48


# ---------------------------------------------------------------------------------------------- AdamW
def test_make_optimizer_builds_adamw_with_decoupled_weight_decay() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = make_optimizer([p], "adamw", lr=0.1, weight_decay=0.25)
    assert opt.param_groups[0]["decoupled"] and opt.param_groups[0]["weight_decay"] == 0.25
    assert not make_optimizer([p], "adam", lr=0.1).param_groups[0]["decoupled"]
    # where a GradScaler drives the step: torch.optim's own
    opt = make_optimizer([p], "adamw", lr=0.1, weight_decay=0.25, lean=False)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.25
    assert type(make_optimizer([p], "adam", lr=0.1, lean=False)) is torch.optim.Adam
    with pytest.raises(ValueError, match=r"optimizer: unknown name 'lamb' \(valid: sgd, adam, adamw\)"):
        make_optimizer([p], "lamb", lr=0.1)


def _unit_step_fraction(optimizer: str, lr: float, wd: float) -> float:
    """Share of the projector's output weights whose first update is lr * (wd * w + (+-1 or 0)): AdamW's first
    step (decoupled decay, then m/sqrt(v) = sign(g)); Adam folds the decay into g and SGD scales g."""
    cfg = config(optimizer=optimizer, weight_decay=wd, max_steps_per_epoch=1, local_epochs=1)
    glob, result = local_round(cfg, lr=lr)
    key = "projector.3.weight"
    w0, w1 = glob[key].astype(np.float64), result.shared_state[key].astype(np.float64)
    step = (w0 * (1 - lr * wd) - w1) / lr  # AdamW: sign(g), i.e. +-1 (0 where g = 0)
    return float(np.mean((np.abs(np.abs(step) - 1) < 1e-2) | (np.abs(step) < 1e-4)))


def test_adamw_from_the_config_takes_a_decoupled_decay_step() -> None:
    assert "projector.3.weight" in state_to_numpy(build_ssl_model(config(), seed=0).state_dict())
    assert _unit_step_fraction("adamw", lr=1e-3, wd=2.0) > 0.99
    assert _unit_step_fraction("adam", lr=1e-3, wd=2.0) < 0.5  # the same check tells Adam's coupled decay apart


# ---------------------------------------------------------------------------------------------- non-finite loss
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_training_with_a_clear_error(bad: float) -> None:
    method = Recorder()
    hook = lambda _m: torch.tensor(bad)
    word = "nan" if math.isnan(bad) else "inf"
    before = [p.detach().clone() for p in method.parameters()]
    with pytest.raises(FloatingPointError, match=rf"^local SSL loss at epoch 1 step 1 became {word}$"):
        train_ssl(method, images(24), epochs=2, batch_size=8, lr=0.01, fast_path=False, loss_hook=hook)
    assert len(method.calls) == 1  # stopped at the first bad step, not after the epoch
    # and before that step touched the weights: nothing of the model is lost
    assert all(torch.equal(a, b) for a, b in zip(before, method.parameters()))


def test_a_non_finite_loss_in_a_later_step_names_that_step() -> None:
    method = Recorder()
    calls = []

    def hook(_m):
        calls.append(1)
        return torch.tensor(float("nan") if len(calls) == 5 else 0.0)

    with pytest.raises(FloatingPointError, match=r"^local SSL loss at epoch 2 step 2 became nan$"):
        train_ssl(method, images(24), epochs=3, batch_size=8, lr=0.01, fast_path=False, loss_hook=hook)


# ---------------------------------------------------------------------------------------------- precision
@pytest.fixture()
def capability(monkeypatch):
    """Set what the (fake) hardware supports: the GPU's bf16 ("native": Ampere or newer; "emulated": an older GPU
    where torch can create bf16 tensors but runs them without bf16 units; "none") and the CPU's native bf16 units."""

    import contextlib

    current = {"index": 0}  # torch.cuda's current device, switched by torch.cuda.device(...)

    @contextlib.contextmanager
    def cuda_device(device):
        index = device.index if isinstance(device, torch.device) else device
        previous = current["index"]
        current["index"] = previous if index is None else int(index)
        try:
            yield
        finally:
            current["index"] = previous

    def set_capability(cuda_bf16: str | dict = "none", cpu_bf16: bool = False) -> None:
        """``cuda_bf16``: one GPU's capability, or {index: capability} for a machine with several."""
        per_gpu = cuda_bf16 if isinstance(cuda_bf16, dict) else {0: cuda_bf16}

        def is_bf16_supported(including_emulation: bool = True) -> bool:  # torch.cuda's signature and default
            gpu = per_gpu[current["index"]]  # torch asks the current device
            return gpu == "native" or (including_emulation and gpu == "emulated")

        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
        monkeypatch.setattr(torch.cuda, "device", cuda_device)
        monkeypatch.setattr(training, "cpu_has_fast_bf16", lambda: cpu_bf16)

    return set_capability


@pytest.mark.parametrize(
    ("device", "cuda_bf16", "cpu_bf16", "expected"),
    [
        ("cuda", "native", False, FastPath(torch.bfloat16, True, False)),  # bf16 GPU: bf16, no scaler
        ("cuda", "emulated", True, FastPath(torch.float16, True, True)),  # older GPU (V100, T4): fp16 with a scaler
        ("cuda", "none", True, FastPath(torch.float16, True, True)),
        ("cpu", "native", True, FastPath(torch.bfloat16, True, False)),  # AMX / AVX512-BF16 CPU
        ("cpu", "native", False, FastPath(None, True, False)),  # other CPUs: fp32 (channels-last only)
    ],
)
def test_fast_path_precision_follows_device_capability(capability, device, cuda_bf16, cpu_bf16, expected) -> None:
    capability(cuda_bf16=cuda_bf16, cpu_bf16=cpu_bf16)
    chosen = fast_path_for(torch.device(device), True)
    assert chosen == expected
    assert chosen.precision == {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[expected.autocast_dtype]
    assert fast_path_for(torch.device(device), False) == FastPath(None, False, False)  # fast_path: false


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cuda:1", FastPath(torch.float16, True, True)),  # the older GPU the run was given: fp16 with a scaler
        ("cuda:0", FastPath(torch.bfloat16, True, False)),
        ("cuda", FastPath(torch.bfloat16, True, False)),  # no index: the current device (0)
    ],
)
def test_fast_path_asks_the_gpu_the_run_trains_on(capability, device, expected) -> None:
    capability(cuda_bf16={0: "native", 1: "emulated"})
    assert fast_path_for(torch.device(device), True) == expected


@pytest.mark.parametrize(("cpu_bf16", "autocast", "precision"), [(True, True, "bf16"), (False, False, "fp32")])
def test_train_ssl_runs_the_chosen_precision(capability, cpu_bf16, autocast, precision) -> None:
    capability(cpu_bf16=cpu_bf16)
    method, stats = run(16, fast_path=True)
    assert stats.precision == precision
    assert [c[1] for c in method.calls] == [autocast, autocast]
    if autocast:
        assert all(c[2] == torch.bfloat16 for c in method.calls)
    method, stats = run(16, fast_path=False)  # off: fp32 whatever the CPU
    assert stats.precision == "fp32" and not any(c[1] for c in method.calls)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("fpu sse avx2 amx_bf16 amx_tile", True), ("fpu sse avx512f avx512_bf16", True), ("fpu sse avx2 avx512f", False)],
)
def test_cpu_bf16_detection_reads_the_cpu_flags(monkeypatch, flags, expected) -> None:
    import io

    monkeypatch.setattr(
        training, "open", lambda *a, **k: io.StringIO(f"processor\t: 0\nflags\t\t: {flags}\n"), raising=False
    )
    training.cpu_has_fast_bf16.cache_clear()
    try:
        assert training.cpu_has_fast_bf16() is expected
    finally:
        monkeypatch.undo()
        training.cpu_has_fast_bf16.cache_clear()
