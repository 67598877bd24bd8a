"""``SampleCache``: decoded samples through RAM -> SSD -> origin, read a whole batch at a time.

Read path for a batch of sample indices (all in the calling process, one thread):

1. one read transaction on the RAM tier, then one on the SSD tier for what is left: each entry is verified (CRC-32,
   the first time this process reads it) and copied once, from the memory map straight into its row of the batch
   tensor (shared memory inside a DataLoader worker, so the batch crosses to the main process as one file
   descriptor, not a copy);
2. corrupt entries are deleted from their tier, counted as ``refetches`` and treated as misses;
3. misses are read from the origin (a remote one concurrently, or taken from reads the prefetcher started earlier;
   a local one inline, see ``prefetch``), decoded straight into their batch rows (``decode.decode_into`` when the
   decoder has it, else the decoder's tensor is copied in), and written to the SSD tier (the RAM tier when there is
   no SSD tier) in one write transaction;
4. SSD hits are promoted to the RAM tier while it has room.

Prefetch: :meth:`SampleCache.hint` starts origin reads for upcoming samples that no tier holds, on the store's
bounded thread pool, keeping at most ``max_pending`` reads (and their bytes) outstanding.
"""

from __future__ import annotations

import hashlib
import multiprocessing.util
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess
from lightning_accel.data.codec import CorruptEntryError, copy_payload, encode_entry, peek_shape
from lightning_accel.data.decode import DecodeError
from lightning_accel.data.origin import Listing, ObjectStore
from lightning_accel.data.pack import DEFAULT_STAGE_BYTES, PackedReader
from lightning_accel.data.stats import CacheStats
from lightning_accel.data.tiers import LmdbTier

__all__ = ["BatchResult", "SampleCache"]

_MAX_KEY = 400  # LMDB keys are limited to 511 bytes; longer sample keys are hashed


class BatchResult:
    """``images`` (N, ...) in listing order minus skipped samples, ``labels`` int64 (N,), ``kept`` positions."""

    __slots__ = ("images", "kept", "labels")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, kept: list[int]) -> None:
        self.images, self.labels, self.kept = images, labels, kept


def _alloc_shared(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # As torch's default_collate does inside workers: allocate the batch directly in shared memory so sending it to
    # the main process is a file-descriptor handoff instead of a 9.6 MB copy (64 x 3 x 224 x 224 uint8).
    numel = 1
    for s in shape:
        numel *= int(s)
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(numel, device=elem.device)
    return elem.new(storage).resize_(*[int(s) for s in shape])


class BufferPool:
    """Recycles batch buffers once nothing outside the pool references them.

    Why: a fresh 9.6 MB batch (64 x 3 x 224 x 224 uint8) is a fresh ``mmap`` from glibc (above its mmap threshold,
    and always so for reader threads, whose malloc arenas trim freed memory), so every warm batch paid ~2,350 page
    faults (zero-filled pages) before its first byte was copied. Copying 64 entries into a reused buffer ran at ~78k
    samples/s on this 2-core machine, into a fresh one at ~40k/s.

    Contract: the pool keeps each buffer's *storage* and hands out a new tensor over it; a storage is reused only
    when its use count is back to 1 (the pool's own reference), i.e. the batch tensor and every view of it (slices,
    numpy arrays) are gone. A caller that keeps batches simply makes the pool allocate: at most ``max_buffers``
    storages per (shape, dtype) are kept, beyond that batches are plain allocations. Only private (non-shared)
    memory is pooled: a shared-memory batch leaves its worker process.
    """

    def __init__(self, max_buffers: int = 8) -> None:
        self.max_buffers = max_buffers
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.UntypedStorage]] = {}
        self._lock = ForkSafeLock()
        self.reused = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"max_buffers": self.max_buffers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_buffers"])  # type: ignore[misc]

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype``, on a recycled storage when one is free."""
        shape_t = tuple(int(s) for s in shape)
        use_count = getattr(torch._C, "_storage_Use_Count", None)  # also what inductor's cudagraph trees rely on
        if self.max_buffers <= 0 or use_count is None:
            return torch.empty(shape_t, dtype=dtype)
        key = (shape_t, dtype)
        with self._lock:
            stores = self._free.setdefault(key, [])
            storage = next((s for s in stores if use_count(s._cdata) == 1), None)
            if storage is not None:
                self.reused += 1
            elif len(stores) < self.max_buffers:
                storage = torch.empty(shape_t, dtype=dtype).untyped_storage()
                stores.append(storage)
            else:
                return torch.empty(shape_t, dtype=dtype)
            # Created under the lock: from here the use count is 2, so no other thread can take this storage.
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape_t)


_WRITE_QUEUE = 4  # batches waiting for the writer thread (~9.6 MB each at 224 px); a full queue blocks the reader


class _WriteBehind:
    """One writer thread per process for :class:`SampleCache` misses (see ``write_behind``)."""

    def __init__(self, cache: SampleCache) -> None:
        self.pid = os.getpid()
        self._cache = cache
        self._q: queue.Queue[list[tuple[bytes, bytes]]] = queue.Queue(maxsize=_WRITE_QUEUE)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="la-cache-writer", daemon=True)
        self._thread.start()
        # DataLoader workers leave through multiprocessing's exit path, which runs these finalisers (not atexit):
        # commit what is queued so the next epoch finds it.
        multiprocessing.util.Finalize(self, self.flush, kwargs={"raise_errors": False}, exitpriority=10)

    def submit(self, writes: list[tuple[bytes, bytes]]) -> None:
        """Queue a batch's entries; raises the error of an earlier background write (e.g. BudgetTooSmallError)."""
        self._raise_error()
        self._q.put(writes)

    def flush(self, raise_errors: bool = True) -> None:
        if self._thread.is_alive():
            self._q.join()
        if raise_errors:
            self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _run(self) -> None:
        while True:
            writes = self._q.get()
            try:
                written, rejected, evicted = self._cache._write(writes, [])
                self._cache.stats.add(writes=written, rejected=rejected, evictions=evicted)
            except Exception as e:  # disk errors disable the tier inside put_many; this is bad input (budget)
                self.error = e  # raised by the next submit, in the reading thread
            finally:
                self._q.task_done()


