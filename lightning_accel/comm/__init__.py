"""1-bit compressed gradient averaging: the plain-torch core and its Lightning adapter, ``OneBitDDPStrategy``.

- :mod:`~lightning_accel.comm.packing`: sign bits packed 8 per byte.
- :mod:`~lightning_accel.comm.compress`: canonical group layout, per-block ``mean |x|`` scales, the torch
  compressors (the reference and the buffer-reusing ``Compressor``).
- :mod:`~lightning_accel.comm.allreduce`: the two-phase compressed allreduce with worker/server error feedback, flat
  and hierarchical (fp32 inside a node, compressed between nodes).
- :mod:`~lightning_accel.comm.topology`: the node layout and its process groups for hierarchical averaging.
- :mod:`~lightning_accel.comm.config`: ``OneBitConfig``, the validated hyper-parameters.
- :mod:`~lightning_accel.comm.state` / :mod:`~lightning_accel.comm.hook`: the DDP comm hook and its ``__slots__`` state
  (hyper-parameters, error-feedback state, ``CommStats``).
- :mod:`~lightning_accel.comm.momentum`: the compressed-momentum optimizer step (SGD-momentum, Adam, AdamW).
- :mod:`~lightning_accel.comm.auto`: ``compression="auto"``, timing fp32 against 1-bit at the end of warm-up.
- :mod:`~lightning_accel.comm.warmup`: ``warmup_steps="auto"``, ending the warm-up when Adam's variance settles.
- :mod:`~lightning_accel.comm.triton_kernels`: the fused CUDA compressor (imported lazily).
- :mod:`~lightning_accel.comm.localsteps`: local steps with a compressed outer update (DiLoCo, Streaming DiLoCo).
- :mod:`~lightning_accel.comm.strategy`: ``OneBitDDPStrategy`` (``strategy="ddp_1bit"``) and
  ``LocalStepsStrategy`` (``strategy="diloco"``), the only modules here
  that import Lightning.
"""

from lightning_accel.comm.allreduce import (
    HierarchicalOneBitAllreduce,
    OneBitAllreduce,
    OneBitResult,
    fp32_ring_bytes,
    onebit_allreduce,
    run_pipelined,
)
from lightning_accel.comm.auto import OverlapTrial, StepTiming, StepTrial, decide, measure
from lightning_accel.comm.compress import (
    BlockTable,
    Compressor,
    GroupLayout,
    NodeShard,
    block_scales,
    compress_fast,
    compress_reference,
    decode,
)
from lightning_accel.comm.config import (
    CompressedSignal,
    Compression,
    CompressorBackend,
    OneBitConfig,
)
from lightning_accel.comm.hook import onebit_hook
from lightning_accel.comm.localsteps import LocalSteps, LocalStepsConfig
from lightning_accel.comm.momentum import MomentumCompressor, momentum_kind, plan_groups
from lightning_accel.comm.packing import pack_signs, unpack_signs
from lightning_accel.comm.state import (
    CommStats,
    GroupState,
    KeptBuffers,
    OneBitState,
    StepBytes,
    gather_state_dict,
    gather_state_dict_async,
    select_rank_state,
)
from lightning_accel.comm.strategy import CHECKPOINT_KEY, LocalStepsStrategy, OneBitDDPStrategy
from lightning_accel.comm.topology import NodeTopology, node_topology, resolve_hierarchical
from lightning_accel.comm.warmup import AUTO_MIN_WARMUP, WarmupWatch, warmup_cap

__all__ = [
    "AUTO_MIN_WARMUP",
    "CHECKPOINT_KEY",
    "BlockTable",
    "CommStats",
    "CompressedSignal",
    "Compression",
    "Compressor",
    "CompressorBackend",
    "GroupLayout",
    "GroupState",
    "HierarchicalOneBitAllreduce",
    "KeptBuffers",
    "LocalSteps",
    "LocalStepsConfig",
    "LocalStepsStrategy",
    "MomentumCompressor",
    "NodeShard",
    "NodeTopology",
    "OneBitAllreduce",
    "OneBitResult",
    "OverlapTrial",
    "OneBitConfig",
    "OneBitDDPStrategy",
    "OneBitState",
    "block_scales",
    "compress_fast",
    "compress_reference",
    "StepBytes",
    "StepTiming",
    "StepTrial",
    "WarmupWatch",
    "decide",
    "decode",
    "fp32_ring_bytes",
    "gather_state_dict",
    "gather_state_dict_async",
    "measure",
    "momentum_kind",
    "node_topology",
    "onebit_allreduce",
    "onebit_hook",
    "pack_signs",
    "plan_groups",
    "resolve_hierarchical",
    "run_pipelined",
    "select_rank_state",
    "unpack_signs",
    "warmup_cap",
]
