"""The two-phase compressed allreduce (1-bit signs + block scales, error feedback on workers and servers).

Bytes per rank and step (exactly what the collectives are handed; ``M`` scale slots per chunk, ``C`` chunk elements):
phase 1 sends ``N - 1`` rows of ``C/8 + 4M`` bytes (the row for itself stays local), phase 2 sends its own row to
``N - 1`` peers (a ring all-gather forwards ``N - 1`` rows). Total ``2 (N-1) (C/8 + 4M)`` ≈ ``2 (N-1)/N · d/8``,
against ``2 (N-1)/N · 4d`` for an fp32 ring allreduce: ~32x less at any ``N``.

**Hierarchical** (:class:`HierarchicalOneBitAllreduce`, ``K`` nodes of ``L`` processes): the same exchange between
nodes instead of ranks. An fp32 reduce-scatter inside the node leaves local rank ``l`` with the node's average of
shard ``l`` (chunks ``l*K ... l*K+K-1`` of the same canonical layout); the ``K`` ranks holding shard ``l`` run the
two-phase 1-bit exchange on it; an all-gather of the compressed result inside the node gives every rank all ``N``
server chunks in the flat path's order, decoded as there. Over the slow link each rank sends
``2 (K-1) (C/8 + 4M)``, so each node sends ``L`` times that: ``2 (K-1)/K · d/8`` per node against the flat path's
``2 L (N-L)/N · d/8`` (node-major ranks: the ``N-L`` peers on other nodes); half at ``2 x 2``, ``1/L`` asymptotically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_accel.comm.compress import BlockTable, Compressor, GroupLayout, compress_reference, decode
from lightning_accel.comm.topology import NodeTopology

__all__ = [
    "CompressFn",
    "CompressedAllreduce",
    "HierarchicalOneBitAllreduce",
    "OneBitAllreduce",
    "OneBitBuffers",
    "OneBitResult",
    "fp32_ring_bytes",
    "onebit_allreduce",
    "run_pipelined",
]

CompressFn = Callable[
    [torch.Tensor, "torch.Tensor | None", BlockTable, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]",
]


@dataclass
class OneBitResult:
    """What :func:`onebit_allreduce` produced.

    Attributes:
        out: float32 ``(padded_numel,)`` averaged gradient (identical on every rank); garbage on padding.
        worker_error: the worker error to commit (None without error feedback).
        server_error: the server error of this rank's chunk to commit (None without error feedback).
        finite: 0-dim bool tensor, whether ``out`` is finite on its real elements; commit the errors only if True.
        bytes_sent: bytes this rank put on the wire in the compressed exchange (both phases; hierarchical: the
            exchange between nodes).
        intra_bytes: hierarchical only, bytes this rank sent to the ranks of its own node (fp32 reduce-scatter and
            compressed all-gather); 0 on the flat path.
    """

    out: torch.Tensor
    worker_error: torch.Tensor | None
    server_error: torch.Tensor | None
    finite: torch.Tensor
    bytes_sent: int
    intra_bytes: int = 0


def fp32_ring_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` fp32 values: ``2 (N-1)/N · 4 numel``."""
    return int(round(2 * (world_size - 1) / world_size * 4 * numel))


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.14
    return gather(out, inp, group=group, async_op=async_op)