class SampleCache:
    """Decoded samples of one origin, cached in byte-budgeted tiers.

    Args:
        store: the origin.
        listing: its keys and labels (shared by every rank and worker).
        decode: deterministic ``bytes -> tensor`` step; its ``fingerprint`` attribute (or its repr) namespaces entries.
        ram: the RAM tier (``None``: none).
        ssd: the SSD tier (``None``: none).
        stats: shared counters (a new :class:`CacheStats` by default).
        on_decode_error: ``"raise"`` (error naming the key) or ``"skip"`` (drop the sample from its batch, count it).
        max_pending: most prefetched origin reads outstanding per process.
        prefetch: read ahead (:meth:`hint`) and read a batch's misses concurrently on the store's thread pool.
            ``None`` (default): only for remote origins. A local origin (plain path, ``file://``) is read inline in
            the calling thread: a page-cache read costs ~20 us there against ~80 us of CPU through the pool (thread
            hand-offs and GIL switches, measured on this 2-core machine), and in DataLoader workers that CPU is
            taken from decoding. Pass ``True`` for a local disk slow enough that concurrent reads pay off.
        stage_dir: where shards of a remote *packed* origin are staged (node-local, shared by workers and ranks;
            default: ``shards/`` beside the SSD tier, else beside the RAM tier, else in the temp directory).
        stage_bytes: most bytes of staged shards kept (see :class:`~lightning_accel.data.pack.PackedReader`).
        write_behind: write a batch's misses to the tier on a background thread of this process (one batch after
            another, at most ``_WRITE_QUEUE`` batches queued) instead of before the batch is returned. ``None``
            (default): only inside DataLoader workers. Why: an LMDB commit waits for the node-wide writer lock and
            for the page cache, while the worker could decode its next batch. Measured here (2 workers, 224 px): a
            cold epoch into the RAM tier went from 24-26 to 22.5-23 ms per batch; into the SSD tier it stayed at
            29-33 ms, bound by the page-cache writes themselves (``docs/data.md``). Entries become visible when their
            write commits; :meth:`flush` waits for that (also run when a worker process exits).
    """

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
    ) -> None:
        if on_decode_error not in ("raise", "skip"):
            raise ValueError(f"`on_decode_error` must be 'raise' or 'skip', got {on_decode_error!r}.")
        self.store = store
        self.listing = listing
        self.decode = decode
        self.ram = ram
        self.ssd = ssd
        self.stats = stats if stats is not None else CacheStats()
        self.on_decode_error = on_decode_error
        self.max_pending = max_pending
        self.prefetch = (not store.is_local) if prefetch is None else bool(prefetch)
        fp = getattr(decode, "fingerprint", None) or repr(decode)
        self.namespace = hashlib.sha1(f"{store.url}|{fp}".encode()).hexdigest()[:12]
        # Read-ahead futures of this process (a forked child's copies belong to threads it does not have).
        self._pending: PerProcess[dict[int, Future[bytes]]] = PerProcess(dict)
        self.packed: PackedReader | None = None
        if listing.pack is not None:
            if stage_dir is None:
                near = ssd if ssd is not None else ram
                base = os.path.dirname(near.path) if near is not None else tempfile.gettempdir()
                stage_dir = os.path.join(base, "shards")
            self.packed = PackedReader(store, listing.pack, os.fspath(stage_dir), stage_bytes, on_staged=self._account)
        self._seen = (0, 0)  # (retries, bytes) of the store already added to the statistics
        self._ram_full = False
        self.buffers = BufferPool()
        self.write_behind = write_behind
        self._writer: _WriteBehind | None = None
        self._lock = ForkSafeLock()
        # 1 byte per sample, in shared memory so the DataLoader workers (fork or spawn) share it: entries verified
        # (CRC-32) once, or written, by a process of this tree; later reads skip the checksum. Without sharing, the
        # first warm epoch in the main process re-checked every entry the cold epoch's workers had just written
        # (~3x slower than the next warm epochs at 224 px).
        self._verified_t = torch.zeros(max(1, len(listing)), dtype=torch.uint8).share_memory_()
        self._verified = self._verified_t.numpy()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_seen=(0, 0), _verified=None, _writer=None)  # _verified_t travels; _pending, _lock pickle fresh
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._verified = self._verified_t.numpy()

    def __len__(self) -> int:
        return len(self.listing)

    @property
    def tiers(self) -> list[tuple[str, LmdbTier]]:
        return [(n, t) for n, t in (("ram", self.ram), ("ssd", self.ssd)) if t is not None and not t.disabled]

    def key(self, i: int) -> bytes:
        """The tier key of listing entry ``i``."""
        k = self.listing.keys[i]
        if len(k) > _MAX_KEY:
            k = "sha1:" + hashlib.sha1(k.encode()).hexdigest()
        return f"{self.namespace}/{k}".encode()

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
            retried, fetched = self.store.retried - self._seen[0], self.store.bytes_read - self._seen[1]
            self._seen = (self.store.retried, self.store.bytes_read)
        self.stats.add(bytes_fetched=fetched, retries=retried)

    def _uncached(self, todo: list[int]) -> list[int]:
        keys = [self.key(i) for i in todo]
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
    def _write(self, writes: list[tuple[bytes, bytes]], promote: list[tuple[bytes, bytes]]) -> tuple[int, int, int]:
        """Store misses and promotions; returns (stored, rejected, evicted)."""
        # Misses go to one tier: the SSD when there is one (persistent; its pages stay in the OS page cache), else
        # RAM. Writing both doubled the cold epoch's write cost (~20 % of it at 224 px); the RAM tier fills instead
        # by promotion of SSD hits, in the first warm epoch.
        tiers = self.tiers
        first = "ssd" if any(n == "ssd" for n, _ in tiers) else "ram"
        written = rejected = evicted = 0
        for name, tier in tiers:
            batch = (writes if name == first else []) + (promote if name == "ram" else [])
            if not batch:
                continue
            r = tier.put_many(batch)
            written += r.stored
            rejected += r.rejected
            evicted += r.evicted
            if name == "ram" and r.stored == 0 and r.rejected and tier.policy == "keep":
                self._ram_full = True  # stop copying SSD hits for promotion
        return written, rejected, evicted

    def _write_behind_writer(self) -> _WriteBehind | None:
        on = self.write_behind
        if on is None:
            from torch.utils.data import get_worker_info

            on = get_worker_info() is not None
        if not on:
            return None
        if self._writer is None or self._writer.pid != os.getpid():
            self._writer = _WriteBehind(self)
        return self._writer

    @property
    def writes_behind(self) -> bool:
        """True when this process has a write-behind thread (see ``write_behind``)."""
        return self._writer is not None and self._writer.pid == os.getpid()

    def flush(self) -> None:
        """Wait until every write-behind batch of this process is committed (no-op without write-behind)."""
        if self._writer is not None and self._writer.pid == os.getpid():
            self._writer.flush()
        # raises the error of a background write (e.g. BudgetTooSmallError) here, in the caller

    def _alloc(self, shape: Sequence[int], dtype: torch.dtype, shared: bool) -> torch.Tensor:
        return _alloc_shared(shape, dtype) if shared else self.buffers.take(shape, dtype)

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
        n = len(indices)
        keys = [self.key(i) for i in indices]
        labels = [0] * n
        state: dict[str, Any] = {"out": None}

        verified = self._verified

        def place(pos: int, buf: memoryview | bytes) -> None:
            if state["out"] is None:
                dtype, shape = peek_shape(buf)
                state["out"] = self._alloc((n, *shape), dtype, shared)
            if "rows" not in state:  # one numpy view of the whole batch, rows indexed per sample
                out = state["out"]
                state["rows"] = out.view(torch.uint8).numpy().reshape(n, -1)
                state["dtype"], state["shape"] = out.dtype, list(out.shape[1:])
            i = indices[pos]
            labels[pos] = copy_payload(buf, state["rows"][pos], state["dtype"], state["shape"], verify=not verified[i])
            verified[i] = 1

        hits = {"ram": 0, "ssd": 0}
        corrupt = {"ram": [], "ssd": []}
        promote: list[tuple[bytes, bytes]] = []
        missing = list(range(n))
        for name, tier in self.tiers:
            if not missing:
                break
            still = []
            want_promote = name == "ssd" and self.ram is not None and not self.ram.disabled and not self._ram_full
            with tier.reader() as get:
                for pos in missing:
                    buf = get(keys[pos])
                    if buf is None:
                        still.append(pos)
                        continue
                    try:
                        place(pos, buf)
                    except CorruptEntryError:
                        verified[indices[pos]] = 0
                        corrupt[name].append(keys[pos])
                        still.append(pos)
                        continue
                    hits[name] += 1
                    if want_promote:
                        promote.append((keys[pos], bytes(buf)))
            missing = still
        evicted = 0
        for name, tier in self.tiers:
            if corrupt[name]:
                evicted += tier.delete(corrupt[name])
        refetches = len(corrupt["ram"]) + len(corrupt["ssd"])

        kept = [True] * n
        writes: list[tuple[bytes, bytes]] = []
        skipped = 0
        if missing:
            datas = self._fetch([indices[p] for p in missing])
            # A decoder with `decode_into` (ImageDecoder) decodes straight into the batch row: no tensor of its own
            # and no strided HWC -> CHW copy (see ImageDecoder.decode_into).
            into = getattr(self.decode, "decode_into", None)
            shape_of = getattr(self.decode, "out_shape", None)
            if shape_of is None:
                into = None
            for pos, data in zip(missing, datas, strict=False):
                i = indices[pos]
                if isinstance(data, BaseException):
                    raise data
                t: torch.Tensor | None = None
                try:
                    if into is not None:
                        shape, dtype = tuple(shape_of(data)), torch.uint8
                    else:
                        t = self.decode(data)
                        if not isinstance(t, torch.Tensor):
                            raise TypeError(f"`decode` returned {type(t).__name__}, expected a torch.Tensor")
                        shape, dtype = tuple(t.shape), t.dtype
                except Exception as e:
                    if self._decode_failed(i, e):
                        kept[pos] = False
                        skipped += 1
                        continue
                if state["out"] is None:
                    state["out"] = self._alloc((n, *shape), dtype, shared)
                row = state["out"][pos]
                if tuple(row.shape) != shape or row.dtype != dtype:
                    raise ValueError(
                        f"`decode` returned dtype {dtype} and shape {list(shape)} for "
                        f"{self.listing.keys[i]!r}, the batch expects {row.dtype} and {list(row.shape)}. Make "
                        "`decode` return one fixed shape (e.g. resize/crop to a fixed size)."
                    )
                if t is None:
                    try:
                        into(data, row)
                    except Exception as e:
                        if self._decode_failed(i, e):
                            kept[pos] = False
                            skipped += 1
                            continue
                else:
                    row.copy_(t)  # the one strided copy (decoders give HWC->CHW views); the entry copies the row
                labels[pos] = self.listing.labels[i]
                writes.append((keys[pos], encode_entry(row, self.listing.labels[i])))
                verified[i] = 1  # written from the row we just decoded: as good as a checked read
        # Misses go to one tier: the SSD when there is one (persistent; its pages stay in the OS page cache), else
        # RAM. Writing both doubled the cold epoch's write cost (~20 % of it at 224 px); the RAM tier fills instead
        # by promotion of SSD hits, in the first warm epoch.
        writer = self._write_behind_writer() if writes else None
        if writer is not None:
            writer.submit(writes)  # misses: committed on the writer thread (see `write_behind`)
            writes = []
        written, rejected, ev = self._write(writes, promote)
        evicted += ev
        self._account()
        self.stats.add(
            requests=n,
            ram_hits=hits["ram"],
            ssd_hits=hits["ssd"],
            origin_fetches=len(missing),
            writes=written,
            rejected=rejected,
            evictions=evicted,
            refetches=refetches,
            decode_skipped=skipped,
        )
        out = state["out"]
        label_t = torch.tensor(labels, dtype=torch.int64)
        keep_pos = [p for p in range(n) if kept[p]]
        if out is None:  # every sample skipped
            return BatchResult(torch.empty(0, dtype=torch.uint8), label_t[:0], [])
        if skipped:
            out, label_t = out[keep_pos], label_t[keep_pos]
        return BatchResult(out, label_t, keep_pos)
