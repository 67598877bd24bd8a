"""``SampleCache``: decoded samples through RAM -> SSD -> origin, read a whole batch at a time.

Read path for a batch of sample indices (all in the calling process, one thread):

1. one read transaction on the RAM tier, then one on the SSD tier for what is left: each entry is verified (CRC-32,
   the first time this process reads it) and copied once, from the memory map straight into its row of the batch
   tensor (shared memory inside a DataLoader worker, so the batch crosses to the main process as one file
   descriptor, not a copy);
2. corrupt entries are deleted from their tier, counted as ``refetches`` and treated as misses;
3. misses are read from the origin (a remote one concurrently, or taken from reads the prefetcher started earlier;
   a local one inline, see ``prefetch``), decoded straight into their batch rows (``decode.decode_into`` when the
   decoder has it, else the decoder's tensor is copied in), and written in one write transaction to the RAM tier
   while it has room, the rest to the SSD tier (``misses_to``); :meth:`SampleCache.spill` later copies the RAM
   tier's entries to the SSD tier, which survives a reboot;
4. SSD hits are promoted to the RAM tier while it has room.

Prefetch: :meth:`SampleCache.hint` starts origin reads for upcoming samples that no tier holds, on the store's
bounded thread pool, keeping at most ``max_pending`` reads (and their bytes) outstanding.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_accel._utils.checks import check_bool, check_choice, check_int
from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess, ResetOnPickle
from lightning_accel._utils.malloc import keep_freed_memory
from lightning_accel.data.buffers import BufferPool, alloc_shared
from lightning_accel.data.codec import (
    CorruptEntryError,
    copy_payload,
    encode_entry,
    encode_undecodable,
    is_undecodable,
    peek_shape,
)
from lightning_accel.data.decode import DecodeError, decoder_fingerprint
from lightning_accel.data.origin import Listing, ObjectStore, text_bytes
from lightning_accel.data.pack import DEFAULT_STAGE_BYTES, PackedReader
from lightning_accel.data.stats import CacheStats
from lightning_accel.data.tiers import LmdbTier
from lightning_accel.data.writeback import WriteBehind, Writes

__all__ = ["MAX_PENDING", "BatchResult", "SampleCache"]

_MAX_KEY = 400  # LMDB keys are limited to 511 bytes; longer sample keys are hashed
# The most prefetched origin reads a process keeps outstanding. Each holds its sample's bytes until its batch reads it:
# at this bound, ~6.5 GB of 100 KB images per process (times the DataLoader workers); the data module asks for
# `2 * prefetch_batches * batch_size`, 1,024 with its defaults.
MAX_PENDING = 65_536


def _in_worker() -> bool:
    """True inside a DataLoader worker process."""
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class BatchResult:
    """``images`` (N, ...) in listing order minus skipped samples, ``labels`` int64 (N,), ``kept`` positions."""

    __slots__ = ("images", "kept", "labels")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, kept: list[int]) -> None:
        self.images, self.labels, self.kept = images, labels, kept


@dataclass
class _Batch:
    """The batch one :meth:`SampleCache.load` call assembles; ``pos`` below is a position in ``indices``."""

    indices: Sequence[int]
    keys: list[bytes]
    shared: bool
    labels: list[int]
    kept: list[bool]
    out: torch.Tensor | None = None  # allocated once the first sample's dtype and shape are known
    rows: np.ndarray | None = None  # uint8 (n, row bytes) view of `out` that cached entries are copied into
    row_shape: list[int] = field(default_factory=list)  # the shape of one row of `out`, made with `rows`
    hits: dict[str, int] = field(default_factory=lambda: {"ram": 0, "ssd": 0})
    corrupt: dict[str, list[bytes]] = field(default_factory=lambda: {"ram": [], "ssd": []})
    # records of undecodable samples read with on_decode_error="raise": deleted, the samples decoded again
    undecodable: dict[str, list[bytes]] = field(default_factory=lambda: {"ram": [], "ssd": []})
    promote: list[tuple[bytes, bytes]] = field(default_factory=list)  # SSD hits to copy into the RAM tier
    writes: Writes = field(default_factory=list)  # decoded misses to store
    write_idx: list[int] = field(default_factory=list)  # their listing entries
    fetched: int = 0  # samples read from the origin
    skipped: int = 0  # undecodable samples left out (on_decode_error="skip")

    @classmethod
    def start(cls, indices: Sequence[int], keys: list[bytes], shared: bool) -> _Batch:
        n = len(indices)
        return cls(indices, keys, shared, labels=[0] * n, kept=[True] * n)

    def result(self, row_like: tuple[tuple[int, ...], torch.dtype] | None = None) -> BatchResult:
        """The batch without its skipped samples; ``row_like`` (shape and dtype of one row of an earlier batch) shapes
        a batch whose samples were all skipped: ``(0, C, H, W)``, which augmentations accept, not ``(0,)``."""
        label_t = torch.tensor(self.labels, dtype=torch.int64)
        if self.out is None:  # every sample skipped before a row was allocated
            shape, dtype = row_like if row_like is not None else ((), torch.uint8)
            return BatchResult(torch.empty((0, *shape), dtype=dtype), label_t[:0], [])
        keep_pos = [p for p, k in enumerate(self.kept) if k]
        if self.skipped:
            return BatchResult(self.out[keep_pos], label_t[keep_pos], keep_pos)
        return BatchResult(self.out, label_t, keep_pos)


def _no_counts() -> list[int]:
    """A fresh baseline of a store's (retries, bytes) counters (a module-level factory: :class:`PerProcess` pickles
    it)."""
    return [0, 0]


class SampleCache(ResetOnPickle):
    """Decoded samples of one origin, cached in byte-budgeted tiers.

    Args:
        store: the origin.
        listing: its keys, labels and class names (shared by every rank and worker); the class names namespace
            entries with the origin's URL. Batch labels always come from the listing, never from the entries, so a
            relabelled manifest takes effect without decoding again.
        decode: deterministic ``bytes -> tensor`` step; its ``fingerprint`` attribute (else the stable identity
            :func:`~lightning_accel.data.decode.decoder_fingerprint` derives) namespaces entries.
        ram: the RAM tier (``None``: none).
        ssd: the SSD tier (``None``: none).
        stats: shared counters (a new :class:`CacheStats` by default).
        on_decode_error: ``"raise"`` (error naming the key) or ``"skip"`` (drop the sample from its batch, count it;
            a batch whose samples all fail is returned with 0 samples, never dropped: see ``docs/data.md``). A skipped
            sample is recorded in the tiers under its key (see :func:`~lightning_accel.data.codec.encode_undecodable`)
            and skipped from then on without a read; under ``"raise"`` a recorded sample is decoded again.
        max_pending: most prefetched origin reads outstanding per process (0 to :data:`MAX_PENDING`; 0: no
            read-ahead).
        prefetch: read ahead (:meth:`hint`) and read a batch's misses concurrently on the store's thread pool.
            ``None`` (default): only for remote origins. A local origin (plain path, ``file://``) is read inline in
            the calling thread: a page-cache read costs a fraction of the CPU a hand-off through the pool does
            (thread hand-offs and GIL switches; the cold local rows of ``benchmarks/data_cache.py`` measure it), and
            in DataLoader workers that CPU is taken from decoding. Pass ``True`` for a local disk slow enough that
            concurrent reads pay off.
        stage_dir: where shards of a remote *packed* origin are staged (node-local, shared by workers and ranks;
            default: ``shards/`` beside the SSD tier, else beside the RAM tier, else in the temp directory).
        stage_bytes: most bytes of staged shards kept (see :class:`~lightning_accel.data.pack.PackedReader`).
        write_behind: write a batch's misses to the tier on a background thread of this process (one batch after
            another, at most :data:`~lightning_accel.data.writeback.WRITE_QUEUE` batches queued; see
            :class:`~lightning_accel.data.writeback.WriteBehind`) instead of before the batch is returned. ``None``
            (default): only inside DataLoader workers. Why: an LMDB commit waits for the node-wide writer lock and
            for the page cache, while the worker could decode its next batch. It shortens a cold epoch into the RAM
            tier; into the SSD tier the page-cache writes themselves bound it (the cold rows of
            ``benchmarks/data_cache.py`` measure both; ``docs/data.md``). Entries become visible when their write
            commits; :meth:`flush` waits for that (also run when a worker process exits).
        misses_to: where decoded misses are written: ``"ram"`` (default: the RAM tier while it has room, the rest to
            the SSD tier; :meth:`spill` copies the RAM tier's entries to the SSD tier later) or ``"ssd"`` (the SSD
            tier; SSD hits are promoted into the RAM tier while it has room). See :meth:`_write` for why.
    """

    # The tier keys, computed once per process from the listing (`_tier_keys`); a pickled copy computes its own rather
    # than carry them (a spawned worker's pickle stays small).
    _reset_on_pickle = {"_keys": None}

    def __init__(
        self,
        store: ObjectStore,
        listing: Listing,
        decode: Callable[[bytes], torch.Tensor],
        *,
        ram: LmdbTier | None = None,
        ssd: LmdbTier | None = None,
        stats: CacheStats | None = None,
        on_decode_error: str = "raise",
        max_pending: int = 256,
        prefetch: bool | None = None,
        stage_dir: str | os.PathLike[str] | None = None,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        write_behind: bool | None = None,
        misses_to: str = "ram",
    ) -> None:
        check_choice("misses_to", misses_to, ("ram", "ssd"))
        if not callable(decode):  # else every read fails, in a DataLoader worker, far from here
            raise TypeError(
                f"`decode` must be a callable `decode(data: bytes) -> torch.Tensor`, got {decode!r} "
                f"({type(decode).__name__}). Pass e.g. `ImageDecoder(224)`."
            )
        # strings are truthy: prefetch="no" would read ahead, write_behind="false" write behind
        if prefetch is not None:
            check_bool("prefetch", prefetch, fix="None: only for remote origins.")
        if write_behind is not None:
            check_bool("write_behind", write_behind, fix="None: only inside DataLoader workers.")
        check_choice("on_decode_error", on_decode_error, ("raise", "skip"))
        check_int(
            "max_pending",
            max_pending,
            low=0,
            high=MAX_PENDING,
            fix="It counts the prefetched origin reads a process keeps outstanding, each holding its sample's bytes "
            "in memory: pass a few batches' worth (0 for none).",
        )
        self.store = store
        self.listing = listing
        self.decode = decode
        self.ram = ram
        self.ssd = ssd
        self.stats = stats if stats is not None else CacheStats()
        self.on_decode_error = on_decode_error
        self.max_pending = max_pending
        self.prefetch = (not store.is_local) if prefetch is None else bool(prefetch)
        fp = decoder_fingerprint(decode)
        # The class list is part of the key: a cache written under other classes (a class folder added or removed)
        # is kept apart. Entries hold their label too, but reads take it from the listing (see `_place`).
        classes = "\x1f".join(listing.classes)
        self.namespace = hashlib.sha1(text_bytes(f"{store.url}|{fp}|{classes}")).hexdigest()[:12]
        self._keys: tuple[str, list[bytes]] | None = None  # (namespace, tier key of each listing entry)
        # Read-ahead futures of this process (a forked child's copies belong to threads it does not have).
        self._pending: PerProcess[dict[int, Future[bytes]]] = PerProcess(dict)
        self.packed: PackedReader | None = None
        if listing.pack is not None:
            if stage_dir is None:
                near = ssd if ssd is not None else ram
                base = os.path.dirname(near.path) if near is not None else tempfile.gettempdir()
                stage_dir = os.path.join(base, "shards")
            self.packed = PackedReader(store, listing.pack, os.fspath(stage_dir), stage_bytes, on_staged=self._account)
        # (retries, bytes) of the store already added to the statistics: a baseline of the store's own counters,
        # which are per process (they restart in a pickled copy and in a forked child), so it is per process too
        self._seen: PerProcess[list[int]] = PerProcess(_no_counts)
        # The shape and dtype of one row of this process's last batch: a batch whose samples were all skipped
        # (on_decode_error="skip") is returned as 0 rows of it.
        self._row_like: tuple[tuple[int, ...], torch.dtype] | None = None
        # 1 once a process of this tree found the RAM tier ("keep" policy) full, shared like the two below: the main
        # process's first warm epoch then does not copy a batch of SSD hits for a promotion the tier must refuse
        # (10-17 ms on its first batch here, when only the cold pass's workers had learnt it).
        self._ram_full_t = torch.zeros(1, dtype=torch.uint8).share_memory_()
        self.buffers = BufferPool()
        self.write_behind = write_behind
        self.misses_to = misses_to
        self._writer: PerProcess[WriteBehind] = PerProcess(WriteBehind)  # made on the first write behind
        self._lock = ForkSafeLock()
        # 1 byte per sample, in shared memory so the DataLoader workers (fork or spawn) share it: entries verified
        # (CRC-32) once, or written, by a process of this tree; later reads skip the checksum. Without sharing, the
        # first warm epoch in the main process re-checked every entry the cold epoch's workers had just written
        # (several times slower than the next warm epochs; the first-warm row of benchmarks/data_cache.py).
        self._verified_t = torch.zeros(max(1, len(listing)), dtype=torch.uint8).share_memory_()
        # 1 byte per sample, shared the same way: 1 once a process of this tree read the sample from a tier or
        # stored it in one, so "is every sample of this epoch cached?" is answered when the cold pass ends without
        # a lookup per key (`cached`). A 0 only means "not seen here"; `cached` then asks the tiers.
        self._cached_t = torch.zeros(max(1, len(listing)), dtype=torch.uint8).share_memory_()

    def __len__(self) -> int:
        return len(self.listing)

    @property
    def _ram_full(self) -> bool:
        """Whether a process of this tree found the RAM tier full (misses and SSD hits are no longer offered)."""
        return bool(self._ram_full_t.numpy()[0])

    @_ram_full.setter
    def _ram_full(self, full: bool) -> None:
        self._ram_full_t.numpy()[0] = int(full)

    @property
    def tiers(self) -> list[tuple[str, LmdbTier]]:
        return [(n, t) for n, t in (("ram", self.ram), ("ssd", self.ssd)) if t is not None and not t.disabled]

    def key(self, i: int) -> bytes:
        """The tier key of listing entry ``i``: ``<namespace>/<key>`` followed by the sample's content identity (see
        :meth:`_tier_keys`)."""
        return self._tier_keys()[i]

    def keys_of(self, indices: Sequence[int]) -> list[bytes]:
        """The tier keys of listing entries ``indices``."""
        keys = self._tier_keys()
        return [keys[i] for i in indices]

    def _tier_keys(self) -> list[bytes]:
        """Every listing entry's tier key, made once per process (and again if ``namespace`` changed).

        A key is ``<namespace>/<sample key>\\0<content identity>``: for a packed origin the index's CRC-32 and size
        of the sample, else the listing's stamp (:class:`~lightning_accel.data.origin.SampleKeys`: size and mtime, or
        ETag and size). A file changed under the same name therefore has a new key once the origin is listed again
        (a re-pack writes a new index): it is decoded again, and the old entry is never served. NUL cannot occur in a
        key (``safe_join`` refuses it), so no two (key, identity) pairs meet. A listing without identities (a
        ``Listing`` built from a plain list of keys) keys by name alone.

        Made once per listing (7 ms for 30k samples here), not per read: the warm path reads ~30k samples/s, and a
        batch's keys are now list lookups (1.3 us per 64 samples, against 17 us to format them per read before).
        Every rank and worker reads the same listing (``listing-*.json``, or the pack index), so all of them compute
        the same keys."""
        made = self._keys
        if made is not None and made[0] == self.namespace:
            return made[1]
        listing, ns = self.listing, self.namespace
        pack = listing.pack
        if pack is not None:
            stamps: Sequence[str] | None = [f"{c:08x}.{n}" for c, n in zip(pack.crc32, pack.size, strict=True)]
        else:
            stamps = listing.stamps
        keys = []
        for j, k in enumerate(listing.keys):
            tail = f"{k}\0{stamps[j]}" if stamps is not None and stamps[j] else k
            raw = text_bytes(tail)  # a local file name that is not UTF-8 keeps its own bytes
            if len(raw) > _MAX_KEY:
                raw = b"sha1:" + hashlib.sha1(raw).hexdigest().encode()
            keys.append(f"{ns}/".encode() + raw)
        self._keys = (ns, keys)
        return keys

    # ---- prefetch ------------------------------------------------------------------------------------------------
    def hint(self, indices: Sequence[int]) -> int:
        """Start origin reads for those of ``indices`` no tier holds; returns how many were started.

        Does nothing (returns 0) when ``prefetch`` is off (a local origin, by default)."""
        if not self.prefetch:
            return 0
        with self._lock:
            return self._hint(indices)

    def _account(self) -> None:
        """Add the store's new bytes and retries to the statistics. Counted where the bytes arrive (each batch, and
        each staged shard), so read-ahead that was never used, or done by the main process, is included too."""
        with self._lock:
            seen = self._seen.get()
            retried, fetched = self.store.retried - seen[0], self.store.bytes_read - seen[1]
            seen[:] = [self.store.retried, self.store.bytes_read]
        self.stats.add(bytes_fetched=fetched, retries=retried)

    def _uncached(self, todo: list[int]) -> list[int]:
        keys = self.keys_of(todo)
        for _, tier in self.tiers:
            if not todo:
                break
            have = tier.contains(keys)
            todo = [i for i, h in zip(todo, have, strict=False) if not h]
            keys = [k for k, h in zip(keys, have, strict=False) if not h]
        return todo

    def _hint(self, indices: Sequence[int]) -> int:
        pending = self._pending.get()
        todo = [i for i in dict.fromkeys(indices) if i not in pending]
        room = self.max_pending - len(pending)
        if not todo or room <= 0:
            return 0
        todo = self._uncached(todo)
        if self.packed is not None:  # read ahead whole shards; the batch then reads its samples from them inline
            started = self.packed.prefetch(todo)
            self.stats.add(prefetched=started)
            return started
        started = 0
        for i in todo[:room]:
            pending[i] = self.store.submit(self.listing.keys[i])
            started += 1
        self.stats.add(prefetched=started)
        return started

    def stage_ahead(self, indices: Sequence[int]) -> int:
        """Packed remote origins only: start staging the shards of ``indices`` (node-wide, so any process may call
        it, e.g. the main process before the DataLoader workers are up); returns the samples covered."""
        if self.packed is None or not self.prefetch:
            return 0
        return self.packed.prefetch(self._uncached(list(dict.fromkeys(indices))))

    @property
    def stages_shards(self) -> bool:
        """True when reads go through shards staged on a node-wide stage (a packed remote origin, read ahead)."""
        return self.packed is not None and self.packed.staging and self.prefetch

    def need(self, group: str, batches: Sequence[tuple[int, Sequence[int]]], done: Callable[[int], bool]) -> None:
        """Packed remote origins only: keep the staged shards of upcoming ``batches`` (``(batch, indices)`` of the
        order ``group``) until each batch is read (:meth:`release_batch`); see
        :meth:`~lightning_accel.data.pack.PackedReader.need`. Samples a local tier holds need no shard: those this
        process tree has seen cached are left out without a lookup (a warm epoch pays one array read per batch)."""
        if not self.stages_shards:
            return
        assert self.packed is not None
        todo = [(b, self._uncached(self.not_yet_seen_cached(list(dict.fromkeys(ix))))) for b, ix in batches]
        self.packed.need(group, [(b, ix) for b, ix in todo if ix], done)

    def drop_needs(self, group: str) -> None:
        """Packed remote origins only: remove every "needed" marker of the order ``group`` (see
        :meth:`~lightning_accel.data.pack.PackedReader.drop_needs`)."""
        if self.stages_shards:
            assert self.packed is not None
            self.packed.drop_needs(group)

    def release_batch(self, group: str, batch: int, indices: Sequence[int]) -> None:
        """Packed remote origins only: batch ``batch`` of the order ``group`` (samples ``indices``) was read."""
        if self.stages_shards:
            assert self.packed is not None
            self.packed.release_batch(group, batch, indices)

    def reading(self, batch: tuple[str, int] | None) -> contextlib.AbstractContextManager[None]:
        """Packed remote origins only: the loads of this thread inside the block read batch ``batch[1]`` of the order
        ``batch[0]`` (``None``: no batch of an order), so a shard they stage waits for earlier batches of that order
        rather than evict a shard they still need; see :meth:`~lightning_accel.data.pack.PackedReader.reading`."""
        if batch is None or not self.stages_shards:
            return contextlib.nullcontext()
        assert self.packed is not None
        return self.packed.reading(*batch)

    def drop_pending(self) -> None:
        """Forget outstanding prefetches (new epoch order); reads already running finish in the background."""
        with self._lock:
            pending = self._pending.get()
            for f in pending.values():
                f.cancel()
            pending.clear()
        if self.packed is not None:
            self.packed.drop_pending()

    def _fetch(self, indices: Sequence[int]) -> list[bytes | BaseException]:
        if self.packed is not None:  # from staged shards (read ahead by `hint`) or ranged reads of a local pack
            got: list[bytes | BaseException] = []
            for i in indices:
                try:
                    got.append(self.packed.read(i, self.listing.keys[i]))
                except Exception as e:  # an OriginError: raised by the caller with context
                    got.append(e)
            return got
        if not self.prefetch and not self._pending.get():  # local origin: inline reads (see `prefetch`)
            inline: list[bytes | BaseException] = []
            for i in indices:
                try:
                    inline.append(self.store.fetch(self.listing.keys[i]))
                except Exception as e:  # an OriginError: raised by the caller with context
                    inline.append(e)
            return inline
        futs = []
        with self._lock:
            pending = self._pending.get()
            for i in indices:
                f = pending.pop(i, None)
                futs.append(f if f is not None else self.store.submit(self.listing.keys[i]))
        out: list[bytes | BaseException] = []
        for f in futs:
            try:
                out.append(f.result())
            except BaseException as e:  # an OriginError: raised by the caller with context
                out.append(e)
        return out

    def _decode_failed(self, i: int, e: Exception) -> bool:
        """True: skip the sample (``on_decode_error="skip"``); otherwise raise a DecodeError naming the key."""
        if self.on_decode_error == "skip":
            return True
        raise DecodeError(
            f"cannot decode sample {self.listing.keys[i]!r} ({self.store.url_of(self.listing.keys[i])}): "
            f"{type(e).__name__}: {e}. Fix or remove the file, or pass `on_decode_error='skip'`."
        ) from e

    # ---- writes --------------------------------------------------------------------------------------------------
    def _write(self, writes: Writes, promote: list[tuple[bytes, bytes]]) -> tuple[int, int, int, list[int]]:
        """Store misses and promotions; returns (stored, rejected, evicted, positions of ``writes`` stored nowhere)."""
        # Misses go to one tier, never both (writing both doubles the cold epoch's write cost). With
        # `misses_to="ram"` (default): the RAM tier while it admits them ("keep" policy), its overflow to the SSD tier
        # in the same call; the SSD tier gets the RAM tier's entries later (`spill`). Why: tmpfs writes cost less than
        # page-cache writes to ext4, and the first warm epoch then reads what the cold one wrote with nothing to
        # promote (promoting SSD hits into the RAM tier makes it several times slower than the next warm epochs);
        # the cold and first-warm rows of benchmarks/data_cache.py measure both. `misses_to="ssd"`: the SSD tier, SSD
        # hits promoted into the RAM tier while it has room.
        tiers = dict(self.tiers)
        ram, ssd = tiers.get("ram"), tiers.get("ssd")
        written = rejected = evicted = 0
        ram_writes: Writes = []  # misses offered to the RAM tier
        to_ssd: Writes = []
        ssd_pos: list[int] = []  # position in `writes` of each entry of `to_ssd`
        lost: list[int] = []
        if ram is not None and (ssd is None or (self._ram_first() and not self._ram_full)):
            ram_writes = writes
        elif ssd is not None:
            to_ssd, ssd_pos = writes, list(range(len(writes)))
        else:
            lost = list(range(len(writes)))  # no usable tier
        to_ram = [*ram_writes, *promote] if ram is not None else []
        if ram is not None and to_ram:
            r = ram.put_many(to_ram)
            written, rejected, evicted = r.stored, r.rejected, r.evicted
            if r.not_stored and ram.policy == "keep":
                self._ram_full = True  # stop offering it misses and SSD hits
            overflow = [i for i in r.not_stored if i < len(ram_writes)]
            if ssd is not None:
                # The overflow joins the SSD writes: with `misses_to="ssd"` (or a "fifo" RAM tier) `to_ssd` already
                # holds the batch's misses, and only the promoted SSD hits went to the RAM tier.
                to_ssd, ssd_pos = [*to_ssd, *(to_ram[i] for i in overflow)], [*ssd_pos, *overflow]
                rejected -= len(overflow)
            else:
                lost = overflow
        if ssd is not None and to_ssd:
            r = ssd.put_many(to_ssd)
            written, rejected, evicted = written + r.stored, rejected + r.rejected, evicted + r.evicted
            lost = [ssd_pos[i] for i in r.not_stored]
        return written, rejected, evicted, lost

    def _ram_first(self) -> bool:
        """Misses go to the RAM tier first (``misses_to="ram"``, a usable RAM tier with the "keep" policy: a "fifo"
        RAM tier would evict entries the SSD tier does not hold)."""
        ram = self.ram
        return self.misses_to == "ram" and ram is not None and not ram.disabled and ram.policy == "keep"

    def spill(self, batch: int = 64) -> int:
        """Copy this cache's RAM-tier entries that the SSD tier lacks into the SSD tier; returns how many it stored.

        The RAM tier lives on tmpfs and is gone at reboot; after a spill, every entry it held is on the SSD tier too
        (as far as the SSD budget admits them), so a rebooted node decodes nothing again. One read of the RAM tier
        and one SSD write transaction per ``batch`` entries; safe to run while other processes read and write.
        """
        ram, ssd = self.ram, self.ssd
        if ram is None or ssd is None or ram.disabled or ssd.disabled:
            return 0
        prefix = f"{self.namespace}/".encode()
        stored, after = 0, None
        while True:
            keys = ram.scan_keys(prefix, after, limit=batch)
            if not keys:
                return stored
            after = keys[-1]
            lacking = [k for k, h in zip(keys, ssd.contains(keys), strict=True) if not h]
            if not lacking:
                continue  # spilled before: nothing is copied out of the map
            with ram.reader() as get:
                todo = [(k, bytes(v)) for k in lacking if (v := get(k)) is not None]
            if todo:
                r = ssd.put_many(todo)
                stored += r.stored
                if r.not_stored and ssd.policy == "keep":
                    return stored  # the SSD tier is full

    def _commit_behind(self, writes: Writes, indices: Sequence[int] = ()) -> None:
        """A write-behind batch, on the writer thread: store the misses (listing entries ``indices``), count them."""
        written, rejected, evicted, lost = self._write(writes, [])
        self._mark_cached(indices, lost)
        self.stats.add(writes=written, rejected=rejected, evictions=evicted)

    def _mark_cached(self, indices: Sequence[int], lost: Sequence[int]) -> None:
        """Record listing entries ``indices`` as cached, except positions ``lost`` (stored in no tier)."""
        if indices:
            idx = np.asarray(indices, dtype=np.int64)
            if lost:
                idx = np.delete(idx, list(lost))
            self._cached_t.numpy()[idx] = 1

    def not_yet_seen_cached(self, indices: Sequence[int]) -> list[int]:
        """Those of listing entries ``indices`` that no process of this tree has read from a tier or stored yet
        (no lookups; they may still be cached, by an earlier run: see :meth:`cached`)."""
        if not len(indices):
            return []
        idx = np.asarray(indices, dtype=np.int64)
        return idx[self._cached_t.numpy()[idx] == 0].tolist()

    def cached(self, indices: Sequence[int]) -> list[bool]:
        """Which of listing entries ``indices`` some tier holds: from this process tree's record where it has seen
        them (no lookups: the usual case right after a cold pass), from the tiers for the rest."""
        seen = self._cached_t.numpy()[np.asarray(indices, dtype=np.int64)] if len(indices) else np.zeros(0, bool)
        out = [bool(b) for b in seen]
        rest = [p for p, b in enumerate(out) if not b]
        if rest and self.tiers:
            keys = self.keys_of([indices[p] for p in rest])
            found = [False] * len(keys)
            for _, tier in self.tiers:
                have = tier.contains(keys)
                found = [a or b for a, b in zip(found, have, strict=True)]
            got = [p for p, f in zip(rest, found, strict=True) if f]
            for p in got:
                out[p] = True
            if got:
                self._cached_t.numpy()[np.asarray([indices[p] for p in got], dtype=np.int64)] = 1
        return out

    def _write_behind_writer(self) -> WriteBehind | None:
        on = self.write_behind
        if on is None:
            on = _in_worker()
        return self._writer.get() if on else None

    @property
    def writes_behind(self) -> bool:
        """True when this process has a write-behind thread (see ``write_behind``)."""
        return self._writer.peek() is not None

    def flush(self) -> None:
        """Wait until every write-behind batch of this process is committed (no-op without write-behind).

        Raises the error of a background write (e.g. BudgetTooSmallError) here, in the caller.
        """
        writer = self._writer.peek()
        if writer is not None:
            writer.flush()

    def _alloc(self, shape: Sequence[int], dtype: torch.dtype, shared: bool) -> torch.Tensor:
        return alloc_shared(shape, dtype) if shared else self.buffers.take(shape, dtype)

    # ---- the batch read path -------------------------------------------------------------------------------------
    def load(self, indices: Sequence[int], *, shared: bool = False) -> BatchResult:
        """Read listing entries ``indices`` as one batch (see the module docstring for the path).

        Args:
            indices: positions in the listing.
            shared: allocate the batch in shared memory (inside DataLoader workers).

        Raises:
            OriginError: the origin cannot deliver a missing sample (names the URL).
            DecodeError: a sample cannot be decoded and ``on_decode_error="raise"`` (names the URL).
        """
        batch = _Batch.start(indices, self.keys_of(indices), shared)
        missing = self._read_tiers(batch)
        if len(missing) < len(indices):
            hit = np.asarray(indices, dtype=np.int64)
            if missing:
                hit = np.delete(hit, missing)
            self._cached_t.numpy()[hit] = 1
        refetches, evicted = self._drop_corrupt(batch)
        if missing:
            self._read_origin(batch, missing)
        written, rejected, ev = self._store(batch)
        self._account()
        self.stats.add(
            requests=len(indices),
            ram_hits=batch.hits["ram"],
            ssd_hits=batch.hits["ssd"],
            origin_fetches=batch.fetched,
            writes=written,
            rejected=rejected,
            evictions=evicted + ev,
            refetches=refetches,
            decode_skipped=batch.skipped,
        )
        if batch.out is not None:
            self._row_like = (tuple(batch.out.shape[1:]), batch.out.dtype)
        return batch.result(self._row_like)

    def _read_tiers(self, batch: _Batch) -> list[int]:
        """Copy every entry the tiers hold into its batch row (one read transaction per tier); returns the
        positions still missing. Corrupt entries are noted in ``batch.corrupt`` and count as missing."""
        verified = self._verified_t.numpy()
        missing = list(range(len(batch.indices)))
        for name, tier in self.tiers:
            if not missing:
                break
            still = []
            want_promote = name == "ssd" and self.ram is not None and not self.ram.disabled and not self._ram_full
            with tier.reader() as get:
                for pos in missing:
                    buf = get(batch.keys[pos])
                    if buf is None:
                        still.append(pos)
                        continue
                    if is_undecodable(buf):
                        # A sample known not to decode: skipped without reading it again, and known cached, so the
                        # loader is not kept on the cold path by it. Under "raise" it is decoded again, for the error.
                        if self.on_decode_error == "skip":
                            batch.kept[pos] = False
                            batch.skipped += 1
                            batch.hits[name] += 1
                        else:
                            batch.undecodable[name].append(batch.keys[pos])
                            still.append(pos)
                        continue
                    try:
                        self._place(batch, pos, buf, verified)
                    except CorruptEntryError:
                        verified[batch.indices[pos]] = 0
                        batch.corrupt[name].append(batch.keys[pos])
                        still.append(pos)
                        continue
                    batch.hits[name] += 1
                    if want_promote:
                        batch.promote.append((batch.keys[pos], bytes(buf)))
            missing = still
        return missing

    def _place(self, batch: _Batch, pos: int, buf: memoryview | bytes, verified: np.ndarray) -> None:
        """Copy one cached entry into row ``pos`` (checking its CRC-32 unless this process tree already did)."""
        if batch.rows is None:  # the first entry: allocate the batch, and one numpy view of it to copy rows into
            if batch.out is None:
                dtype, shape = peek_shape(buf)
                batch.out = self._alloc((len(batch.indices), *shape), dtype, batch.shared)
            batch.rows = batch.out.view(torch.uint8).numpy().reshape(len(batch.indices), -1)
            batch.row_shape = list(batch.out.shape[1:])
        assert batch.out is not None
        i = batch.indices[pos]
        copy_payload(buf, batch.rows[pos], batch.out.dtype, batch.row_shape, verify=not verified[i])
        # The label comes from the listing, not from the entry: a relabelled manifest (same key, same bytes, new
        # label) takes effect without decoding anything again. One list lookup per hit.
        batch.labels[pos] = self.listing.labels[i]
        verified[i] = 1

    def _drop_corrupt(self, batch: _Batch) -> tuple[int, int]:
        """Delete the corrupt entries found by :meth:`_read_tiers`; returns (corrupt entries, entries deleted)."""
        evicted = 0
        for name, tier in self.tiers:
            if batch.corrupt[name]:
                evicted += tier.delete(batch.corrupt[name])
            if batch.undecodable[name]:
                # else a sample that now decodes (a decoder fixed) could never be stored: a present key is kept
                tier.delete(batch.undecodable[name])
        return len(batch.corrupt["ram"]) + len(batch.corrupt["ssd"]), evicted

    def _read_origin(self, batch: _Batch, missing: list[int]) -> None:
        """Read the ``missing`` positions from the origin and decode each into its batch row."""
        datas = self._fetch([batch.indices[p] for p in missing])
        batch.fetched = len(missing)
        # A decoder with `decode_into` (ImageDecoder) decodes straight into the batch row: no tensor of its own
        # and no strided HWC -> CHW copy (see ImageDecoder.decode_into).
        into: Callable[[bytes, torch.Tensor], None] | None = getattr(self.decode, "decode_into", None)
        shape_of: Callable[[bytes], Sequence[int]] | None = getattr(self.decode, "out_shape", None)
        verified = self._verified_t.numpy()
        for data in datas:
            if isinstance(data, BaseException):
                raise data
        done = self._decode_batch(batch, missing, datas, shape_of)  # type: ignore[arg-type]  # no errors left
        for pos, data, already in zip(missing, datas, done, strict=True):
            assert not isinstance(data, BaseException)
            if already:
                decoded: torch.Tensor | None = batch.out[pos]  # type: ignore[index]  # allocated by _decode_batch
            elif into is not None and shape_of is not None:
                decoded = self._decode_into_row(batch, pos, data, into, shape_of)
            else:
                decoded = self._decode_to_row(batch, pos, data)
            if decoded is None:  # skipped (on_decode_error="skip")
                continue
            i = batch.indices[pos]
            batch.labels[pos] = self.listing.labels[i]
            batch.writes.append((batch.keys[pos], encode_entry(decoded, self.listing.labels[i])))
            batch.write_idx.append(i)
            verified[i] = 1  # written from the row we just decoded: as good as a checked read

    def _decode_batch(
        self, batch: _Batch, missing: list[int], datas: list[bytes], shape_of: Callable[[bytes], Sequence[int]] | None
    ) -> list[bool]:
        """A decoder with ``decode_batch_into`` and a ``device`` (``ImageDecoder(device="cuda")``) decodes the
        batch's misses in one call on the device, straight into their rows; returns which it did."""
        batch_into = getattr(self.decode, "decode_batch_into", None)
        if batch_into is None or getattr(self.decode, "device", None) is None or shape_of is None or not missing:
            return [False] * len(missing)
        rows = []
        try:
            for pos, data in zip(missing, datas, strict=True):
                rows.append(self._row(batch, pos, tuple(shape_of(data)), torch.uint8))
        except Exception:
            return [False] * len(missing)  # the per-sample path reports it, naming the key
        return list(batch_into(datas, rows))

    def _decode_into_row(
        self,
        batch: _Batch,
        pos: int,
        data: bytes,
        into: Callable[[bytes, torch.Tensor], None],
        shape_of: Callable[[bytes], Sequence[int]],
    ) -> torch.Tensor | None:
        """Decode ``data`` straight into row ``pos``; returns the row, or None when the sample is skipped."""
        try:
            shape = tuple(shape_of(data))
        except Exception as e:
            self._skip(batch, pos, e)
            return None
        row = self._row(batch, pos, shape, torch.uint8)
        try:
            into(data, row)
        except Exception as e:
            self._skip(batch, pos, e)
            return None
        return row

    def _decode_to_row(self, batch: _Batch, pos: int, data: bytes) -> torch.Tensor | None:
        """Decode ``data`` to a tensor and copy it into row ``pos``; returns the row, or None when skipped."""
        try:
            t = self.decode(data)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"`decode` returned {type(t).__name__}, expected a torch.Tensor")
        except Exception as e:
            self._skip(batch, pos, e)
            return None
        row = self._row(batch, pos, tuple(t.shape), t.dtype)
        row.copy_(t)  # the one strided copy (decoders give HWC->CHW views); the entry copies the row
        return row

    def _row(self, batch: _Batch, pos: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Row ``pos`` of the batch (allocated now if this is its first sample), checked against ``shape``/``dtype``."""
        if batch.out is None:
            batch.out = self._alloc((len(batch.indices), *shape), dtype, batch.shared)
        row = batch.out[pos]
        if tuple(row.shape) != shape or row.dtype != dtype:
            raise ValueError(
                f"`decode` returned dtype {dtype} and shape {list(shape)} for "
                f"{self.listing.keys[batch.indices[pos]]!r}, the batch expects {row.dtype} and {list(row.shape)}. "
                "Make `decode` return one fixed shape (e.g. resize/crop to a fixed size)."
            )
        return row

    def _skip(self, batch: _Batch, pos: int, e: Exception) -> None:
        """Leave an undecodable sample out of the batch (``on_decode_error="skip"``), or raise naming its key."""
        i = batch.indices[pos]
        self._decode_failed(i, e)
        batch.kept[pos] = False
        batch.skipped += 1
        # Remembered in the tiers under the sample's key (its content identity included): later epochs and runs skip
        # it without a read and a decode, and count it cached. Without the record the cache was never complete and
        # the loader stayed on the cold path every epoch.
        batch.writes.append((batch.keys[pos], encode_undecodable(f"{type(e).__name__}: {e}")))
        batch.write_idx.append(i)

    def _store(self, batch: _Batch) -> tuple[int, int, int]:
        """Store the batch's decoded misses (behind, on the writer thread, when ``write_behind``) and its SSD hits
        to promote; returns what was stored inline: (stored, rejected, evicted)."""
        writes, idx = batch.writes, batch.write_idx
        if writes and _in_worker():
            keep_freed_memory()  # the tiers' write pages are malloc'd per commit: keep them (see _utils/malloc.py)
        writer = self._write_behind_writer() if writes else None
        if writer is not None:
            writer.submit(functools.partial(self._commit_behind, indices=idx), writes)  # on the writer thread
            writes, idx = [], []
        written, rejected, evicted, lost = self._write(writes, batch.promote)
        self._mark_cached(idx, lost)
        return written, rejected, evicted
