"""1-bit compressed gradient averaging (the core of the ``ddp_1bit`` strategy; no Lightning import).

- :mod:`~lightning_accel.comm.packing`: sign bits packed 8 per byte.
- :mod:`~lightning_accel.comm.compress`: canonical group layout, per-block ``mean |x|`` scales, the torch compressor.
- :mod:`~lightning_accel.comm.allreduce`: the two-phase compressed allreduce with worker/server error feedback.
- :mod:`~lightning_accel.comm.state` / :mod:`~lightning_accel.comm.hook`: the DDP comm hook and its ``__slots__`` state.
- :mod:`~lightning_accel.comm.triton_kernels`: the fused CUDA compressor (imported lazily).
"""

from lightning_accel.comm.allreduce import OneBitResult, fp32_ring_bytes, onebit_allreduce
from lightning_accel.comm.compress import BlockTable, GroupLayout, block_scales, compress_reference, decode
from lightning_accel.comm.hook import onebit_hook
from lightning_accel.comm.packing import pack_signs, unpack_signs
from lightning_accel.comm.state import GroupState, OneBitState, gather_state_dict, select_rank_state

__all__ = [
    "BlockTable",
    "GroupLayout",
    "GroupState",
    "OneBitResult",
    "OneBitState",
    "block_scales",
    "compress_reference",
    "decode",
    "fp32_ring_bytes",
    "gather_state_dict",
    "onebit_allreduce",
    "onebit_hook",
    "pack_signs",
    "select_rank_state",
    "unpack_signs",
]
