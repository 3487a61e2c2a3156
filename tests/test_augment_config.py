"""Augmentation recipes in the config: YAML loading and validation, the blur and the input normalisation
(hand-checked values), and that the recipe reaches every place that augments and the normalisation every
place where images enter an encoder."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
import yaml

from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.augment import SSLAugment, blur_kernel_size_for, gaussian_blur, gaussian_kernels
from ssl_models.evaluation.checkpoint import load_encoder_checkpoint, save_encoder_checkpoint
from ssl_models.factory import build_augment, build_ssl_model
from ssl_models.federated.similarity import public_representations
from ssl_models.networks import build_backbone
from ssl_models.networks.input_norm import InputNormalization

TINY = {
    "rounds": 2,
    "data": {"dataset": "synthetic", "synthetic_train": 96, "synthetic_test": 32, "partition": "iid"},
    "model": {"arch": "resnet18", "width": 0.125},
    "method": {"name": "byol", "options": {"proj_hidden_dim": 32, "proj_out_dim": 16, "pred_hidden_dim": 32}},
    "federation": {"num_clients": 2},
    "train": {"local_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 1, "fast_path": False},
}
MEAN, STD = [0.5, 0.25, 0.0], [0.5, 0.25, 1.0]
FLESD_RECIPE = {
    "crop_scale": [0.2, 1.0],
    "brightness": 0.8,
    "contrast": 0.8,
    "saturation": 0.8,
    "hue": 0.2,
    "jitter_p": 0.8,
    "grayscale_p": 0.2,
    "blur_p": 0.5,
    "blur_sigma": [0.1, 2.0],
    "normalize": True,
    "mean": MEAN,
    "std": STD,
}


def cfg_with(augment: dict, **extra) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**TINY, "augment": augment, **extra})


def random_images(num: int = 6, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num, size, size, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------- loading and errors


def test_recipe_loads_from_yaml_reaches_the_augmentation_and_is_recorded(tmp_path):
    raw = {**TINY, "augment": FLESD_RECIPE}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg, _ = load_experiment({"config": str(path), "augment.jitter_p": 0.6})  # scalar keys: run-config overrides
    aug = build_augment(cfg, 32)
    assert aug.crop_scale == (0.2, 1.0) and aug.jitter == (0.8, 0.8, 0.8, 0.2) and aug.jitter_p == 0.6
    assert aug.grayscale_p == 0.2 and aug.blur_p == 0.5 and aug.blur_sigma == (0.1, 2.0)
    assert aug.blur_kernel_size == 3  # automatic: 10 % of 32 made odd
    recorded = cfg.to_dict()["augment"]  # what summary.json's "config" holds
    assert recorded["crop_scale"] == [0.2, 1.0] and recorded["normalize"] is True and recorded["mean"] == MEAN
    assert ExperimentConfig.from_json(cfg.to_json()).augment == cfg.augment  # travels to the clients intact


def test_default_recipe_is_the_documented_one():
    aug = build_augment(ExperimentConfig.from_dict({}), 32)
    assert (aug.crop_scale, aug.jitter, aug.jitter_p, aug.grayscale_p, aug.flip_p, aug.blur_p) == (
        (0.08, 1.0),
        (0.4, 0.4, 0.4, 0.1),
        0.8,
        0.2,
        0.5,
        0.0,
    )
    assert ExperimentConfig.from_dict({}).augment.input_normalization() is None


@pytest.mark.parametrize(
    "augment, message",
    [
        ({"jitter_p": 1.5}, r"^augment\.jitter_p: must be in \[0, 1\] \(got 1\.5\)"),
        ({"blur_p": -0.1}, r"^augment\.blur_p: must be in \[0, 1\]"),
        ({"flip_p": 2}, r"^augment\.flip_p: must be in \[0, 1\]"),
        ({"grayscale_p": 1.01}, r"^augment\.grayscale_p: must be in \[0, 1\]"),
        ({"hue": 0.6}, r"^augment\.hue: must be in \[0, 0\.5\]"),
        ({"brightness": -0.2}, r"^augment\.brightness: must be >= 0"),
        ({"crop_scale": [0.5, 0.2]}, r"^augment\.crop_scale: must be \[low, high\] with 0 < low <= high <= 1"),
        ({"crop_scale": [0.2, 1.5]}, r"^augment\.crop_scale: must be \[low, high\]"),
        ({"crop_scale": [0.2]}, r"^augment\.crop_scale: must be \[low, high\]"),
        ({"crop_ratio": [0, 1]}, r"^augment\.crop_ratio: must be \[low, high\] with 0 < low <= high"),
        ({"blur_sigma": ["a", 2.0]}, r"^augment\.blur_sigma: must be \[low, high\]"),
        ({"blur_kernel_size": 4}, r"^augment\.blur_kernel_size: must be 0 \(automatic\) or an odd number >= 3"),
        ({"std": [0.5, 0.0, 0.5]}, r"^augment\.std: must be 3 numbers \(one per RGB channel\), each > 0"),
        ({"mean": [0.5, 0.5]}, r"^augment\.mean: must be 3 numbers"),
        ({"normalize": "yes"}, r"^augment\.normalize: expected bool"),
        ({"jitterp": 0.5}, r"^augment\.jitterp: unknown key"),
        ({"crop_scale": 0.5}, r"^augment\.crop_scale: expected a list"),
    ],
)
def test_bad_values_give_one_error_naming_the_key(augment, message):
    with pytest.raises(ConfigError, match=message):
        cfg_with(augment)


def test_bad_value_in_a_yaml_file_stops_the_loader_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "augment": {"jitter_p": 1.2}}))
    with pytest.raises(ConfigError, match=r"^augment\.jitter_p: must be in \[0, 1\]"):
        load_experiment({"config": str(path)})


# ---------------------------------------------------------------------------------- blur


def test_blur_kernel_matches_hand_computation():
    # sigma 1, kernel 3: weights exp(-x^2 / 2) at x = -1, 0, 1 = (e^-0.5, 1, e^-0.5) / (1 + 2 e^-0.5)
    side = math.exp(-0.5) / (1 + 2 * math.exp(-0.5))
    centre = 1 / (1 + 2 * math.exp(-0.5))
    kernel = gaussian_kernels(torch.tensor([1.0]), 3)[0]
    torch.testing.assert_close(kernel, torch.tensor([side, centre, side]), atol=1e-7, rtol=0)
    assert (round(side, 5), round(centre, 5)) == (0.27407, 0.45186)
    assert [blur_kernel_size_for(s) for s in (32, 64, 96, 224)] == [3, 7, 9, 23]


def test_blur_of_a_point_is_the_outer_product_of_the_kernel():
    image = torch.zeros(1, 3, 7, 7)
    image[0, :, 3, 3] = 1.0
    out = gaussian_blur(image, torch.tensor([1.0]), 3)
    # hand values: centre 0.45186^2, edge neighbours 0.45186 * 0.27407, corners 0.27407^2
    assert out[0, 0, 3, 3].item() == pytest.approx(0.204177, abs=1e-5)
    assert out[0, 1, 3, 4].item() == pytest.approx(0.123841, abs=1e-5)
    assert out[0, 2, 2, 2].item() == pytest.approx(0.075114, abs=1e-5)
    assert out[0, 0, 3, 5].item() == 0.0 and out.sum().item() == pytest.approx(3.0, abs=1e-5)  # mass kept


def test_blur_equals_torchvision_per_sample_and_skips_unchosen_exactly():
    images = torch.rand(3, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 1.0, 1.7])
    out = gaussian_blur(images, sigma, 5, chosen=torch.tensor([True, True, False]))
    for i in (0, 1):
        expected = TF.gaussian_blur(images[i], kernel_size=[5, 5], sigma=[float(sigma[i])] * 2)
        torch.testing.assert_close(out[i], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[2], images[2])  # the one-hot kernel is the exact identity


def test_augment_blur_p_switches_the_blur_and_keeps_the_no_blur_stream():
    images = torch.as_tensor(random_images(8, 16))
    identity = {"crop_scale": (1.0, 1.0), "jitter_p": 0.0, "grayscale_p": 0.0, "flip_p": 0.0}
    plain = SSLAugment(image_size=16, **identity)(images, torch.Generator().manual_seed(0))
    off = SSLAugment(image_size=16, blur_p=0.0, **identity)(images, torch.Generator().manual_seed(0))
    assert torch.equal(plain, off)
    blurred = SSLAugment(image_size=16, blur_p=1.0, blur_sigma=(1.0, 1.0), **identity)(
        images, torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(blurred, gaussian_blur(plain, torch.ones(8), 3), atol=1e-6, rtol=0)

    def roughness(x):  # mean absolute difference between horizontal neighbours: blur smooths it
        return (x[..., 1:] - x[..., :-1]).abs().mean().item()

    assert roughness(blurred) < 0.7 * roughness(plain)
    # default recipe vs a non-default one: the views differ (the options take effect)
    a = SSLAugment(image_size=16)(images, torch.Generator().manual_seed(0))
    b = SSLAugment.from_config(cfg_with(FLESD_RECIPE).augment, 16)(images, torch.Generator().manual_seed(0))
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------------------------- normalisation


def test_input_normalization_hand_values():
    layer = InputNormalization(MEAN, STD)
    pixel = torch.tensor([1.0, 0.5, 0.2]).view(1, 3, 1, 1)
    torch.testing.assert_close(layer(pixel).flatten(), torch.tensor([1.0, 1.0, 0.2]))
    assert layer.state_dict() == {}  # not exchanged, not in checkpoints' state dicts
    with pytest.raises(ValueError, match="3 means and 3 stds > 0"):
        InputNormalization([0.5, 0.5, 0.5], [0.5, 0.0, 0.5])


def _normalised(x: torch.Tensor) -> torch.Tensor:
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def test_normalisation_is_part_of_every_encoder_built_from_the_config():
    norm, plain = cfg_with(FLESD_RECIPE), cfg_with({})
    with_norm, without = build_ssl_model(norm, seed=3).eval(), build_ssl_model(plain, seed=3).eval()
    assert list(with_norm.state_dict()) == list(without.state_dict())  # same arrays travel
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(with_norm.backbone(x), without.backbone(_normalised(x)))
        # the BYOL target branch (a deep copy) normalises too
        torch.testing.assert_close(with_norm.target_backbone(x), without.target_backbone(_normalised(x)))
        assert not torch.allclose(with_norm.backbone(x), without.backbone(x))
    # FLESD's public-set representations go through the same layer
    images = random_images(5)
    reps = public_representations(with_norm, images)
    with torch.no_grad():
        x_pub = torch.as_tensor(images).permute(0, 3, 1, 2).float() / 255.0
        expected = without.projector(without.backbone(_normalised(x_pub)))
    torch.testing.assert_close(reps, expected)


def test_checkpoint_records_the_normalisation_and_fedssl_eval_rebuilds_it(tmp_path):
    backbone, _ = build_backbone("resnet18", 0.125, (MEAN, STD))
    backbone.eval()
    path = save_encoder_checkpoint(tmp_path / "model.pt", backbone, "resnet18", 0.125)
    loaded, info = load_encoder_checkpoint(path)
    assert info["input_normalization"] == {"mean": MEAN, "std": STD}
    assert isinstance(loaded.input_norm, InputNormalization)
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), backbone(x))
        plain, _ = build_backbone("resnet18", 0.125)
        plain.load_state_dict(backbone.state_dict())
        assert not torch.allclose(plain.eval()(x), backbone(x))  # without the layer the features differ

    from ssl_models.evaluation.cli import main
    from ssl_models.evaluation.protocol import evaluate_backbone

    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    x_train, x_test = random_images(60, seed=1), random_images(20, seed=2)
    y_train, y_test = rng.integers(0, 3, 60), rng.integers(0, 3, 20)
    np.savez(data, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main([str(path), str(data), "--no-linear", "--device", "cpu"]) == 0
    record = json.loads(out.getvalue().strip().splitlines()[-1])
    assert record["input_normalization"] == {"mean": MEAN, "std": STD}
    direct = evaluate_backbone(
        backbone, x_train, y_train, x_test, y_test, 3, torch.device("cpu"), knn=True, linear=False
    )
    assert record["knn_acc"] == direct["knn_acc"]


def test_server_evaluator_and_flesd_server_use_the_configs_recipe_and_normalisation():
    from fedssl_wire import to_array_record
    from server_app.app import ServerEvaluator
    from ssl_models.data.splits import federated_split, load_experiment_data
    from ssl_models.factory import split_state, state_to_numpy
    from strategies.fedssl import ModelToEvaluate
    from strategies.flesd import FLESD

    cfg = ExperimentConfig.from_dict(
        {
            **TINY,
            "data": {**TINY["data"], "public_size": 16},
            "method": {"name": "simclr", "options": {"proj_hidden_dim": 16, "proj_out_dim": 8}},
            "strategy": {"name": "flesd"},
            "augment": FLESD_RECIPE,
        }
    )
    model = build_ssl_model(cfg, seed=0)
    arrays = to_array_record(state_to_numpy(split_state(model, model.shared_prefixes())[0]))
    evaluator = ServerEvaluator(cfg)
    backbone = evaluator.load(ModelToEvaluate("resnet18", arrays))
    assert isinstance(backbone.input_norm, InputNormalization)
    assert backbone.input_norm.values() == {"mean": MEAN, "std": STD}

    data = load_experiment_data(cfg)
    strategy = FLESD(clients={0: 10, 1: 11}, clients_per_round=2, options=FLESD.default_options())
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    assert isinstance(strategy.model.backbone.input_norm, InputNormalization)
    aug = strategy.augment  # what the distillation's views are made with
    assert aug.crop_scale == (0.2, 1.0) and aug.jitter == (0.8, 0.8, 0.8, 0.2) and aug.blur_p == 0.5


def test_local_training_gets_the_configs_recipe(monkeypatch):
    from client_app.rounds import weights
    from ssl_models.data.splits import client_images

    seen = {}
    real_train_ssl = weights.train_ssl

    def fake_train_ssl(method, images, **kwargs):
        seen.update(kwargs, method=method)
        return real_train_ssl(method, images, **kwargs)

    monkeypatch.setattr(weights, "train_ssl", fake_train_ssl)
    cfg = cfg_with(FLESD_RECIPE)
    model = build_ssl_model(cfg, seed=0)
    glob = {k: v for k, v in model.state_dict().items() if k.startswith(model.shared_prefixes())}
    weights.train_local_ssl(
        cfg,
        client_images(cfg, 0),
        {k: v.numpy() for k, v in glob.items()},
        None,
        server_round=1,
        partition_id=0,
        lr=0.05,
    )
    aug = seen["augment"]
    assert aug.crop_scale == (0.2, 1.0) and aug.jitter == (0.8, 0.8, 0.8, 0.2) and aug.blur_p == 0.5
    assert isinstance(seen["method"].backbone.input_norm, InputNormalization)
