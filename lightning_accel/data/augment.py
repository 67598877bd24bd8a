"""``GpuAugment``: batch-wise random augmentation and normalisation on whatever device the batch is on.

Input: uint8 images (N, C, H, W) straight from the cache. Output: float32 normalised images (N, C, out, out).
Every sample draws its own parameters (torchvision.transforms.v2 transforms draw one set per call, i.e. per batch,
when given a batch tensor), and all samples are transformed together:

1. random resized crop + horizontal flip: one affine sampling grid per sample (``affine_grid`` + ``grid_sample``,
   bilinear), so crop box, scale, aspect ratio and flip are per sample and the whole batch is one kernel;
2. colour jitter: per-sample brightness / contrast / saturation factors with torchvision's formulas
   (``rgb_to_grayscale`` from transforms.v2.functional for the grey reference);
3. scale to [0, 1] and ``normalize`` from transforms.v2.functional.

Device-agnostic torch ops: on a CUDA batch it runs on the GPU (the point: the CPU does not touch pixels); on a CPU batch
(no GPU, or ``trainer.accelerator="cpu"``) the same code runs on the CPU, the transparent fallback. Random
parameters come from a CPU generator seeded by ``seed`` (or, when None, torch's global seed, which ``seed_everything``
sets), the rank under ``torch.distributed`` and the batch's index in the stream (a call counter, or the ``call``
argument), so the same seed gives the same augmentation on either device, on whichever thread runs it, and in every
run, while each rank draws its own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel._utils.checks import check_int, check_number

__all__ = ["GpuAugment"]


def _with_rank(seed: int) -> int:
    """``seed`` mixed with this process's rank under ``torch.distributed``, so ranks augment differently: with one
    seed for all, every rank drew the same crop, flip and colour factors for the ``j``-th sample of batch ``k``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        seed = seed * 1_000_033 + dist.get_rank()
    return seed % (2**63 - 1)


def _global_seed() -> int:
    """The seed ``seed=None`` follows: torch's initial seed (what ``seed_everything`` / ``torch.manual_seed`` set; in
    a DataLoader worker, that worker's seed), mixed with the rank. Without a seed call torch starts from a random
    one, so an unseeded run is still fresh randomness."""
    return _with_rank(torch.initial_seed())


def _numbers(name: str, value: object, *, pair: bool = False) -> tuple[float, ...]:
    """``value`` (a sequence of real numbers; exactly two, ``(low, high)``, when ``pair``) as a tuple of floats.

    Raises:
        TypeError: not a sequence, or an item that is not a real number (a string, a bool, None).
        ValueError: ``pair`` and not two items, or an item that is NaN or infinite.
    """
    expected = "a (low, high) pair of numbers" if pair else "a sequence of numbers, one per channel"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"`{name}` must be {expected}, got {value!r} ({type(value).__name__}).")
    items = list(value)
    for v in items:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"`{name}` must be {expected}, got {value!r}, holding {v!r} ({type(v).__name__}).")
    out = tuple(float(v) for v in items)
    if pair and len(out) != 2:
        raise ValueError(f"`{name}` must be {expected}, got {value!r}.")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:  # an infinite std normalised every image to 0; an infinite ratio cropped to a line
        raise ValueError(f"`{name}` must be {expected}, got {value!r}, holding {bad[0]!r}: every value must be finite.")
    return out


#: the largest output side ``size`` accepts (a 16384 px RGB float batch of one is already 3 GiB)
MAX_SIZE = 16384


