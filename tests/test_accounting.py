"""Tests for FLOP and memory accounting (docs/methods/lwfedssl.md, Resource accounting): reference figures at full width, batch 2;
hand-computed memory on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ssl_models.accounting import (
    analytic_training_memory,
    backbone_training_flops,
    forward_flops,
    function_training_flops,
    optimizer_state_factor,
    process_peak_rss_bytes,
    reset_peak_rss,
    saved_activation_bytes,
    training_step_flops,
)
from ssl_models.methods import build_method
from ssl_models.networks import build_backbone

SHAPE = (3, 32, 32)


def rel_close(value: float, reference: float, tolerance: float = 0.01) -> bool:
    return abs(value - reference) <= tolerance * reference


# ---------------------------------------------------------------------------------------------- FLOPs
def test_vit_tiny_reference_flops() -> None:
    torch.manual_seed(0)
    vit, _ = build_backbone("vit_tiny")  # 12 blocks
    assert rel_close(forward_flops(vit, SHAPE) / 1e9, 0.6913)
    counts = backbone_training_flops(vit, SHAPE, batch_size=2)
    assert rel_close(counts["forward"] / 1e9, 0.6913)
    assert rel_close(counts["total"] / 1e9, 2.073)
    assert counts["total"] == counts["forward"] + counts["backward"]
    assert counts["fvcore_equivalent"] == counts["forward"] / 2


def test_cpu_attention_formula_adds_the_attention_matmuls() -> None:
    torch.manual_seed(0)
    vit, _ = build_backbone("vit_tiny", 0.0625, depth=3)
    plain = backbone_training_flops(vit, SHAPE)
    counted = backbone_training_flops(vit, SHAPE, count_cpu_attention=True)
    # per block and sample: QK^T and AV, 2 * 65 * 65 * D FLOPs each (D = 12 over 3 heads of 4)
    attention_forward = 3 * 2 * (2 * 65 * 65 * 12)
    assert counted["forward"] - plain["forward"] == attention_forward
    assert counted["backward"] - plain["backward"] == 2.5 * attention_forward  # five matmuls, as torch counts CUDA
    assert forward_flops(vit, SHAPE, count_cpu_attention=True) - forward_flops(vit, SHAPE) == attention_forward


def test_resnet18_reference_flops_and_frozen_layers() -> None:
    torch.manual_seed(0)
    resnet, _ = build_backbone("resnet18", 1.0)
    assert rel_close(forward_flops(resnet, SHAPE) / 1e9, 1.1108)
    counts = backbone_training_flops(resnet, SHAPE)
    assert rel_close(counts["forward"] / 1e9, 1.1108)
    assert rel_close(counts["total"] / 1e9, 3.329)
    # only layer4 trainable: the backward stops there (reference: 1.606 GFLOP)
    for name, parameter in resnet.named_parameters():
        parameter.requires_grad_(name.startswith("layer4."))
    assert rel_close(backbone_training_flops(resnet, SHAPE)["total"] / 1e9, 1.606)


def test_forward_flops_of_a_linear_layer_by_hand_and_mode_restored() -> None:
    layer = nn.Linear(5, 3).train()
    assert forward_flops(layer, (5,), batch_size=4) == 2 * 5 * 3
    assert layer.training
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        forward_flops(layer, (5,), batch_size=0)


class LinearSSL(nn.Module):
    """A stand-in SSL method: one linear map of each flattened view, loss = sum of squared outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(12, 4, bias=False)

    def training_step(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        return self.backbone(view1.flatten(1)).pow(2).sum() + self.backbone(view2.flatten(1)).pow(2).sum()


def test_training_step_flops_by_hand() -> None:
    counts = training_step_flops(LinearSSL(), view_shape=(3, 2, 2), batch_size=3)
    assert counts["forward"] == 2 * (2 * 12 * 4)  # two views per sample
    assert counts["backward"] == 2 * (2 * 12 * 4)  # weight gradients only: the views need none
    assert counts["total"] == 4 * (2 * 12 * 4) and counts["batch_size"] == 3


def test_function_training_flops_by_hand_and_the_module_untouched() -> None:
    model = nn.Sequential(nn.Linear(5, 4, bias=False), nn.Linear(4, 3, bias=False))
    before = [p.detach().clone() for p in model.parameters()]
    counts = function_training_flops(model, lambda m: m, (5,), batch_size=4)
    assert counts["forward"] == 2 * (5 * 4 + 4 * 3)
    # weight gradients of both layers, the input gradient of the second only (the input needs none)
    assert counts["backward"] == 2 * (5 * 4) + 2 * (4 * 3) + 2 * (4 * 3)
    assert all(p.grad is None for p in model.parameters())  # counted on a copy
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a part of the model: the first layer alone
    assert function_training_flops(model, lambda m: m[0], (5,))["total"] == 2 * (2 * 5 * 4)


def test_training_step_flops_leave_the_method_untouched_and_see_frozen_blocks() -> None:
    torch.manual_seed(0)
    backbone, dim = build_backbone("vit_tiny", 0.0625, depth=3)
    method = build_method("mocov3", backbone, dim, proj_hidden_dim=32, proj_out_dim=16, pred_hidden_dim=32)
    state_before = {k: v.clone() for k, v in method.state_dict().items()}
    full = training_step_flops(method, SHAPE, batch_size=2)
    assert full["forward"] > 0 and full["backward"] > 0
    assert all(p.grad is None for p in method.parameters())
    assert all(torch.equal(v, state_before[k]) for k, v in method.state_dict().items())

    method.backbone.set_trainable("last_block")
    layer_wise = training_step_flops(method, SHAPE, batch_size=2)
    assert layer_wise["forward"] == full["forward"]  # frozen blocks still run forward (online and target)
    assert layer_wise["backward"] < 0.7 * full["backward"]


# ---------------------------------------------------------------------------------------------- memory
def test_analytic_memory_of_a_tiny_linear_model_by_hand() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.rand(8, 4)
    param_bytes = (4 * 3 + 3 + 3 * 2 + 2) * 4  # 23 float32 parameters
    # saved: the input (first Linear's weight gradient) and the ReLU output (saved by ReLU and by the second
    # Linear: one storage, counted once); the weights saved by the Linears are parameters, not activations
    activation_bytes = 8 * 4 * 4 + 8 * 3 * 4
    adam = analytic_training_memory(model, "adam", (x,))
    assert adam == {
        "parameters": param_bytes,
        "buffers": 0,
        "gradients": param_bytes,
        "optimizer_state": 2 * param_bytes,
        "activations": activation_bytes,
        "total": 4 * param_bytes + activation_bytes,
    }
    assert analytic_training_memory(model, "adamw", (x,))["optimizer_state"] == 2 * param_bytes
    assert analytic_training_memory(model, "sgd", (x,))["optimizer_state"] == param_bytes
    assert analytic_training_memory(model, "sgd", (x,), sgd_momentum=0.0)["optimizer_state"] == 0
    with_weights = analytic_training_memory(model, "sgd", (x,), exclude_parameters=False)
    # plus the second weight matrix (saved for the input gradient; the first layer's input needs none)
    assert with_weights["activations"] == activation_bytes + 3 * 2 * 4

    model[0].requires_grad_(False)  # frozen first layer: no gradient, no state, and its input is not saved
    frozen = analytic_training_memory(model, "adam", (x,))
    trainable_bytes = (3 * 2 + 2) * 4
    assert frozen["parameters"] == param_bytes
    assert frozen["gradients"] == trainable_bytes and frozen["optimizer_state"] == 2 * trainable_bytes
    assert frozen["activations"] == 8 * 3 * 4
    assert all(p.grad is None for p in model.parameters())


def test_saved_activations_are_deduplicated_by_storage() -> None:
    x = torch.rand(5, requires_grad=True)
    counts = saved_activation_bytes(lambda: x * x)  # mul saves both operands: the same tensor twice
    assert counts == {"bytes": 5 * 4, "storages": 1, "saved_tensors": 2}
    y = torch.rand(4, 6, requires_grad=True)
    views = saved_activation_bytes(lambda: y[:2] * y[2:])  # two views of one storage: the storage once
    assert views["saved_tensors"] == 2 and views["storages"] == 1 and views["bytes"] == 4 * 6 * 4
    assert saved_activation_bytes(lambda: x * x, exclude=[x])["bytes"] == 0


def test_analytic_memory_of_layer_wise_vit_method() -> None:
    def method_with(depth: int, mode: str):
        torch.manual_seed(0)
        backbone, dim = build_backbone("vit_tiny", 0.0625, depth=depth)
        backbone.set_trainable(mode)
        return build_method("mocov3", backbone, dim, proj_hidden_dim=32, proj_out_dim=16, pred_hidden_dim=32)

    shallow = analytic_training_memory(method_with(2, "last_block"), "adamw", 4)
    deep = analytic_training_memory(method_with(4, "last_block"), "adamw", 4)
    full = analytic_training_memory(method_with(4, "all"), "adamw", 4)
    assert deep["activations"] == shallow["activations"]  # frozen blocks save nothing
    assert deep["gradients"] == shallow["gradients"] < full["gradients"]
    assert deep["parameters"] == full["parameters"] > shallow["parameters"]
    assert full["activations"] > 2 * deep["activations"]
    assert full["optimizer_state"] == 2 * full["gradients"]
    with pytest.raises(ValueError, match="optimizer_name must be one of"):
        analytic_training_memory(method_with(2, "all"), "lamb", 4)


def test_optimizer_state_factor() -> None:
    assert optimizer_state_factor("sgd") == 1 and optimizer_state_factor("sgd", 0.0) == 0
    assert optimizer_state_factor("adam") == optimizer_state_factor("adamw") == 2
    with pytest.raises(ValueError, match="optimizer_name must be one of"):
        optimizer_state_factor("rmsprop")


def test_process_peak_rss(tmp_path: Path) -> None:
    peak = process_peak_rss_bytes()
    if Path("/proc/self/status").is_file():
        assert isinstance(peak, int) and peak > 0
    status = tmp_path / "status"
    status.write_text("Name:\tpython3\nVmPeak:\t  900 kB\nVmHWM:\t    1234 kB\nVmRSS:\t 1000 kB\n")
    assert process_peak_rss_bytes(status) == 1234 * 1024
    assert process_peak_rss_bytes(tmp_path / "missing") is None
    assert reset_peak_rss(tmp_path / "no" / "such" / "clear_refs") is False


def test_measuring_a_step_keeps_none_of_its_tensors_alive():
    """A client measures its step every round: the measured step's activations must be freed afterwards."""
    import gc
    import weakref

    from ssl_models.accounting.memory import saved_activation_bytes

    layer = torch.nn.Linear(8, 8)
    refs = []

    def step():
        hidden = torch.relu(layer(torch.randn(4, 8)))
        refs.append(weakref.ref(hidden))
        return (hidden * hidden).sum()  # mul saves ``hidden``, an output with a grad_fn

    assert saved_activation_bytes(step)["bytes"] > 0
    gc.collect()
    assert refs[0]() is None
