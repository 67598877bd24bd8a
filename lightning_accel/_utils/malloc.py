"""glibc ``malloc`` tuning: keep freed memory in the process instead of handing it back to the kernel.

Used where a process frees and allocates the same large blocks over and over: the cache's cold-pass DataLoader workers
(below) and, through :class:`~lightning_accel.perf.callbacks.HostMemoryManager`, training processes on the CPU, whose
every step frees and allocates its activations and gradients again (~4-9k page faults per step of the end-to-end CPU
job's model in fp32 under glibc's defaults).

Why: LMDB builds each write transaction's pages in ``malloc``'d memory (a 150 KB entry is one 150 KB block) and frees
them at commit. Under glibc's defaults the heap top that a commit frees (9.6 MB for a batch of 64 entries at 224 px)
is above the trim threshold, so it goes back to the kernel, and the next transaction takes ~2,350 zero-filled page
faults to get it again: on ext4 a put cost 125 us per entry against 50 us with the freed memory kept (best of 3,
``benchmarks/data_cache.py`` has the cold rows it changes). Raising ``M_TRIM_THRESHOLD`` keeps up to that many freed
bytes in the process; fixing ``M_MMAP_THRESHOLD`` at glibc's own dynamic ceiling (32 MiB on 64-bit) keeps such blocks
on the heap, where they are reused, as glibc's dynamic threshold does anyway once a block of that size was freed.

The cost is memory: a process keeps up to ``trim_bytes`` of freed heap instead of returning it. So the cache applies
it only where it writes from a DataLoader worker (short-lived: the cold pass's workers stop when the cache is warm);
a training process gets it only when the user asks (``HostMemoryManager``). Not glibc (musl, macOS): nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable

__all__ = ["MMAP_THRESHOLD", "TRIM_BYTES", "can_keep_freed_memory", "keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_BYTES = 64 << 20

_lock = threading.Lock()
# (pid, trim bytes) of the last setting applied: a forked child applies it again (its parent's may not have been), and
# a later call asking to keep more raises it (never lowers it: the first caller's blocks would be handed back)
_applied: tuple[int, int] | None = None


def keep_freed_memory(trim_bytes: int = TRIM_BYTES) -> bool:
    """Keep up to ``trim_bytes`` of freed heap memory in this process (see the module notes); a later call with more
    raises it, one with less leaves it.

    Returns True when glibc accepted it (now or earlier in this process), False where there is no glibc ``mallopt``.
    """
    global _applied
    pid = os.getpid()
    with _lock:
        if _applied is not None and _applied[0] == pid and _applied[1] >= trim_bytes:
            return True
        mallopt = _mallopt()
        if mallopt is None:
            return False
        ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, int(trim_bytes)))
        if ok:
            _applied = (pid, int(trim_bytes))
        return ok


def can_keep_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` can act in this process (its C library is glibc), without applying it."""
    return _mallopt() is not None


@functools.cache  # looked up once: without glibc, every cache-writing batch would otherwise load libc again
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``int mallopt(int, int)``, or None (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
        # `gnu_get_libc_version` only exists in glibc: another libc's `mallopt` may take other parameter numbers
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn
