"""Cache statistics shared by the main process and every DataLoader worker.

The counters live in one int64 tensor in shared memory, one row per process slot (row 0: the main process, row
``1 + lane * 65 + worker_id``: a DataLoader worker, ``lane`` the ``stats_lane`` of the dataset it iterates), so
workers count without locks and without sending anything back, and the main process reads the sum at any time. Lanes
keep the workers of two loaders running at once (training and validation) off each other's rows: ``+=`` on shared
memory from two processes loses counts. The tensor crosses into workers with the dataset: fork inherits the mapping,
spawn shares it through torch's multiprocessing reductions. Pickled any other way (``pickle.dumps``) it is a copy.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_accel._utils.forksafe import ForkSafeLock

__all__ = ["FIELDS", "LANES", "CacheStats", "summarize"]

FIELDS = (
    "requests",  # samples asked for
    "ram_hits",
    "ssd_hits",
    "origin_fetches",  # samples read from the origin (misses of every local tier)
    "bytes_fetched",  # bytes read from the origin (listing excluded)
    "prefetched",  # origin reads started ahead of need
    "writes",  # entries written to a tier
    "rejected",  # entries a full tier did not admit ("keep" policy)
    "evictions",  # entries removed: "fifo" policy or corrupt
    "refetches",  # corrupt entries detected, evicted and refetched
    "decode_skipped",  # undecodable samples skipped (on_decode_error="skip")
    "retries",  # transient origin errors retried
)
_IDX = {f: i for i, f in enumerate(FIELDS)}
_WORKER_SLOTS = 65  # worker rows per lane (worker ids beyond share rows modulo this)
LANES = 4  # loaders that may count at once with distinct rows
_ROWS = 1 + LANES * _WORKER_SLOTS


def summarize(totals: torch.Tensor | list[int]) -> dict[str, Any]:
    """``{field: count}`` for counters in ``FIELDS`` order, plus hit rates derived from them."""
    tot = totals.tolist() if isinstance(totals, torch.Tensor) else list(totals)
    d: dict[str, Any] = {f: int(v) for f, v in zip(FIELDS, tot, strict=True)}
    req = max(1, d["requests"])
    d["ram_hit_rate"] = d["ram_hits"] / req
    d["ssd_hit_rate"] = d["ssd_hits"] / req
    d["hit_rate"] = (d["ram_hits"] + d["ssd_hits"]) / req
    return d


class CacheStats:
    """Lock-free counters shared across processes; ``as_dict()`` sums every slot."""

    def __init__(self) -> None:
        self._t = torch.zeros(_ROWS, len(FIELDS), dtype=torch.int64)
        self._t.share_memory_()
        self._lock = ForkSafeLock()  # threads of one process share its slot

    def _slot(self) -> int:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return 0
        lane = getattr(info.dataset, "stats_lane", 0)
        lane = lane if isinstance(lane, int) and 0 <= lane < LANES else 0
        return 1 + lane * _WORKER_SLOTS + info.id % _WORKER_SLOTS

    def add(self, **counts: int) -> None:
        """Add to this process's slot, e.g. ``stats.add(ssd_hits=3, requests=3)``."""
        row = self._t.numpy()[self._slot()]  # numpy on the shared buffer: far cheaper per field than torch ops
        with self._lock:
            for k, v in counts.items():
                if v:
                    row[_IDX[k]] += int(v)

    def totals(self) -> torch.Tensor:
        """The counters summed over this process tree's slots, int64 in ``FIELDS`` order (for a cross-rank sum)."""
        return self._t.sum(0)

    def as_dict(self) -> dict[str, Any]:
        """Totals over all processes plus derived hit rates (``hit_rate``: any local tier)."""
        return summarize(self.totals())

    def reduced(self, group: Any = None) -> dict[str, Any]:
        """:meth:`as_dict` summed over every rank of ``group`` (a collective: every rank must call it; this process's
        own totals without an initialised process group). Counts are sums; rates are recomputed from the sums, so
        ``hit_rate`` is the global one (hits of all ranks over requests of all ranks)."""
        t = self.totals()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return summarize(t)

    def reset(self) -> None:
        """Zero every counter (e.g. at the start of an epoch you want to measure)."""
        self._t.zero_()

    def __repr__(self) -> str:
        return f"CacheStats({self.as_dict()})"
