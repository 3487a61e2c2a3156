"""Batched SSL augmentations that run on the training device.

The default recipe, as torchvision would apply it per image::

    RandomResizedCrop(32, scale=(0.08, 1.0), ratio=(3/4, 4/3)) -> RandomHorizontalFlip(0.5)
    -> RandomApply([ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8) -> RandomGrayscale(0.2) -> ToTensor

with no blur and no normalisation. It is this project's default, the common CIFAR recipe with moderate
jitter; it is *not* what the papers reproduced here train with: EasyFL (the FedEMA code) uses it only for
MoCo v1, its SimCLR/BYOL/SimSiam/MoCo v2 transform has ColorJitter(0.8, 0.8, 0.8, 0.2), and FLESD crops with
scale 0.2-1 and the same strong jitter. Every parameter is set by the experiment's ``augment`` section
(``SSLAugment.from_config``), and the paper configs set their paper's values. An optional Gaussian blur
(``blur_p``) follows grayscale. Normalisation is not an augmentation here: it is a layer of the encoder
(``ssl_models.networks.input_norm``), so every place that feeds images to an encoder applies it.

Doing this per image with PIL on the CPU starves a GPU, so here every step works on a whole batch at once
while each sample still draws its own parameters:

* crop + flip are one per-sample affine map sampled with ``F.grid_sample`` (bilinear). Crop boxes
  follow ``RandomResizedCrop.get_params`` exactly (10 tries of integer boxes, then the centre-crop
  fallback). Unlike torchvision there is no antialiasing when a large crop is shrunk; for the usual
  case (output size = input size) crops are only ever enlarged, so this does not matter.
* colour jitter follows ``torchvision.transforms.functional`` on float images: brightness scales,
  contrast blends with the image's mean grey level, saturation blends with the grey image, hue
  shifts H in an exact batched RGB <-> HSV conversion (not the YIQ approximation), clamping to
  [0, 1] after every step. As in torchvision the four steps run in a random order, drawn per sample.
* grayscale replaces chosen samples by their luma (0.2989 R + 0.587 G + 0.114 B) on all channels.
* blur is torchvision's ``GaussianBlur`` on tensors (separable kernel ``exp(-x^2 / 2 sigma^2)`` normalised
  to sum 1, reflect padding), one sigma per sample, as grouped convolutions over the whole batch; samples
  that are not blurred get the one-hot kernel, which is exactly the identity.

Randomness comes from an optional ``torch.Generator`` (on the CPU or on the images' device): the
same generator state gives the same views. Inputs are never modified in place, and the maths runs
in float32 even inside an autocast region.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale
CROP_TRIES = 10  # RandomResizedCrop.get_params tries this many boxes before its fallback
# Identifiers of the colour-jitter steps, in the order of the ``jitter`` tuple.
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)

ImageBatch = torch.Tensor | np.ndarray


# --------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------


def _as_tensor(images: ImageBatch) -> torch.Tensor:
    """Wrap a numpy array as a tensor without copying (copying only read-only arrays)."""
    if isinstance(images, torch.Tensor):
        return images
    if isinstance(images, np.ndarray):
        return torch.from_numpy(images if images.flags.writeable else images.copy())
    raise ValueError(f"images must be a torch.Tensor or numpy array, got {type(images).__name__}")


def to_float_nchw(images: ImageBatch) -> torch.Tensor:
    """Model input without augmentation: uint8 NHWC -> float32 NCHW in [0, 1], on the same device.

    A float NCHW batch (assumed already in [0, 1]) is returned as float32 unchanged otherwise.
    """
    images = _as_tensor(images)
    if images.dtype == torch.uint8:
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"uint8 images must be NHWC with 3 channels (N, H, W, 3), got shape {tuple(images.shape)}")
        return images.permute(0, 3, 1, 2).float().div_(255.0)
    if images.is_floating_point():
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"float images must be NCHW with 3 channels (N, 3, H, W), got shape {tuple(images.shape)}")
        return images.float()
    raise ValueError(f"images must be uint8 NHWC or float NCHW, got dtype {images.dtype}")


# --------------------------------------------------------------------------------------------------
# Random parameters
# --------------------------------------------------------------------------------------------------


def _uniform(n: int, low: float, high: float, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``n`` draws from U[low, high) (float32)."""
    return torch.rand(n, generator=generator, device=device) * (high - low) + low


