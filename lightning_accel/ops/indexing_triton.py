"""Element offsets for the fused ops' Triton kernels, computed in int64.

``tl.program_id`` is an int32, and so is every product with it while its other factor (a block size, a row stride,
which Triton passes as int32 when it fits) is one: ``program_id * BLOCK`` or ``row * stride`` wraps past ``2**31 - 1``
elements (an 8 GiB float32 activation, e.g. 64 x 8192 tokens x 4096 features), and the wrapped, negative offset reads
and writes outside the tensor with no error. Every kernel therefore starts its offsets from :func:`program_start`,
whose int64 result makes the arithmetic after it int64 too; on a GPU the extra cost is one 64-bit multiply-add per
address. Imported lazily, by the kernels' modules only.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["program_start"]


@triton.jit
def program_start(axis: tl.constexpr, BLOCK: tl.constexpr):
    """``program_id(axis) * BLOCK`` as an int64 scalar: the first index of this program's block along ``axis``
    (``BLOCK=1``: the program id itself, e.g. a row index multiplied by a row stride next)."""
    return tl.program_id(axis).to(tl.int64) * BLOCK
