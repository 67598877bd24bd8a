from __future__ import annotations

import pytest
import torch

from lightning_accel.data.codec import CorruptEntryError, copy_payload, decode_entry, encode_entry, peek_shape


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (0, 4)])
def test_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.rand(shape) * 100).to(dtype)
    s = decode_entry(encode_entry(t, 7, {"k": "v"}))
    assert s.tensor.dtype == dtype and s.tensor.shape == t.shape
    assert torch.equal(s.tensor, t)
    assert s.label == 7 and s.meta == {"k": "v"}


def test_copy_payload_copies_into_a_batch_row() -> None:
    t = torch.randint(0, 255, (3, 4, 4), dtype=torch.uint8)
    out = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    rows = out.numpy().reshape(2, -1)  # the batch's numpy view, as SampleCache makes it
    buf = memoryview(encode_entry(t, 3))
    assert peek_shape(buf) == (torch.uint8, [3, 4, 4])
    assert copy_payload(buf, rows[1], torch.uint8, [3, 4, 4]) == 3
    assert torch.equal(out[1], t) and not out[0].any()
    with pytest.raises(ValueError, match="fixed shape"):
        copy_payload(buf, torch.zeros(3, 5, 5, dtype=torch.uint8).numpy().reshape(-1), torch.uint8, [3, 5, 5])


def test_every_kind_of_corruption_is_detected() -> None:
    entry = bytearray(encode_entry(torch.arange(60, dtype=torch.uint8).view(3, 4, 5), 1))
    flipped = bytearray(entry)
    flipped[-1] ^= 0x01  # payload bit flip
    header_flip = bytearray(entry)
    header_flip[14] ^= 0x20  # inside the JSON header
    for bad, why in [
        (bytes(flipped), "checksum"),
        (bytes(header_flip), "checksum"),
        (bytes(entry[:-3]), "checksum"),  # torn write: truncated payload
        (bytes(entry[:6]), "shorter"),
        (b"XXXX" + bytes(entry[4:]), "magic"),
    ]:
        with pytest.raises(CorruptEntryError, match=why):
            decode_entry(bad)


def test_unsupported_dtype_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="decode"):
        encode_entry(torch.zeros(2, dtype=torch.complex64), 0)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(3 * 8 * 8, dtype=torch.uint8).view(3, 8, 8),  # contiguous: CRC over the tensor, bytes.join
        torch.randn(4, 5).to(torch.bfloat16),
        torch.arange(24, dtype=torch.int32).view(2, 3, 4).permute(2, 0, 1),  # strided: copied into the entry
        torch.tensor(2.5),
        torch.tensor([True, False, True]),
    ],
)
def test_contiguous_and_strided_tensors_encode_the_same_layout(t: torch.Tensor) -> None:
    entry = encode_entry(t, 5)
    assert (
        entry
        == encode_entry(t.contiguous().clone(), 5)
        == bytes(encode_entry(t.clone(memory_format=torch.contiguous_format), 5))
    )
    s = decode_entry(entry)
    assert torch.equal(s.tensor, t) and s.label == 5
