"""Tests of the fixed evaluation protocol (ssl_models.evaluation.protocol): features, weighted kNN, linear probe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ssl_models.data.datasets import synthetic_dataset
from ssl_models.evaluation.protocol import (
    DEFAULT_PROTOCOL,
    evaluate_backbone,
    extract_features,
    knn_accuracy,
    knn_predict,
    linear_probe_accuracy,
    standardisation_stats,
)
from ssl_models.networks import build_backbone


@pytest.fixture(scope="module")
def tiny_backbone() -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    return build_backbone("resnet18", width=0.125)


@pytest.fixture(scope="module")
def tiny_data():
    return synthetic_dataset(num_train=200, num_test=100, num_classes=10, seed=0)


def _random_images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, 32, 32, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------------------------------------
# extract_features
# ----------------------------------------------------------------------------------------------------------


def test_extract_features_matches_manual_eval_forward(tiny_backbone):
    backbone, feature_dim = tiny_backbone
    images = _random_images(10)
    features = extract_features(backbone, images, batch_size=4)
    assert features.shape == (10, feature_dim) and features.dtype == torch.float32
    backbone.eval()
    with torch.no_grad():
        # [0, 1] floats, NCHW, no mean/std normalisation
        expected = backbone(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)


def test_extract_features_is_batch_size_invariant_and_keeps_bn_stats(tiny_backbone):
    backbone, _ = tiny_backbone
    images = _random_images(9, seed=1)
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    backbone.train()
    one_batch = extract_features(backbone, images, batch_size=512)
    many_batches = extract_features(backbone, images, batch_size=2)
    torch.testing.assert_close(one_batch, many_batches, rtol=1e-4, atol=1e-5)
    for name, value in backbone.state_dict().items():  # running stats / num_batches_tracked untouched
        assert torch.equal(value, before[name]), name


def test_extract_features_restores_every_submodule_mode(tiny_backbone):
    backbone, _ = tiny_backbone
    backbone.train()
    backbone.stem[1].eval()  # mixed modes must come back exactly as they were
    extract_features(backbone, _random_images(3))
    assert backbone.training and backbone.layer1.training
    assert not backbone.stem[1].training
    backbone.eval()
    extract_features(backbone, _random_images(3))
    assert not any(m.training for m in backbone.modules())


def test_extract_features_rejects_wrong_layout_and_dtype(tiny_backbone):
    backbone, _ = tiny_backbone
    with pytest.raises(ValueError, match="images_uint8_nhwc"):
        extract_features(backbone, np.zeros((2, 3, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        extract_features(backbone, np.zeros((2, 32, 32, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="batch_size"):
        extract_features(backbone, _random_images(2), batch_size=0)


def test_extract_features_of_no_images_is_empty_with_feature_width(tiny_backbone):
    backbone, feature_dim = tiny_backbone
    assert extract_features(backbone, np.zeros((0, 32, 32, 3), dtype=np.uint8)).shape == (0, feature_dim)


def test_extract_features_accepts_read_only_arrays(tiny_backbone):
    backbone, feature_dim = tiny_backbone
    images = _random_images(4)
    images.setflags(write=False)
    assert extract_features(backbone, images).shape == (4, feature_dim)


# ----------------------------------------------------------------------------------------------------------
# weighted kNN against hand computations
# ----------------------------------------------------------------------------------------------------------

# Bank: b0=(1,0) class 0, b1=(0,1) class 1, b2=(1,1) class 1, b3=(-1,0) class 0.
BANK = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
BANK_LABELS = torch.tensor([0, 1, 1, 0])
# q0=(1,0): cosines 1, 0, 0.7071, -1 -> top-3 = b0 (class 0), b2, b1 (class 1).
#   t=0.1: class 0 gets e^10 = 22026.5, class 1 gets e^7.071 + e^0 = 1177.3 + 1 -> predicts 0,
#   whereas an unweighted majority (2 votes to 1) would predict 1.
# q1=(0,2): cosines 0, 1, 0.7071, 0 -> top-3 = b1, b2 (class 1) and one cosine-0 point of class 0
#   -> class 1 (e^10 + e^7.07 vs e^0) -> predicts 1.
QUERIES = torch.tensor([[1.0, 0.0], [0.0, 2.0]])


def test_knn_weighted_vote_matches_hand_computation():
    predicted = knn_predict(BANK, BANK_LABELS, QUERIES, num_classes=2, k=3, temperature=0.1)
    assert predicted.tolist() == [0, 1]
    # labels [0, 0]: the first query is right, the second wrong -> 0.5
    assert knn_accuracy(BANK, BANK_LABELS, QUERIES, torch.tensor([0, 0]), 2, k=3, temperature=0.1) == 0.5


def test_knn_high_temperature_degenerates_to_majority_vote():
    # t=100: weights e^{0.01}=1.010 (class 0) vs e^{0.00707}+e^0=2.007 (class 1) -> q0 now predicts 1.
    predicted = knn_predict(BANK, BANK_LABELS, QUERIES, num_classes=2, k=3, temperature=100.0)
    assert predicted.tolist() == [1, 1]


def test_knn_uses_cosine_similarity_not_euclidean_distance():
    # Query (0.1, 0.05): Euclidean-nearest is (0, 0.2) of class 1 (distance 0.18 vs 4.9), but its cosine with
    # (5, 0) is 0.894 against 0.447, so the cosine 1-NN answers class 0. Rescaling the bank changes nothing.
    bank, labels = torch.tensor([[5.0, 0.0], [0.0, 0.2]]), torch.tensor([0, 1])
    query = torch.tensor([[0.1, 0.05]])
    assert knn_predict(bank, labels, query, num_classes=2, k=1).tolist() == [0]
    assert knn_predict(bank * torch.tensor([[0.01], [30.0]]), labels, query, num_classes=2, k=1).tolist() == [0]


def test_knn_caps_k_at_bank_size_and_batches_queries():
    # k=200 is capped to the 4 bank points, so everybody votes:
    # q0: class 0 = e^10 + e^-10, class 1 = e^7.07 + e^0 -> 0;  q1: class 1 = e^10 + e^7.07, class 0 = 2 -> 1.
    labels = torch.tensor([0, 1])
    assert knn_accuracy(BANK, BANK_LABELS, QUERIES, labels, 2, k=200, batch_size=1) == 1.0


def test_knn_ties_go_to_the_lowest_class_index():
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    predicted = knn_predict(bank, torch.tensor([1, 0]), torch.tensor([[1.0, 1.0]]), num_classes=2, k=2)
    assert predicted.tolist() == [0]


def test_knn_tiny_temperature_does_not_overflow():
    predicted = knn_predict(BANK, BANK_LABELS, QUERIES, num_classes=2, k=3, temperature=1e-4)
    assert predicted.tolist() == [0, 1]


def test_knn_accepts_numpy_and_validates_arguments():
    assert knn_accuracy(BANK.numpy(), BANK_LABELS.numpy(), QUERIES.numpy(), np.array([0, 1]), 2, k=3) == 1.0
    with pytest.raises(ValueError, match="test_labels"):
        knn_accuracy(BANK, BANK_LABELS, QUERIES, torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="width"):
        knn_accuracy(BANK, BANK_LABELS, torch.ones(2, 3), torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="k must"):
        knn_accuracy(BANK, BANK_LABELS, QUERIES, torch.tensor([0, 1]), 2, k=0)
    with pytest.raises(ValueError, match="temperature"):
        knn_accuracy(BANK, BANK_LABELS, QUERIES, torch.tensor([0, 1]), 2, temperature=0.0)
    with pytest.raises(ValueError, match="test_feats"):
        knn_accuracy(BANK, BANK_LABELS, torch.ones(0, 2), torch.ones(0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="train_labels"):
        knn_accuracy(BANK, BANK_LABELS.float(), QUERIES, torch.tensor([0, 1]), 2)


# ----------------------------------------------------------------------------------------------------------
# linear probe
# ----------------------------------------------------------------------------------------------------------


def _clustered(num_per_class: int, num_classes: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs around well separated class centres: linearly separable with overwhelming margin."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(123)) * 6.0
    labels = torch.arange(num_classes).repeat_interleave(num_per_class)
    return centres[labels] + torch.randn(labels.shape[0], dim, generator=generator), labels


def test_standardisation_stats_match_hand_values_and_guard_constant_dims():
    features = torch.tensor([[1.0, 5.0, 2.0], [3.0, 5.0, 2.0]])
    mean, std = standardisation_stats(features)
    assert mean.tolist() == [2.0, 5.0, 2.0]
    assert std.tolist() == [1.0, 1.0, 1.0]  # population std of (1, 3) is 1; constant dims get 1
    mean, std = standardisation_stats(torch.tensor([[0.0, 10.0], [4.0, 30.0]]))
    assert std.tolist() == [2.0, 10.0]


def test_linear_probe_reaches_full_accuracy_on_separable_features():
    train_x, train_y = _clustered(40, 4, 16, seed=0)
    test_x, test_y = _clustered(25, 4, 16, seed=1)
    # A constant column and a huge-scale column must not break the standardisation.
    train_x = torch.cat([train_x, torch.full((len(train_x), 1), 3.0), train_x[:, :1] * 1e4], dim=1)
    test_x = torch.cat([test_x, torch.full((len(test_x), 1), 3.0), test_x[:, :1] * 1e4], dim=1)
    assert linear_probe_accuracy(train_x, train_y, test_x, test_y, 4, epochs=30) == 1.0


def test_linear_probe_on_random_labels_is_near_chance():
    generator = torch.Generator().manual_seed(0)
    train_x, test_x = torch.randn(400, 32, generator=generator), torch.randn(1000, 32, generator=generator)
    train_y = torch.randint(0, 4, (400,), generator=generator)
    test_y = torch.randint(0, 4, (1000,), generator=generator)
    accuracy = linear_probe_accuracy(train_x, train_y, test_x, test_y, 4, epochs=20)
    assert 0.18 <= accuracy <= 0.32  # chance is 0.25; 3 sigma of a 1000-sample estimate is about 0.04


def test_linear_probe_is_deterministic_for_a_seed_and_leaves_global_rng_alone():
    train_x, train_y = _clustered(30, 3, 8, seed=2)
    noisy_y = train_y.clone()
    noisy_y[::4] = (noisy_y[::4] + 1) % 3  # label noise so the result actually depends on the training path
    test_x, test_y = _clustered(30, 3, 8, seed=3)
    torch.manual_seed(42)
    expected_next = torch.rand(1)
    torch.manual_seed(42)
    first = linear_probe_accuracy(train_x, noisy_y, test_x, test_y, 3, epochs=5, batch_size=16, seed=7)
    assert torch.equal(torch.rand(1), expected_next)  # global RNG not consumed
    second = linear_probe_accuracy(train_x, noisy_y, test_x, test_y, 3, epochs=5, batch_size=16, seed=7)
    assert first == second


def test_linear_probe_validates_arguments():
    x, y = _clustered(5, 2, 4, seed=0)
    with pytest.raises(ValueError, match="epochs"):
        linear_probe_accuracy(x, y, x, y, 2, epochs=0)
    with pytest.raises(ValueError, match="lr"):
        linear_probe_accuracy(x, y, x, y, 2, lr=0)
    with pytest.raises(ValueError, match="num_classes"):
        linear_probe_accuracy(x, y, x, y, 1)
    with pytest.raises(ValueError, match="train_feats"):
        linear_probe_accuracy(x[0], y, x, y, 2)


# ----------------------------------------------------------------------------------------------------------
# evaluate_backbone
# ----------------------------------------------------------------------------------------------------------


def test_evaluate_backbone_reports_all_fields(tiny_backbone, tiny_data):
    backbone, feature_dim = tiny_backbone
    result = evaluate_backbone(
        backbone,
        tiny_data.x_train,
        tiny_data.y_train,
        tiny_data.x_test,
        tiny_data.y_test,
        10,
        probe_epochs=10,
        return_features=True,
    )
    assert result["num_train"] == 200 and result["num_test"] == 100 and result["feature_dim"] == feature_dim
    assert result["train_features"].shape == (200, feature_dim)
    assert result["test_features"].shape == (100, feature_dim)
    # The synthetic classes differ in colour and grating, so even random-init features beat chance (0.1).
    assert 0.3 < result["knn_acc"] <= 1.0
    assert 0.2 < result["linear_probe_acc"] <= 1.0
    # The scores are exactly the stand-alone functions applied to the returned features.
    assert result["knn_acc"] == knn_accuracy(
        result["train_features"], tiny_data.y_train, result["test_features"], tiny_data.y_test, 10
    )
    assert set(result["seconds"]) == {"features", "knn", "linear_probe"}


def test_evaluate_backbone_can_skip_scores(tiny_backbone, tiny_data):
    backbone, _ = tiny_backbone
    result = evaluate_backbone(
        backbone,
        tiny_data.x_train[:50],
        tiny_data.y_train[:50],
        tiny_data.x_test[:20],
        tiny_data.y_test[:20],
        10,
        knn=False,
        linear=False,
    )
    assert result["knn_acc"] is None and result["linear_probe_acc"] is None
    assert "train_features" not in result
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_a_protocol_key'"):
        evaluate_backbone(
            backbone, tiny_data.x_train, tiny_data.y_train, tiny_data.x_test, tiny_data.y_test, 10, not_a_protocol_key=1
        )


def test_default_protocol_is_the_documented_one():
    assert dict(DEFAULT_PROTOCOL) == {
        "feature_batch_size": 512,
        "knn_k": 200,
        "knn_temperature": 0.1,
        "probe_epochs": 100,
        "probe_lr": 1e-3,
        "probe_batch_size": 256,
        "probe_weight_decay": 0.0,
        "seed": 0,
    }
