"""The cache entry format: a decoded sample as raw tensor bytes plus a small JSON header and a checksum. No pickle.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"LAC2"
    4       4     header_len  (uint32, bytes of the JSON header)
    8       8     xxh3  (XXH3-64, seed 0, of header + payload)
    16      H     header: UTF-8 JSON {"dtype": "uint8", "shape": [3, 224, 224], "label": 3, "meta": {...}}
    16+H    P     payload: the tensor's bytes, C-contiguous, native little-endian; P = prod(shape) * itemsize

Entries of the first format, ``b"LAC1" | u32 header_len | u32 CRC-32 (zlib) of header + payload | header | payload``,
are still read (caches written by earlier versions stay warm); new entries are always ``LAC2``. The checksum changed
because CRC-32 cost 35 us per 150 KB entry here against 2.4 us for XXH3-64 (best of 5 x 200, one thread), paid on
every miss a cold epoch writes and on the first read of every entry by a process tree that did not write it.

A sample whose bytes do not decode (``on_decode_error="skip"``) is recorded under its key as ``b"LACX"`` followed by
the error's text (UTF-8, at most :data:`_MAX_REASON` bytes): the cache then knows the sample is left out without
reading and decoding it again every epoch. The key holds the sample's content identity, so a fixed file (new size
and mtime, ETag or pack index entry) is decoded again. :func:`is_undecodable` tells such a record from an entry.

An entry that does not parse, whose length disagrees with its header, or whose checksum fails raises
:class:`CorruptEntryError`; the cache then evicts it and refetches the sample from the origin. The cache verifies each
entry the first time a process tree (the main process and its DataLoader workers) reads it, trusts the entries that
tree wrote itself, and trusts both afterwards (entries are immutable once committed; a corrupt entry is deleted and
rewritten, never changed in place).
"""

from __future__ import annotations

import functools
import json
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

__all__ = [
    "MAGIC",
    "UNDECODABLE",
    "CorruptEntryError",
    "Sample",
    "copy_payload",
    "decode_entry",
    "encode_entry",
    "encode_undecodable",
    "is_undecodable",
    "peek_shape",
]

MAGIC = b"LAC2"
_PREFIX = struct.Struct("<4sIQ")
_LEGACY_MAGIC = b"LAC1"  # read, never written
_LEGACY_PREFIX = struct.Struct("<4sII")
UNDECODABLE = b"LACX"  # a record of an undecodable sample, not an entry
_MAX_REASON = 240  # bytes of the error's text kept in the record: enough to say what failed

# Only plain numeric dtypes: the payload is reinterpreted with numpy, never unpickled.
_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _digest(header: bytes | memoryview, payload: bytes | memoryview) -> int:
    """XXH3-64 of ``header + payload`` without joining them."""
    h = xxhash.xxh3_64(header)
    h.update(payload)
    return h.intdigest()


class CorruptEntryError(ValueError):
    """A cache entry failed to parse or its checksum did not match."""


@dataclass
class Sample:
    """A decoded sample: a tensor, its integer label and optional JSON-serialisable metadata."""

    tensor: torch.Tensor
    label: int
    meta: dict[str, Any] = field(default_factory=dict)


def encode_entry(tensor: torch.Tensor, label: int, meta: dict[str, Any] | None = None) -> bytes | bytearray:
    """Serialise a CPU tensor and its label into the documented entry layout.

    Args:
        tensor: the sample (any of the plain numeric dtypes).
        label: its integer label.
        meta: JSON-serialisable metadata stored in the header.

    Raises:
        TypeError: ``tensor`` has a dtype outside the supported plain numeric set.
    """
    if tensor.dtype not in _NAMES:
        raise TypeError(
            f"`tensor` dtype {tensor.dtype} cannot be cached; expected one of {sorted(_DTYPES)}. "
            "Convert it in your `decode` function (uint8 is the usual choice for images)."
        )
    t = tensor.detach().cpu()
    header = json.dumps(
        {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "label": int(label), "meta": meta or {}},
        separators=(",", ":"),
    ).encode("utf-8")
    if t.is_contiguous() and t.numel() and t.dim() and t.dtype != torch.bool:
        # The cache's path (a batch row): the checksum straight over the tensor's memory, then one copy into the entry
        # by `bytes.join` (a bytearray would be zero-filled first: a 150 KB memset per 224 px sample).
        payload = t.view(torch.uint8).numpy().data.cast("B")
        check = _digest(header, payload)
        return b"".join((_PREFIX.pack(MAGIC, len(header), check), header, payload))
    # One strided copy straight into the entry (a decoded HWC->CHW view is not contiguous): no temporaries.
    start = _PREFIX.size + len(header)
    buf = bytearray(start + t.numel() * t.element_size())
    buf[_PREFIX.size : start] = header
    if t.numel():
        dst = torch.frombuffer(buf, dtype=torch.uint8, offset=start).view(t.dtype).view(t.shape)
        dst.copy_(t)
    mv = memoryview(buf)
    check = _digest(header, mv[start:])
    _PREFIX.pack_into(buf, 0, MAGIC, len(header), check)
    return bytes(buf) if len(buf) < 4096 else buf  # large entries: hand the buffer over without another copy


