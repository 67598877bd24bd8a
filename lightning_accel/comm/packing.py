"""Sign bits packed 8 per byte with vectorised torch bit operations (no Python loops over elements).

Convention (shared with the Triton kernel): bit 1 means ``x >= 0`` (decodes to ``+scale``), bit 0 means ``x < 0`` or
NaN (decodes to ``-scale``); element ``8*i + j`` lives in byte ``i`` at bit ``7 - j`` (most significant bit first).
"""

from __future__ import annotations

import torch

__all__ = ["pack_signs", "unpack_signs"]

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}
_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS_CACHE.get(device)
    if s is None:
        s = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
        _SHIFTS_CACHE[device] = s
    return s


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the sign bits of ``x`` (last dimension a multiple of 8) into ``uint8`` bytes.

    Args:
        x: a floating tensor ``(..., L)`` with ``L % 8 == 0``.

    Returns:
        ``uint8`` tensor ``(..., L // 8)``.
    """
    if x.shape[-1] % 8:
        raise ValueError(
            f"`x` must have a last dimension divisible by 8, got shape {tuple(x.shape)}. Pad it with zeros."
        )
    bits = (x >= 0).to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // 8, 8)
    return (bits << _shifts(x.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: ``uint8 (..., B)`` -> ``±1`` of ``dtype`` ``(..., 8 * B)``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"`packed` must be a uint8 tensor, got {packed.dtype}.")
    # a 256 x 8 lookup table of ±1 rows: one gather instead of four elementwise passes (shift, mask, convert, scale)
    key = (packed.device, dtype)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        codes = torch.arange(256, dtype=torch.uint8, device=packed.device)
        bits = (codes.unsqueeze(-1) >> _shifts(packed.device)) & 1
        lut = _LUT_CACHE[key] = bits.to(dtype) * 2 - 1
    return lut[packed.long()].reshape(*packed.shape[:-1], packed.shape[-1] * 8)
