"""1-bit compression with per-block scales and error feedback: the layout of a parameter group and the torch path.

The torch functions here are the CPU path and the reference that the Triton kernel (``triton_kernels.py``) is tested
against.

**Layout.** A *group* is a set of parameters compressed together (normally one DDP bucket). Its gradients are laid
out in a canonical flat buffer: parameters in a fixed order (their index in the model), each padded with zeros to a
multiple of 8 elements so that every parameter starts on a byte of packed signs; the buffer is padded to ``N * C``
elements, ``C`` (a multiple of 8) being the chunk that each of the ``N`` ranks owns in the two-phase allreduce.

**Blocks and scales.** The buffer is cut into blocks: at every parameter start, every ``block_size`` elements inside a
parameter and at every chunk boundary. Each block gets one fp32 scale, ``mean |x|`` over its real (non-pad) elements,
and decodes to ``±scale``. Why ``mean |x|`` and not the RMS that DeepSpeed's 1-bit Adam uses: ``s = mean |x|`` is the
minimiser of ``||x - s * sign(x)||²`` (set the derivative ``2 * sum(s - |x_i|)`` to zero), so the residual that error
feedback has to carry is as small as it can be; the RMS is always >= ``mean |x|`` and overshoots. Why blocks aligned
to parameters: a parameter whose gradient is exactly zero (unused, masked) gets scale 0 and decodes to exact zeros,
so it is not pushed by ``±scale`` noise forever, and its error-feedback state stays zero. Cost: 32 bits of scale per
block, 1.6 % of the signs at the default ``block_size=2048``.

**Two torch paths.** :func:`compress_reference` is the readable oracle (the Triton kernel's reference).
:class:`Compressor` computes the same thing with preallocated buffers and C-speed passes over them (numpy ufuncs on
shared-memory views of the CPU tensors, ``out=`` everywhere), so a caller that keeps one per buffer allocates nothing
per step; :func:`compress_fast` is the same code behind :func:`compress_reference`'s signature (fresh outputs), an
order of magnitude faster than the reference on CPU (``benchmarks/onebit.py`` measures both against one
``torch.add``: ``ratios.compress_over_add``); the passes it makes and why each is needed are listed in
:meth:`Compressor.compress`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from lightning_accel._utils.checks import check_int
from lightning_accel._utils.triton import use_triton
from lightning_accel.comm.packing import pack_bits_into, pack_signs, sign_lut, unpack_signs

__all__ = [
    "BlockTable",
    "Compressor",
    "GroupLayout",
    "NodeShard",
    "block_scales",
    "compress_fast",
    "compress_reference",
    "decode",
]


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class BlockTable:
    """The scale blocks of one flat buffer (a whole group, or one rank's chunk of it).

    Attributes:
        starts: int64 block starts (multiples of 8), relative to the buffer.
        lengths: int64 block lengths (multiples of 8), summing to the buffer's length.
        valid: float32 real (non-pad) elements per block.
        mask: bool, True on the buffer's real elements.
        num_blocks: number of blocks.
        max_len: the longest block (Python int, so kernels launch without a device sync).
    """

    starts: torch.Tensor
    lengths: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    num_blocks: int
    max_len: int

    # Derived index tensors, computed once per table on first use (``cached_property`` writes the instance
    # ``__dict__`` directly, so it works on a frozen dataclass; the fields above stay the equality).
    @cached_property
    def byte_block(self) -> torch.Tensor:
        """int64 ``(L/8,)``: the block each packed byte belongs to (blocks are whole bytes)."""
        return torch.repeat_interleave(
            torch.arange(self.num_blocks, device=self.lengths.device),
            self.lengths // 8,
            output_size=self.mask.numel() // 8,
        )

    @cached_property
    def pad_index(self) -> torch.Tensor:
        """int64 positions of the padding elements (usually a few per parameter and the buffer's tail)."""
        return torch.nonzero(~self.mask).reshape(-1)

    @cached_property
    def has_real(self) -> torch.Tensor:
        """bool ``(num_blocks,)``: blocks with at least one real element (the others decode only padding)."""
        return self.valid > 0

    @cached_property
    def valid_or_one(self) -> torch.Tensor:
        """``valid`` clamped to >= 1 (the divisor of the block sums: an all-padding block gets scale 0)."""
        return self.valid.clamp_min(1.0)

    @cached_property
    def starts_np(self) -> np.ndarray:
        """``starts`` as a numpy ``intp`` array (the segment starts of ``np.add.reduceat``; CPU tables only)."""
        return self.starts.cpu().numpy().astype(np.intp)


class GroupLayout:
    """Canonical flat layout of one parameter group for ``world_size`` ranks (see the module docstring).

    Args:
        numels: element counts of the group's parameters, in canonical order.
        world_size: number of ranks ``N``.
        block_size: maximum elements per scale block (a multiple of 8).
        device: where the index tensors live (the gradients' device).

    Attributes:
        numel: real elements (sum of ``numels``).
        offsets: canonical start of each parameter (multiples of 8).
        chunk_numel: ``C``, elements per rank chunk (multiple of 8).
        padded_numel: ``N * C``.
        table: the :class:`BlockTable` of the whole ``(padded_numel,)`` buffer.
        chunks: one :class:`BlockTable` per rank chunk (chunk-relative starts; blocks never straddle chunks).
        max_blocks: ``M``, the most blocks any chunk has (scale rows are padded to it).
        slot: int64 ``(num_blocks,)``, each block's position in the flattened ``(N, M)`` scale table.
        message_bytes: bytes one rank sends to one peer per phase: ``C / 8`` signs + ``4 * M`` scale bytes.
    """

    def __init__(self, numels: Sequence[int], world_size: int, block_size: int, device: torch.device) -> None:
        check_int("world_size", world_size, low=1)
        check_int("block_size", block_size, low=8)
        if block_size % 8:
            raise ValueError(f"`block_size` must be a multiple of 8, got {block_size!r}.")
        if not numels or any(n < 1 for n in numels):
            raise ValueError(f"`numels` must be a non-empty list of positive sizes, got {list(numels)!r}.")
        self.numels = tuple(int(n) for n in numels)
        self.world_size = world_size
        self.block_size = block_size
        self.numel = sum(self.numels)
        offsets, pos = [], 0
        for n in self.numels:
            offsets.append(pos)
            pos += _ceil_to(n, 8)
        self.offsets = tuple(offsets)
        aligned = pos
        self.chunk_numel = max(8, _ceil_to(math.ceil(aligned / world_size), 8))
        self.padded_numel = self.chunk_numel * world_size
        bounds = set(range(0, self.padded_numel, self.chunk_numel))
        for o, n in zip(self.offsets, self.numels, strict=True):
            bounds.update(range(o, o + _ceil_to(n, 8), block_size))
        bounds.add(aligned)
        edges = sorted(b for b in bounds if b < self.padded_numel) + [self.padded_numel]
        starts = torch.tensor(edges[:-1], dtype=torch.int64)
        lengths = torch.tensor(edges[1:], dtype=torch.int64) - starts
        mask = torch.zeros(self.padded_numel, dtype=torch.bool)
        for o, n in zip(self.offsets, self.numels, strict=True):
            mask[o : o + n] = True
        # real elements per block: a cumulative sum of the mask read at the block edges
        csum = torch.cat([torch.zeros(1, dtype=torch.int64), mask.to(torch.int64).cumsum(0)])
        valid = (csum[starts + lengths] - csum[starts]).to(torch.float32)
        chunk_of = torch.div(starts, self.chunk_numel, rounding_mode="floor")
        counts = torch.bincount(chunk_of, minlength=world_size)
        first = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)[:-1]])
        self.max_blocks = int(counts.max())
        slot = chunk_of * self.max_blocks + (torch.arange(len(starts)) - first[chunk_of])
        self.message_bytes = self.chunk_numel // 8 + 4 * self.max_blocks
        self.device = torch.device(device)
        self.slot = slot.to(self.device)
        self.table = BlockTable(
            starts=starts.to(self.device),
            lengths=lengths.to(self.device),
            valid=valid.to(self.device),
            mask=mask.to(self.device),
            num_blocks=len(starts),
            max_len=int(lengths.max()),
        )
        self.chunks: list[BlockTable] = []
        for r in range(world_size):
            a, b = int(first[r]), int(first[r]) + int(counts[r])
            c0 = r * self.chunk_numel
            self.chunks.append(
                BlockTable(
                    starts=(starts[a:b] - c0).to(self.device),
                    lengths=lengths[a:b].to(self.device),
                    valid=valid[a:b].to(self.device),
                    mask=mask[c0 : c0 + self.chunk_numel].to(self.device),
                    num_blocks=b - a,
                    max_len=int(lengths[a:b].max()),
                )
            )

    @property
    def num_blocks(self) -> int:
        """Number of scale blocks."""
        return self.table.num_blocks

    def node_shard(self, local_rank: int, local_size: int) -> NodeShard:
        """The shard that local rank ``local_rank`` of ``local_size`` owns in hierarchical averaging (cached).

        With ``N = local_size * nodes`` chunks, shard ``l`` is chunks ``l*nodes ... (l+1)*nodes - 1``, a contiguous
        range of the buffer: the canonical layout (and so every block and scale) is the flat path's, only who
        compresses what changes.

        Raises:
            ValueError: ``local_size`` does not divide the layout's world size, or ``local_rank`` is out of range.
        """
        if local_size < 1 or self.world_size % local_size or not 0 <= local_rank < local_size:
            raise ValueError(
                f"`local_size`={local_size!r} must divide the world size {self.world_size} and `local_rank`="
                f"{local_rank!r} must be in [0, local_size)."
            )
        cache: dict[tuple[int, int], NodeShard] = self.__dict__.setdefault("_shards", {})
        shard = cache.get((local_rank, local_size))
        if shard is None:
            shard = cache[(local_rank, local_size)] = NodeShard(self, local_rank, local_size)
        return shard

    def __repr__(self) -> str:
        return (
            f"GroupLayout(params={len(self.numels)}, numel={self.numel}, world_size={self.world_size}, "
            f"chunk_numel={self.chunk_numel}, blocks={self.num_blocks}, max_blocks={self.max_blocks})"
        )


