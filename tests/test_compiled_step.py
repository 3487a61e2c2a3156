"""The compiled training step (``train.compile`` / ``train_ssl(compile_backend=...)``) and its eager fallback.

Compilation with inductor takes minutes on a 2-core CPU, so these tests use torch.compile's "eager" backend (the
graph is captured by Dynamo and run as captured) and a failing ``torch.compile``: what they check is the wiring, that
a compiled step trains the same model as the eager one, and that any failure falls back to eager training at once,
from the same step, saying why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ssl_models import training
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.methods import SSLMethod
from ssl_models.methods.losses import nt_xent_loss
from ssl_models.training import train_ssl


class TinySimCLR(SSLMethod):
    """A linear encoder with a projector and the NT-Xent loss: small enough for Dynamo to trace in a second."""

    name = "tiny-simclr"

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 8)), 8)
        self.projector = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        return nt_xent_loss(self.projector(self.backbone(view1)), self.projector(self.backbone(view2)), 0.5)


def images(n: int = 32) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)


def train(method: SSLMethod, backend: str | None, log=None):
    return train_ssl(
        method,
        images(),
        epochs=2,
        batch_size=8,
        lr=0.05,
        optimizer="sgd",
        fast_path=False,
        seed=3,
        compile_backend=backend,
        log=log,
    )


def weights(method: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in method.parameters()]


def test_eager_by_default_and_says_so():
    stats = train(TinySimCLR(), None)
    assert stats.compiled is False and stats.compile_fallback is None


def test_compiled_step_trains_the_same_model_as_the_eager_one():
    torch._dynamo.reset()
    eager, compiled = TinySimCLR(), TinySimCLR()
    s_eager = train(eager, None)
    s_compiled = train(compiled, "eager")
    assert s_compiled.compiled is True and s_compiled.compile_fallback is None
    assert s_compiled.steps == s_eager.steps == 8
    assert s_compiled.loss == pytest.approx(s_eager.loss, rel=1e-5)
    for a, b in zip(weights(eager), weights(compiled)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_compiler_that_fails_on_the_first_step_falls_back_to_eager_training(monkeypatch):
    calls = []

    def broken_compile(fn, backend=None):
        def run(*args):
            calls.append(backend)
            raise RuntimeError("InductorError: CppCompileError: C++ compile error\nlong compiler output")

        return run

    monkeypatch.setattr(training.torch, "compile", broken_compile)
    messages: list[str] = []
    reference, method = TinySimCLR(), TinySimCLR()
    s_ref = train(reference, None)
    stats = train(method, "inductor", log=messages.append)
    assert calls == ["inductor"]  # tried once, then never again in this loop
    assert stats.compiled is False
    assert stats.compile_fallback == "RuntimeError: InductorError: CppCompileError: C++ compile error"
    assert sum("torch.compile (backend inductor) failed, training eagerly" in m for m in messages) == 1
    # nothing was lost: the same steps, the same final weights as an eager run
    assert stats.steps == s_ref.steps and stats.loss == pytest.approx(s_ref.loss, rel=1e-6)
    for a, b in zip(weights(reference), weights(method)):
        torch.testing.assert_close(a, b)


def test_torch_compile_itself_raising_also_falls_back(monkeypatch):
    def unavailable(fn, backend=None):
        raise RuntimeError(f"backend {backend!r} is not available")

    monkeypatch.setattr(training.torch, "compile", unavailable)
    stats = train(TinySimCLR(), "inductor")
    assert stats.compiled is False and stats.steps == 8
    assert stats.compile_fallback == "RuntimeError: backend 'inductor' is not available"


def test_train_compile_is_a_validated_config_switch():
    assert ExperimentConfig.from_dict({}).train.compile is False
    assert ExperimentConfig.from_dict({"train": {"compile": True}}).train.compile is True
    with pytest.raises(ConfigError, match="train.compile"):
        ExperimentConfig.from_dict({"train": {"compile": "yes"}})


def test_the_client_passes_the_switch_to_the_loop(monkeypatch):
    from client_app.rounds import weights

    seen = {}

    def fake_train_ssl(method, images, **kwargs):
        seen["backend"] = kwargs["compile_backend"]
        raise StopIteration  # enough: the loop was reached with the switch

    monkeypatch.setattr(weights, "train_ssl", fake_train_ssl)
    for flag, backend in ((False, None), (True, "inductor")):
        cfg = ExperimentConfig.from_dict({"train": {"compile": flag}})
        with pytest.raises(StopIteration):
            weights.local_training(cfg, TinySimCLR(), images(), lr=0.1, seed=0, device=torch.device("cpu"))
        assert seen["backend"] == backend


class BrokenBackward(torch.autograd.Function):
    """Identity forward whose backward raises, as a compiled backward that fails to build would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("CppCompileError: backward kernel failed to build")


def test_a_backward_that_fails_on_the_first_step_also_falls_back(monkeypatch):
    """The failure surfaces in ``loss.backward()``, after the (compiled) forward ran: the step is redone eagerly
    with the buffers as they were (here BatchNorm's running statistics), so nothing differs from an eager run."""

    class WithBatchNorm(TinySimCLR):
        def __init__(self) -> None:
            super().__init__()
            self.projector = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))

    def compile_with_broken_backward(fn, backend=None):
        return lambda v1, v2: BrokenBackward.apply(fn(v1, v2))

    reference = WithBatchNorm()
    train(reference, None)
    monkeypatch.setattr(training.torch, "compile", compile_with_broken_backward)
    method = WithBatchNorm()
    stats = train(method, "inductor")
    assert stats.compiled is False and stats.compile_fallback.startswith("RuntimeError: CppCompileError")
    for (name, a), (_, b) in zip(reference.state_dict().items(), method.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)  # weights and BN running statistics alike
