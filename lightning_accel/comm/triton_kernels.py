"""Triton kernel fusing error-add, per-block scale, sign and pack (CUDA path of :func:`compress_reference`).

One program per scale block: it loads the block's gradient and error once, forms ``x = g + e * loss_scale``, reduces
``mean |x|`` in registers, packs the sign bits 8 per byte and writes the new error, so ``x`` never round-trips through
memory (the torch path reads/writes it five times). Imported lazily: ``import triton`` costs about a second and is
not needed on CPU. Tested on CPU with ``TRITON_INTERPRET=1`` (fp32 only, small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_accel.comm.compress import BlockTable

__all__ = ["compress_triton"]


@triton.jit
def _onebit_compress_kernel(
    g_ptr,
    e_ptr,
    e_out_ptr,
    starts_ptr,
    lengths_ptr,
    valid_ptr,
    mask_ptr,
    packed_ptr,
    scales_ptr,
    ls_ptr,
    HAS_EF: tl.constexpr,
    HAS_LS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    start = tl.load(starts_ptr + pid)
    length = tl.load(lengths_ptr + pid)
    nvalid = tl.load(valid_ptr + pid)
    offs = tl.arange(0, BLOCK)
    in_block = offs < length
    real = tl.load(mask_ptr + start + offs, mask=in_block, other=0) != 0
    x = tl.load(g_ptr + start + offs, mask=in_block, other=0.0).to(tl.float32)
    if HAS_EF:
        e = tl.load(e_ptr + start + offs, mask=in_block, other=0.0)
        if HAS_LS:
            s = tl.load(ls_ptr)
            x = x + e * s
        else:
            x = x + e
    x = tl.where(real, x, 0.0)
    scale = tl.sum(tl.abs(x), axis=0) / tl.maximum(nvalid, 1.0)
    bit = x >= 0
    if HAS_EF:
        new_e = tl.where(real, x - tl.where(bit, scale, -scale), 0.0)
        if HAS_LS:
            new_e = new_e / s
        tl.store(e_out_ptr + start + offs, new_e, mask=in_block)
    bits = tl.reshape(bit.to(tl.int32), (BLOCK // 8, 8))
    shifts = 7 - tl.arange(0, 8)
    byte = tl.sum(bits << shifts[None, :], axis=1)
    boffs = tl.arange(0, BLOCK // 8)
    tl.store(packed_ptr + start // 8 + boffs, byte.to(tl.uint8), mask=boffs < length // 8)
    tl.store(scales_ptr + pid, scale)


def compress_triton(
    grad: torch.Tensor,
    error: torch.Tensor | None,
    table: BlockTable,
    loss_scale: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as :func:`~lightning_accel.comm.compress.compress_reference` over the whole group buffer.

    Args:
        grad: contiguous ``(L,)`` gradients (any float dtype; computed in fp32).
        error: contiguous float32 error state of the same length, or None.
        table: the buffer's blocks (a whole group or one rank's chunk).
        loss_scale: 0-dim float32 tensor or None.
        out: optional ``(packed uint8 (L/8,), scales float32 (num_blocks,), new_error float32 (L,) or None)``
            buffers to write into instead of allocating (``new_error`` must not be ``error``; None without error
            feedback); they are returned.
    """
    n = table.mask.numel()
    if grad.numel() != n or (error is not None and error.numel() != n):
        raise ValueError(f"`grad`/`error` must have {n} elements (the block table's length), got {grad.numel()}.")
    if out is None:
        packed = torch.empty(n // 8, dtype=torch.uint8, device=grad.device)
        scales = torch.empty(table.num_blocks, dtype=torch.float32, device=grad.device)
        new_error = torch.empty_like(error) if error is not None else None
    else:
        packed, scales, new_error = out
        if (
            packed.numel() != n // 8
            or scales.numel() != table.num_blocks
            or (error is not None and (new_error is None or new_error.numel() != n or new_error is error))
        ):
            raise ValueError(
                f"`out` must be (packed of {n // 8} bytes, {table.num_blocks} scales, a new-error buffer of {n} "
                "elements other than `error`, or None without error feedback)."
            )
        if error is None:
            new_error = None
    block = triton.next_power_of_2(max(8, table.max_len))
    dummy = scales  # any tensor: the pointer is never read when the constexpr flag is off
    ls = loss_scale.to(device=grad.device, dtype=torch.float32).reshape(1) if loss_scale is not None else dummy
    _onebit_compress_kernel[(table.num_blocks,)](
        grad,
        error if error is not None else dummy,
        new_error if new_error is not None else dummy,
        table.starts,
        table.lengths,
        table.valid,
        table.mask.view(torch.uint8),
        packed,
        scales,
        ls,
        HAS_EF=error is not None,
        HAS_LS=loss_scale is not None and error is not None,
        BLOCK=block,
    )
    return packed, scales, new_error