class NodeShard:
    """One local rank's shard of a :class:`GroupLayout` in hierarchical averaging (:meth:`GroupLayout.node_shard`).

    Attributes:
        nodes: ``K``, chunks per shard (one per node: the cross-node exchange of the shard has ``K`` ranks).
        first_chunk: the layout's chunk index of the shard's first chunk (``local_rank * K``).
        start: the shard's first element in the layout's buffer; ``numel``: its length (``K * chunk_numel``).
        table: the :class:`BlockTable` of the shard (shard-relative starts; its blocks are the layout's).
        slot: int64, each shard block's position in the flattened ``(K, max_blocks)`` scale table of the shard.
        chunks: the layout's chunk tables of the shard, in node order (node ``n`` serves ``chunks[n]``).
    """

    def __init__(self, layout: GroupLayout, local_rank: int, local_size: int) -> None:
        k = layout.world_size // local_size
        self.nodes = k
        self.first_chunk = local_rank * k
        self.start = self.first_chunk * layout.chunk_numel
        self.numel = k * layout.chunk_numel
        self.chunks = layout.chunks[self.first_chunk : self.first_chunk + k]
        full = layout.table
        # blocks never straddle chunks, so the shard's blocks are a contiguous run of the layout's
        first = sum(c.num_blocks for c in layout.chunks[: self.first_chunk])
        count = sum(c.num_blocks for c in self.chunks)
        sl = slice(first, first + count)
        self.slot = layout.slot[sl] - self.first_chunk * layout.max_blocks
        self.table = BlockTable(
            starts=full.starts[sl] - self.start,
            lengths=full.lengths[sl],
            valid=full.valid[sl],
            mask=full.mask[self.start : self.start + self.numel],
            num_blocks=count,
            max_len=max(c.max_len for c in self.chunks),
        )