def sample_crop_boxes(
    num: int,
    height: int,
    width: int,
    scale: Sequence[float],
    ratio: Sequence[float],
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Per-sample ``(top, left, box_height, box_width)`` rows, distributed as RandomResizedCrop's.

    Each sample tries ``CROP_TRIES`` (area, aspect ratio) draws and keeps the first integer box that
    fits; samples where none fits get torchvision's fallback (the largest centred box whose aspect
    ratio is within ``ratio``). The box position is uniform over the valid integer offsets.
    """
    area = height * width
    shape = (num, CROP_TRIES)
    target_area = area * (torch.rand(shape, generator=generator, device=device) * (scale[1] - scale[0]) + scale[0])
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(torch.rand(shape, generator=generator, device=device) * (log_high - log_low) + log_low)
    box_w = torch.round(torch.sqrt(target_area * aspect))
    box_h = torch.round(torch.sqrt(target_area / aspect))
    fits = (box_w > 0) & (box_w <= width) & (box_h > 0) & (box_h <= height)
    first_fit = fits.int().argmax(dim=1, keepdim=True)  # argmax returns the first maximum
    any_fit = fits.any(dim=1)
    box_w = box_w.gather(1, first_fit).squeeze(1)
    box_h = box_h.gather(1, first_fit).squeeze(1)

    fallback_h, fallback_w = _fallback_box(height, width, ratio)
    box_w = torch.where(any_fit, box_w, torch.full_like(box_w, fallback_w))
    box_h = torch.where(any_fit, box_h, torch.full_like(box_h, fallback_h))
    # Uniform integer offset in [0, size - box]; the fallback box is centred instead.
    top = torch.floor(torch.rand(num, generator=generator, device=device) * (height - box_h + 1))
    left = torch.floor(torch.rand(num, generator=generator, device=device) * (width - box_w + 1))
    top = torch.where(any_fit, top, torch.full_like(top, (height - fallback_h) // 2))
    left = torch.where(any_fit, left, torch.full_like(left, (width - fallback_w) // 2))
    return torch.stack([top, left, box_h, box_w], dim=1)


def _fallback_box(height: int, width: int, ratio: Sequence[float]) -> tuple[int, int]:
    """RandomResizedCrop's fallback (box_height, box_width): whole image, ratio clamped into range."""
    in_ratio = width / height
    if in_ratio < min(ratio):
        return round(width / min(ratio)), width
    if in_ratio > max(ratio):
        return height, round(height * max(ratio))
    return height, width


