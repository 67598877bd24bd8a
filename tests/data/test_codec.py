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


def _legacy_entry(t: torch.Tensor, label: int) -> bytes:
    """An entry in the first format (``LAC1``, CRC-32), as earlier versions wrote it."""
    import json
    import struct
    import zlib

    header = json.dumps({"dtype": "uint8", "shape": list(t.shape), "label": label, "meta": {}}).encode()
    payload = t.contiguous().numpy().tobytes()
    crc = zlib.crc32(payload, zlib.crc32(header))
    return struct.pack("<4sII", b"LAC1", len(header), crc) + header + payload


def test_new_entries_carry_the_xxh3_format() -> None:
    import xxhash

    t = torch.randint(0, 255, (3, 4, 4), dtype=torch.uint8)
    buf = bytes(encode_entry(t, 2))
    assert buf[:4] == b"LAC2"
    hlen = int.from_bytes(buf[4:8], "little")
    assert int.from_bytes(buf[8:16], "little") == xxhash.xxh3_64_intdigest(buf[16:])  # header + payload
    assert len(buf) == 16 + hlen + t.numel()


def test_legacy_entries_stay_readable_and_checked() -> None:
    t = torch.randint(0, 255, (3, 4, 4), dtype=torch.uint8)
    buf = _legacy_entry(t, 5)
    s = decode_entry(buf)
    assert torch.equal(s.tensor, t) and s.label == 5
    row = torch.zeros(3, 4, 4, dtype=torch.uint8)
    assert copy_payload(memoryview(buf), row.numpy().reshape(-1), torch.uint8, [3, 4, 4]) == 5
    assert torch.equal(row, t)
    bad = bytearray(buf)
    bad[-1] ^= 0xFF
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode_entry(bytes(bad))


@pytest.mark.parametrize("where", [-1, 20])  # a payload byte, a header byte
def test_a_flipped_byte_fails_the_checksum(where: int) -> None:
    buf = bytearray(encode_entry(torch.arange(48, dtype=torch.uint8).view(3, 4, 4), 1))
    buf[where] ^= 0x01
    with pytest.raises(CorruptEntryError):
        decode_entry(bytes(buf))


def test_an_unknown_magic_names_both_formats() -> None:
    buf = bytearray(encode_entry(torch.zeros(2, dtype=torch.uint8), 0))
    buf[:4] = b"LAC9"
    with pytest.raises(CorruptEntryError, match="LAC2.*LAC1"):
        decode_entry(bytes(buf))