def block_scales(x: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``mean |x|`` over the real elements of each block (padding is zero in ``x``); 0 for blocks without any."""
    sums = torch.segment_reduce(x.abs(), "sum", lengths=lengths, unsafe=True)
    return sums / valid.clamp_min(1.0)


def decode(
    packed: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``±scale`` per element: ``packed (..., L/8)``, ``scales (..., num_blocks)`` -> float32 ``(..., L)``.

    Blocks are whole bytes, so each byte's 8 signs (one row gathered from the ``±1`` table) are multiplied by its
    block's scale: the product with ``±1`` is exact, so this equals ``unpack_signs(packed) * repeat(scales)``
    bit for bit, in two passes (gather, multiply) instead of four.

    Args:
        packed: ``uint8 (..., L/8)``.
        scales: float32 ``(..., num_blocks)``.
        lengths: block lengths (multiples of 8) summing to ``L``.
        out: optional contiguous float32 tensor of ``8 * packed.numel()`` elements to write into.
    """
    nbytes = packed.shape[-1]
    per_byte = torch.repeat_interleave(scales.float(), lengths // 8, dim=-1, output_size=nbytes)
    rows = unpack_signs(packed, out=out).view(*packed.shape, 8)
    rows.mul_(per_byte.unsqueeze(-1))
    return rows.view(*packed.shape[:-1], nbytes * 8)


def compress_reference(
    grad: torch.Tensor,
    error: torch.Tensor | None,
    table: BlockTable,
    loss_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Error-add, scale, sign and pack one flat buffer (the torch path; the Triton kernel's reference).

    ``x = grad + error * loss_scale``; ``scales = mean |x|`` per block; signs packed 8 per byte;
    ``new_error = (x - decode(packed, scales)) / loss_scale`` (zero on padding). Errors are kept in *unscaled* units
    so that a change of the AMP loss scale between steps does not corrupt them.

    Args:
        grad: float32 ``(L,)``, zeros on padding.
        error: float32 ``(L,)`` error-feedback state, or None (no error feedback).
        table: the buffer's blocks (lengths summing to ``L``, real-element counts, mask of real elements).
        loss_scale: 0-dim tensor, the loss scale the gradients carry (None: 1).

    Returns:
        ``(packed uint8 (L/8,), scales float32 (num_blocks,), new_error or None)``; ``error`` is not modified.
    """
    if error is None:
        x = grad
    elif loss_scale is None:
        x = grad + error
    else:
        x = grad + error * loss_scale
    x = torch.where(table.mask, x.float(), 0.0)
    scales = block_scales(x, table.lengths, table.valid)
    packed = pack_signs(x)
    if error is None:
        return packed, scales, None
    # decode(packed, scales) without unpacking: bit 1 <=> x >= 0 (NaN -> bit 0 -> -scale, as decode would give)
    rep = torch.repeat_interleave(scales, table.lengths, output_size=x.numel())
    new_error = torch.where(table.mask, x - torch.where(x >= 0, rep, -rep), 0.0)
    if loss_scale is not None:
        new_error = new_error / loss_scale
    return packed, scales, new_error


class Compressor:
    """Compress and decode flat buffers of one :class:`BlockTable` into buffers it keeps (no allocation per call).

    Computes what :func:`compress_reference` computes: the same ``x``, the same packed bits; the block sums come from
    numpy's pairwise ``add.reduceat`` instead of torch's ``segment_reduce``, so a scale may differ from the
    reference's in its last bits (``tests/comm/test_compressor.py`` bounds the difference); the residual is exactly
    ``x - decode(packed, scales)`` for the scales returned, which is what error feedback needs.

    On CPU every pass runs in C over preallocated buffers (about ``10 L`` bytes for an ``L``-element table: ``x``,
    one fp32 scratch, one byte per element of signs, ``L/8`` gather codes and per-byte scales). On other devices it
    runs the fused Triton kernel into its buffers when Triton is usable there, otherwise the torch reference (which
    allocates) copied into them.

    Args:
        table: the blocks of the buffers this compressor handles (a whole group or one rank's chunk).

    Attributes:
        table: the block table.
        numel: ``L``, elements per buffer.
        packed: ``uint8 (L/8,)``, the last packed signs (overwritten by the next call).
        scales: float32 ``(num_blocks,)``, the last scales (overwritten by the next call).
    """

    def __init__(self, table: BlockTable) -> None:
        self.table = table
        n = table.mask.numel()
        if n % 8:
            raise ValueError(f"`table` must cover a multiple of 8 elements, got {n}.")
        dev = table.mask.device
        self.numel = n
        self.device = dev
        self.packed = torch.empty(n // 8, dtype=torch.uint8, device=dev)
        self.scales = torch.empty(table.num_blocks, dtype=torch.float32, device=dev)
        self._x = torch.empty(n, dtype=torch.float32, device=dev)
        self._cpu = dev.type == "cpu" and sys.byteorder == "little"
        if self._cpu:
            self._work = torch.empty(n, dtype=torch.float32)
            self._bits = torch.empty(n, dtype=torch.bool)
            self._codes = torch.empty(n // 8, dtype=torch.int64)
            self._per_byte = torch.empty(n // 8, 1, dtype=torch.float32)
            self._sums = np.empty(table.num_blocks, dtype=np.float32)
            self._lut = sign_lut(dev)
            # touch the cached index tensors now, not on the first step
            self._pad, self._byte_block = table.pad_index, table.byte_block
            self._valid1, self._starts = table.valid_or_one.numpy(), table.starts_np

    def _check(self, name: str, t: torch.Tensor | None) -> None:
        if t is not None and (t.numel() != self.numel or t.device != self.device):
            raise ValueError(
                f"`{name}` must have {self.numel} elements on {self.device} (the block table's length), "
                f"got {t.numel()} on {t.device}."
            )

    def compress(
        self,
        grad: torch.Tensor,
        error: torch.Tensor | None = None,
        loss_scale: torch.Tensor | None = None,
        *,
        out_error: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:func:`compress_reference` into this compressor's buffers.

        Passes over the ``L`` elements on CPU (each about one ``torch.add``, see ``benchmarks/onebit.py``):
        ``x = g + e``
        (``e * s`` then ``+ g`` with a loss scale, the reference's rounding), ``|x|`` into scratch, the block sums
        (``np.add.reduceat``), ``x >= 0`` as bytes, the sign packing (one multiply over ``L/8`` words, see
        :mod:`~lightning_accel.comm.packing`); with error feedback also the ``±1`` rows of the packed bytes (one
        gather) and ``x - (±1) * scale`` in one ``addcmul`` (exact: the product with ``±1`` rounds nothing), written
        over ``x`` itself, which therefore doubles as the new error buffer; ``/ s`` with a loss scale.

        Args:
            grad: ``(L,)`` gradients (any float dtype; zeros on padding, which is zeroed regardless).
            error: float32 ``(L,)`` error state, or None (no error feedback).
            loss_scale: 0-dim tensor, the loss scale the gradients carry (None: 1).
            out_error: where to write the new error (may be ``error`` itself: an in-place update); None: an
                internal buffer.

        Returns:
            ``(packed, scales, new_error or None)``; ``packed``/``scales`` (and ``new_error`` without ``out_error``)
            are this compressor's buffers, valid until its next call; ``grad`` and ``error`` are not modified
            (unless ``out_error`` is ``error``).
        """
        g = grad.reshape(-1)
        self._check("grad", g)
        self._check("error", error)
        self._check("out_error", out_error)
        if not self._cpu:
            return self._compress_device(g, error, loss_scale, out_error)
        if error is None:
            if g.dtype == torch.float32 and g.is_contiguous() and not (self._pad.numel() and g[self._pad].any()):
                x = g.detach()  # read only: no copy needed
            else:
                x = self._x
                x.copy_(g)
                x.index_fill_(0, self._pad, 0.0)
        else:
            x = out_error if out_error is not None else self._x
            if loss_scale is None:
                torch.add(g, error, out=x)
            else:
                torch.mul(error, loss_scale.to(torch.float32), out=x)
                x.add_(g)
            x.index_fill_(0, self._pad, 0.0)
        xn = x.numpy()
        work = self._work.numpy()
        np.abs(xn, out=work)
        np.add.reduceat(work, self._starts, out=self._sums)
        np.divide(self._sums, self._valid1, out=self.scales.numpy())
        bits = self._bits.numpy()
        np.greater_equal(xn, 0, out=bits)
        pack_bits_into(bits, self.packed.numpy())
        if error is None:
            return self.packed, self.scales, None
        self._signed_scales(self.packed, self.scales, self._work)
        x8 = x.view(-1, 8)
        torch.addcmul(x8, self._work.view(-1, 8), self._per_byte, value=-1.0, out=x8)
        x.index_fill_(0, self._pad, 0.0)
        if loss_scale is not None:
            x.div_(loss_scale.to(torch.float32))
        return self.packed, self.scales, x

    @property
    def error_buffer(self) -> torch.Tensor:
        """The internal buffer :meth:`compress` writes its new error into when given no ``out_error``."""
        return self._x

    def exchange_error(self, t: torch.Tensor) -> torch.Tensor:
        """Adopt ``t`` as the internal buffer the next :meth:`compress` writes its new error into (without
        ``out_error``), and return the current one, which holds the last new error.

        Committing an error by exchanging buffers instead of copying saves one pass over the buffer; ``t`` must not
        be read by anyone afterwards (the next call overwrites it).
        """
        if t.shape != self._x.shape or t.dtype != torch.float32 or t.device != self.device or not t.is_contiguous():
            raise ValueError(f"`t` must be a contiguous float32 tensor of {self.numel} elements on {self.device}.")
        old, self._x = self._x, t
        return old

    def _signed_scales(self, packed: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows`` (L floats) <- the ``±1`` signs of ``packed``; ``_per_byte`` <- each byte's block scale."""
        self._codes.copy_(packed.reshape(-1))
        torch.index_select(self._lut, 0, self._codes, out=rows.view(-1, 8))
        torch.index_select(scales.reshape(-1), 0, self._byte_block, out=self._per_byte.view(-1))

    def decode(self, packed: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``±scale`` per element (as :func:`decode`), rows at a time for ``packed (R, L/8)``, ``scales (R, nb)``.

        Args:
            packed: ``uint8 (L/8,)`` or ``(R, L/8)``.
            scales: float32 ``(num_blocks,)`` or ``(R, num_blocks)``.
            out: contiguous float32 ``(L,)`` / ``(R, L)`` to write into (None: a new tensor).

        Returns:
            ``out``, float32 shaped ``(..., L)``.
        """
        rows = 1 if packed.dim() == 1 else packed.shape[0]
        nb = self.table.num_blocks
        if packed.shape[-1] * 8 != self.numel or scales.shape[-1] != nb or packed.numel() * 8 != rows * self.numel:
            raise ValueError(
                f"`packed`/`scales` must be (..., {self.numel // 8}) / (..., {nb}) for this table, "
                f"got {tuple(packed.shape)} / {tuple(scales.shape)}."
            )
        shape = (*packed.shape[:-1], self.numel)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=packed.device)
        elif out.numel() != rows * self.numel or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"`out` must be a contiguous float32 tensor of {rows * self.numel} elements.")
        if not self._cpu:
            return decode(packed, scales, self.table.lengths, out=out).view(shape)
        flat_out = out.view(rows, self.numel)
        p2, s2 = packed.reshape(rows, -1), scales.reshape(rows, nb)
        for r in range(rows):
            o = flat_out[r]
            self._signed_scales(p2[r], s2[r], o)
            o.view(-1, 8).mul_(self._per_byte)
        return out.view(shape)

    def _compress_device(
        self,
        g: torch.Tensor,
        error: torch.Tensor | None,
        loss_scale: torch.Tensor | None,
        out_error: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        new_error = None if error is None else (out_error if out_error is not None else self._x)
        if use_triton(self.device, "auto"):
            from lightning_accel.comm.triton_kernels import compress_triton

            if new_error is error and error is not None:  # the kernel reads e while writing the new e: no aliasing
                new_error = self._x
            compress_triton(g, error, self.table, loss_scale, out=(self.packed, self.scales, new_error))
            if out_error is not None and new_error is not None and new_error is not out_error:
                out_error.copy_(new_error)
                new_error = out_error
            return self.packed, self.scales, new_error
        packed, scales, e = compress_reference(g, error, self.table, loss_scale)
        self.packed.copy_(packed)
        self.scales.copy_(scales)
        if e is not None and new_error is not None:
            new_error.copy_(e)
        return self.packed, self.scales, new_error


def compress_fast(
    grad: torch.Tensor,
    error: torch.Tensor | None,
    table: BlockTable,
    loss_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`compress_reference`'s signature and contract (fresh outputs), computed by a :class:`Compressor`.

    The scratch buffers are allocated per call (the index tensors are cached on ``table``); a caller that compresses
    the same buffer every step keeps a :class:`Compressor` instead and allocates nothing.
    """
    return Compressor(table).compress(grad, error, loss_scale)
