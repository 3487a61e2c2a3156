"""Tests of the semi-supervised evaluation (ssl_models.evaluation.protocol protocol step 5) and its fedssl-eval flags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ssl_models.data.datasets import synthetic_dataset
from ssl_models.evaluation.checkpoint import save_encoder_checkpoint
from ssl_models.evaluation.cli import main
from ssl_models.evaluation.protocol import (
    build_mlp_head,
    class_balanced_label_subset,
    extract_features,
    fit_mlp_head,
    random_crop_flip,
    semi_supervised_accuracy,
)
from ssl_models.networks import build_backbone

ARCH, WIDTH = "resnet18", 0.125


@pytest.fixture(scope="module")
def tiny_data():
    return synthetic_dataset(num_train=200, num_test=100, num_classes=10, seed=0)


def _backbone(seed: int = 0) -> nn.Module:
    """A tiny backbone whose BN buffers differ from a fresh build (so "unchanged" is a real check)."""
    torch.manual_seed(seed)
    backbone, _ = build_backbone(ARCH, WIDTH)
    backbone.train()
    with torch.no_grad():
        backbone(torch.rand(8, 3, 32, 32))
    return backbone.eval()


def _state_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _assert_same_state(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = module.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


class _Recorder:
    """Forward pre-hooks on the backbone's BatchNorms and stem conv.

    ``copy.deepcopy`` copies hooks, so a fine-tuned copy of the backbone reports into the same recorder: this is
    how the tests see what happened inside the function without access to the copy.
    """

    def __init__(self, backbone: nn.Module) -> None:
        self.bn_training: list[bool] = []
        self.stem_weight_sums: list[float] = []
        for module in backbone.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.register_forward_pre_hook(lambda m, _: self.bn_training.append(m.training))
        backbone.stem[0].register_forward_pre_hook(
            lambda m, _: self.stem_weight_sums.append(float(m.weight.detach().double().sum()))
        )


# ----------------------------------------------------------------------------------------------------------
# class_balanced_label_subset
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "per_class"),
    [(0.1, 2), (0.25, 5), (0.125, 3), (0.001, 1), (1.0, 20)],  # 0.125 * 200 / 10 = 2.5 -> 3 (half up)
)
def test_label_subset_takes_the_same_rounded_count_from_every_class(fraction, per_class):
    labels = np.random.default_rng(0).permutation(np.arange(200) % 10)  # 20 images per class
    subset = class_balanced_label_subset(labels, fraction, num_classes=10, seed=0)
    assert subset.dtype == np.int64 and len(subset) == 10 * per_class
    assert np.all(np.diff(subset) > 0)  # sorted, no repeats
    assert np.bincount(labels[subset], minlength=10).tolist() == [per_class] * 10


def test_label_subset_is_deterministic_seeded_and_nested_across_fractions():
    labels = np.arange(300) % 10
    small = class_balanced_label_subset(labels, 0.1, 10, seed=4)
    assert np.array_equal(small, class_balanced_label_subset(labels, 0.1, 10, seed=4))
    assert not np.array_equal(small, class_balanced_label_subset(labels, 0.1, 10, seed=5))
    large = class_balanced_label_subset(labels, 0.5, 10, seed=4)
    assert len(small) == 30 and len(large) == 150 and set(small) <= set(large)


def test_label_subset_takes_all_of_a_class_smaller_than_the_quota():
    labels = np.array([0] * 2 + [1] * 18)
    subset = class_balanced_label_subset(labels, 0.5, num_classes=2, seed=0)  # quota round(0.5 * 20 / 2) = 5
    assert np.bincount(labels[subset]).tolist() == [2, 5]
    assert subset[:2].tolist() == [0, 1]


def test_label_subset_rejects_bad_arguments():
    labels = np.arange(20) % 4
    for fraction in (0, -0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="fraction"):
            class_balanced_label_subset(labels, fraction, 4, seed=0)
    with pytest.raises(ValueError, match="no image of class 4"):
        class_balanced_label_subset(labels, 0.5, 5, seed=0)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        class_balanced_label_subset(labels, 0.5, 3, seed=0)
    with pytest.raises(ValueError, match="integer class ids"):
        class_balanced_label_subset(labels.astype(float), 0.5, 4, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        class_balanced_label_subset(labels.reshape(4, 5), 0.5, 4, seed=0)


# ----------------------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------------------


def test_random_crop_flip_outputs_are_shifted_and_mirrored_crops_of_the_zero_padded_images():
    images = torch.from_numpy(np.random.default_rng(1).integers(1, 256, size=(64, 6, 5, 3), dtype=np.uint8))
    original = images.clone()
    out = random_crop_flip(images, padding=2, generator=torch.Generator().manual_seed(0))
    assert out.shape == images.shape and out.dtype == torch.uint8
    assert torch.equal(images, original)  # input untouched
    padded = torch.zeros(64, 10, 9, 3, dtype=torch.uint8)
    padded[:, 2:8, 2:7] = images
    seen = set()
    for n in range(64):
        matches = [
            (top, left, flip)
            for top in range(5)
            for left in range(5)
            for flip in (False, True)
            if torch.equal(
                out[n],
                padded[n, top : top + 6, left : left + 5].flip(1)
                if flip
                else padded[n, top : top + 6, left : left + 5],
            )
        ]
        assert len(matches) == 1, n  # pixels are all non-zero, so the crop offset and flip are identifiable
        seen.add(matches[0])
    assert {flip for _, _, flip in seen} == {False, True} and len({(t, l) for t, l, _ in seen}) > 10
    again = random_crop_flip(images, padding=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    unpadded = random_crop_flip(images, padding=0, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(unpadded[n], images[n]) or torch.equal(unpadded[n], images[n].flip(1)) for n in range(64))


def test_mlp_head_layout_and_seeded_default_init_leave_the_global_rng_alone():
    global_state = torch.get_rng_state()
    head = build_mlp_head(16, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), global_state)
    assert [type(layer) for layer in head] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert (head[0].in_features, head[0].out_features, head[3].in_features, head[3].out_features) == (16, 16, 16, 5)
    assert head[0].weight.abs().max() <= 1 / 16**0.5 and head[0].weight.abs().max() > 0.9 / 16**0.5
    twin = build_mlp_head(16, 5, generator=torch.Generator().manual_seed(0))
    for mine, theirs in zip(head.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)
    assert build_mlp_head(16, 5, hidden_dim=7)[1].num_features == 7


# ----------------------------------------------------------------------------------------------------------
# semi_supervised_accuracy
# ----------------------------------------------------------------------------------------------------------


def test_head_mode_freezes_the_backbone_and_equals_an_mlp_head_on_precomputed_features(tiny_data):
    backbone = _backbone()
    before = _state_copy(backbone)
    recorder = _Recorder(backbone)
    kwargs = {"epochs": 100, "batch_size": 32, "mode": "head", "seed": 2}
    result = semi_supervised_accuracy(
        backbone, tiny_data.x_train, tiny_data.y_train, tiny_data.x_test, tiny_data.y_test, 10, 0.5, **kwargs
    )
    _assert_same_state(backbone, before)  # weights and BN running statistics
    assert not backbone.training
    assert recorder.bn_training and not any(recorder.bn_training)  # BN only ever ran in eval mode
    # features computed once: one batch of the 100 labelled images and one of the 100 test images
    assert len(recorder.stem_weight_sums) == 2
    assert result["mode"] == "head" and result["augment"] is False
    assert (result["fraction"], result["num_labelled"], result["epochs"]) == (0.5, 100, 100)

    subset = class_balanced_label_subset(tiny_data.y_train, 0.5, 10, seed=2)
    head = fit_mlp_head(
        extract_features(backbone, tiny_data.x_train[subset]),
        torch.from_numpy(tiny_data.y_train[subset]),
        10,
        epochs=100,
        batch_size=32,
        seed=2,
    )
    with torch.no_grad():
        predicted = head(extract_features(backbone, tiny_data.x_test)).argmax(dim=1).numpy()
    assert result["accuracy"] == pytest.approx(float(np.mean(predicted == tiny_data.y_test)), abs=1e-12)
    assert result["accuracy"] >= 0.5  # chance is 0.1 (0.73 here)

    repeat = semi_supervised_accuracy(
        backbone, tiny_data.x_train, tiny_data.y_train, tiny_data.x_test, tiny_data.y_test, 10, 0.5, **kwargs
    )
    assert repeat["accuracy"] == result["accuracy"]


def test_finetune_mode_trains_a_copy_in_train_mode_and_leaves_the_callers_backbone_unchanged(tiny_data):
    backbone = _backbone(seed=1)
    backbone.layer1.train()  # a mixed train/eval state must survive as well
    before = _state_copy(backbone)
    recorder = _Recorder(backbone)
    # 4 steps per epoch on the 100 labelled images; an odd batch size also guards the contiguous() fix of the
    # CPU crash on channels-last batches (see _finetune_classifier)
    kwargs = {"epochs": 8, "batch_size": 25, "seed": 0}
    result = semi_supervised_accuracy(
        backbone, tiny_data.x_train, tiny_data.y_train, tiny_data.x_test, tiny_data.y_test, 10, 0.5, **kwargs
    )
    _assert_same_state(backbone, before)
    assert not backbone.training and backbone.layer1.training and not backbone.layer2.training
    assert all(p.grad is None for p in backbone.parameters())
    steps, bn_layers = 8 * 4, sum(isinstance(m, nn.BatchNorm2d) for m in backbone.modules())
    assert recorder.bn_training[: steps * bn_layers] == [True] * (steps * bn_layers)  # the copy trains in train()
    assert not any(recorder.bn_training[steps * bn_layers :])  # and is scored in eval()
    sums = recorder.stem_weight_sums
    assert len(set(sums[:steps])) == steps  # every step updated the copy's encoder weights
    assert result["mode"] == "finetune" and result["augment"] is True and result["num_labelled"] == 100
    assert result["accuracy"] > 0.2  # chance is 0.1 (0.35 here after these 32 steps)

    repeat = semi_supervised_accuracy(
        backbone, tiny_data.x_train, tiny_data.y_train, tiny_data.x_test, tiny_data.y_test, 10, 0.5, **kwargs
    )
    assert repeat["accuracy"] == result["accuracy"]  # seeded: subset, head init, order and augmentation
    assert set(result) == {"fraction", "num_labelled", "mode", "augment", "accuracy", "epochs", "seconds"}
    assert result["seconds"] > 0


def test_finetune_does_not_touch_the_global_rng(tiny_data):
    backbone = _backbone()
    state = torch.get_rng_state()
    semi_supervised_accuracy(
        backbone,
        tiny_data.x_train[:40],
        tiny_data.y_train[:40],
        tiny_data.x_test[:10],
        tiny_data.y_test[:10],
        10,
        0.1,
        epochs=1,
    )
    assert torch.equal(torch.get_rng_state(), state)


def test_semi_supervised_accuracy_rejects_bad_arguments(tiny_data):
    backbone = _backbone()
    args = (backbone, tiny_data.x_train, tiny_data.y_train, tiny_data.x_test, tiny_data.y_test, 10)
    cases = [
        ({"fraction": 0.0}, "fraction"),
        ({"fraction": 0.5, "mode": "linear"}, "mode must be one of"),
        ({"fraction": 0.5, "mode": "head", "augment": True}, "augment=True needs mode='finetune'"),
        ({"fraction": 0.5, "batch_size": 1}, "batch_size must be an integer >= 2"),
        ({"fraction": 0.5, "epochs": 0}, "epochs must be an integer >= 1"),
        ({"fraction": 0.5, "lr": 0.0}, "lr must be > 0"),
    ]
    for kwargs, message in cases:
        fraction = kwargs.pop("fraction")
        with pytest.raises(ValueError, match=message):
            semi_supervised_accuracy(*args, fraction, **kwargs)
    with pytest.raises(ValueError, match="x_train must have dtype uint8"):
        semi_supervised_accuracy(backbone, tiny_data.x_train.astype(np.float32), *args[2:], 0.5)


# ----------------------------------------------------------------------------------------------------------
# fedssl-eval --semi-supervised
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("semi")
    model = save_encoder_checkpoint(folder / "model.pt", _backbone(seed=3), ARCH, WIDTH)
    data = synthetic_dataset(num_train=120, num_test=60, num_classes=6, seed=1)
    npz = folder / "toy.npz"
    np.savez(npz, x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test)
    return model, npz


def _run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_reports_one_semi_supervised_record_per_fraction(capsys, cli_files):
    model, npz = cli_files
    code, out, err = _run_cli(
        capsys,
        model,
        npz,
        "--no-linear",
        "--knn-k",
        "20",
        "--semi-supervised",
        "0.1,0.5",
        "--semi-epochs",
        "2",
        "--semi-lr",
        "0.002",
    )
    assert code == 0, err
    record = json.loads(out)
    semi = record["semi_supervised"]
    # 120 train images of 6 classes: round(0.1 * 120 / 6) = 2 and round(0.5 * 120 / 6) = 10 per class
    assert [(r["fraction"], r["num_labelled"], r["mode"], r["epochs"]) for r in semi] == [
        (0.1, 12, "finetune", 2),
        (0.5, 60, "finetune", 2),
    ]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["augment"] is True for r in semi)
    assert record["protocol"]["semi_mode"] == "finetune" and record["protocol"]["semi_lr"] == 0.002
    assert record["protocol"]["semi_epochs"] == 2 and "semi_supervised" in record["seconds_by_step"]
    assert record["linear_probe_acc"] is None and record["knn_acc"] is not None
    assert "semi-supervised" in err

    with np.load(npz) as arrays:
        expected = semi_supervised_accuracy(
            _backbone(seed=3),
            arrays["x_train"],
            arrays["y_train"],
            arrays["x_test"],
            arrays["y_test"],
            6,
            0.5,
            epochs=2,
            lr=0.002,
            device=record["device"],
        )
    assert semi[1]["accuracy"] == expected["accuracy"]


def test_cli_head_mode_and_no_semi_supervised_flag(capsys, cli_files):
    model, npz = cli_files
    code, out, _ = _run_cli(
        capsys, model, npz, "--no-linear", "--semi-supervised", "1", "--semi-mode", "head", "--semi-epochs", "3"
    )
    assert code == 0
    (only,) = json.loads(out)["semi_supervised"]
    assert (only["mode"], only["augment"], only["num_labelled"]) == ("head", False, 120)
    code, out, _ = _run_cli(capsys, model, npz, "--no-linear")
    assert code == 0 and json.loads(out)["semi_supervised"] == []


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--semi-supervised", "0"], "--semi-supervised"),
        (["--semi-supervised", "0.1,1.5"], "--semi-supervised"),
        (["--semi-supervised", "0.1,,0.2"], "--semi-supervised"),
        (["--semi-supervised", "nan"], "--semi-supervised"),
        (["--semi-supervised", "0.1", "--semi-mode", "linear"], "--semi-mode"),
        (["--semi-supervised", "0.1", "--semi-epochs", "0"], "--semi-epochs"),
        (["--semi-supervised", "0.1", "--semi-lr", "-1"], "--semi-lr"),
    ],
)
def test_cli_rejects_bad_semi_supervised_flags_with_exit_2(capsys, cli_files, flags, named):
    model, npz = cli_files
    code, out, err = _run_cli(capsys, model, npz, *flags)
    assert code == 2 and out == "" and named in err
