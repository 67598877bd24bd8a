"""The deterministic ``decode`` step whose output is cached: raw bytes -> fixed-size uint8 CHW tensor.

A decoder is any picklable callable ``decode(data: bytes) -> torch.Tensor`` with a ``fingerprint`` string attribute
(it namespaces the cache: change the decoder and old entries are not reused). It must be deterministic; random
augmentation belongs after the cache (a CPU ``transform`` or :class:`~lightning_accel.data.augment.GpuAugment`).
"""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["DecodeError", "ImageDecoder"]


class DecodeError(ValueError):
    """A sample's bytes could not be decoded; the message names the key."""


class ImageDecoder:
    """Decode an image file, resize its shorter side to ``size`` and centre-crop to ``size x size``: uint8 (3, H, W).

    Exactly torchvision's ``Resize(size) -> CenterCrop(size) -> PILToTensor()`` after ``ImageFolder``'s loader
    (``PIL.Image.open(...).convert("RGB")``), so cached tensors are bit-identical to that pipeline.

    Args:
        size: output side in pixels; ``None`` keeps the original size (then every image must have the same size).
    """

    def __init__(self, size: int | None = 224) -> None:
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"`image_size` must be a positive integer or None, got {size!r}.")
        self.size = size
        self._tf: Any = None

    @property
    def fingerprint(self) -> str:
        return f"ImageDecoder(size={self.size},v1)"

    def pil_transform(self) -> Any:
        """The torchvision transform applied to the RGB PIL image (also what a baseline ``ImageFolder`` should use)."""
        from torchvision import transforms as T

        ops = [T.Resize(self.size), T.CenterCrop(self.size)] if self.size is not None else []
        return T.Compose([*ops, T.PILToTensor()])

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "_tf": None}

    def __call__(self, data: bytes) -> torch.Tensor:
        from PIL import Image

        if self._tf is None:
            self._tf = self.pil_transform()
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
        return self._tf(rgb)

    def __repr__(self) -> str:
        return f"ImageDecoder(size={self.size})"