def _scale_bytes(scales: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 scales -> their raw bytes, zero-padded to ``width`` scale slots."""
    padded = torch.zeros(width, dtype=torch.float32, device=scales.device)
    padded[: scales.numel()] = scales
    return padded.view(torch.uint8)


def _worker_message(
    x: torch.Tensor,
    table: BlockTable,
    slot: torch.Tensor,
    rows: int,
    layout: GroupLayout,
    buffers: OneBitBuffers | None,
    compress: CompressFn,
    worker_error: torch.Tensor | None,
    loss_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The worker step on ``x`` (blocks ``table``): compress with the worker error (``buffers``' kept compressor, else
    ``compress``) and lay out phase 1's message.

    Returns:
        ``(send, new_worker_error)``: ``send`` is ``(rows, C/8 + 4M)`` bytes, row ``j`` holding chunk ``j``'s signs
        and its blocks' scales (``slot``: each block's place in the flattened ``(rows, M)`` scale table).
    """
    if buffers is not None:
        packed, scales, new_worker = buffers.worker.compress(x, worker_error, loss_scale)
    else:
        packed, scales, new_worker = compress(x, worker_error, table, loss_scale)
    cb, m = layout.chunk_numel // 8, layout.max_blocks
    scale_table = torch.zeros(rows * m, dtype=torch.float32, device=packed.device)
    scale_table[slot] = scales
    return torch.cat([packed.view(rows, cb), scale_table.view(rows, m).view(torch.uint8)], dim=1), new_worker


def _serve_chunk(
    recv: torch.Tensor,
    mine: BlockTable,
    layout: GroupLayout,
    buffers: OneBitBuffers | None,
    compress: CompressFn,
    server_error: torch.Tensor | None,
    loss_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The server step on the received rows of chunk ``mine``: decode, average, recompress with the server error.

    Returns:
        ``(own, new_server_error)``: phase 2's message (signs + scales, ``C/8 + 4M`` bytes) and the new error.
    """
    cb, m = layout.chunk_numel // 8, layout.max_blocks
    recv_scales = recv[:, cb:].clone(memory_format=torch.contiguous_format).view(torch.float32)[:, : mine.num_blocks]
    if buffers is not None:
        rows = buffers.server.decode(recv[:, :cb], recv_scales, out=buffers.rows)
        avg = torch.mean(rows, dim=0, out=buffers.avg)
        avg.index_fill_(0, mine.pad_index, 0.0)  # = torch.where(mask, avg, 0.0), in place
        s_packed, s_scales, new_server = buffers.server.compress(avg, server_error, loss_scale)
    else:
        avg = decode(recv[:, :cb], recv_scales, mine.lengths).mean(dim=0)
        avg = torch.where(mine.mask, avg, 0.0)
        s_packed, s_scales, new_server = compress(avg, server_error, mine, loss_scale)
    return torch.cat([s_packed, _scale_bytes(s_scales, m)]), new_server


def _decode_chunks(
    gathered: torch.Tensor, layout: GroupLayout, buffers: OneBitBuffers | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the ``(N, C/8 + 4M)`` server chunks of the whole group (with ``buffers``: their decoder of the whole
    table, into ``buffers.out``; None: the generic decode).

    Returns:
        ``(out, finite)``. Every real element decodes to ±(its block's scale), exactly, so ``out`` is finite on the real
        elements iff the scales of the blocks holding real elements are: the verdict of
        ``isfinite(where(mask, out, 0)).all()`` from ``num_blocks`` values instead of two passes over the group.
    """
    cb = layout.chunk_numel // 8
    all_scales = (
        gathered[:, cb:].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(-1)[layout.slot]
    )
    if buffers is not None:
        decoded = buffers.full.decode(gathered[:, :cb].reshape(-1), all_scales, out=buffers.out)
    else:
        decoded = decode(gathered[:, :cb].reshape(-1), all_scales, layout.table.lengths)
    return decoded, torch.isfinite(all_scales[layout.table.has_real]).all()


class OneBitBuffers:
    """Everything one group's :class:`OneBitAllreduce` writes, kept between steps so a step allocates nothing big.

    Without them every call builds fresh compressors (``compress_fast``: ~10 bytes of scratch per element, page
    faulted on first touch) and decodes through the generic :func:`~lightning_accel.comm.compress.decode` into new
    tensors; together with the scale-based finiteness check of :meth:`OneBitAllreduce.finish` these buffers cut the
    compressed step's host work to a fraction (the hook time ``benchmarks/onebit.py`` reports on the shaped link).
    Results are bit-identical to those computed without (the same :class:`~lightning_accel.comm.compress.Compressor`
    passes; its decode equals :func:`~lightning_accel.comm.compress.decode` exactly).

    One instance per group and rank: the outputs of an operation (``result.out``, its new errors) are these buffers,
    valid until the next operation using the same instance starts, so two operations in flight need two instances.

    Args:
        layout: the group's layout.
        rank: this rank in the group's process group.
        topology: for hierarchical averaging, the node layout (the worker side then compresses this rank's shard and
            the server side serves the shard's chunk of this rank's node), else None.

    Attributes:
        worker: compressor of the whole group's table (hierarchical: of this rank's shard; worker side).
        server: compressor of this rank's chunk (server side; decodes the received rows too).
        full: decoder of the whole group's table (the gathered result; ``worker`` itself on the flat path).
        rows: float32 ``(R, C)``, the decoded rows of this rank's chunk (``R``: ranks, hierarchical: nodes).
        avg: float32 ``(C,)``, their average.
        out: float32 ``(padded_numel,)``, the decoded result.
        node_rows: hierarchical only, float32 ``(L, shard numel)``, the node's rows of this rank's shard.
        node_avg: hierarchical only, float32 ``(shard numel,)``, their average.
    """

    def __init__(self, layout: GroupLayout, rank: int, topology: NodeTopology | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.topology = topology
        dev = layout.device
        if topology is None:
            self.worker = Compressor(layout.table)
            self.server = Compressor(layout.chunks[rank])
            self.full = self.worker
            rows = layout.world_size
        else:
            shard = layout.node_shard(topology.local_rank, topology.local_size)
            self.worker = Compressor(shard.table)
            self.server = Compressor(shard.chunks[topology.node])
            self.full = Compressor(layout.table)
            rows = topology.nodes
            self.node_rows = torch.empty(topology.local_size, shard.numel, dtype=torch.float32, device=dev)
            self.node_avg = torch.empty(shard.numel, dtype=torch.float32, device=dev)
        self.rows = torch.empty(rows, layout.chunk_numel, dtype=torch.float32, device=dev)
        self.avg = torch.empty(layout.chunk_numel, dtype=torch.float32, device=dev)
        self.out = torch.empty(layout.padded_numel, dtype=torch.float32, device=dev)


class OneBitAllreduce:
    """One two-phase compressed allreduce split at its collectives, so several can be in flight (pipelining).

    :meth:`start` compresses on the worker side and issues phase 1 (asynchronous), :meth:`serve` waits for it,
    averages and recompresses this rank's chunk and issues phase 2 (asynchronous), :meth:`finish` waits for it and
    decodes. Callers that keep several in flight must call the three methods in the same order on every rank (the
    collectives are then issued in the same order everywhere, which gloo and NCCL require). Arguments are those of
    :func:`onebit_allreduce`.
    """

    __slots__ = (
        "_a2a",
        "_ag",
        "_gathered",
        "_own",
        "_recv",
        "_send",
        "compress",
        "group",
        "layout",
        "loss_scale",
        "rank",
        "result",
        "server_error",
        "worker_error",
        "x",
        "_new_worker",
        "_new_server",
        "buffers",
    )

    def __init__(
        self,
        x: torch.Tensor,
        layout: GroupLayout,
        worker_error: torch.Tensor | None,
        server_error: torch.Tensor | None,
        *,
        group: dist.ProcessGroup | None = None,
        loss_scale: torch.Tensor | None = None,
        compress: CompressFn = compress_reference,
        buffers: OneBitBuffers | None = None,
    ) -> None:
        self.x = x
        self.buffers = buffers
        self.layout = layout
        self.worker_error = worker_error
        self.server_error = server_error
        self.group = group
        self.loss_scale = loss_scale
        self.compress = compress
        self.rank = dist.get_rank(group)
        if buffers is not None and (
            buffers.layout is not layout or buffers.rank != self.rank or buffers.topology is not None
        ):
            raise ValueError("`buffers` must be made for this `layout` and this rank, without a node topology.")
        self.result: OneBitResult | None = None
        self._a2a: Any = None
        self._ag: Any = None

    def start(self) -> OneBitAllreduce:
        """Step 1 (worker compression) and phase 1 issued asynchronously."""
        layout = self.layout
        self._send, self._new_worker = _worker_message(
            self.x,
            layout.table,
            layout.slot,
            layout.world_size,
            layout,
            self.buffers,
            self.compress,
            self.worker_error,
            self.loss_scale,
        )
        self._recv = torch.empty_like(self._send)
        # phase 1: row j of `send` goes to rank j
        self._a2a = dist.all_to_all_single(self._recv, self._send, group=self.group, async_op=True)
        return self

    def serve(self) -> OneBitAllreduce:
        """Step 3 (server average + recompression of this rank's chunk) and phase 2 issued asynchronously."""
        layout, n = self.layout, self.layout.world_size
        self._a2a.wait()
        mine = layout.chunks[self.rank]
        self._own, self._new_server = _serve_chunk(
            self._recv, mine, layout, self.buffers, self.compress, self.server_error, self.loss_scale
        )
        self._gathered = torch.empty(n * self._own.numel(), dtype=torch.uint8, device=self.x.device)
        # phase 2: everyone gets every server chunk (gloo wants a flat output)
        self._ag = _all_gather(self._gathered, self._own, self.group, async_op=True)
        return self

    def finish(self) -> OneBitResult:
        """Step 4: wait for phase 2 and decode every server chunk (identical bytes, so identical results)."""
        layout, n = self.layout, self.layout.world_size
        if self._ag is not None:
            self._ag.wait()
        own = self._own
        out, finite = _decode_chunks(self._gathered.view(n, own.numel()), layout, self.buffers)
        send = self._send
        sent = (send.numel() - send[self.rank].numel()) * send.element_size() + (n - 1) * own.numel()
        self.result = OneBitResult(
            out=out, worker_error=self._new_worker, server_error=self._new_server, finite=finite, bytes_sent=sent
        )
        # drop the message buffers: a finished operation keeps only its result
        self._send = self._recv = self._own = self._gathered = self.x = None  # type: ignore[assignment]
        return self.result


class HierarchicalOneBitAllreduce:
    """The compressed allreduce of ``K`` nodes of ``L`` processes: fp32 inside a node, 1-bit between nodes.

    Same interface and call order as :class:`OneBitAllreduce` (so :func:`run_pipelined` and the momentum step run
    either), same canonical layout, blocks and scales (see the module docstring for the three steps and the bytes):

    - :meth:`start`: fp32 reduce-scatter inside the node (an ``all_to_all_single`` of the ``L`` shards, summed in
      local-rank order: gloo has no reduce-scatter), the node average of this rank's shard compressed with the worker
      error (shard-sized), phase 1 between nodes issued asynchronously on the cross group;
    - :meth:`serve`: the ``K`` rows of this rank's chunk averaged and recompressed with the server error, phase 2
      issued asynchronously on the cross group;
    - :meth:`finish`: the shard's ``K`` server chunks all-gathered inside the node (compressed bytes), so every rank
      holds the ``N`` chunks in the flat path's order and decodes them as :meth:`OneBitAllreduce.finish` does: the
      same bytes on every rank, so bit-identical results.

    Args:
        x: float ``(layout.padded_numel,)`` local gradients (or momentum) in canonical layout, zeros on padding.
        layout: the group's layout (``world_size`` = all ranks, ``L * K``).
        worker_error: float32 ``(K * chunk_numel,)`` (this rank's shard) or None (no error feedback).
        server_error: float32 ``(chunk_numel,)`` or None.
        topology: the node layout and its groups (:func:`~lightning_accel.comm.topology.node_topology`).
        loss_scale, compress, buffers: as for :class:`OneBitAllreduce` (``buffers`` made with this ``topology``).
    """

    __slots__ = (
        "_a2a",
        "_ag",
        "_gathered",
        "_own",
        "_recv",
        "_send",
        "_new_server",
        "_new_worker",
        "_intra_sent",
        "buffers",
        "compress",
        "layout",
        "loss_scale",
        "result",
        "server_error",
        "shard",
        "topology",
        "worker_error",
        "x",
    )

    def __init__(
        self,
        x: torch.Tensor,
        layout: GroupLayout,
        worker_error: torch.Tensor | None,
        server_error: torch.Tensor | None,
        *,
        topology: NodeTopology,
        loss_scale: torch.Tensor | None = None,
        compress: CompressFn = compress_reference,
        buffers: OneBitBuffers | None = None,
    ) -> None:
        if layout.world_size != topology.local_size * topology.nodes:
            raise ValueError(
                f"`layout` was made for {layout.world_size} ranks, the topology has {topology.nodes} nodes of "
                f"{topology.local_size}."
            )
        if buffers is not None and (
            buffers.layout is not layout or buffers.topology is None or buffers.topology.place != topology.place
        ):
            raise ValueError("`buffers` must be made for this `layout` and this rank's place in `topology`.")
        self.x = x
        self.layout = layout
        self.topology = topology
        self.shard = layout.node_shard(topology.local_rank, topology.local_size)
        self.worker_error = worker_error
        self.server_error = server_error
        self.loss_scale = loss_scale
        self.compress = compress
        self.buffers = buffers
        self.result: OneBitResult | None = None
        self._a2a: Any = None
        self._ag: Any = None
        self._intra_sent = 0

    def _node_average(self) -> torch.Tensor:
        """The node's fp32 average of this rank's shard (blocking: the compression needs it)."""
        topo, shard = self.topology, self.shard
        n = topo.local_size
        if n == 1:
            return self.x[shard.start : shard.start + shard.numel]
        bufs = self.buffers
        rows = (
            bufs.node_rows
            if bufs is not None
            else torch.empty(n, shard.numel, dtype=torch.float32, device=self.x.device)
        )
        # row j of x is shard j: local rank j receives every local rank's copy of it
        dist.all_to_all_single(rows, self.x.view(n, shard.numel).float(), group=topo.intra)
        self._intra_sent += (n - 1) * shard.numel * 4
        avg = torch.sum(rows, dim=0, out=bufs.node_avg) if bufs is not None else rows.sum(dim=0)
        return avg.div_(n)

    def start(self) -> HierarchicalOneBitAllreduce:
        """The node average (fp32, inside the node), its worker compression and phase 1 between nodes (async)."""
        shard = self.shard
        self._send, self._new_worker = _worker_message(
            self._node_average(),
            shard.table,
            shard.slot,
            shard.nodes,
            self.layout,
            self.buffers,
            self.compress,
            self.worker_error,
            self.loss_scale,
        )
        self._recv = torch.empty_like(self._send)
        self._a2a = dist.all_to_all_single(self._recv, self._send, group=self.topology.cross, async_op=True)
        return self

    def serve(self) -> HierarchicalOneBitAllreduce:
        """The server average and recompression of this node's chunk of the shard, phase 2 between nodes (async)."""
        k = self.shard.nodes
        self._a2a.wait()
        mine = self.shard.chunks[self.topology.node]
        self._own, self._new_server = _serve_chunk(
            self._recv, mine, self.layout, self.buffers, self.compress, self.server_error, self.loss_scale
        )
        self._gathered = torch.empty(k * self._own.numel(), dtype=torch.uint8, device=self.x.device)
        self._ag = _all_gather(self._gathered, self._own, self.topology.cross, async_op=True)
        return self

    def finish(self) -> OneBitResult:
        """Phase 2 waited for, the shard's chunks gathered inside the node, all ``N`` chunks decoded."""
        layout, topo = self.layout, self.topology
        n, k = layout.world_size, self.shard.nodes
        if self._ag is not None:
            self._ag.wait()
        own, shard_rows = self._own, self._gathered
        if topo.local_size > 1:
            everything = torch.empty(topo.local_size * shard_rows.numel(), dtype=torch.uint8, device=own.device)
            _all_gather(everything, shard_rows, topo.intra)  # local rank l's rows are chunks l*K ... l*K+K-1
            self._intra_sent += (topo.local_size - 1) * shard_rows.numel()
        else:
            everything = shard_rows
        out, finite = _decode_chunks(everything.view(n, own.numel()), layout, self.buffers)
        row = self._send[0].numel() * self._send.element_size()
        sent = (k - 1) * row + (k - 1) * own.numel()
        self.result = OneBitResult(
            out=out,
            worker_error=self._new_worker,
            server_error=self._new_server,
            finite=finite,
            bytes_sent=sent,
            intra_bytes=self._intra_sent,
        )
        self._send = self._recv = self._own = self._gathered = self.x = None  # type: ignore[assignment]
        return self.result


#: either compressed allreduce (same interface: ``start``, ``serve``, ``finish``, ``buffers``)
CompressedAllreduce = OneBitAllreduce | HierarchicalOneBitAllreduce


def onebit_allreduce(
    x: torch.Tensor,
    layout: GroupLayout,
    worker_error: torch.Tensor | None,
    server_error: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
    loss_scale: torch.Tensor | None = None,
    compress: CompressFn = compress_reference,
    buffers: OneBitBuffers | None = None,
) -> OneBitResult:
    """Average ``x`` over the ranks of ``group`` with 1-bit compression in both phases.

    Steps (the 1-bit Adam / 0-1 Adam scheme, with error feedback on both sides):

    1. Worker: ``x + e_worker`` -> per-block ``mean |x|`` scales and sign bits; ``e_worker`` becomes the residual.
    2. Phase 1, ``all_to_all_single``: rank ``r`` receives every rank's signs and scales of chunk ``r``.
    3. Server: decode the ``N`` versions of chunk ``r``, average them, add ``e_server``, compress again, keep the
       residual as the new ``e_server``.
    4. Phase 2, all-gather of the server chunks; every rank decodes all of them, so replicas stay bit-identical.

    Args:
        x: float ``(layout.padded_numel,)`` local gradients in canonical layout, zeros on padding.
        layout: the group's layout for this world size.
        worker_error: float32 ``(padded_numel,)`` or None (no error feedback).
        server_error: float32 ``(chunk_numel,)`` or None.
        group: process group (None: the default group).
        loss_scale: 0-dim tensor of the AMP loss scale the gradients carry (errors are stored unscaled), or None.
        compress: the fused compressor (torch reference or the Triton kernel).
        buffers: the group's kept :class:`OneBitBuffers` (the CPU compressor's outputs go there), or None.

    Returns:
        :class:`OneBitResult`; the caller commits the errors when ``finite`` (a NaN/Inf step leaves them unchanged).
    """
    op = OneBitAllreduce(
        x, layout, worker_error, server_error, group=group, loss_scale=loss_scale, compress=compress, buffers=buffers
    )
    return op.start().serve().finish()


def run_pipelined(ops: Iterable[CompressedAllreduce], apply: Callable[[CompressedAllreduce], None]) -> None:
    """Run several compressed allreduces with up to three in flight, calling ``apply`` on each when it is done.

    Order: start(k) [worker compression, phase 1], serve(k-1) [server, phase 2], apply(k-2) [finish + the caller's
    work], so phase 1 of one group and phase 2 of the previous are on the wire while the next group is compressed and
    the one before is applied. ``ops`` may be a generator that builds each input lazily (in order). The collectives
    are issued in the same order on every rank.
    """
    inflight: list[CompressedAllreduce] = []
    for op in ops:
        inflight.append(op.start())
        if len(inflight) >= 2:
            inflight[-2].serve()
        if len(inflight) >= 3:
            apply(inflight.pop(0))
    if inflight:
        inflight[-1].serve()
    for op in inflight:
        apply(op)
