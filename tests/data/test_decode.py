from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lightning_accel.data import ImageDecoder


def _encode(mode: str, size: tuple[int, int], fmt: str, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr, mode=mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("mode", "size", "fmt"),
    [
        ("RGB", (24, 24), "JPEG"),  # already at the size: no convert, resize or crop
        ("L", (24, 24), "JPEG"),  # convert only
        ("RGB", (24, 40), "PNG"),  # shorter side at the size: crop only
        ("RGBA", (50, 31), "PNG"),  # convert, resize and crop
        ("RGB", (13, 13), "JPEG"),  # upscale
    ],
)
def test_decoder_is_bit_identical_to_the_imagefolder_pipeline(mode: str, size: tuple[int, int], fmt: str) -> None:
    from PIL import Image

    data = _encode(mode, size, fmt, seed=hash((mode, size)) & 0xFFFF)
    dec = ImageDecoder(24)
    with Image.open(io.BytesIO(data)) as img:
        ref = dec.pil_transform()(img.convert("RGB"))
    out = dec(data)
    assert out.dtype == torch.uint8 and out.shape == (3, 24, 24)
    assert torch.equal(out, ref)
    out[0, 0, 0] = 7  # the tensor owns writable memory


def test_decoder_without_size_keeps_the_image_size() -> None:
    data = _encode("RGB", (17, 9), "PNG", seed=1)
    out = ImageDecoder(None)(data)
    assert out.shape == (3, 9, 17)


def test_decode_into_checks_the_destination() -> None:
    data = _encode("RGB", (24, 24), "JPEG", seed=2)
    dec = ImageDecoder(24)
    out = torch.empty((2, 3, 24, 24), dtype=torch.uint8)
    dec.decode_into(data, out[1])
    assert torch.equal(out[1], dec(data)) and dec.out_shape(data) == (3, 24, 24)
    with pytest.raises(ValueError, match=r"`out` must be a contiguous uint8 tensor of shape \(3, 24, 24\)"):
        dec.decode_into(data, torch.empty((3, 24, 24), dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous=False"):
        dec.decode_into(data, torch.empty((3, 24, 48), dtype=torch.uint8)[:, :, ::2])
