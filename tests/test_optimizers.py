"""The project's SGD / Adam / AdamW (ssl_models.optimizers) against torch.optim, step by step, and the reason they
exist: a training step in a new process without torch._dynamo imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ssl_models.optimizers import SGD, Adam, build_local_optimizer

REPO = Path(__file__).resolve().parents[1]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {"body": nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)), "side": nn.Linear(6, 4)}
    )  # used on odd steps only: a parameter skipped in some steps


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + step))
    out = model["body"](x)
    if step % 2:
        out = out + model["side"](x)
    return (out**2).mean()


@pytest.mark.parametrize(
    "name, theirs, kwargs",
    [
        ("sgd", torch.optim.SGD, {"momentum": 0.9, "weight_decay": 5e-4}),
        ("sgd", torch.optim.SGD, {"momentum": 0.0, "weight_decay": 0.0}),
        ("adam", torch.optim.Adam, {"weight_decay": 1e-4}),
        ("adamw", torch.optim.AdamW, {"weight_decay": 0.05}),
    ],
)
def test_every_step_matches_torch_optim(name, theirs, kwargs):
    ours_model, ref_model = _model(0), _model(0)
    momentum = kwargs.get("momentum", 0.9)
    ours = build_local_optimizer(
        ours_model.parameters(), name, lr=0.05, momentum=momentum, weight_decay=kwargs["weight_decay"]
    )
    ref = theirs(ref_model.parameters(), lr=0.05, **kwargs)
    for step in range(6):
        if step == 4:  # the training loop changes the learning rate between rounds through param_groups
            ours.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.02
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad(set_to_none=True)
            _loss(model, step).backward()
            opt.step()
        for (key, a), b in zip(ours_model.state_dict().items(), ref_model.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{name} step {step}: {key}")


def test_a_parameter_without_gradient_keeps_its_value_and_state():
    model = _model(0)
    opt = Adam(model.parameters(), lr=0.1)
    before = model["side"].weight.detach().clone()
    _loss(model, 0).backward()  # step 0 does not use "side"
    opt.step()
    assert torch.equal(model["side"].weight, before) and model["side"].weight not in opt.state
    assert opt.state[model["body"][0].weight]["step"] == 1


def test_bad_hyper_parameters_are_named():
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="lr must be >= 0"):
        SGD(p, lr=-1.0)
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer: unknown name 'lamb'"):
        build_local_optimizer(p, "lamb", lr=0.1)


def test_a_training_step_in_a_new_process_does_not_import_dynamo(tmp_path):
    """What a deployed ClientApp does per message, as far as torch goes: build a model, train one step."""
    code = (
        "import sys, numpy as np\n"
        "from ssl_models.config import ExperimentConfig\n"
        "from ssl_models.factory import build_ssl_model\n"
        "from ssl_models.training import train_ssl\n"
        "cfg = ExperimentConfig.from_dict({'model': {'arch': 'resnet18', 'width': 0.125}, 'method': {'name': 'byol'}})\n"
        "m = build_ssl_model(cfg, seed=0)\n"
        "x = np.random.default_rng(0).integers(0, 255, (8, 32, 32, 3), dtype=np.uint8)\n"
        "for opt in ('sgd', 'adamw'):\n"
        "    train_ssl(m, x, epochs=1, batch_size=4, lr=0.01, optimizer=opt)\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dynamo imported: False" in out.stdout, out.stdout
