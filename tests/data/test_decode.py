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


@pytest.mark.parametrize(
    ("mode", "size"),
    [("RGB", (24, 24)), ("L", (24, 24)), ("RGB", (24, 40)), ("RGB", (41, 24)), ("RGB", (30, 30))],
)
def test_libjpeg_turbo_path_gives_pils_pixels(mode: str, size: tuple[int, int]) -> None:
    # at the size, grey, crop only (both orientations, odd margin): torchvision's libjpeg-turbo decode; a resize
    # (30 px): PIL. Either way the pixels of the PIL-only decoder and of the ImageFolder pipeline.
    from PIL import Image

    data = _encode(mode, size, "JPEG", seed=sum(size))
    fast, pil = ImageDecoder(24), ImageDecoder(24, fast_jpeg=False)
    assert (fast._jpeg_tensor(data) is not None) == (min(size) == 24)
    a, b = torch.empty(3, 24, 24, dtype=torch.uint8), torch.empty(3, 24, 24, dtype=torch.uint8)
    fast.decode_into(data, a)
    pil.decode_into(data, b)
    with Image.open(io.BytesIO(data)) as img:
        ref = fast.pil_transform()(img.convert("RGB"))
    assert torch.equal(a, b) and torch.equal(a, ref) and torch.equal(fast(data), ref)
    assert fast.fingerprint == pil.fingerprint  # same pixels: the same cache entries


def test_undecodable_jpeg_falls_back_to_pils_error() -> None:
    bad = b"\xff\xd8\xff\xe0" + b"\x00" * 64
    with pytest.raises(Exception, match="cannot identify image file|image file is truncated|broken data"):
        ImageDecoder(24).decode_into(bad, torch.empty(3, 24, 24, dtype=torch.uint8))


def test_image_size_is_checked() -> None:
    with pytest.raises(ValueError, match=r"`image_size` must be an integer >= 1 or None, got 0\. None keeps"):
        ImageDecoder(0)
    with pytest.raises(TypeError, match=r"`image_size` must be an integer >= 1 or None, got True \(bool\)"):
        ImageDecoder(True)
    assert ImageDecoder(None).size is None


@pytest.mark.parametrize("value", ["no", 0, None])
def test_fast_jpeg_must_be_a_bool(value: object) -> None:
    with pytest.raises(TypeError, match=rf"^`fast_jpeg` must be True or False, got {value!r} \("):
        ImageDecoder(16, fast_jpeg=value)  # type: ignore[arg-type]


def test_device_must_be_cuda() -> None:
    with pytest.raises(ValueError, match=r"`device` must be None \(CPU\) or a CUDA device"):
        ImageDecoder(24, device="cpu")
    dec = ImageDecoder(24, device="cuda")  # made anywhere; used where CUDA is
    assert dec.fingerprint != ImageDecoder(24).fingerprint and "nvjpeg" in dec.fingerprint


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvjpeg_batch_decode_into_cpu_rows_is_close_to_libjpeg() -> None:
    from PIL import Image

    def smooth(k: int) -> bytes:  # a gradient: decoders differ by rounding only, not by how they smooth noise
        y, x = np.mgrid[0:24, 0:24]
        arr = np.stack([x * 10 + k, y * 10, (x + y) * 5], axis=-1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr, mode="RGB").save(buf, format="JPEG", quality=90)
        return buf.getvalue()

    datas = [smooth(k) for k in range(6)] + [_encode("RGB", (24, 24), "PNG", seed=9)]
    dec = ImageDecoder(24, device="cuda")
    rows = torch.zeros(len(datas), 3, 24, 24, dtype=torch.uint8)
    done = dec.decode_batch_into(datas, list(rows))
    assert done == [True] * 6 + [False]  # the PNG is left to the CPU path
    for d, row in zip(datas[:6], rows[:6], strict=True):
        ref = ImageDecoder(24)(d)
        assert (row.float() - ref.float()).abs().mean() <= 3  # nvJPEG rounds differently, never far


def test_draft_decodes_large_jpegs_at_a_reduced_scale_close_to_the_full_decode() -> None:
    from PIL import Image

    yy, xx = np.mgrid[0:400, 0:520]
    rgb = np.stack([xx * 255 // 519, yy * 255 // 399, (xx + yy) * 255 // 918], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    full, draft = ImageDecoder(96), ImageDecoder(96, draft=True)
    assert draft.fingerprint != full.fingerprint and ImageDecoder(96).fingerprint == full.fingerprint
    assert ImageDecoder(224).fingerprint != full.fingerprint  # the size is part of the namespace
    a, b = full(data), draft(data)
    assert a.shape == b.shape == (3, 96, 96) and not torch.equal(a, b)  # decoded at 1/2 scale (200 >= 96)
    assert (a.int() - b.int()).abs().float().mean() < 3  # the same picture
    out = torch.empty(3, 96, 96, dtype=torch.uint8)
    draft.decode_into(data, out)
    assert torch.equal(out, b)
    with pytest.raises(TypeError, match="`draft`"):
        ImageDecoder(96, draft=1)  # type: ignore[arg-type]
