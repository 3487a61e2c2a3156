"""Tests for the growable ViT-Tiny/4 backbone (LW-FedSSL, Prog-FedSSL, FLL+DD); tiny widths, batch 2-4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssl_models.networks import build_backbone
from ssl_models.networks.input_norm import InputNormalization
from ssl_models.networks.vit import (
    VisionTransformer,
    build_vit_tiny,
    vit_depth_of_state,
    vit_dim_for_width,
)

TINY = 0.0625  # D = 12, 3 heads of 4, MLP 48


def images(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def tiny_vit(depth: int, seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    return build_vit_tiny(TINY, depth)


def saved_bytes(run) -> tuple[int, int]:
    """(bytes of distinct saved storages, number of pack calls) while ``run()`` builds its graph."""
    storages: dict[int, int] = {}
    held: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    del out
    return sum(storages.values()), len(held)


def grads_present(model: VisionTransformer) -> set[str]:
    return {name for name, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------- architecture
def test_full_size_vit_tiny_has_the_reference_parameter_count() -> None:
    model, feature_dim = build_backbone("vit_tiny")
    count = sum(p.numel() for p in model.parameters())
    # patch 3*16*192+192, CLS 192, pos 65*192, 12 blocks of 444,864, final norm 384
    assert count == 9_408 + 192 + 12_480 + 12 * 444_864 + 384 == 5_360_832
    assert abs(count / 1e6 - 5.36) <= 0.01
    assert feature_dim == 192 and model.feature_dim == 192
    assert len(model.blocks) == 12 and model.num_active_blocks == 12
    block = model.blocks[0]
    assert block.attn.num_heads == 3 and block.mlp.fc1.out_features == 768
    assert model.patch_embed.kernel_size == (4, 4) and model.patch_embed.stride == (4, 4)
    assert model.pos_embed.shape == (1, 65, 192) and model.cls_token.shape == (1, 1, 192)


def test_width_scales_dim_to_a_multiple_of_three_heads() -> None:
    assert vit_dim_for_width(1.0) == 192
    assert vit_dim_for_width(0.125) == 24
    assert vit_dim_for_width(0.1) == 18  # round(19.2) = 19 -> nearest multiple of 3
    assert vit_dim_for_width(0.001) == 3
    model, feature_dim = build_backbone("vit_tiny", TINY, depth=2)
    assert feature_dim == 12 and len(model.blocks) == 2
    assert model(images()).shape == (2, 12)
    with pytest.raises(ValueError, match="width must be a positive number"):
        build_backbone("vit_tiny", 0.0)


def test_unknown_architecture_option_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not take option.*depth"):
        build_backbone("resnet18", 0.125, depth=3)
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        build_backbone("vit_tiny", TINY, depth=0)


def test_input_norm_is_identity_by_default_and_applied_first() -> None:
    model = tiny_vit(1)
    assert isinstance(model.input_norm, nn.Identity)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    normalised, _ = build_backbone("vit_tiny", TINY, (mean, std), depth=1)
    assert isinstance(normalised.input_norm, InputNormalization)
    normalised.load_state_dict(model.state_dict())  # the normalisation is not part of the state dict
    x = images()
    manual = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.allclose(normalised(x), model(manual), atol=1e-5)


def test_features_are_the_final_normed_cls_token() -> None:
    model = tiny_vit(2).eval()
    x = images()
    tokens = model.embed(x)
    for block in model.blocks:
        tokens = block(tokens)
    assert torch.allclose(model(x), model.norm(tokens)[:, 0], atol=1e-6)


def test_state_dict_of_s_blocks_loads_into_a_model_built_for_s_blocks() -> None:
    grown = tiny_vit(1)
    grown.grow("copy")
    grown.grow("fresh")
    state = grown.state_dict()
    assert vit_depth_of_state(state) == 3
    assert vit_depth_of_state({f"backbone.{k}": v for k, v in state.items()}, prefix="backbone.") == 3
    rebuilt, _ = build_backbone("vit_tiny", TINY, depth=vit_depth_of_state(state))
    rebuilt.load_state_dict(state)  # strict
    x = images()
    assert torch.allclose(rebuilt.eval()(x), grown.eval()(x))
    with pytest.raises(RuntimeError, match="Missing key"):
        build_vit_tiny(TINY, depth=4).load_state_dict(state)


def test_fewer_active_blocks_equal_a_model_of_that_depth() -> None:
    model = tiny_vit(3)
    model.set_num_active_blocks(2)
    shallow = build_vit_tiny(TINY, depth=2)
    shallow.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("blocks.2.")})
    x = images()
    assert torch.allclose(model.eval()(x), shallow.eval()(x))
    assert not any(p.requires_grad for p in model.blocks[2].parameters())  # inactive blocks never train
    with pytest.raises(ValueError, match=r"num_active must be in \[1, 3\]"):
        model.set_num_active_blocks(4)
    with pytest.raises(ValueError, match="num_active must be a positive integer"):
        model.set_num_active_blocks(0)


# ---------------------------------------------------------------------------------------------- growing
def test_grow_copy_transfers_the_last_blocks_weights() -> None:
    model = tiny_vit(2)
    new_block = model.grow("copy")
    assert len(model.blocks) == 3 and model.num_active_blocks == 3 and model.blocks[2] is new_block
    previous = model.blocks[1].state_dict()
    for key, value in new_block.state_dict().items():
        assert torch.equal(value, previous[key])
        assert value.data_ptr() != previous[key].data_ptr()  # a copy, not shared storage
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight.add_(1.0)
    assert not torch.equal(model.blocks[1].mlp.fc1.weight, new_block.mlp.fc1.weight)


def test_grow_fresh_initialises_a_new_block() -> None:
    model = tiny_vit(2)
    new_block = model.grow("fresh")
    previous = model.blocks[1]
    assert not torch.equal(new_block.attn.qkv.weight, previous.attn.qkv.weight)
    assert not torch.equal(new_block.mlp.fc2.weight, previous.mlp.fc2.weight)
    assert torch.all(new_block.attn.qkv.bias == 0)
    assert torch.all(new_block.norm1.weight == 1)


def test_grow_rejects_unknown_init() -> None:
    with pytest.raises(ValueError, match="init must be one of"):
        tiny_vit(1).grow("random")


def test_trainable_mode_persists_across_growth() -> None:
    model = tiny_vit(1)
    model.set_trainable("last_block")
    assert all(p.requires_grad for p in model.stage1_parameters())  # s = 1: embeddings train with block 1
    model.grow("copy")
    assert not any(p.requires_grad for p in model.stage1_parameters())
    assert not any(p.requires_grad for p in model.blocks[0].parameters())
    assert all(p.requires_grad for p in model.blocks[1].parameters())
    assert all(p.requires_grad for p in model.norm.parameters())
    with pytest.raises(ValueError, match="trainable mode must be one of"):
        model.set_trainable("frozen")


# ---------------------------------------------------------------------------------------------- last_block mode
def test_last_block_mode_gradients_only_on_active_block_and_final_norm() -> None:
    model = tiny_vit(3)
    model.set_trainable("last_block")
    model(images()).pow(2).sum().backward()
    expected = {n for n, _ in model.named_parameters() if n.startswith(("blocks.2.", "norm."))}
    assert grads_present(model) == expected
    for name in ("patch_embed.weight", "cls_token", "pos_embed", "blocks.0.attn.qkv.weight"):
        assert dict(model.named_parameters())[name].grad is None


def test_last_block_mode_at_stage_one_trains_embeddings_with_block_one() -> None:
    model = tiny_vit(2)
    model.set_num_active_blocks(1)
    model.set_trainable("last_block")
    model(images()).pow(2).sum().backward()
    expected = {n for n, _ in model.named_parameters() if not n.startswith("blocks.1.")}
    assert grads_present(model) == expected
    assert {"patch_embed.weight", "patch_embed.bias", "cls_token", "pos_embed"} <= expected


def test_all_mode_gives_gradients_everywhere_active() -> None:
    model = tiny_vit(2)
    model.set_trainable("all")
    model(images()).pow(2).sum().backward()
    assert grads_present(model) == {n for n, _ in model.named_parameters()}


def test_frozen_blocks_save_no_activations() -> None:
    x = images(4)
    bytes_by_depth = {}
    for depth in (2, 3, 5):
        model = tiny_vit(depth)
        model.set_trainable("last_block")
        bytes_by_depth[depth], _ = saved_bytes(lambda model=model: model(x))
    # more frozen blocks in front of the active one do not add saved activations
    assert bytes_by_depth[2] == bytes_by_depth[3] == bytes_by_depth[5] > 0

    single = tiny_vit(1)  # the active block alone with its (trainable) embeddings
    one_block_bytes, _ = saved_bytes(lambda: single(x))
    assert bytes_by_depth[5] <= one_block_bytes

    everything = tiny_vit(5)
    all_bytes, _ = saved_bytes(lambda: everything(x))
    assert all_bytes > 3 * bytes_by_depth[5]


# ---------------------------------------------------------------------------------------------- depth dropout
def test_depth_dropout_skips_frozen_blocks_at_the_configured_rate() -> None:
    model = tiny_vit(9)  # 8 frozen blocks + the active one
    model.set_trainable("last_block")
    model.set_depth_dropout(0.25, seed=123)
    model.train()
    x = images()
    skipped = 0
    draws = []
    with torch.no_grad():
        for _ in range(200):
            model(x)
            assert all(0 <= index < 8 for index in model.last_skipped_blocks)  # never the active block
            skipped += len(model.last_skipped_blocks)
            draws.append(model.last_skipped_blocks)
    assert abs(skipped / (200 * 8) - 0.25) < 0.05

    again = tiny_vit(9)
    again.set_trainable("last_block")
    again.set_depth_dropout(0.25, seed=123)
    repeated = []
    with torch.no_grad():
        for _ in range(200):
            again(x)
            repeated.append(again.last_skipped_blocks)
    assert repeated == draws  # seeded: same skips


def test_depth_dropout_rate_one_skips_every_frozen_block_in_train_mode_only() -> None:
    model = tiny_vit(4)
    model.set_trainable("last_block")
    x = images()
    with torch.no_grad():
        full = model.eval()(x)
        direct = model.norm(model.blocks[3](model.embed(x)))[:, 0]
        model.set_depth_dropout(1.0, seed=0)
        assert torch.allclose(model.train()(x), direct, atol=1e-6)
        assert model.last_skipped_blocks == (0, 1, 2)
        assert torch.allclose(model.eval()(x), full)  # eval mode never skips
        assert model.last_skipped_blocks == ()
        model.set_trainable("all")  # nothing is frozen, so nothing can be skipped
        model.train()(x)
        assert model.last_skipped_blocks == ()


def test_depth_dropout_rejects_rates_outside_unit_interval() -> None:
    with pytest.raises(ValueError, match=r"depth dropout rate must be a number in \[0, 1\]"):
        tiny_vit(2).set_depth_dropout(1.5)


def test_bf16_autocast_and_channels_last_forward_is_finite() -> None:
    model = tiny_vit(2).to(memory_format=torch.channels_last)
    x = images().contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.shape == (2, 12) and torch.isfinite(out.float()).all()


def test_a_momentum_copy_stays_frozen_through_growth_and_mode_changes() -> None:
    from ssl_models.networks.momentum import copy_as_target

    online = tiny_vit(2)
    online.set_trainable("last_block")
    target = copy_as_target(online)
    assert target.frozen_entirely
    target.grow("copy")
    target.set_num_active_blocks(2)
    target.set_trainable("all")
    assert not any(p.requires_grad for p in target.parameters())
    online.grow("copy")
    assert online.trainable_mode == "last_block" and not online.frozen_entirely
    assert {n for n, p in online.named_parameters() if p.requires_grad} == {
        n for n, _ in online.named_parameters() if n.startswith(("blocks.2.", "norm."))
    }
