"""Tensor codecs for the delta checkpoint store: lossless XOR + byte-plane shuffle + zstd, and quantized deltas.

A *blob* encodes one version of one tensor, optionally relative to a *reference* (the reconstructed bytes of an
earlier blob). Every blob is self-describing: ``MAGIC | u32 header length | JSON header | payload``.

Kinds:

1. ``full``  — lossless: byte-plane shuffle of the raw bytes, then zstd.
2. ``xor``   — lossless: XOR of the bit patterns against the reference, byte-plane shuffle, zstd. Bits that did not
   change become zero bytes; the shuffle groups the (slowly changing) sign/exponent bytes of every element together so
   zstd sees long zero runs. fp32 mantissa low bytes change at almost every optimizer step and look random, which is
   why a full Adam state shrinks little this way (``benchmarks/delta_checkpoint.py`` measures the ratio to
   ``torch.save``).
3. ``quant`` — lossy, opt-in: ``d = f(x) - f(r)`` in fp32 (``f`` is the identity, or ``sqrt`` for non-negative
   tensors such as Adam's ``exp_avg_sq``), split into blocks of ``block`` elements, each quantized to a signed
   ``bits``-bit integer with its own fp32 scale ``s = max|d_block| / qmax``; zstd on top. Reconstruction:
   ``x^ = f^-1(f(r) + q * s)``, cast to the tensor's dtype.

   **Error bound** (per element, before the final cast to the tensor's dtype):
   ``|f(x^) - f(x)| <= s_block / 2 = max|d_block| / (2 * qmax)`` with ``qmax = 127`` (int8) or ``7`` (int4); for
   ``sqrt`` tensors the bound holds on ``sqrt(x)``, and ``x^ >= 0`` always. Deltas are always taken against the
   *reconstructed* reference, so errors never accumulate along a chain. A delta that is not finite (an inf or NaN in
   the tensor or its reference) has no finite block scale: :func:`encode_quant` refuses it (:class:`NonFiniteDelta`)
   and the store keeps that tensor lossless. 1-byte floats (float8) are never quantized: an int8 delta is no smaller.

All functions are pure (numpy/torch in, bytes out) and deterministic, so a reconstruction computed while saving is
bit-identical to the one computed while loading — the store relies on that to chain deltas.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_accel._utils.checks import check_choice

__all__ = [
    "BlobHeader",
    "CodecError",
    "NonFiniteDelta",
    "decode_blob",
    "decode_chain",
    "dtype_from_name",
    "dtype_name",
    "encode_full",
    "encode_quant",
    "encode_xor",
    "itemsize_of",
    "pack_blob",
    "quantizable",
    "buffer_strides",
    "copy_into",
    "dense_layout",
    "read_header",
    "same_bytes",
    "shuffle_bytes",
    "tensor_bytes",
    "tensor_from_bytes",
    "unshuffle_bytes",
    "zstd_compress",
    "zstd_decompress",
]

MAGIC = b"LADB1\n"
_QMAX = {8: 127, 4: 7}

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
        _NAMES[getattr(torch, _name)] = _name


_ITEMSIZE: dict[torch.dtype, int] = {}


def itemsize_of(dtype: torch.dtype) -> int:
    """Bytes per element (cached: ``torch.empty(0, dtype=...).element_size()`` allocates a tensor each call)."""
    if dtype not in _ITEMSIZE:
        _ITEMSIZE[dtype] = torch.empty(0, dtype=dtype).element_size()
    return _ITEMSIZE[dtype]


class CodecError(ValueError):
    """A blob that cannot be decoded (corrupt, truncated, or of an unknown kind)."""


class NonFiniteDelta(ValueError):
    """A quantized delta was asked for a tensor whose delta against its reference is not finite (an inf or NaN in
    either): its block's scale would be inf/NaN and every element of the block would decode to NaN."""


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a supported dtype (``torch.float32`` -> ``"float32"``).

    Raises:
        TypeError: the dtype has no raw byte representation the store supports.
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"Tensors of dtype `{dtype}` cannot be stored by the delta checkpoint store; supported: {sorted(_DTYPES)}."
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r} in a blob or manifest") from None


