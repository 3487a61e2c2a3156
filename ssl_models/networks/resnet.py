"""ResNet backbones for self-supervised learning, with a CIFAR or an ImageNet stem.

Two stems (``stem`` of :func:`build_resnet`):

- ``"cifar"`` (the default): the usual CIFAR adaptation of ResNet (as used by EasyFL/FedEMA, SimCLR's CIFAR
  experiments and solo-learn): a single 3x3 stride-1 convolution and no max-pool, because 32x32 inputs would
  otherwise be down-sampled to 8x8 before the first block.
- ``"imagenet"``: torchvision's stem, a 7x7 stride-2 convolution (padding 3), BN, ReLU and a 3x3 stride-2 max-pool
  (padding 1), which divides the side by 4 before the first block: the choice for larger images (96 px and up).

Either way the stem is ``stem.0`` (convolution) and ``stem.1`` (BN) in the state dict, and the stages are
``layer1..layer4`` with torchvision's block names (``conv1``, ``bn1``, ...), except that torchvision's
``downsample`` is ``shortcut`` here (``ssl_models.init_weights`` maps one onto the other).
The classification layer is dropped: every backbone returns pooled, flattened features of shape
``(N, feature_dim)`` so SSL heads can be attached on top.
"""

from __future__ import annotations

import torch
from torch import nn

BASE_WIDTHS: tuple[int, int, int, int] = (64, 128, 256, 512)
STAGE_STRIDES: tuple[int, int, int, int] = (1, 2, 2, 2)
STEMS: tuple[str, ...] = ("cifar", "imagenet")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut; used by ResNet-18/34."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a shortcut; used by ResNet-50 (stride on the 3x3, as in v1.5)."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Identity when shapes match, otherwise a strided 1x1 conv + BN so the residual sum is well defined."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


BlockType = type[BasicBlock] | type[Bottleneck]

# arch name -> (block type, number of blocks per stage)
ARCHITECTURES: dict[str, tuple[BlockType, tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}


def scaled_widths(width: float) -> tuple[int, ...]:
    """Base stage widths 64/128/256/512 scaled by ``width``, never below one channel."""
    if not width > 0:
        raise ValueError(f"width must be a positive number, got {width!r}")
    return tuple(max(1, round(base * width)) for base in BASE_WIDTHS)


def _make_stem(stem: str, channels: int) -> nn.Sequential:
    """The input stem: convolution (``stem.0``), BN (``stem.1``), ReLU, and for ImageNet a max-pool.

    The indices of the convolution and BN are the same for both stems, so a CIFAR-stem state dict keeps the
    key names it always had.
    """
    if stem == "cifar":
        return nn.Sequential(
            nn.Conv2d(3, channels, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
        )
    if stem == "imagenet":
        return nn.Sequential(
            nn.Conv2d(3, channels, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
    raise ValueError(f"stem must be one of {list(STEMS)}, got {stem!r}")


class ResNetTrunk(nn.Module):
    """ResNet trunk (CIFAR or ImageNet stem, four stages), ending in global average pooling and flattening.

    ``feature_dim`` is the number of channels of the last stage, i.e. the length of the returned vectors;
    ``stem_name`` is the stem's name (``"cifar"`` or ``"imagenet"``; ``stem`` is the stem module itself).
    """

    def __init__(
        self,
        block: BlockType,
        blocks_per_stage: tuple[int, ...],
        widths: tuple[int, ...],
        stem: str = "cifar",
    ) -> None:
        super().__init__()
        if len(blocks_per_stage) != len(widths):
            raise ValueError(
                f"blocks_per_stage ({len(blocks_per_stage)} stages) and widths "
                f"({len(widths)} stages) must have the same length"
            )
        stem_channels = widths[0]
        self.input_norm: nn.Module = nn.Identity()  # InputNormalization when the experiment normalises inputs
        self.stem_name = stem
        self.stem = _make_stem(stem, stem_channels)
        stages: list[nn.Module] = []
        in_channels = stem_channels
        for num_blocks, channels, stride in zip(blocks_per_stage, widths, STAGE_STRIDES):
            stage, in_channels = _make_stage(block, in_channels, channels, num_blocks, stride)
            stages.append(stage)
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.feature_dim = in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.input_norm(x))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.flatten(self.pool(x))

    def extra_repr(self) -> str:
        return f"stem={self.stem_name!r}, feature_dim={self.feature_dim}"


# The name this trunk had when it only had the CIFAR stem.
CifarResNet = ResNetTrunk


def _make_stage(
    block: BlockType, in_channels: int, channels: int, num_blocks: int, stride: int
) -> tuple[nn.Sequential, int]:
    """Stack ``num_blocks`` blocks; only the first one changes stride/width. Returns (stage, out channels)."""
    layers: list[nn.Module] = []
    for index in range(num_blocks):
        layers.append(block(in_channels, channels, stride if index == 0 else 1))
        in_channels = channels * block.expansion
    return nn.Sequential(*layers), in_channels


def _init_weights(module: nn.Module) -> None:
    """Kaiming-normal convolutions and unit/zero BN, the standard ResNet initialisation."""
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d):
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(layer, nn.BatchNorm2d):
            nn.init.ones_(layer.weight)
            nn.init.zeros_(layer.bias)


def build_resnet(arch: str, width: float = 1.0, stem: str = "cifar") -> tuple[nn.Module, int]:
    """Build a ResNet trunk with the ``stem`` (``"cifar"`` or ``"imagenet"``) and return ``(module, feature_dim)``.

    ``module(x)`` maps float NCHW images to ``(N, feature_dim)`` features. ``feature_dim`` is read from the
    built layers (512*width for ResNet-18/34, 2048*width for ResNet-50, up to rounding).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    block, blocks_per_stage = ARCHITECTURES[arch]
    model = ResNetTrunk(block, blocks_per_stage, scaled_widths(width), stem)
    _init_weights(model)
    return model, model.feature_dim