def _jitter_factors(
    num: int, jitter: Sequence[float], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """(4, N) factors: brightness/contrast/saturation ~ U[max(0, 1-s), 1+s], hue ~ U[-h, h]."""
    brightness, contrast, saturation, hue = jitter
    rows = [_uniform(num, max(0.0, 1.0 - s), 1.0 + s, generator, device) for s in (brightness, contrast, saturation)]
    rows.append(_uniform(num, -hue, hue, generator, device))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------------
# Geometric step
# --------------------------------------------------------------------------------------------------


def crop_flip_resize(images: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor, out_size: int) -> torch.Tensor:
    """Resize each sample's box ``(top, left, h, w)`` to ``out_size`` (bilinear), mirrored where ``flip``.

    One affine map per sample: output pixel centres (normalised, ``align_corners=False``) map
    linearly onto the box, so a full-image box without flip is the exact identity.
    """
    num, _, height, width = images.shape
    top, left, box_h, box_w = boxes.to(images.dtype).unbind(1)
    sign = 1.0 - 2.0 * flip.to(images.dtype)  # -1 mirrors x
    theta = torch.zeros(num, 2, 3, dtype=images.dtype, device=images.device)
    theta[:, 0, 0] = sign * box_w / width
    theta[:, 0, 2] = (2.0 * left + box_w) / width - 1.0
    theta[:, 1, 1] = box_h / height
    theta[:, 1, 2] = (2.0 * top + box_h) / height - 1.0
    grid = F.affine_grid(theta, [num, 3, out_size, out_size], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


# --------------------------------------------------------------------------------------------------
# Colour steps (batched versions of torchvision.transforms.functional on float images)
# --------------------------------------------------------------------------------------------------


def rgb_to_grayscale(images: torch.Tensor) -> torch.Tensor:
    """Luma of an (N, 3, H, W) batch, shape (N, 1, H, W)."""
    weights = torch.tensor(GRAY_WEIGHTS, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images * weights).sum(dim=1, keepdim=True)


def _per_sample(values: torch.Tensor) -> torch.Tensor:
    """Reshape (N,) values to broadcast over (N, C, H, W)."""
    return values.view(-1, 1, 1, 1)


def blend(images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``factor * images + (1 - factor) * other`` clamped to [0, 1]; ``factor`` is per sample."""
    factor = _per_sample(factor)
    return (factor * images + (1.0 - factor) * other).clamp_(0.0, 1.0)


def adjust_brightness(images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Scale intensities (blend with black)."""
    return blend(images, torch.zeros_like(images[:, :1]), factor)


def adjust_contrast(images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blend with the image's mean grey level."""
    return blend(images, rgb_to_grayscale(images).mean(dim=(1, 2, 3), keepdim=True), factor)


def adjust_saturation(images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blend with the grey version of the image."""
    return blend(images, rgb_to_grayscale(images), factor)


def rgb_to_hsv(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) RGB in [0, 1] -> HSV with all channels in [0, 1] (``colorsys`` conventions)."""
    red, green, blue = images.unbind(1)
    max_c = images.amax(dim=1)
    delta = max_c - images.amin(dim=1)
    has_hue = delta > 0
    safe_delta = torch.where(has_hue, delta, torch.ones_like(delta))
    saturation = delta / torch.where(max_c > 0, max_c, torch.ones_like(max_c))
    # Which channel is largest picks the hue sector (red wins ties, then green, as in colorsys).
    hue = torch.where(
        max_c == red,
        (green - blue) / safe_delta,
        torch.where(max_c == green, 2.0 + (blue - red) / safe_delta, 4.0 + (red - green) / safe_delta),
    )
    hue = torch.where(has_hue, torch.remainder(hue / 6.0, 1.0), torch.zeros_like(hue))
    return torch.stack([hue, saturation, max_c], dim=1)


def hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rgb_to_hsv``, via the branch-free form ``v - v*s*clamp(min(k, 4-k), 0, 1)``.

    With ``k = (n + 6h) mod 6`` and n = 5, 3, 1 for R, G, B; this avoids building all six sector
    candidates that a gather-based conversion needs.
    """
    hue, saturation, value = hsv[:, 0:1], hsv[:, 1:2], hsv[:, 2:3]
    offsets = torch.tensor((5.0, 3.0, 1.0), dtype=hsv.dtype, device=hsv.device).view(1, 3, 1, 1)
    k = torch.remainder(offsets + 6.0 * hue, 6.0)
    ramp = torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)
    return value - value * saturation * ramp


def adjust_hue(images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate the hue by ``shift`` (per sample, fraction of a turn in [-0.5, 0.5])."""
    hsv = rgb_to_hsv(images)
    hue = torch.remainder(hsv[:, 0:1] + _per_sample(shift), 1.0)
    return hsv_to_rgb(torch.cat([hue, hsv[:, 1:]], dim=1)).clamp_(0.0, 1.0)


def color_jitter(
    images: torch.Tensor, factors: torch.Tensor, order: torch.Tensor, active: torch.Tensor, with_hue: bool = True
) -> torch.Tensor:
    """Apply the four jitter steps to ``active`` samples, each sample in its own step ``order``.

    ``factors`` is (4, N) (brightness, contrast, saturation, hue shift), ``order`` (N, 4) a
    permutation of step ids per sample. At each position the brightness/contrast/saturation step is
    one blend whose target (black / mean grey / grey image) is picked per sample; samples whose step
    there is hue (or that are inactive) blend with factor 1, which is exactly the identity. Hue is
    then applied to the samples whose step there is hue (see ``hue_where``). ``with_hue=False``
    skips the hue step (its strength is 0) and with it the costly HSV round trips.
    """
    identity_blend = torch.ones_like(factors[0])
    for position in range(4):
        step = order[:, position]
        blend_factor = identity_blend
        for step_id in (BRIGHTNESS, CONTRAST, SATURATION):
            blend_factor = torch.where(active & (step == step_id), factors[step_id], blend_factor)
        gray = rgb_to_grayscale(images)
        target = torch.where(
            _per_sample(step == BRIGHTNESS),
            torch.zeros_like(gray),
            torch.where(_per_sample(step == CONTRAST), gray.mean(dim=(1, 2, 3), keepdim=True), gray),
        )
        images = blend(images, target, blend_factor)
        if with_hue:
            images = hue_where(images, active & (step == HUE), factors[HUE])
    return images


def hue_where(
    images: torch.Tensor, chosen: torch.Tensor, shift: torch.Tensor, gather_rows: bool | None = None
) -> torch.Tensor:
    """``adjust_hue`` on the ``chosen`` samples only, the others passed through unchanged.

    Two equivalent strategies, picked by device unless ``gather_rows`` says otherwise: on
    accelerators the hue of the whole batch is computed and selected with ``torch.where`` (no host
    synchronisation; the extra elementwise work is negligible there); on the CPU, where the HSV
    round trip dominates the cost, only the chosen rows are gathered and converted.
    """
    if gather_rows is None:
        gather_rows = images.device.type == "cpu"
    if not gather_rows:
        return torch.where(_per_sample(chosen), adjust_hue(images, shift), images)
    rows = torch.nonzero(chosen).squeeze(1)
    if rows.numel() == 0:
        return images
    return images.index_copy(0, rows, adjust_hue(images[rows], shift[rows]))


def random_grayscale(images: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Replace the ``chosen`` samples by their luma repeated over the 3 channels."""
    return torch.where(_per_sample(chosen), rgb_to_grayscale(images).expand_as(images), images)


# --------------------------------------------------------------------------------------------------
# Blur
# --------------------------------------------------------------------------------------------------


def blur_kernel_size_for(image_size: int) -> int:
    """SimCLR's rule, 10 % of the image side made odd, at least 3: 3 at 32x32, 9 at 96x96, 23 at 224x224."""
    return max(3, int(0.1 * image_size) // 2 * 2 + 1)


def gaussian_kernels(sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """(N, K) normalised 1-D Gaussian kernels ``exp(-x^2 / (2 sigma^2))`` at x = -K//2 .. K//2, one per sigma."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size!r}")
    half = kernel_size // 2
    x = torch.arange(-half, half + 1, dtype=torch.float32, device=sigma.device)
    pdf = torch.exp(-0.5 * (x.view(1, -1) / sigma.float().view(-1, 1)).pow(2))
    return pdf / pdf.sum(dim=1, keepdim=True)


def gaussian_blur(
    images: torch.Tensor, sigma: torch.Tensor, kernel_size: int, chosen: torch.Tensor | None = None
) -> torch.Tensor:
    """Blur each sample of an (N, C, H, W) batch with its own ``sigma`` (N,), as torchvision's ``gaussian_blur``
    (separable kernel, reflect padding). Samples not ``chosen`` (when given) pass through unchanged."""
    num, channels, height, width = images.shape
    kernels = gaussian_kernels(sigma, kernel_size).to(images.dtype)
    if chosen is not None:
        identity = torch.zeros_like(kernels)
        identity[:, kernel_size // 2] = 1.0  # one-hot: multiplies by 1 and adds exact zeros
        kernels = torch.where(chosen.view(-1, 1), kernels, identity)
    weights = kernels.repeat_interleave(channels, dim=0)  # one kernel per (sample, channel) plane
    pad = kernel_size // 2
    planes = F.pad(images.reshape(1, num * channels, height, width), (pad, pad, pad, pad), mode="reflect")
    planes = F.conv2d(planes, weights.view(-1, 1, 1, kernel_size), groups=num * channels)  # along x
    planes = F.conv2d(planes, weights.view(-1, 1, kernel_size, 1), groups=num * channels)  # along y
    return planes.reshape(num, channels, height, width).clamp_(0.0, 1.0)


# --------------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------------


def _check_probability(value: float, arg_name: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{arg_name} must be a probability in [0, 1], got {value!r}")
    return float(value)


def _check_range(values: Sequence[float], arg_name: str) -> tuple[float, float]:
    if len(values) != 2 or not 0.0 < values[0] <= values[1]:
        raise ValueError(f"{arg_name} must be (low, high) with 0 < low <= high, got {values!r}")
    return float(values[0]), float(values[1])


class SSLAugment(nn.Module):
    """Random crop/flip/colour-jitter/grayscale/blur views of a batch, computed on the batch's device.

    ``forward(images)`` takes uint8 NHWC (tensor or numpy) or float NCHW in [0, 1] and returns
    float32 NCHW in [0, 1] of size ``image_size``; every sample draws its own parameters.
    ``blur_kernel_size`` 0 picks ``blur_kernel_size_for(image_size)``.
    """

    @classmethod
    def from_config(cls, augment, image_size: int) -> SSLAugment:
        """The recipe of an experiment's ``augment`` section (``ssl_models.config.AugmentConfig``)."""
        return cls(
            image_size=image_size,
            crop_scale=augment.crop_scale,
            crop_ratio=augment.crop_ratio,
            jitter=(augment.brightness, augment.contrast, augment.saturation, augment.hue),
            jitter_p=augment.jitter_p,
            grayscale_p=augment.grayscale_p,
            flip_p=augment.flip_p,
            blur_p=augment.blur_p,
            blur_sigma=augment.blur_sigma,
            blur_kernel_size=augment.blur_kernel_size,
        )

    def __init__(
        self,
        image_size: int = 32,
        crop_scale: Sequence[float] = (0.08, 1.0),
        jitter: Sequence[float] = (0.4, 0.4, 0.4, 0.1),
        jitter_p: float = 0.8,
        grayscale_p: float = 0.2,
        flip_p: float = 0.5,
        crop_ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0),
        blur_p: float = 0.0,
        blur_sigma: Sequence[float] = (0.1, 2.0),
        blur_kernel_size: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be an integer >= 1, got {image_size!r}")
        if len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5:
            raise ValueError(
                f"jitter must be (brightness, contrast, saturation, hue) >= 0 with hue <= 0.5, got {jitter!r}"
            )
        self.image_size = image_size
        self.crop_scale = _check_range(crop_scale, "crop_scale")
        self.crop_ratio = _check_range(crop_ratio, "crop_ratio")
        self.jitter = tuple(float(v) for v in jitter)
        self.jitter_p = _check_probability(jitter_p, "jitter_p")
        self.grayscale_p = _check_probability(grayscale_p, "grayscale_p")
        self.flip_p = _check_probability(flip_p, "flip_p")
        self.blur_p = _check_probability(blur_p, "blur_p")
        self.blur_sigma = _check_range(blur_sigma, "blur_sigma")
        if blur_kernel_size == 0:
            blur_kernel_size = blur_kernel_size_for(image_size)
        if (
            isinstance(blur_kernel_size, bool)
            or not isinstance(blur_kernel_size, int)
            or blur_kernel_size < 1
            or blur_kernel_size % 2 == 0
        ):
            raise ValueError(
                f"blur_kernel_size must be 0 (automatic) or a positive odd integer, got {blur_kernel_size!r}"
            )
        self.blur_kernel_size = blur_kernel_size

    def extra_repr(self) -> str:
        return (
            f"image_size={self.image_size}, crop_scale={self.crop_scale}, crop_ratio={self.crop_ratio}, "
            f"jitter={self.jitter}, jitter_p={self.jitter_p}, grayscale_p={self.grayscale_p}, "
            f"flip_p={self.flip_p}, blur_p={self.blur_p}, blur_sigma={self.blur_sigma}, "
            f"blur_kernel_size={self.blur_kernel_size}"
        )

    def forward(self, images: ImageBatch, generator: torch.Generator | None = None) -> torch.Tensor:
        """One augmented view of every image (see the class docstring for formats)."""
        images = to_float_nchw(images)
        # Float32 maths even under autocast: grid_sample and the colour blends are cheap, and a
        # bfloat16 image would be quantised far more coarsely than 1/255.
        with torch.autocast(device_type=images.device.type, enabled=False):
            return self._augment(images, generator)

    def two_views(
        self, images: ImageBatch, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two independent views of every image (the pair most SSL losses compare)."""
        images = to_float_nchw(images)  # convert once for both views
        with torch.autocast(device_type=images.device.type, enabled=False):
            return self._augment(images, generator), self._augment(images, generator)

    def _augment(self, images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Draw every random parameter, then apply crop/flip, colour jitter, grayscale and blur."""
        num, _, height, width = images.shape
        # Draw on the generator's device (a CPU generator may drive GPU batches), then move over.
        draw_device = generator.device if generator is not None else images.device
        boxes = sample_crop_boxes(num, height, width, self.crop_scale, self.crop_ratio, generator, draw_device)
        flip = torch.rand(num, generator=generator, device=draw_device) < self.flip_p
        jitter_on = torch.rand(num, generator=generator, device=draw_device) < self.jitter_p
        factors = _jitter_factors(num, self.jitter, generator, draw_device)
        order = torch.rand(num, 4, generator=generator, device=draw_device).argsort(dim=1)
        gray_on = torch.rand(num, generator=generator, device=draw_device) < self.grayscale_p
        if self.blur_p > 0:  # drawn last and only when used, so a recipe without blur keeps its random stream
            blur_on = torch.rand(num, generator=generator, device=draw_device) < self.blur_p
            sigma = _uniform(num, self.blur_sigma[0], self.blur_sigma[1], generator, draw_device)

        target = images.device
        out = crop_flip_resize(images, boxes.to(target), flip.to(target), self.image_size)
        if self.jitter_p > 0:
            out = color_jitter(
                out, factors.to(target), order.to(target), jitter_on.to(target), with_hue=self.jitter[HUE] > 0
            )
        if self.grayscale_p > 0:
            out = random_grayscale(out, gray_on.to(target))
        if self.blur_p > 0:
            out = gaussian_blur(out, sigma.to(target), self.blur_kernel_size, blur_on.to(target))
        return out
