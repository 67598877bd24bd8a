""":class:`StoreOptions`: every option of a :class:`~lightning_accel.checkpoint.store.DeltaStore` but its storage, in
one frozen, validated value (checked once, when it is made; a store, a plugin and the encode policy read it)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_accel._utils.checks import check_bool, check_choice, check_int, check_number
from lightning_accel.checkpoint.manifest import MAX_CHAIN_LEN

__all__ = ["StoreOptions"]

# zstd's own limits (libzstd: ZSTD_minCLevel() = -131072, ZSTD_maxCLevel() = 22, ZSTDMT_NBWORKERS_MAX = 200); values
# outside are silently clamped by the library, so they are refused here instead.
_ZSTD_LEVELS = (-131072, 22)
_ZSTD_THREADS = (-1, 200)
_GROUPS_FIX = "Example: `quantize_groups=['state_dict/model.head']`."


@dataclass(frozen=True)
class StoreOptions:
    """How a :class:`~lightning_accel.checkpoint.store.DeltaStore` encodes, chains and writes tensors.

    Args:
        quantize: ``None`` (lossless, the default), ``"int8"`` or ``"int4"``: store deltas of the selected float
            tensors block-quantized (see :mod:`lightning_accel.checkpoint.codec` for the error bound). Full
            snapshots stay lossless.
        quantize_groups: which tensors may be quantized: ``"optimizer"`` (``optimizer_states/...``, the default) or
            ``"all"`` floating tensors, or a sequence of name prefixes (e.g. ``["state_dict/model.head"]``; kept as a
            tuple).
        quant_block: elements per quantization scale.
        delta_ref: ``"base"`` (delta against the chain's full snapshot: restore reads at most 2 blobs) or
            ``"previous"`` (delta against the previous reconstruction: smaller deltas, longer chains).
        max_chain: most blobs one tensor's restore may read (``delta_ref="previous"``; ``"base"`` uses 2, see
            :attr:`chain_limit`).
        full_every: a tensor's chain is restarted with a full snapshot after this many deltas.
        rebase_ratio: write a full snapshot instead of a delta that is at least this fraction of the base's size
            (0.8: a delta that saves less than 20 % is not worth keeping its base alive for; the trade-off between
            bytes written and bytes left on disk is measured by ``benchmarks/delta_checkpoint.py``).
        rebase_dead_fraction: write a full snapshot instead of a delta when the tensor's base is part of no live
            checkpoint any more (its own was removed) and is more than this fraction of the bytes its live chains
            keep on disk; 1.0 (default) never (see ``benchmarks/delta_checkpoint.py`` for its effect).
        redundancy: 1, or 2 to keep a second copy (``<key>.copy``) of every base (full) blob: a lost or damaged
            base is then read from its copy (with a warning) and ``DeltaStore.verify(repair=True)`` rewrites it.
        inline_bytes: tensors smaller than this are packed into the skeleton blob (always rewritten, never deltas)
            instead of getting blobs of their own.
        zstd_level: zstd compression level (3 by default; higher levels buy little on float noise and cost
            encode time, see ``benchmarks/delta_checkpoint.py``).
        zstd_threads: zstd worker threads per blob (0: single-threaded; -1: one per core).
        io_threads: threads that encode/decode tensors in parallel.
        lock: take the directory's writer lock at its first save or removal
            (:class:`~lightning_accel.checkpoint.lock.DirectoryLock`; released by ``DeltaStore.close``).

    Raises:
        TypeError: an argument of the wrong type (``zstd_level="3"``, ``full_every=True``), naming it.
        ValueError: an argument out of its range (``zstd_level=99``), naming it, the range and the fix.
    """

    quantize: Literal["int8", "int4"] | None = None
    quantize_groups: Literal["optimizer", "all"] | Sequence[str] = "optimizer"
    quant_block: int = 128
    delta_ref: Literal["base", "previous"] = "base"
    max_chain: int = 8
    full_every: int = 16
    rebase_ratio: float = 0.8
    rebase_dead_fraction: float = 1.0
    redundancy: int = 1
    inline_bytes: int = 1024
    zstd_level: int = 3
    zstd_threads: int = 0
    io_threads: int = 2
    lock: bool = True

    def __post_init__(self) -> None:
        check_choice(
            "quantize",
            self.quantize,
            (None, "int8", "int4"),
            fix="Use None for lossless checkpoints, 'int8' for quantized deltas with a 1/254 error bound per block, "
            "'int4' for 1/14.",
        )
        set_ = object.__setattr__  # frozen: normalised values are set once, here
        set_(self, "quantize_groups", _check_groups(self.quantize_groups))
        if self.quantize is None and self.quantize_groups != "optimizer":
            warnings.warn(
                f"`quantize_groups={_shown(self.quantize_groups)!r}` has no effect without `quantize`: checkpoints "
                "stay lossless. Set `quantize='int8'` (or 'int4') to quantize the selected tensors.",
                UserWarning,
                stacklevel=4,
            )
        check_choice(
            "delta_ref",
            self.delta_ref,
            ("base", "previous"),
            fix="'base': restores read at most 2 blobs; 'previous': smaller deltas, chains up to `max_chain`.",
        )
        check_int(
            "quant_block",
            self.quant_block,
            low=1,
            high=1 << 24,
            fix="Typical: 32-1024 elements per scale (default 128).",
        )
        check_int("max_chain", self.max_chain, low=1, high=MAX_CHAIN_LEN, fix="Typical: 4-16 (default 8).")
        check_int(
            "full_every",
            self.full_every,
            low=1,
            high=1_000_000,
            fix="Typical: 8-64 deltas per full snapshot (default 16).",
        )
        ratio = check_number(
            "rebase_ratio",
            self.rebase_ratio,
            low=0,
            low_open=True,
            high=100.0,
            fix="Default 0.8: a delta must save at least 20 % of its base; a value > 1 never re-bases on size.",
        )
        set_(self, "rebase_ratio", ratio)
        dead = check_number(
            "rebase_dead_fraction",
            self.rebase_dead_fraction,
            low=0,
            low_open=True,
            high=1.0,
            fix="1.0 (default) never re-bases for dead bytes; 0.3 re-bases when 30 % of a kept chain is dead.",
        )
        set_(self, "rebase_dead_fraction", dead)
        check_int(
            "redundancy",
            self.redundancy,
            low=1,
            high=2,
            fix="1: one copy of every blob; 2: a second copy of every blob.",
        )
        check_int("inline_bytes", self.inline_bytes, low=0, high=1 << 30, fix="Default 1024 bytes.")
        check_int(
            "zstd_level",
            self.zstd_level,
            low=_ZSTD_LEVELS[0],
            high=_ZSTD_LEVELS[1],
            fix="zstd's levels are 1-22 (default 3; higher levels buy little on float tensors) and negative fast "
            "levels.",
        )
        check_int(
            "zstd_threads",
            self.zstd_threads,
            low=_ZSTD_THREADS[0],
            high=_ZSTD_THREADS[1],
            fix="0: single-threaded (default), -1: one per core.",
        )
        check_int(
            "io_threads", self.io_threads, low=1, high=256, fix=f"Default 2; this machine has {os.cpu_count()} cores."
        )
        check_bool("lock", self.lock)

    @property
    def chain_limit(self) -> int:
        """Most blobs one tensor's chain holds: 2 with ``delta_ref="base"`` (base + one delta), else ``max_chain``."""
        return 2 if self.delta_ref == "base" else self.max_chain


def _shown(groups: str | Sequence[str]) -> str | list[str]:
    return groups if isinstance(groups, str) else list(groups)


def _check_groups(groups: object) -> str | tuple[str, ...]:
    """``"optimizer"``, ``"all"``, or a non-empty sequence of non-empty name prefixes (returned as a tuple)."""
    if isinstance(groups, str):
        return check_choice(
            "quantize_groups",
            groups,
            ("optimizer", "all"),
            fix="Or pass a list of tensor-name prefixes. " + _GROUPS_FIX,
        )
    expected = "'optimizer', 'all' or a non-empty list of tensor-name prefixes"
    if not isinstance(groups, Sequence):
        raise TypeError(
            f"`quantize_groups` must be {expected}, got {groups!r} ({type(groups).__name__}). "
            "Example: `quantize_groups=['optimizer_states/']`."
        )
    if not groups:
        raise ValueError(
            f"`quantize_groups` must be {expected}, got {groups!r}. Example: `quantize_groups=['optimizer_states/']`."
        )
    if not all(isinstance(p, str) and p for p in groups):
        raise ValueError(f"`quantize_groups` prefixes must be non-empty strings, got {groups!r}. {_GROUPS_FIX}")
    return tuple(groups)