def quantizable(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` may be stored as quantized deltas: floats of 2 bytes or more. float8 tensors stay
    lossless: an 8-bit delta is no smaller than the tensor, and torch lacks the reductions the encoder needs on them."""
    return dtype.is_floating_point and itemsize_of(dtype) > 1


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a flat uint8 array (a view when the tensor is contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # A lazy conjugate / negative view (`c.conj()`) cannot be viewed as bytes: materialise its values first (a no-op
    # for every other tensor).
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span without gaps or overlap in a standard order (contiguous, or
    channels_last for 4-D / 5-D tensors): two such tensors with equal strides hold their elements in the same order."""
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def buffer_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of a private copy of ``t`` that copies in and out without reordering: ``t``'s own when its layout
    is dense (:func:`dense_layout`: a channels_last weight stays channels_last), else contiguous."""
    if dense_layout(t):
        return tuple(t.stride())
    stride, acc = [], 1
    for n in reversed(t.shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _span_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a dense CPU tensor (:func:`dense_layout`) in memory order, as a view."""
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return flat.view(torch.uint8).numpy()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.stride() == b.stride() and dense_layout(a) and dense_layout(b)


#: tensors from this size on are compared and copied with numpy (one memcmp/memcpy-speed pass, single-threaded);
#: smaller ones with one torch call (less overhead per call). Measured by benchmarks/delta_checkpoint.py (snapshot_s).
_NUMPY_FROM = 1 << 16
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bytes(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 19) -> bool:
    """Whether two CPU tensors of the same dtype and shape hold the same bytes (bit patterns: ``-0.0`` differs from
    ``0.0``, a NaN equals itself). Large tensors are compared in chunks of ``chunk`` words, so a difference near the
    start returns early and no tensor-sized temporary is allocated."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Lazy conjugate / negative views cannot be reinterpreted as bytes: compare their values (no-op without the bits).
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.numel() * a.element_size() < _NUMPY_FROM:
        if not a.dtype.is_floating_point and not a.dtype.is_complex:  # integers and bools: value equality is bitwise
            return torch.equal(a, b)
        bits = _SAME_SIZE_INT.get(a.element_size())
        if bits is not None and not a.dtype.is_complex:  # floats as same-size integers: -0.0 != 0.0, NaN == NaN
            return torch.equal(a.detach().view(bits), b.detach().view(bits))
        return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
    # same memory order (e.g. both channels_last): compare the spans as they are, without contiguous copies
    x, y = (_span_bytes(a), _span_bytes(b)) if _same_layout(a, b) else (tensor_bytes(a), tensor_bytes(b))
    if x.size % 8 == 0:
        x, y = x.view(np.uint64), y.view(np.uint64)
    return all(np.array_equal(x[i : i + chunk], y[i : i + chunk]) for i in range(0, x.size, chunk))


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a CPU ``dst`` of ``src``'s dtype and shape; a CPU ``src`` of ``_NUMPY_FROM`` bytes or
    more is copied by numpy (a single memcpy pass: torch's multi-threaded copy is slower on a busy machine, see
    ``benchmarks/delta_checkpoint.py``) when ``dst`` is contiguous or has ``src``'s dense layout (channels_last
    weights into a channels_last buffer: one memcpy, no reordering)."""
    if src.device.type != "cpu" or src.numel() * src.element_size() < _NUMPY_FROM or src.is_conj() or src.is_neg():
        dst.copy_(src)  # (a lazy conjugate / negative view has no bytes to memcpy: torch resolves it while copying)
    elif _same_layout(dst, src):
        np.copyto(_span_bytes(dst), _span_bytes(src))
    elif dst.is_contiguous():
        np.copyto(tensor_bytes(dst), tensor_bytes(src))
    else:
        dst.copy_(src)


def tensor_from_bytes(raw: np.ndarray | bytes, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor from its raw bytes (copies, so the result owns writable memory)."""
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    t = torch.from_numpy(np.array(buf, dtype=np.uint8, copy=True))
    if t.numel() == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return t.view(dtype).reshape(tuple(shape))


def shuffle_bytes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-plane shuffle: byte ``j`` of every element, for ``j = 0..itemsize-1``, stored contiguously."""
    if itemsize == 1 or raw.size == 0:
        return raw
    # One strided copy per plane: faster than numpy's generic transpose copy (save times in
    # benchmarks/delta_checkpoint.py).
    elems = raw.reshape(-1, itemsize)
    out = np.empty((itemsize, elems.shape[0]), dtype=np.uint8)
    for j in range(itemsize):
        out[j] = elems[:, j]
    return out.reshape(-1)


def unshuffle_bytes(planes: np.ndarray, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`shuffle_bytes`, optionally written straight into ``out`` (a flat uint8 array)."""
    if out is None:
        out = np.empty(planes.size, dtype=np.uint8)
    if itemsize == 1 or planes.size == 0:
        out[...] = planes
        return out
    src = planes.reshape(itemsize, -1)
    dst = out.reshape(-1, itemsize)
    for j in range(itemsize):
        dst[:, j] = src[j]
    return out


def _tensor_from_planes(planes: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Allocate the result tensor and unshuffle into its memory (no intermediate copy)."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if t.numel():
        unshuffle_bytes(planes, t.element_size(), out=t.reshape(-1).view(torch.uint8).numpy())
    return t


class BlobHeader(dict):
    """The JSON header of a blob: ``kind``, ``dtype``, ``nbytes`` (raw size), ``ref`` (reference key or None), and
    for ``quant`` blobs ``bits``, ``block``, ``sqrt``."""


def zstd_compress(data: np.ndarray | bytes, level: int, threads: int) -> bytes:
    """One zstd frame of ``data`` (with its content checksum) at ``level`` with ``threads`` workers (0: none)."""
    import zstandard

    return zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True).compress(
        data.data if isinstance(data, np.ndarray) else data
    )


def zstd_decompress(data: memoryview | bytes, size: int) -> np.ndarray:
    """The ``size`` bytes a zstd frame holds, as a uint8 array.

    Raises:
        CodecError: the frame is corrupt or does not hold exactly ``size`` bytes.
    """
    import zstandard

    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd payload is corrupt: {e}") from e
    if len(out) != size:
        raise CodecError(f"payload decompressed to {len(out)} bytes, expected {size}")
    return np.frombuffer(out, dtype=np.uint8)


# A plane is stored raw when zstd saves less than this fraction: fp32 low-mantissa planes are ~random, and copying
# them restores much faster than Huffman-decoding them for a small gain (load times in benchmarks/delta_checkpoint.py).
_RAW_PLANE_GAIN = 0.03


def _compress_planes(
    planes: np.ndarray, itemsize: int, level: int, threads: int
) -> tuple[list[bytes | memoryview], list[int]]:
    """zstd each byte plane on its own; planes that do not shrink by ``_RAW_PLANE_GAIN`` are stored raw.

    Returns the payload's parts (raw planes as views of ``planes``: joined once, by :func:`pack_blob`) and, per
    plane, its stored length (negative: raw).
    """
    n = planes.size // itemsize if itemsize else 0
    parts: list[bytes | memoryview] = []
    lengths: list[int] = []
    for j in range(itemsize):
        plane = planes[j * n : (j + 1) * n]
        c = zstd_compress(plane, level, threads) if n else b""
        if n and len(c) > (1.0 - _RAW_PLANE_GAIN) * n:
            parts.append(plane.data)  # a view: copied once, by pack_blob
            lengths.append(-n)
        else:
            parts.append(c)
            lengths.append(len(c))
    return parts, lengths


def _plane_list(payload: memoryview | bytes, nbytes: int, itemsize: int, lengths: list[int]) -> list[np.ndarray]:
    """The byte planes of a blob: zero-copy views for raw planes, decompressed arrays for the others."""
    if len(lengths) != itemsize or nbytes % max(1, itemsize):
        raise CodecError(f"blob has {len(lengths)} byte planes, its dtype needs {itemsize}")
    n = nbytes // itemsize
    mv, pos, planes = memoryview(payload), 0, []
    for ln in lengths:
        size = abs(int(ln))
        if pos + size > len(mv):
            raise CodecError("truncated blob payload")
        chunk = mv[pos : pos + size]
        pos += size
        if ln < 0:
            if size != n:
                raise CodecError("raw plane of the wrong size")
            planes.append(np.frombuffer(chunk, dtype=np.uint8))
        else:
            planes.append(zstd_decompress(chunk, n))
    if pos != len(mv):
        raise CodecError("trailing bytes after the last plane")
    return planes


def _decompress_planes(payload: memoryview | bytes, nbytes: int, itemsize: int, lengths: list[int]) -> np.ndarray:
    planes = _plane_list(payload, nbytes, itemsize, lengths)
    return np.concatenate(planes) if planes else np.zeros(0, dtype=np.uint8)


def pack_blob(header: dict[str, Any], payload: bytes | Sequence[bytes | memoryview]) -> bytes:
    """A blob: ``MAGIC | u32 header length | JSON header (sorted keys) | payload`` (:func:`read_header` splits it).
    ``payload`` may be given as its parts (joined here, in one copy)."""
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    return b"".join([MAGIC, struct.pack("<I", len(h)), h, *parts])


def read_header(blob: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """Split a blob into its header dict and payload.

    Raises:
        CodecError: not a blob of this format.
    """
    mv = memoryview(blob)
    if len(mv) < len(MAGIC) + 4 or bytes(mv[: len(MAGIC)]) != MAGIC:
        raise CodecError("not a lightning-accel delta blob (bad magic)")
    (n,) = struct.unpack("<I", mv[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if start + n > len(mv):
        raise CodecError("truncated blob header")
    try:
        header = json.loads(bytes(mv[start : start + n]))
    except ValueError as e:
        raise CodecError(f"unreadable blob header: {e}") from e
    if not isinstance(header, dict) or "kind" not in header:
        raise CodecError("blob header is not a mapping with a `kind`")
    return header, mv[start + n :]


def encode_full(t: torch.Tensor, *, level: int = 3, threads: int = 0) -> bytes:
    """Lossless blob of ``t`` alone (shuffle + zstd)."""
    raw = tensor_bytes(t)
    payload, planes = _compress_planes(shuffle_bytes(raw, t.element_size()), t.element_size(), level, threads)
    header = {"kind": "full", "dtype": dtype_name(t.dtype), "nbytes": int(raw.size), "ref": None, "planes": planes}
    return pack_blob(header, payload)


def encode_xor(t: torch.Tensor, ref: torch.Tensor, ref_key: str, *, level: int = 3, threads: int = 0) -> bytes:
    """Lossless blob of ``t`` as the XOR of its bits with ``ref`` (same dtype and element count)."""
    if ref.dtype != t.dtype or ref.numel() != t.numel():
        raise ValueError(f"XOR reference mismatch: {ref.dtype}/{ref.numel()} vs {t.dtype}/{t.numel()}")
    raw = tensor_bytes(t)
    diff = np.bitwise_xor(raw, tensor_bytes(ref))
    shuffled = shuffle_bytes(diff, t.element_size())
    del diff  # (a view of it when itemsize is 1: then kept by `shuffled`)
    payload, planes = _compress_planes(shuffled, t.element_size(), level, threads)
    header = {"kind": "xor", "dtype": dtype_name(t.dtype), "nbytes": int(raw.size), "ref": ref_key, "planes": planes}
    return pack_blob(header, payload)


def _quant_forward(x: torch.Tensor, use_sqrt: bool) -> torch.Tensor:
    x = x.detach().reshape(-1).to(torch.float32)
    return x.sqrt() if use_sqrt else x


def _quant_apply(ref: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int, use_sqrt: bool) -> torch.Tensor:
    """``f^-1(f(ref) + q * s)`` in fp32, cast back to ``ref.dtype`` (shared by encoder and decoder: bit-identical)."""
    n = ref.numel()
    base = _quant_forward(ref, use_sqrt)
    deq = (q.to(torch.float32).reshape(-1, block) * scales.reshape(-1, 1)).reshape(-1)[:n]
    y = base + deq
    if use_sqrt:
        y = y.clamp_min(0.0).square()
    return y.to(ref.dtype).reshape(ref.shape)


def encode_quant(
    t: torch.Tensor,
    ref: torch.Tensor,
    ref_key: str,
    *,
    bits: int = 8,
    block: int = 128,
    level: int = 3,
    threads: int = 0,
) -> tuple[bytes, torch.Tensor]:
    """Lossy blob of ``t`` as a block-quantized delta against ``ref`` (the *reconstructed* reference).

    Returns:
        ``(blob, reconstruction)``: the reconstruction is exactly what :func:`decode_blob` will return for this blob
        given the same reference; the caller must use it (not ``t``) as the next reference.

    Raises:
        ValueError: ``t`` is not :func:`quantizable`, or ``ref`` differs in dtype or size.
        NonFiniteDelta: ``t - ref`` (in the quantization domain) holds an inf or NaN; encode the tensor losslessly.
    """
    check_choice("bits", bits, (8, 4))
    if not quantizable(t.dtype) or ref.dtype != t.dtype or ref.numel() != t.numel():
        raise ValueError(
            "quantized deltas need a float tensor of 2 bytes or more per element and a reference of the same dtype "
            f"and size, got {t.dtype}/{t.numel()} against {ref.dtype}/{ref.numel()}"
        )
    qmax = _QMAX[bits]
    n = t.numel()
    # sqrt domain for non-negative tensors (Adam's exp_avg_sq): keeps x^ >= 0 and bounds the error of sqrt(x), which
    # is what divides the update, instead of x itself.
    use_sqrt = bool(n and t.min().item() >= 0 and ref.min().item() >= 0)
    d = _quant_forward(t, use_sqrt) - _quant_forward(ref, use_sqrt)
    pad = (-n) % block
    if pad:
        d = torch.cat([d, d.new_zeros(pad)])
    d = d.reshape(-1, block)
    scales = d.abs().amax(dim=1) / qmax
    # An inf/NaN in `t` or `ref` (a running max initialised to inf, a diverged state), or a difference that overflows
    # fp32, makes its block's scale inf/NaN, and every element of the block would decode to NaN.
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteDelta(f"the delta against {ref_key} is not finite (an inf or NaN in the tensor or reference)")
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(d / safe.reshape(-1, 1)).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    recon = _quant_apply(ref, q, scales, block, use_sqrt)
    qb = q.numpy().astype(np.int8)
    if bits == 4:  # two signed nibbles per byte
        u = (qb.astype(np.int16) & 0xF).astype(np.uint8)
        if u.size % 2:
            u = np.concatenate([u, np.zeros(1, dtype=np.uint8)])
        qbytes = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    else:
        qbytes = qb.view(np.uint8)
    sbytes = scales.numpy().astype("<f4").view(np.uint8)
    payload = zstd_compress(np.concatenate([shuffle_bytes(sbytes, 4), qbytes]), level, threads)
    header = {
        "kind": "quant",
        "dtype": dtype_name(t.dtype),
        "nbytes": int(n * t.element_size()),
        "ref": ref_key,
        "bits": bits,
        "block": block,
        "sqrt": use_sqrt,
        "numel": n,
        "nblocks": int(scales.numel()),
        "qlen": int(qbytes.size),
    }
    return pack_blob(header, payload), recon


def _decode_lossless_chain(
    blobs: Sequence[bytes | memoryview], shape: list[int] | tuple[int, ...]
) -> torch.Tensor | None:
    """``full`` + ``xor`` links only: per byte plane, XOR the links' planes and write the result strided straight
    into the output tensor (one pass over memory per link; raw planes are never copied). None for other chains."""
    links = [read_header(b) for b in blobs]
    if not links or links[0][0]["kind"] != "full" or any(h["kind"] != "xor" for h, _ in links[1:]):
        return None
    dtype = dtype_from_name(links[0][0]["dtype"])
    nbytes = int(links[0][0]["nbytes"])
    if any(dtype_from_name(h["dtype"]) != dtype or int(h["nbytes"]) != nbytes for h, _ in links):
        raise CodecError("the links of a chain disagree on the dtype or size")
    itemsize = itemsize_of(dtype)
    out = torch.empty(tuple(shape), dtype=dtype)
    if out.numel() * itemsize != nbytes:
        raise CodecError(f"chain holds {nbytes} bytes, the manifest's shape needs {out.numel() * itemsize}")
    if nbytes == 0:
        return out
    dst = out.reshape(-1).view(torch.uint8).numpy().reshape(-1, itemsize)
    per_link = [_plane_list(p, nbytes, itemsize, h.get("planes", [])) for h, p in links]
    for j in range(itemsize):
        plane = per_link[0][j]
        for lp in per_link[1:]:
            plane = np.bitwise_xor(plane, lp[j])
        dst[:, j] = plane
    return out


def decode_chain(blobs: Sequence[bytes | memoryview], shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Decode a chain ``[full, delta, delta, ...]`` (each delta against the previous link's reconstruction).

    Runs of XOR links stay in the shuffled domain (``shuffle`` commutes with XOR), so a lossless chain costs one
    decompression per link and a single unshuffle, written straight into the result tensor.

    Raises:
        CodecError: a corrupt blob or a chain that does not start with a ``full`` blob.
    """
    fast = _decode_lossless_chain(blobs, shape)
    if fast is not None:
        return fast
    planes: np.ndarray | None = None
    tensor: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    for i, blob in enumerate(blobs):
        header, payload = read_header(blob)
        kind, nbytes = header["kind"], int(header["nbytes"])
        if (i == 0) != (kind == "full"):
            raise CodecError(f"link {i} of a chain is a `{kind}` blob")
        if dtype is None:
            dtype = dtype_from_name(header["dtype"])
        elif dtype_from_name(header["dtype"]) != dtype:
            raise CodecError("the links of a chain disagree on the dtype")
        itemsize = itemsize_of(dtype)
        if kind == "full":
            planes = _decompress_planes(payload, nbytes, itemsize, header.get("planes", []))
        elif kind == "xor":
            if planes is None:  # after a quantized link
                if tensor is None:
                    raise CodecError(f"link {i} of a chain is an XOR delta with nothing before it")
                planes = shuffle_bytes(tensor_bytes(tensor), itemsize)
            if planes.size != nbytes:
                raise CodecError(f"XOR link has {nbytes} bytes, its reference {planes.size}")
            planes = np.bitwise_xor(planes, _decompress_planes(payload, nbytes, itemsize, header.get("planes", [])))
        else:
            if planes is not None:
                tensor, planes = _tensor_from_planes(planes, dtype, [planes.size // itemsize]), None
            tensor = decode_blob(blob, tensor)
    if dtype is None:
        raise CodecError("empty chain")
    if planes is not None:
        return _tensor_from_planes(planes, dtype, list(shape))
    if tensor is None:
        raise CodecError("empty chain")
    return tensor.reshape(tuple(shape))


def decode_blob(
    blob: bytes | memoryview, ref: torch.Tensor | None, shape: list[int] | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Decode one blob, given the reconstructed tensor of its reference (``None`` for ``full`` blobs).

    Args:
        blob: the blob bytes.
        ref: the reconstruction of ``header["ref"]`` (flat or shaped; only its bytes/values matter).
        shape: shape of the result (flat when None).

    Raises:
        CodecError: corrupt blob, or a reference of the wrong size/dtype.
    """
    header, payload = read_header(blob)
    kind = header["kind"]
    dtype = dtype_from_name(header["dtype"])
    nbytes = int(header["nbytes"])
    itemsize = itemsize_of(dtype)
    if nbytes % itemsize:
        raise CodecError(f"blob size {nbytes} is not a multiple of the {header['dtype']} item size")
    out_shape = list(shape) if shape is not None else [nbytes // itemsize]
    if kind == "full":
        return _tensor_from_planes(
            _decompress_planes(payload, nbytes, itemsize, header.get("planes", [])), dtype, out_shape
        )
    if kind not in ("xor", "quant"):
        raise CodecError(f"unknown blob kind {kind!r}")
    if ref is None:
        raise CodecError(f"a `{kind}` blob needs its reference {header.get('ref')!r}")
    if ref.dtype != dtype or ref.numel() * itemsize != nbytes:
        raise CodecError(f"reference has {ref.dtype}/{ref.numel()} elements, blob expects {dtype}/{nbytes}")
    if kind == "xor":
        diff = _decompress_planes(payload, nbytes, itemsize, header.get("planes", []))
        planes = np.bitwise_xor(diff, shuffle_bytes(tensor_bytes(ref), itemsize))
        return _tensor_from_planes(planes, dtype, out_shape)
    if kind == "quant":
        bits, block, n = int(header["bits"]), int(header["block"]), int(header["numel"])
        nblocks, qlen = int(header["nblocks"]), int(header["qlen"])
        if bits not in _QMAX or block < 1 or nblocks * block < n:
            raise CodecError(f"bad quantization parameters in blob header: {header}")
        body = zstd_decompress(payload, nblocks * 4 + qlen)
        scales = torch.from_numpy(unshuffle_bytes(body[: nblocks * 4], 4).copy().view("<f4").astype(np.float32))
        qraw = body[nblocks * 4 :]
        if bits == 4:
            lo = (qraw & 0xF).astype(np.int8)
            hi = (qraw >> 4).astype(np.int8)
            both = np.empty(qraw.size * 2, dtype=np.int8)
            both[0::2], both[1::2] = lo, hi
            qv = np.where(both > 7, both - 16, both).astype(np.int8)[: nblocks * block]
        else:
            qv = qraw.view(np.int8)
        q = torch.from_numpy(qv.copy())
        if q.numel() != nblocks * block:
            raise CodecError("quantized payload has the wrong length")
        recon = _quant_apply(ref.reshape(-1), q, scales, block, bool(header["sqrt"]))
        return recon.reshape(out_shape)
    raise CodecError(f"unknown blob kind {kind!r}")
