"""The ResNets' ImageNet stem, the ViT's patch size by image side, and starting a run from saved weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from ssl_models.config import ExperimentConfig
from ssl_models.evaluation.checkpoint import save_encoder_checkpoint
from ssl_models.factory import build_ssl_model
from ssl_models.init_weights import check_init_weights, load_init_weights, read_init_weights
from ssl_models.networks import backbone_build_settings, build_backbone

TINY = 0.125


def shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(tensor.shape)) for name, tensor in module.state_dict().items()]


def feature_map_sides(backbone: nn.Module, side: int) -> dict[str, int]:
    """The spatial side after the stem and after each stage, for a ``side`` x ``side`` input."""
    seen: dict[str, int] = {}
    for name in ("stem", "layer1", "layer2", "layer3", "layer4"):
        getattr(backbone, name).register_forward_hook(
            lambda _m, _i, out, name=name: seen.__setitem__(name, out.shape[-1])
        )
    backbone(torch.rand(1, 3, side, side))
    return seen


def config(tmp_path: Path, **sections: dict) -> ExperimentConfig:
    """A tiny-width config; ``sections`` are merged over ``model: {width: 0.125}``."""
    raw: dict = {"model": {"width": TINY}}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    if raw.get("data", {}).get("dataset") == "folder":
        raw["data"].setdefault("path", str(tmp_path))
    return ExperimentConfig.from_dict(raw)


def torchvision_resnet18() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    # Random BN statistics and affine parameters, so that a wrongly mapped BN shows in the comparison.
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.BatchNorm2d):
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.1, 0.1)
                layer.running_mean.uniform_(-0.1, 0.1)
                layer.running_var.uniform_(0.5, 1.5)
    return model


# ---------------------------------------------------------------------------------------------------- stems


def test_imagenet_stem_divides_the_side_by_four_before_the_first_stage() -> None:
    backbone, feature_dim = build_backbone("resnet18", TINY, stem="imagenet")
    # 96 -> conv stride 2 -> 48 -> max-pool stride 2 -> 24; stages 1..4: 24, 12, 6, 3
    assert feature_map_sides(backbone, 96) == {"stem": 24, "layer1": 24, "layer2": 12, "layer3": 6, "layer4": 3}
    assert backbone(torch.rand(2, 3, 96, 96)).shape == (2, feature_dim) == (2, 64)
    conv, pool = backbone.stem[0], backbone.stem[3]
    assert conv.kernel_size == (7, 7) and conv.stride == (2, 2) and conv.padding == (3, 3)
    assert isinstance(pool, nn.MaxPool2d) and (pool.kernel_size, pool.stride, pool.padding) == (3, 2, 1)
    assert backbone_build_settings(backbone) == {"stem": "imagenet"}


def test_imagenet_stem_resnet18_has_torchvisions_weights_under_our_names() -> None:
    reference = torchvision_resnet18()
    backbone, _ = build_backbone("resnet18", 1.0, stem="imagenet")
    renamed = {
        name.replace("conv1.", "stem.0.", 1) if name.startswith("conv1.") else name: shape
        for name, shape in shapes(reference)
        if not name.startswith("fc.")
    }
    renamed = {
        ("stem.1." + name[len("bn1.") :] if name.startswith("bn1.") else name).replace(".downsample.", ".shortcut."): s
        for name, s in renamed.items()
    }
    assert dict(shapes(backbone)) == renamed
    # the stem itself: torchvision's conv1 and bn1
    assert dict(shapes(backbone.stem)) == {
        "0.weight": tuple(reference.conv1.weight.shape),
        **{f"1.{name}": tuple(t.shape) for name, t in reference.bn1.state_dict().items()},
    }


@pytest.mark.parametrize("arch", ["resnet18", "resnet34", "resnet50"])
def test_cifar_stem_is_the_default_and_unchanged(arch: str) -> None:
    torch.manual_seed(0)
    default, _ = build_backbone(arch, TINY)
    torch.manual_seed(0)
    explicit, _ = build_backbone(arch, TINY, stem="cifar")
    assert shapes(default) == shapes(explicit)
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), explicit.state_dict().values()))
    assert not any(isinstance(m, nn.MaxPool2d) for m in default.modules())
    assert backbone_build_settings(default) == {"stem": "cifar"}


def test_cifar_stem_resnet18_state_dict_is_what_it_was_before_the_imagenet_stem() -> None:
    # Recorded before the stem option existed: 120 entries, 176,972 elements, the stem as stem.0 / stem.1.
    backbone, _ = build_backbone("resnet18", TINY)
    listing = shapes(backbone)
    assert len(listing) == 120
    assert sum(t.numel() for t in backbone.state_dict().values()) == 176_972
    assert listing[:6] == [
        ("stem.0.weight", (8, 3, 3, 3)),
        ("stem.1.weight", (8,)),
        ("stem.1.bias", (8,)),
        ("stem.1.running_mean", (8,)),
        ("stem.1.running_var", (8,)),
        ("stem.1.num_batches_tracked", ()),
    ]


def test_unknown_stem_is_rejected() -> None:
    with pytest.raises(ValueError, match="stem must be one of"):
        build_backbone("resnet18", TINY, stem="huge")


def test_default_cifar10_config_builds_the_same_model_as_an_explicit_cifar_stem(tmp_path: Path) -> None:
    default = build_ssl_model(config(tmp_path), seed=3)
    explicit = build_ssl_model(config(tmp_path, model={"stem": "cifar"}), seed=3)
    assert shapes(default) == shapes(explicit)
    assert len(default.state_dict()) == 264  # BYOL at width 0.125, as before the stem option existed
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), explicit.state_dict().values()))


@pytest.mark.parametrize(("side", "stem"), [(96, "imagenet"), (64, "cifar")])
def test_a_folder_configs_image_side_picks_the_stem(tmp_path: Path, side: int, stem: str) -> None:
    cfg = config(tmp_path, data={"dataset": "folder", "image_size": side})
    assert build_ssl_model(cfg, seed=0).backbone.stem_name == stem


def test_an_explicit_stem_overrides_the_image_side(tmp_path: Path) -> None:
    cfg = config(tmp_path, data={"dataset": "folder", "image_size": 96}, model={"stem": "cifar"})
    assert build_ssl_model(cfg, seed=0).backbone.stem_name == "cifar"


# ---------------------------------------------------------------------------------------------------- ViT


@pytest.mark.parametrize(("side", "patch"), [(32, 4), (64, 8), (96, 12)])
def test_vit_patch_size_cuts_the_image_into_eight_by_eight_patches(side: int, patch: int) -> None:
    backbone, feature_dim = build_backbone("vit_tiny", TINY, depth=1, image_size=side)
    assert backbone.patch_size == patch
    assert tuple(backbone.pos_embed.shape) == (1, 65, feature_dim)
    assert backbone(torch.rand(2, 3, side, side)).shape == (2, feature_dim)
    assert backbone_build_settings(backbone) == {"image_size": side}


def test_vit_default_is_patch_four_for_32_pixels() -> None:
    assert build_backbone("vit_tiny", TINY, depth=1)[0].patch_size == 4


def test_vit_rejects_a_side_that_is_not_a_multiple_of_eight() -> None:
    with pytest.raises(ValueError, match="multiple of 8.*100 px"):
        build_backbone("vit_tiny", TINY, depth=1, image_size=100)


def test_vit_follows_a_folder_configs_image_side(tmp_path: Path) -> None:
    cfg = config(tmp_path, data={"dataset": "folder", "image_size": 96}, model={"arch": "vit_tiny"})
    assert build_ssl_model(cfg, seed=0, depth=1).backbone.patch_size == 12


# ---------------------------------------------------------------------------------------------------- init weights


def test_a_model_pt_of_this_app_round_trips(tmp_path: Path) -> None:
    source = build_ssl_model(config(tmp_path), seed=1).backbone
    path = save_encoder_checkpoint(tmp_path / "model.pt", source, "resnet18", TINY)
    cfg = config(tmp_path, model={"init_weights": str(path)})
    started = build_ssl_model(cfg, seed=2)
    for name, tensor in source.state_dict().items():
        assert torch.equal(started.backbone.state_dict()[name], tensor), name
        assert torch.equal(started.target_backbone.state_dict()[name], tensor), name  # the BYOL target copies it
    # the heads keep their seeded initialisation
    seeded = build_ssl_model(config(tmp_path), seed=2)
    for name, tensor in seeded.state_dict().items():
        if not name.startswith(("backbone.", "target_backbone.")):
            assert torch.equal(started.state_dict()[name], tensor), name
    assert "starts from" in check_init_weights(cfg)


@pytest.mark.parametrize("nesting", [None, "state_dict", "model"])
def test_torchvision_resnet18_weights_load_into_our_imagenet_stem_resnet18(tmp_path: Path, nesting: str | None) -> None:
    reference = torchvision_resnet18()
    path = tmp_path / "resnet18.pth"
    state = reference.state_dict()
    torch.save(state if nesting is None else {nesting: state, "epoch": 90}, path)
    backbone, _ = build_backbone("resnet18", 1.0, stem="imagenet")
    line = load_init_weights(backbone, path, "resnet18", 1.0)
    assert "2 classifier tensors ignored" in line
    ours = backbone.state_dict()
    assert torch.equal(ours["stem.0.weight"], state["conv1.weight"])
    assert torch.equal(ours["stem.1.running_var"], state["bn1.running_var"])
    assert torch.equal(ours["layer2.0.shortcut.0.weight"], state["layer2.0.downsample.0.weight"])
    assert torch.equal(ours["layer4.1.bn2.bias"], state["layer4.1.bn2.bias"])
    # same weights, same network: the features are torchvision's pooled features
    reference.fc = nn.Identity()
    images = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(backbone.eval()(images), reference.eval()(images))


def test_torchvision_weights_into_the_cifar_stem_name_the_stem_to_use(tmp_path: Path) -> None:
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision_resnet18().state_dict(), path)
    backbone, _ = build_backbone("resnet18", 1.0, stem="cifar")
    with pytest.raises(ValueError) as error:
        load_init_weights(backbone, path, "resnet18", 1.0)
    message = str(error.value)
    assert "model.init_weights" in message and str(path) in message
    assert "stem.0.weight is (64, 3, 7, 7) in the file, (64, 3, 3, 3) in the model" in message
    assert "model.stem = imagenet" in message


def test_a_file_of_another_width_names_the_mismatched_keys(tmp_path: Path) -> None:
    wider, _ = build_backbone("resnet18", 0.25)
    path = tmp_path / "wide.pt"
    torch.save(wider.state_dict(), path)
    cfg = config(tmp_path, model={"init_weights": str(path)})
    with pytest.raises(ValueError) as error:
        build_ssl_model(cfg, seed=0)
    message = str(error.value)
    assert f"model.init_weights: {path} (a plain state dict) does not fit resnet18 (stem cifar, width 0.125)" in message
    # the first few mismatches are named, the rest counted
    assert "stem.0.weight is (16, 3, 3, 3) in the file, (8, 3, 3, 3) in the model" in message
    assert "; 95 more shape mismatches" in message
    with pytest.raises(ValueError, match="stem.0.weight is"):
        check_init_weights(cfg)


def test_a_file_missing_keys_names_them_and_unexpected_ones(tmp_path: Path) -> None:
    state = build_backbone("resnet18", TINY)[0].state_dict()
    del state["layer4.1.bn2.weight"], state["layer4.1.bn2.bias"]
    state["projector.weight"] = torch.zeros(1)
    path = tmp_path / "partial.pt"
    torch.save(state, path)
    with pytest.raises(ValueError) as error:
        load_init_weights(build_backbone("resnet18", TINY)[0], path, "resnet18", TINY)
    message = str(error.value)
    assert "missing layer4.1.bn2.weight, layer4.1.bn2.bias" in message
    assert "unexpected projector.weight" in message


def test_a_failed_load_changes_nothing(tmp_path: Path) -> None:
    state = build_backbone("resnet18", TINY)[0].state_dict()
    del state["layer4.1.bn2.weight"]
    path = tmp_path / "partial.pt"
    torch.save(state, path)
    backbone, _ = build_backbone("resnet18", TINY)
    before = {name: tensor.clone() for name, tensor in backbone.state_dict().items()}
    with pytest.raises(ValueError):
        load_init_weights(backbone, path, "resnet18", TINY)
    assert all(torch.equal(before[name], tensor) for name, tensor in backbone.state_dict().items())


def test_an_ssl_models_state_dict_gives_its_online_backbone(tmp_path: Path) -> None:
    method = build_ssl_model(config(tmp_path), seed=4)
    path = tmp_path / "method.pt"
    torch.save({"model": method.state_dict()}, path)
    backbone, _ = build_backbone("resnet18", TINY)
    load_init_weights(backbone, path, "resnet18", TINY)
    assert all(torch.equal(t, method.backbone.state_dict()[n]) for n, t in backbone.state_dict().items())


def test_a_missing_or_unreadable_file_is_a_value_error(tmp_path: Path) -> None:
    backbone, _ = build_backbone("resnet18", TINY)
    with pytest.raises(ValueError, match="does not exist"):
        load_init_weights(backbone, tmp_path / "nope.pt", "resnet18", TINY)
    (tmp_path / "text.pt").write_text("not weights")
    with pytest.raises(ValueError, match="torch.load"):
        load_init_weights(backbone, tmp_path / "text.pt", "resnet18", TINY)


def test_the_file_is_read_once_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save(build_backbone("resnet18", TINY)[0].state_dict(), path)
    first, _ = read_init_weights(path)
    assert read_init_weights(path)[0] is first
    torch.save(build_backbone("resnet18", TINY)[0].state_dict(), path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert read_init_weights(path)[0] is not first


def test_vit_sub_models_take_the_files_first_blocks_but_the_configs_model_is_strict(tmp_path: Path) -> None:
    source, _ = build_backbone("vit_tiny", TINY, depth=3)
    path = tmp_path / "vit.pt"
    torch.save(source.state_dict(), path)
    cfg = config(tmp_path, model={"arch": "vit_tiny", "options": {"depth": 3}, "init_weights": str(path)})
    assert torch.equal(build_ssl_model(cfg, seed=0).backbone.blocks[2].mlp.fc2.weight, source.blocks[2].mlp.fc2.weight)
    stage = build_ssl_model(cfg, seed=0, depth=2).backbone  # a layer-wise stage's sub-model
    assert torch.equal(stage.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    shallow = config(tmp_path, model={"arch": "vit_tiny", "options": {"depth": 2}, "init_weights": str(path)})
    with pytest.raises(ValueError, match="unexpected blocks.2."):
        check_init_weights(shallow)


def test_clients_of_another_architecture_start_from_their_seed(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save(build_backbone("resnet18", TINY)[0].state_dict(), path)
    cfg = config(tmp_path, model={"init_weights": str(path)})
    seeded = build_ssl_model(config(tmp_path), seed=5, arch="resnet34").backbone
    started = build_ssl_model(cfg, seed=5, arch="resnet34").backbone
    assert all(torch.equal(t, seeded.state_dict()[n]) for n, t in started.state_dict().items())


def test_no_init_weights_checks_nothing(tmp_path: Path) -> None:
    assert check_init_weights(config(tmp_path)) == ""
