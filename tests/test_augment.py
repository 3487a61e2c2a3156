"""Tests for ssl_models.data.augment: batched, per-sample-random SSL views matching torchvision's recipe."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torchvision.transforms import v2

from ssl_models.data.augment import (
    SSLAugment,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    color_jitter,
    crop_flip_resize,
    hsv_to_rgb,
    hue_where,
    rgb_to_hsv,
    sample_crop_boxes,
    to_float_nchw,
)
from ssl_models.data.datasets import synthetic_dataset

IDENTITY_KW = {"crop_scale": (1.0, 1.0), "jitter_p": 0.0, "grayscale_p": 0.0, "flip_p": 0.0}


def random_uint8(num: int = 16, size: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num, size, size, 3), dtype=torch.uint8, generator=generator)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------- formats


def test_to_float_nchw_scales_and_permutes():
    images = random_uint8(2, 4)
    out = to_float_nchw(images.numpy())
    assert out.shape == (2, 3, 4, 4) and out.dtype == torch.float32
    assert out[1, 2, 3, 0].item() == pytest.approx(images[1, 3, 0, 2].item() / 255.0)
    with pytest.raises(ValueError, match="NHWC"):
        to_float_nchw(images.permute(0, 3, 1, 2))
    with pytest.raises(ValueError, match="NCHW"):
        to_float_nchw(torch.rand(2, 4, 4, 3))


@pytest.mark.parametrize("in_size, out_size", [(32, 32), (96, 96), (40, 32)])
def test_output_shape_dtype_range(in_size, out_size):
    out = SSLAugment(image_size=out_size)(random_uint8(8, in_size), seeded(0))
    assert out.shape == (8, 3, out_size, out_size) and out.dtype == torch.float32
    assert out.min() >= 0.0 and out.max() <= 1.0


def test_accepts_numpy_and_float_nchw_alike():
    images = random_uint8(4)
    aug = SSLAugment()
    from_tensor = aug(images, seeded(1))
    from_numpy = aug(images.numpy(), seeded(1))
    from_float = aug(to_float_nchw(images), seeded(1))
    assert torch.equal(from_tensor, from_numpy) and torch.equal(from_tensor, from_float)


# ----------------------------------------------------------------------------- randomness


def test_each_sample_gets_its_own_parameters():
    same_image = random_uint8(1).expand(8, -1, -1, -1)
    out = SSLAugment()(same_image, seeded(0)).flatten(1)
    gaps = torch.cdist(out, out)
    assert (gaps + torch.eye(8) * 1e9).min() > 1e-3  # no two samples identical


def test_seeded_generator_is_reproducible_and_seed_dependent():
    images = random_uint8(8)
    aug = SSLAugment()
    assert torch.equal(aug(images, seeded(5)), aug(images, seeded(5)))
    assert not torch.allclose(aug(images, seeded(5)), aug(images, seeded(6)))
    view1, view2 = aug.two_views(images, seeded(5))
    assert torch.equal(view1, aug(images, seeded(5)))  # two_views = two calls on one generator
    assert not torch.allclose(view1, view2)


# ----------------------------------------------------------------------- identities by hand


def test_disabled_augmentations_give_the_identity():
    images = random_uint8(8)
    out = SSLAugment(**IDENTITY_KW)(images, seeded(0))
    torch.testing.assert_close(out, to_float_nchw(images), atol=1e-6, rtol=0)


def test_flip_only_mirrors_width():
    images = random_uint8(4)
    out = SSLAugment(**{**IDENTITY_KW, "flip_p": 1.0})(images, seeded(0))
    torch.testing.assert_close(out, to_float_nchw(images).flip(-1), atol=1e-6, rtol=0)


def test_grayscale_gives_equal_channels_equal_to_luma():
    images = random_uint8(4)
    out = SSLAugment(**{**IDENTITY_KW, "grayscale_p": 1.0})(images, seeded(0))
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 1], out[:, 2])
    x = to_float_nchw(images)
    torch.testing.assert_close(out[:, 0], 0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])


def test_crop_resize_matches_interpolate_inside_the_box():
    images = to_float_nchw(random_uint8(1, 16))
    box = torch.tensor([[2.0, 4.0, 8.0, 8.0]])  # top 2, left 4, 8x8 -> upsampled to 16x16
    out = crop_flip_resize(images, box, torch.tensor([False]), out_size=16)
    expected = F.interpolate(images[:, :, 2:10, 4:12], size=16, mode="bilinear", align_corners=False)
    # Border rows differ by design: grid_sample reads the neighbours outside the box, interpolate clamps.
    torch.testing.assert_close(out[..., 1:-1, 1:-1], expected[..., 1:-1, 1:-1], atol=1e-5, rtol=0)


def test_crop_boxes_follow_random_resized_crop():
    boxes = sample_crop_boxes(4000, 32, 32, (0.08, 1.0), (3 / 4, 4 / 3), seeded(0))
    top, left, box_h, box_w = boxes.unbind(1)
    assert torch.all(top >= 0) and torch.all(left >= 0)
    assert torch.all(top + box_h <= 32) and torch.all(left + box_w <= 32)
    assert torch.equal(boxes, boxes.round())  # integer boxes, as torchvision
    # Compare the mean area fraction with torchvision's own sampler.
    torch.manual_seed(0)
    reference = [
        v2.RandomResizedCrop.get_params(torch.zeros(3, 32, 32), [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)
    ]
    ref_area = np.mean([h * w for _, _, h, w in reference]) / 1024
    our_area = (box_h * box_w).mean().item() / 1024
    assert abs(our_area - ref_area) < 0.02


def test_crop_fallback_is_the_whole_image_for_full_scale():
    boxes = sample_crop_boxes(50, 24, 24, (1.0, 1.0), (3 / 4, 4 / 3), seeded(0))
    assert torch.equal(boxes, torch.tensor([[0.0, 0.0, 24.0, 24.0]]).expand(50, 4))


def test_crop_fallback_clamps_aspect_ratio_for_wide_images():
    # Width/height 2 > 4/3: torchvision falls back to h=H, w=round(H*4/3)=16, centred.
    boxes = sample_crop_boxes(5, 12, 24, (1.0, 1.0), (3 / 4, 4 / 3), seeded(0))
    assert boxes[0].tolist() == [0.0, 4.0, 12.0, 16.0]


# --------------------------------------------------------------------- colour maths vs torchvision


@pytest.mark.parametrize(
    "ours, theirs, low, high",
    [
        (adjust_brightness, TF.adjust_brightness, 0.6, 1.4),
        (adjust_contrast, TF.adjust_contrast, 0.6, 1.4),
        (adjust_saturation, TF.adjust_saturation, 0.0, 1.4),
        (adjust_hue, TF.adjust_hue, -0.5, 0.5),
    ],
)
def test_colour_steps_match_torchvision(ours, theirs, low, high):
    images = torch.rand(6, 3, 8, 8, generator=seeded(0))
    factors = torch.linspace(low, high, 6)
    expected = torch.stack([theirs(img, float(f)) for img, f in zip(images, factors)])
    torch.testing.assert_close(ours(images, factors), expected, atol=1e-5, rtol=0)


def test_colour_steps_by_hand():
    flat = torch.full((1, 3, 2, 2), 0.8)
    assert torch.allclose(adjust_brightness(flat, torch.tensor([0.5])), torch.full_like(flat, 0.4))
    assert torch.allclose(adjust_brightness(flat, torch.tensor([1.5])), torch.ones_like(flat))  # clamped
    two_tone = torch.tensor([0.2, 0.6]).view(1, 1, 1, 2).expand(1, 3, 2, 2)
    # Contrast 0 -> the mean grey level 0.4 everywhere (luma weights sum to 0.9999, hence atol).
    torch.testing.assert_close(
        adjust_contrast(two_tone, torch.tensor([0.0])), torch.full_like(two_tone, 0.4), atol=1e-4, rtol=0
    )
    red = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    assert torch.allclose(rgb_to_hsv(red).flatten(), torch.tensor([0.0, 1.0, 1.0]))
    green = adjust_hue(red, torch.tensor([1.0 / 3.0]))
    assert torch.allclose(green.flatten(), torch.tensor([0.0, 1.0, 0.0]), atol=1e-6)


def test_hue_where_strategies_agree():
    images = torch.rand(6, 3, 8, 8, generator=seeded(4))
    chosen = torch.tensor([True, False, True, False, False, True])
    shift = torch.linspace(-0.1, 0.1, 6)
    gathered = hue_where(images, chosen, shift, gather_rows=True)
    selected = hue_where(images, chosen, shift, gather_rows=False)
    torch.testing.assert_close(gathered, selected, atol=1e-6, rtol=0)
    assert torch.equal(gathered[~chosen], images[~chosen])
    torch.testing.assert_close(gathered[chosen], adjust_hue(images[chosen], shift[chosen]))


def test_hsv_round_trip():
    images = torch.rand(4, 3, 16, 16, generator=seeded(2))
    torch.testing.assert_close(hsv_to_rgb(rgb_to_hsv(images)), images, atol=1e-6, rtol=0)


def test_color_jitter_applies_steps_in_each_samples_order():
    images = torch.rand(6, 3, 8, 8, generator=seeded(3))
    factors = torch.tensor([[1.3] * 6, [0.7] * 6, [1.4] * 6, [0.08] * 6])
    order = torch.stack([torch.randperm(4, generator=seeded(s)) for s in range(6)])
    active = torch.tensor([True, True, True, True, True, False])
    out = color_jitter(images, factors, order, active)
    steps = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    for n in range(5):
        expected = images[n]
        for step in order[n].tolist():
            expected = steps[step](expected, float(factors[step, n]))
        torch.testing.assert_close(out[n], expected, atol=1e-5, rtol=0)
    assert torch.equal(out[5], images[5])  # inactive sample untouched


# ------------------------------------------------------------------------------ safety


def test_autocast_keeps_float32_and_leaves_input_unchanged():
    images = random_uint8(4)
    as_float = to_float_nchw(images)
    copies = images.clone(), as_float.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = SSLAugment()(images, seeded(0))
        out_float = SSLAugment()(as_float, seeded(0))
    assert out.dtype == torch.float32 and out_float.dtype == torch.float32
    assert torch.equal(images, copies[0]) and torch.equal(as_float, copies[1])
    torch.testing.assert_close(out, SSLAugment()(images, seeded(0)))


def test_constructor_validates_arguments():
    with pytest.raises(ValueError, match="image_size"):
        SSLAugment(image_size=0)
    with pytest.raises(ValueError, match="crop_scale"):
        SSLAugment(crop_scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="jitter"):
        SSLAugment(jitter=(0.4, 0.4, 0.4, 0.6))
    with pytest.raises(ValueError, match="grayscale_p"):
        SSLAugment(grayscale_p=1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_generator_drives_cuda_batches_like_cpu_ones():
    images = random_uint8(32)
    aug = SSLAugment()
    on_cpu = aug(images, seeded(0))
    on_gpu = aug(images.cuda(), seeded(0))
    assert on_gpu.is_cuda
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-4, rtol=0)
    cuda_generator = torch.Generator(device="cuda").manual_seed(0)
    assert aug(images.cuda(), cuda_generator).shape == (32, 3, 32, 32)


# ------------------------------------------------------------------ against torchvision v2 per image


def _torchvision_recipe() -> v2.Compose:
    return v2.Compose(
        [
            v2.RandomResizedCrop(32, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
            v2.RandomHorizontalFlip(0.5),
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            v2.RandomGrayscale(0.2),
            v2.ToDtype(torch.float32, scale=True),
        ]
    )


def _best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_statistics_match_torchvision_and_report_throughput(capsys):
    images = torch.from_numpy(synthetic_dataset(512, 1, 10, seed=0).x_train)
    per_image = images.permute(0, 3, 1, 2).contiguous()
    recipe, aug = _torchvision_recipe(), SSLAugment()
    torch.manual_seed(0)
    reference = torch.stack([recipe(img) for img in per_image])
    ours = aug(images, seeded(0))

    def grey_fraction(batch: torch.Tensor) -> float:
        return float(((batch[:, 0] == batch[:, 1]) & (batch[:, 1] == batch[:, 2])).flatten(1).all(1).float().mean())

    # 512 samples: standard error of the grey fraction ~0.018, of the mean level ~0.005.
    assert abs(grey_fraction(ours) - 0.2) < 0.07 and abs(grey_fraction(reference) - 0.2) < 0.07
    assert abs(ours.mean().item() - reference.mean().item()) < 0.03
    assert abs(ours.std(dim=(2, 3)).mean().item() - reference.std(dim=(2, 3)).mean().item()) < 0.03

    torch_time = _best_of(2, lambda: torch.stack([recipe(img) for img in per_image]))
    ours_time = _best_of(2, lambda: aug(images))
    with capsys.disabled():
        print(
            f"\n[augment throughput, 512 images 32x32, {torch.get_num_threads()} threads] "
            f"torchvision v2 per image: {512 / torch_time:,.0f} img/s ({torch_time * 1e3:.0f} ms); "
            f"SSLAugment batched: {512 / ours_time:,.0f} img/s ({ours_time * 1e3:.0f} ms); "
            f"speed-up x{torch_time / ours_time:.1f}"
        )