def encode_undecodable(reason: str) -> bytes:
    """The record of a sample whose bytes do not decode, with ``reason`` (the error's text, cut to fit)."""
    return UNDECODABLE + reason.encode("utf-8", "replace")[:_MAX_REASON]


def is_undecodable(buf: memoryview | bytes) -> bool:
    """Whether ``buf`` is a record of :func:`encode_undecodable` rather than an entry."""
    return bytes(memoryview(buf)[:4]) == UNDECODABLE


@dataclass(frozen=True)
class _Layout:
    """What a header declares, checked once per distinct header."""

    header: dict[str, Any]
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    label: int


_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES.values()}


@functools.lru_cache(maxsize=4096)
def _layout(raw: bytes) -> _Layout:
    # Headers repeat (same dtype/shape, few labels): parse and check each distinct one once. Per entry this saves a
    # large share of a warm read (json, a torch.empty for the item size, np.prod; see benchmarks/data_cache.py).
    try:
        header = json.loads(raw)
        dtype = _DTYPES[header["dtype"]]
        shape = tuple(int(s) for s in header["shape"])
        label = int(header["label"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntryError(f"unreadable header: {e}") from e
    return _Layout(header, dtype, shape, math.prod(shape) * _ITEMSIZE[dtype], label)


def _parse(buf: memoryview | bytes, verify: bool = True) -> tuple[_Layout, memoryview]:
    mv = memoryview(buf)
    magic = bytes(mv[:4])
    legacy = magic == _LEGACY_MAGIC
    prefix = _LEGACY_PREFIX if legacy else _PREFIX
    if len(mv) < prefix.size:
        raise CorruptEntryError(f"entry of {len(mv)} bytes is shorter than its {prefix.size}-byte prefix")
    if magic == UNDECODABLE:
        raise CorruptEntryError(
            f"not an entry: the record of an undecodable sample ({bytes(mv[4:]).decode('utf-8', 'replace')})"
        )
    if not legacy and magic != MAGIC:
        raise CorruptEntryError(f"bad magic {magic!r}, expected {MAGIC!r} (or {_LEGACY_MAGIC!r})")
    _, hlen, check = prefix.unpack_from(mv, 0)
    end = prefix.size + hlen
    if end > len(mv):
        raise CorruptEntryError(f"header length {hlen} runs past the entry's {len(mv)} bytes")
    header_b = mv[prefix.size : end]
    payload = mv[end:]
    if verify:
        got = zlib.crc32(payload, zlib.crc32(header_b)) if legacy else _digest(header_b, payload)
        if got != check:
            raise CorruptEntryError("checksum mismatch")
    layout = _layout(bytes(header_b))
    if layout.nbytes != len(payload):
        raise CorruptEntryError(
            f"payload has {len(payload)} bytes, header {list(layout.shape)} x {_ITEMSIZE[layout.dtype]} says otherwise"
        )
    return layout, payload


def decode_entry(buf: memoryview | bytes) -> Sample:
    """Parse and verify an entry; the returned tensor owns a copy of the payload.

    Raises:
        CorruptEntryError: the entry is malformed or fails its checksum.
    """
    layout, payload = _parse(buf)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    t = raw.view(layout.dtype).reshape(layout.shape)
    return Sample(t, layout.label, dict(layout.header.get("meta") or {}))


def peek_shape(buf: memoryview | bytes) -> tuple[torch.dtype, list[int]]:
    """The dtype and shape an entry declares (structure checked; the checksum is left to :func:`copy_payload`)."""
    layout, _ = _parse(buf, verify=False)
    return layout.dtype, list(layout.shape)


def copy_payload(
    buf: memoryview | bytes, dst: np.ndarray, dtype: torch.dtype, shape: Sequence[int], *, verify: bool = True
) -> int:
    """Verify an entry and copy its payload straight into ``dst`` (one copy, e.g. from LMDB's mmap into a batch).

    Args:
        buf: the entry bytes (a memoryview into the LMDB map is fine; it is not kept).
        dst: a flat uint8 numpy view of one batch row. The caller makes the batch's numpy view once, which saves
            the per-sample tensor/array wrappers (~5 us).
        dtype: the dtype the batch expects.
        shape: the shape of one row.
        verify: check the checksum (``False`` only for an entry this process tree has already verified: entries are
            immutable once committed).

    Returns:
        The entry's label.

    Raises:
        CorruptEntryError: malformed entry or checksum mismatch.
        ValueError: the entry's dtype/shape is not ``dtype``/``shape``.
    """
    layout, payload = _parse(buf, verify)
    if layout.dtype != dtype or layout.shape != tuple(shape):
        raise ValueError(
            f"cached sample has dtype {layout.header['dtype']} and shape {list(layout.shape)}, the batch expects "
            f"{dtype} and {list(shape)}. Make `decode` return one fixed shape (e.g. resize/crop to a fixed size)."
        )
    if len(payload):
        np.copyto(dst, np.frombuffer(payload, dtype=np.uint8))
    return layout.label