class GpuAugment(nn.Module):
    """Per-sample random resized crop, flip, colour jitter, then normalise; training-time randomness only.

    Args:
        mean: per-channel mean of the [0, 1] images.
        std: per-channel std.
        size: output side (``None``: keep the input size).
        crop_scale: range of the crop's area fraction; ``None`` disables cropping (resize only when ``size`` differs).
        crop_ratio: range of the crop's aspect ratio.
        flip_p: probability of a horizontal flip (0 for digits and text).
        brightness: factor drawn from ``[1 - b, 1 + b]``.
        contrast: factor drawn from ``[1 - c, 1 + c]``; needs 1 or 3 channels (``len(mean)``).
        saturation: factor drawn from ``[1 - s, 1 + s]``; needs 3 channels.
        seed: seed of the parameters (``None``: follow torch's global seed, so ``seed_everything`` makes runs
            repeat exactly). Either way it is mixed with the rank under ``torch.distributed``: each rank draws its
            own parameters, and the same rank of a run with the same world size repeats them.

    ``augment.eval()`` (or ``forward(x, train=False)``) skips the random part: resize to ``size`` and normalise only.

    The random stream: training batch ``k`` (counted from 0 by :attr:`calls`, or given as ``forward(..., call=k)``)
    draws its parameters from a generator seeded with ``(seed, k)`` alone, so a batch augmented ahead of time on
    another thread (what :class:`~lightning_accel.data.datamodule.CachedDataModule` does with CPU batches) gets the
    same tensor as the same batch augmented in the training step.
    """

    def __init__(
        self,
        mean: Sequence[float] = (0.485, 0.456, 0.406),
        std: Sequence[float] = (0.229, 0.224, 0.225),
        *,
        size: int | None = None,
        crop_scale: Sequence[float] | None = (0.08, 1.0),
        crop_ratio: Sequence[float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        brightness: float = 0.0,
        contrast: float = 0.0,
        saturation: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        mean, std = _numbers("mean", mean), _numbers("std", std)
        if len(mean) != len(std):
            raise ValueError(f"`mean` and `std` need one value per channel, got {len(mean)} and {len(std)}.")
        if any(s <= 0 for s in std):
            raise ValueError(f"`std` must hold values > 0, got {tuple(std)}.")
        if crop_scale is not None:
            crop_scale = _numbers("crop_scale", crop_scale, pair=True)
            if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
                raise ValueError(f"`crop_scale` must satisfy 0 < low <= high <= 1, got {tuple(crop_scale)}.")
        crop_ratio = _numbers("crop_ratio", crop_ratio, pair=True)
        if not 0 < crop_ratio[0] <= crop_ratio[1]:
            raise ValueError(f"`crop_ratio` must satisfy 0 < low <= high, got {tuple(crop_ratio)}.")
        # the output batch is allocated at this size: a typo such as 22400 would ask for gigabytes per batch
        check_int("size", size, low=1, high=MAX_SIZE, allow_none=True, fix="None keeps the input size; use e.g. 224.")
        check_int("seed", seed, allow_none=True, fix="None follows torch's global seed.")
        check_number("flip_p", flip_p, low=0.0, high=1.0)
        for name, v in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            check_number(name, v, low=0.0, high=1.0, high_open=True, fix="0 leaves it unchanged.")
        # `forward` takes only batches of len(mean) channels: a jitter defined for other counts would skip every batch
        for name, v, takes, needs in (
            ("contrast", contrast, (1, 3), "1 or 3 channels (grey or RGB)"),
            ("saturation", saturation, (3,), "3 channels (RGB)"),
        ):
            if v and len(mean) not in takes:
                raise ValueError(
                    f"`{name}` {v!r} needs {needs}, but `mean`/`std` give {len(mean)}: it would never be applied. "
                    f"Set `{name}=0`, or give one `mean`/`std` value per channel of your images."
                )
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.size = size
        self.crop_scale = tuple(crop_scale) if crop_scale is not None else None
        self.crop_ratio = tuple(crop_ratio)
        self.flip_p = flip_p
        self.brightness, self.contrast, self.saturation = brightness, contrast, saturation
        self.seed = seed
        self._calls = 0

    @property
    def calls(self) -> int:
        """Index of the next training batch in the random stream (training batches augmented so far)."""
        return self._calls

    @calls.setter
    def calls(self, value: int) -> None:
        self._calls = int(value)

    def _generator(self, call: int | None = None) -> torch.Generator:
        g = torch.Generator()
        base = _with_rank(self.seed) if self.seed is not None else _global_seed()
        if call is None:
            call = self._calls
            self._calls += 1
        g.manual_seed((base * 1_000_003 + call) % (2**63 - 1))
        return g

    def sample_params(self, n: int, h: int, w: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        """Per-sample parameters (CPU): crop centre/size as fractions, flip sign and colour factors."""
        u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
        if self.crop_scale is not None:
            area = self.crop_scale[0] + u(n) * (self.crop_scale[1] - self.crop_scale[0])
            lr = math.log(self.crop_ratio[0]), math.log(self.crop_ratio[1])
            ratio = torch.exp(lr[0] + u(n) * (lr[1] - lr[0]))
            # crop width/height as fractions of the image (aspect in pixels: cw*w / (ch*h) = ratio)
            cw = torch.sqrt(area * ratio * h / w).clamp(max=1.0)
            ch = torch.sqrt(area / ratio * w / h).clamp(max=1.0)
            cx = (u(n) * 2 - 1) * (1 - cw)  # centre in [-1, 1] normalised coordinates, crop stays inside
            cy = (u(n) * 2 - 1) * (1 - ch)
        else:
            cw = ch = torch.ones(n, dtype=torch.float64)
            cx = cy = torch.zeros(n, dtype=torch.float64)
        flip = torch.where(u(n) < self.flip_p, -1.0, 1.0).to(torch.float64)
        b = 1 + (u(n) * 2 - 1) * self.brightness
        c = 1 + (u(n) * 2 - 1) * self.contrast
        s = 1 + (u(n) * 2 - 1) * self.saturation
        return {"cw": cw, "ch": ch, "cx": cx, "cy": cy, "flip": flip, "brightness": b, "contrast": c, "saturation": s}

    def forward(self, x: torch.Tensor, train: bool | None = None, call: int | None = None) -> torch.Tensor:
        """Augment (when training) and normalise a batch (N, C, H, W); returns float32 on ``x``'s device.

        Args:
            x: uint8 (or float in [0, 1]) images.
            train: draw random parameters (default: ``self.training``).
            call: this batch's index in the random stream; ``None``: the next one (:attr:`calls`, then advanced). An
                explicit index leaves :attr:`calls` unchanged.
        """
        if x.ndim != 4:
            raise ValueError(f"`GpuAugment` expects a batch (N, C, H, W), got shape {tuple(x.shape)}.")
        if x.shape[1] != len(self.mean):
            raise ValueError(
                f"`GpuAugment` has {len(self.mean)} mean/std values but the batch has {x.shape[1]} channels; "
                "pass one `mean`/`std` value per channel."
            )
        train = self.training if train is None else train
        n, _, h, w = x.shape
        out_h, out_w = (h, w) if self.size is None else (self.size, self.size)
        xf = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        # Every training batch takes its index in the stream, an empty one too (all its samples skipped as
        # undecodable): otherwise the batches after it drew other parameters here than on the data module's
        # augment-ahead thread, which numbers batches by their position (`call`).
        g = self._generator(call) if train else None
        if g is not None and n:
            params = self.sample_params(n, h, w, g)
            p = {k: v.to(device=x.device, dtype=torch.float32) for k, v in params.items()}
            theta = torch.zeros(n, 2, 3, device=x.device, dtype=torch.float32)
            theta[:, 0, 0] = p["cw"] * p["flip"]
            theta[:, 0, 2] = p["cx"]
            theta[:, 1, 1] = p["ch"]
            theta[:, 1, 2] = p["cy"]
            grid = F.affine_grid(theta, [n, x.shape[1], out_h, out_w], align_corners=False)
            xf = F.grid_sample(xf, grid, mode="bilinear", padding_mode="border", align_corners=False)
            xf = self._jitter(xf, p)
        elif (out_h, out_w) != (h, w):
            xf = F.interpolate(xf, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False)
        from torchvision.transforms.v2 import functional as TF  # type: ignore[import-untyped]  # no type hints

        return TF.normalize(xf, self.mean, self.std)

    def _jitter(self, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        view = (-1, 1, 1, 1)
        if self.brightness:
            x = (x * p["brightness"].view(view)).clamp(0, 1)
        if self.contrast and x.shape[1] in (1, 3):
            grey_mean = (
                TF.rgb_to_grayscale(x).mean(dim=(-3, -2, -1), keepdim=True)
                if x.shape[1] == 3
                else x.mean(dim=(-3, -2, -1), keepdim=True)
            )
            x = (p["contrast"].view(view) * x + (1 - p["contrast"].view(view)) * grey_mean).clamp(0, 1)
        if self.saturation and x.shape[1] == 3:
            grey = TF.rgb_to_grayscale(x)
            x = (p["saturation"].view(view) * x + (1 - p["saturation"].view(view)) * grey).clamp(0, 1)
        return x

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, crop_scale={self.crop_scale}, crop_ratio={self.crop_ratio}, flip_p={self.flip_p}, "
            f"brightness={self.brightness}, contrast={self.contrast}, saturation={self.saturation}"
        )
