"""ViT-Tiny/4 for 32x32 images, growable block by block (LW-FedSSL, Prog-FedSSL, FLL+DD).

Architecture (docs/methods/lwfedssl.md, The encoder): a 4x4/stride-4 patch projection ``Conv2d(3, D, 4, 4)`` turns a 32x32 image
into 64 tokens, a learned CLS token is prepended and learned position embeddings (65 tokens) are added; then
pre-norm transformer blocks (``x + attn(LN(x))``, ``x + mlp(LN(x))``, multi-head self-attention through
``torch.nn.functional.scaled_dot_product_attention``, MLP ``D -> 4D -> D`` with GELU) and a final LayerNorm.
The features are the CLS token after the final norm, ``(N, D)``. Defaults: D = 192, 3 heads, MLP 768,
12 blocks: 5,360,832 parameters. Like the ResNets, the module applies its ``input_norm`` submodule
(``nn.Identity`` unless the experiment normalises its inputs) first.

Growing (layer-wise training):

- ``vit.blocks`` is an ``nn.ModuleList`` of every block the module holds; ``vit.num_active_blocks`` (s, set with
  :meth:`VisionTransformer.set_num_active_blocks`) of them run, blocks ``s+1..`` are skipped and never train.
- :meth:`VisionTransformer.grow` appends one block (``init="copy"``: weights copied from the current last block,
  the paper's weight transfer; ``"fresh"``: newly initialised) and makes every block active.
- :meth:`VisionTransformer.set_trainable`: ``"all"`` trains everything active; ``"last_block"`` trains only the
  last active block (plus the patch projection, CLS token and position embeddings at s = 1, which belong to
  stage 1) and the final norm. The frozen part (embeddings at s > 1, blocks 1..s-1) then runs under
  ``torch.no_grad()``, so it keeps no activations for backward. The mode persists across ``grow`` and
  ``set_num_active_blocks``. A module frozen from outside (every parameter ``requires_grad=False``, as the
  momentum copy ``copy_as_target`` makes) stays frozen through all of these.
- Depth dropout (FLL+DD, :meth:`VisionTransformer.set_depth_dropout`): in training mode each *frozen* block is
  skipped with probability p, one draw per forward for the whole batch from the module's own seeded
  ``torch.Generator``; eval mode never skips, and nothing is skipped in ``"all"`` mode (no block is frozen).
  A deep copy (a MoCo v3 momentum encoder) inherits the rate and a copy of the generator state; call
  ``target.set_depth_dropout(0.0)`` on it if the target branch should always run every block.

State dicts and depth: the state dict holds every block (``blocks.0.``, ``blocks.1.``, ...), so a model with s
blocks loads into a model built with exactly s blocks: ``build_vit_tiny(width, depth=s)``, or
``build_backbone("vit_tiny", width, depth=s)`` through the registry. :func:`vit_depth_of_state` reads s off a
state dict (``prefix="backbone."`` for an SSL method's state). Neither the active depth, the trainable mode nor
the depth-dropout settings are in the state dict: every party sets them from its config.

``width`` scales D: D = round(192 * width), rounded to a multiple of the (fixed) 3 heads; the MLP is 4D.

Larger images: the registry builder takes the image side, ``build_vit("vit_tiny", width, image_size=S)``, and cuts
the image into the same 8x8 grid of patches as ViT-Tiny/4 does at 32 px: patch size S // 8 (8 at 64 px, 12 at
96 px), so there are always 64 tokens (+ CLS) and only the patch projection grows. S must be a multiple of 8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

BASE_DIM = 192
NUM_HEADS = 3
MLP_RATIO = 4
DEFAULT_DEPTH = 12
PATCH_SIZE = 4
IMAGE_SIZE = 32
# Patches per image side: ViT-Tiny/4 on 32 px images has 8; other sides keep that grid (patch = side // 8).
PATCHES_PER_SIDE = IMAGE_SIZE // PATCH_SIZE
LAYER_NORM_EPS = 1e-6
TRAINABLE_MODES: tuple[str, ...] = ("all", "last_block")
BLOCK_INITS: tuple[str, ...] = ("copy", "fresh")

TrainableMode = Literal["all", "last_block"]


class Attention(nn.Module):
    """Multi-head self-attention: one ``qkv`` Linear, scaled dot-product attention per head, ``proj`` Linear."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of num_heads ({num_heads})")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (batch, heads, tokens, head_dim)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class MLP(nn.Module):
    """``fc1`` (D -> hidden), GELU, ``fc2`` (hidden -> D)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = MLP(dim, mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _init_block(block: Block) -> None:
    """Xavier-uniform Linear weights, zero biases, unit/zero LayerNorm (the MoCo v3 / timm ViT scheme)."""
    for layer in block.modules():
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
        elif isinstance(layer, nn.LayerNorm):
            nn.init.ones_(layer.weight)
            nn.init.zeros_(layer.bias)


class VisionTransformer(nn.Module):
    """Growable ViT encoder returning the final-normed CLS token, ``(N, embed_dim)``. See the module docstring."""

    def __init__(
        self,
        embed_dim: int = BASE_DIM,
        depth: int = DEFAULT_DEPTH,
        num_heads: int = NUM_HEADS,
        mlp_dim: int | None = None,
        patch_size: int = PATCH_SIZE,
        image_size: int = IMAGE_SIZE,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        for name, value in (
            ("embed_dim", embed_dim),
            ("depth", depth),
            ("num_heads", num_heads),
            ("patch_size", patch_size),
            ("image_size", image_size),
            ("in_channels", in_channels),
        ):
            _check_positive_int(name, value)
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        mlp_dim = MLP_RATIO * embed_dim if mlp_dim is None else mlp_dim
        _check_positive_int("mlp_dim", mlp_dim)
        self.embed_dim = embed_dim
        self.feature_dim = embed_dim
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.image_size = image_size
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2

        self.input_norm: nn.Module = nn.Identity()  # InputNormalization when the experiment normalises inputs
        self.patch_embed = nn.Conv2d(in_channels, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.blocks = nn.ModuleList([self._new_block() for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=LAYER_NORM_EPS)
        self._init_embeddings()
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)

        self.num_active_blocks = depth
        self.trainable_mode: TrainableMode = "all"
        self.depth_dropout = 0.0
        self.depth_dropout_generator = torch.Generator()
        self.depth_dropout_generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        self.last_skipped_blocks: tuple[int, ...] = ()  # indices skipped by the latest forward (inspection)

    # ------------------------------------------------------------------ construction helpers
    def _new_block(self) -> Block:
        block = Block(self.embed_dim, self.num_heads, self.mlp_dim)
        _init_block(block)
        return block

    def _init_embeddings(self) -> None:
        # the patch projection is a linear map of flattened patches: Xavier-uniform on that view
        fan_in = self.patch_embed.weight[0].numel()
        bound = math.sqrt(6.0 / (fan_in + self.embed_dim))
        nn.init.uniform_(self.patch_embed.weight, -bound, bound)
        nn.init.zeros_(self.patch_embed.bias)  # type: ignore[arg-type]  # a Conv2d with bias: never None
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    # ------------------------------------------------------------------ depth / growth
    @property
    def depth(self) -> int:
        """Number of blocks the module holds (active or not)."""
        return len(self.blocks)

    def set_num_active_blocks(self, num_active: int) -> None:
        """Run only blocks ``1..num_active`` (1 <= num_active <= depth); the trainable mode is re-applied."""
        _check_positive_int("num_active", num_active)
        if num_active > len(self.blocks):
            raise ValueError(f"num_active must be in [1, {len(self.blocks)}] (blocks held), got {num_active}")
        self.num_active_blocks = num_active
        self._apply_trainable()

    @property
    def num_frozen_blocks(self) -> int:
        """Active blocks that run frozen (under no_grad): s - 1 in ``"last_block"`` mode, 0 in ``"all"`` mode."""
        return self.num_active_blocks - 1 if self.trainable_mode == "last_block" else 0

    @property
    def active_block(self) -> Block:
        """The last active block (the one that trains in ``"last_block"`` mode)."""
        return cast(Block, self.blocks[self.num_active_blocks - 1])

    def grow(self, init: str = "copy") -> Block:
        """Append one block after the last one held and make every block active; returns the new block.

        ``init="copy"`` copies the weights of the current last block (weight transfer), ``"fresh"`` initialises
        it anew (Xavier-uniform Linear weights from the global RNG). The new block is placed on the device and
        dtype of the existing ones and the trainable mode is re-applied, so in ``"last_block"`` mode only the
        new block (and the final norm) trains afterwards. An optimizer built before ``grow`` does not know the
        new parameters: build it afterwards.
        """
        if init not in BLOCK_INITS:
            raise ValueError(f"init must be one of {list(BLOCK_INITS)}, got {init!r}")
        was_frozen = self.frozen_entirely
        block = self._new_block()
        if was_frozen:
            block.requires_grad_(False)
        if init == "copy":
            block.load_state_dict(self.blocks[-1].state_dict())
        reference = next(self.blocks[-1].parameters())
        block.to(device=reference.device, dtype=reference.dtype)
        self.blocks.append(block)
        self.num_active_blocks = len(self.blocks)
        self._apply_trainable()
        return block

    # ------------------------------------------------------------------ what trains
    def stage1_parameters(self) -> list[nn.Parameter]:
        """Patch projection, CLS token and position embeddings: trained with block 1 (stage 1)."""
        return [*self.patch_embed.parameters(), self.cls_token, self.pos_embed]

    def set_trainable(self, mode: str) -> None:
        """``"all"``: every active parameter trains; ``"last_block"``: only the last active block (+ stage-1
        embeddings at s = 1) and the final norm. Sets ``requires_grad`` accordingly (blocks beyond the active
        depth never train) and decides which part of the forward runs under ``no_grad``."""
        if mode not in TRAINABLE_MODES:
            raise ValueError(f"trainable mode must be one of {list(TRAINABLE_MODES)}, got {mode!r}")
        self.trainable_mode = mode  # type: ignore[assignment]
        self._apply_trainable()

    @property
    def frozen_entirely(self) -> bool:
        """True when no parameter requires grad: frozen from outside (``requires_grad_(False)``, e.g. a momentum
        copy made by ``copy_as_target``). Such a module stays frozen through ``grow``, ``set_trainable`` and
        ``set_num_active_blocks``; call ``requires_grad_(True)`` first to make it trainable again."""
        return not any(p.requires_grad for p in self.parameters())

    def _apply_trainable(self) -> None:
        if self.frozen_entirely:
            return
        active = self.num_active_blocks
        last_only = self.trainable_mode == "last_block"
        for parameter in self.stage1_parameters():
            parameter.requires_grad_(not last_only or active == 1)
        for index, block in enumerate(self.blocks):
            trains = index < active and (not last_only or index == active - 1)
            for parameter in block.parameters():
                parameter.requires_grad_(trains)
        for parameter in self.norm.parameters():
            parameter.requires_grad_(True)

    # ------------------------------------------------------------------ depth dropout
    def set_depth_dropout(self, rate: float, seed: int | None = None) -> None:
        """Skip each frozen block with probability ``rate`` per training-mode forward (FLL+DD); ``seed``
        re-seeds the module's generator (None keeps its current state)."""
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"depth dropout rate must be a number in [0, 1], got {rate!r}")
        self.depth_dropout = float(rate)
        if seed is not None:
            self.depth_dropout_generator.manual_seed(int(seed))

    def _draw_skipped(self, num_frozen: int) -> tuple[int, ...]:
        if not (self.training and self.depth_dropout > 0.0 and num_frozen > 0):
            return ()
        draws = torch.rand(num_frozen, generator=self.depth_dropout_generator)
        return tuple(int(i) for i in torch.nonzero(draws < self.depth_dropout).flatten().tolist())

    # ------------------------------------------------------------------ forward
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Input normalisation, patch projection, CLS token and position embeddings: ``(N, 1 + P, D)``."""
        x = self.patch_embed(self.input_norm(images))  # (N, D, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (N, P, D)
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed.to(x.dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        active = self.num_active_blocks
        frozen = self.num_frozen_blocks
        skipped = self._draw_skipped(frozen)
        self.last_skipped_blocks = skipped
        # at s > 1 in "last_block" mode the embeddings and blocks 1..s-1 are inference only
        with torch.no_grad() if frozen > 0 else nullcontext():
            x = self.embed(images)
            for index in range(frozen):
                if index not in skipped:
                    x = self.blocks[index](x)
        for index in range(frozen, active):
            x = self.blocks[index](x)
        return self.norm(x)[:, 0]

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, heads={self.num_heads}, blocks={len(self.blocks)}, "
            f"active={self.num_active_blocks}, trainable={self.trainable_mode!r}, "
            f"depth_dropout={self.depth_dropout}"
        )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def vit_dim_for_width(width: float, num_heads: int = NUM_HEADS) -> int:
    """round(192 * width), rounded to a multiple of ``num_heads`` (never below ``num_heads``)."""
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0:
        raise ValueError(f"width must be a positive number, got {width!r}")
    return max(num_heads, num_heads * round(round(BASE_DIM * width) / num_heads))


def patch_size_for(image_size: int) -> int:
    """The patch side that cuts an ``image_size`` image into an 8x8 grid: 4 at 32 px, 8 at 64, 12 at 96."""
    _check_positive_int("image_size", image_size)
    if image_size % PATCHES_PER_SIDE:
        raise ValueError(
            f"a vit_tiny needs an image side that is a multiple of {PATCHES_PER_SIDE} (it cuts the image into "
            f"{PATCHES_PER_SIDE}x{PATCHES_PER_SIDE} patches), got {image_size} px"
        )
    return image_size // PATCHES_PER_SIDE


def build_vit_tiny(width: float = 1.0, depth: int = DEFAULT_DEPTH, image_size: int = IMAGE_SIZE) -> VisionTransformer:
    """ViT-Tiny with ``depth`` blocks (all active, all trainable), D scaled by ``width``, for ``image_size`` px
    images in 8x8 patches (ViT-Tiny/4 at the default 32 px)."""
    return VisionTransformer(
        embed_dim=vit_dim_for_width(width),
        depth=depth,
        num_heads=NUM_HEADS,
        patch_size=patch_size_for(image_size),
        image_size=image_size,
    )


def build_vit(
    arch: str, width: float = 1.0, depth: int = DEFAULT_DEPTH, image_size: int = IMAGE_SIZE
) -> tuple[nn.Module, int]:
    """Registry builder (``BACKBONES["vit_tiny"]``): ``(module, feature_dim)``; ``depth`` = blocks held,
    ``image_size`` = the side of the input images (patch size ``image_size // 8``)."""
    if arch != "vit_tiny":
        raise ValueError(f"arch must be 'vit_tiny', got {arch!r}")
    model = build_vit_tiny(width, depth, image_size)
    return model, model.feature_dim


def vit_depth_of_state(state: Iterable[str], prefix: str = "") -> int:
    """Number of blocks in a ViT state dict (keys ``{prefix}blocks.<i>.``); 0 when there are none."""
    start = f"{prefix}blocks."
    indices = {int(key[len(start) :].split(".", 1)[0]) for key in state if key.startswith(start)}
    if indices and indices != set(range(len(indices))):
        raise ValueError(f"state dict blocks are not numbered 0..n-1: {sorted(indices)}")
    return len(indices)


__all__ = [
    "MLP",
    "Attention",
    "Block",
    "VisionTransformer",
    "build_vit",
    "build_vit_tiny",
    "patch_size_for",
    "vit_depth_of_state",
    "vit_dim_for_width",
]
