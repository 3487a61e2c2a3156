"""Tests for the CIFAR ResNet backbones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssl_models.networks import available_backbones, build_backbone
from ssl_models.networks.resnet import BasicBlock, Bottleneck, scaled_widths


def test_resnet18_full_width_has_the_reference_parameter_count() -> None:
    # torchvision's resnet18 has 11,689,512 parameters; dropping the fc layer (513,000) and replacing the
    # 7x7 stem (9,408) by a 3x3 one (1,728) gives 11,689,512 - 513,000 - 9,408 + 1,728 = 11,168,832
    backbone, feature_dim = build_backbone("resnet18")
    assert feature_dim == 512
    assert sum(p.numel() for p in backbone.parameters()) == 11_168_832


@pytest.mark.parametrize(
    ("arch", "width", "expected_dim"),
    [
        ("resnet18", 0.125, 64),
        ("resnet34", 0.125, 64),
        ("resnet50", 0.125, 256),
        ("resnet18", 0.25, 128),
    ],
)
def test_feature_dim_matches_output_shape(arch: str, width: float, expected_dim: int) -> None:
    backbone, feature_dim = build_backbone(arch, width)
    assert feature_dim == expected_dim
    features = backbone(torch.rand(2, 3, 32, 32))
    assert features.shape == (2, expected_dim)


@pytest.mark.parametrize(
    ("arch", "block", "num_blocks"),
    [("resnet18", BasicBlock, 8), ("resnet34", BasicBlock, 16), ("resnet50", Bottleneck, 16)],
)
def test_architecture_uses_expected_blocks(arch: str, block: type, num_blocks: int) -> None:
    backbone, _ = build_backbone(arch, 0.125)
    blocks = [m for m in backbone.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    assert len(blocks) == num_blocks
    assert all(isinstance(m, block) for m in blocks)


def test_cifar_stem_keeps_resolution_and_has_no_max_pool() -> None:
    backbone, _ = build_backbone("resnet18", 0.125)
    assert not any(isinstance(m, nn.MaxPool2d) for m in backbone.modules())
    first_conv = next(m for m in backbone.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.kernel_size == (3, 3) and first_conv.stride == (1, 1) and first_conv.padding == (1, 1)
    # three stride-2 stages: 32 -> 16 -> 8 -> 4 before pooling
    seen: dict[str, torch.Size] = {}
    backbone.layer1.register_forward_hook(lambda _m, _i, out: seen.__setitem__("layer1", out.shape))
    backbone.layer4.register_forward_hook(lambda _m, _i, out: seen.__setitem__("layer4", out.shape))
    backbone(torch.rand(1, 3, 32, 32))
    assert seen["layer1"][-2:] == (32, 32)
    assert seen["layer4"][-2:] == (4, 4)


def test_scaled_widths_round_and_never_reach_zero() -> None:
    assert scaled_widths(1.0) == (64, 128, 256, 512)
    assert scaled_widths(0.125) == (8, 16, 32, 64)
    assert scaled_widths(0.3) == (19, 38, 77, 154)  # round(19.2), round(38.4), round(76.8), round(153.6)
    assert scaled_widths(0.001) == (1, 1, 1, 1)


def test_unknown_arch_error_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="resnet18.*resnet34.*resnet50"):
        build_backbone("resnet101")
    assert available_backbones() == ["resnet18", "resnet34", "resnet50", "vit_tiny"]


@pytest.mark.parametrize("width", [0.0, -1.0])
def test_non_positive_width_is_rejected(width: float) -> None:
    with pytest.raises(ValueError, match="width"):
        build_backbone("resnet18", width)
