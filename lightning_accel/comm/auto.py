"""``compression="auto"``: time fp32 and 1-bit averaging of this run's buffers, keep the faster.

Compression is extra work (two compressions, three decodes, two collectives instead of one); it pays only when the
link is slow compared with that work. Nothing predicts that well from outside (link speed, CPU or GPU compressor,
overlap), so the run measures it once at the end of warm-up (and every ``recheck_every`` steps if asked):

1. Every rank builds buffers of the sizes the compressed stage will use (the trainable parameters in model order, cut
   into groups of ``group_numel`` elements) on the gradients' device.
2. It times an fp32 allreduce of those buffers and the pipelined compressed allreduce of the same buffers (compression
   included, error state untouched), alternating, ``repeats`` rounds after one untimed round each; medians.
3. The per-rank medians are reduced with MAX (the slowest rank sets the pace); rank 0 decides ``"1bit"`` only if
   ``onebit_s * (1 + MARGIN) < fp32_s`` and broadcasts the decision with both figures, so every rank switches at the
   same step. The margin keeps a near tie on fp32: a fast link must never be slower than plain DDP.
4. The decision and both times are logged (logger ``lightning_accel.comm``) and appended to ``state.decisions``.
"""

from __future__ import annotations

import logging
import time
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from lightning_accel.comm.allreduce import CompressFn, OneBitAllreduce, run_pipelined
from lightning_accel.comm.compress import GroupLayout
from lightning_accel.comm.state import OneBitState

__all__ = ["MARGIN", "decide", "measure"]

log = logging.getLogger("lightning_accel.comm")

#: 1-bit must be at least this much faster (10 %) than fp32 to be chosen: the timing covers communication and
#: compression but not DDP's overlap of its allreduce with backward, which favours fp32 further
MARGIN = 0.1


def _groups(state: OneBitState, numels: list[int] | None) -> list[list[int]]:
    from lightning_accel.comm.momentum import plan_groups  # plan_groups lives with the step that uses it

    sizes = numels if numels else [n for n in state.param_numels if n > 0]
    keys = plan_groups(list(enumerate(sizes)), state.group_numel)
    return [[sizes[i] for i in k] for k in keys]


def measure(
    state: OneBitState, device: torch.device, numels: list[int] | None = None, *, repeats: int = 3
) -> tuple[float, float]:
    """Seconds per fp32 allreduce and per compressed allreduce of the run's buffers on this rank (medians).

    Collective. ``numels``: the element counts to time (default: the trainable parameters ``state`` numbered).
    """
    groups = _groups(state, numels)
    world = state.process_group_size()
    layouts = [GroupLayout(g, world, state.block_size, device) for g in groups]
    gen = torch.Generator().manual_seed(0)
    flat = [torch.randn(lay.numel, generator=gen).to(device) for lay in layouts]
    padded = [(torch.randn(lay.padded_numel, generator=gen).to(device) * lay.table.mask) for lay in layouts]
    errors = [
        (torch.zeros(lay.padded_numel, device=device), torch.zeros(lay.chunk_numel, device=device))
        if state.error_feedback
        else (None, None)
        for lay in layouts
    ]
    from lightning_accel.comm.momentum import MomentumCompressor  # the same backend choice as the real step

    compress: CompressFn = MomentumCompressor._compressor_for(device, state.backend)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def fp32() -> None:
        works = [dist.all_reduce(b, group=state.process_group, async_op=True) for b in flat]
        for w in works:
            w.wait()

    def onebit() -> None:
        ops = (
            OneBitAllreduce(x, lay, e[0], e[1], group=state.process_group, compress=compress)
            for x, lay, e in zip(padded, layouts, errors, strict=True)
        )

        def done(op: OneBitAllreduce) -> None:
            op.finish()

        run_pipelined(ops, done)

    times: dict[str, list[float]] = {"fp32": [], "1bit": []}
    for rnd in range(repeats + 1):
        for name, fn in (("fp32", fp32), ("1bit", onebit)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if rnd:  # the first round warms up (allocations, connections, kernel compilation)
                times[name].append(time.perf_counter() - t0)
    return median(times["fp32"]), median(times["1bit"])


def decide(state: OneBitState, device: torch.device, numels: list[int] | None = None) -> str:
    """Measure (or call ``state.measure_fn``), decide on rank 0, broadcast, log; sets ``state.decision``.

    Collective: every rank must call it at the same step. Returns the decision, ``"1bit"`` or ``"fp32"``.
    """
    if state.measure_fn is not None:
        t32, t1 = state.measure_fn(state)
    else:
        t32, t1 = measure(state, device, numels)
    group = state.process_group
    t = torch.tensor([t32, t1], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    verdict = torch.tensor([0.0, float(t[0]), float(t[1])], dtype=torch.float64, device=device)
    if dist.get_rank(group) == 0:
        verdict[0] = 1.0 if float(t[1]) * (1 + MARGIN) < float(t[0]) else 0.0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(verdict, src=src, group=group)
    decision = "1bit" if float(verdict[0]) > 0.5 else "fp32"
    entry: dict[str, Any] = {
        "step": state.step,
        "fp32_s": float(verdict[1]),
        "onebit_s": float(verdict[2]),
        "decision": decision,
    }
    state.decisions.append(entry)
    state.set_decision(decision)
    if dist.get_rank(group) == 0:
        log.info(
            "ddp_1bit compression='auto' at step %d: fp32 allreduce %.2f ms, 1-bit %.2f ms per step -> %s",
            state.step,
            1e3 * entry["fp32_s"],
            1e3 * entry["onebit_s"],
            decision,
        )
    return decision
