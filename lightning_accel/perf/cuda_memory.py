"""PyTorch's CUDA caching allocator as the memory pool: settings, fragmentation, safe releases, OOM snapshots.

The caching allocator already is a pre-allocating, splitting pool. Its knobs map to the classic memory-pool design:

* ``max_split_size_mb``: blocks larger than this are never split, so big requests (the 256 MB threshold) get whole
  segments from ``cudaMalloc`` and cannot fragment the pool of small blocks;
* ``expandable_segments``: segments grow in place (virtual memory mapping) instead of leaving holes; the modern fix
  for fragmentation with changing shapes;
* ``garbage_collection_threshold``: when reserved memory passes this fraction of the device, unused cached blocks
  are returned before a ``cudaMalloc`` retry (a proactive defragmentation).

Settings are read by the allocator when it initialises; :func:`apply_allocator_settings` writes them to the
environment (``PYTORCH_ALLOC_CONF``) and to the allocator's runtime setter. If CUDA is already initialised, the runtime
setter only affects segments reserved from then on, and the result says so.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_accel._utils.checks import check_bool, check_int, check_number
from lightning_accel._utils.errors import one_line

__all__ = [
    "AllocatorSettings",
    "AppliedSettings",
    "FragmentationStats",
    "apply_allocator_settings",
    "dump_memory_snapshot",
    "fragmentation_stats",
    "host_memory_stats",
    "merge_alloc_conf",
    "parse_alloc_conf",
    "should_release",
]

# torch >= 2.9 reads PYTORCH_ALLOC_CONF and still honours the CUDA-specific name; we write both so older and newer
# torch see the same setting.
ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator knobs this project sets (None: leave PyTorch's default).

    Args:
        expandable_segments: grow segments in place instead of allocating new ones.
        max_split_size_mb: blocks above this size are never split (>= 20 MB; 256 is a common choice).
        garbage_collection_threshold: fraction in (0, 1) of device memory above which cached blocks are reclaimed.
    """

    expandable_segments: bool | None = True
    max_split_size_mb: int | None = 256
    garbage_collection_threshold: float | None = 0.8

    def __post_init__(self) -> None:
        if self.expandable_segments is not None:
            # a YAML `"false"` is a non-empty string, which `as_dict` would read as True: refuse it here
            check_bool("expandable_segments", self.expandable_segments, fix="Use True, False or None (leave as is).")
        check_int(
            "max_split_size_mb",
            self.max_split_size_mb,
            low=20,
            allow_none=True,
            fix="20 is PyTorch's minimum; use 256 to send requests above 256 MB straight to cudaMalloc.",
        )
        check_number(
            "garbage_collection_threshold",
            self.garbage_collection_threshold,
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            allow_none=True,
            fix="E.g. 0.8 (a fraction of device memory).",
        )

    def as_dict(self) -> dict[str, str]:
        """``{key: value}`` in the allocator's string syntax, only for the knobs that are set."""
        out: dict[str, str] = {}
        if self.expandable_segments is not None:
            out["expandable_segments"] = "True" if self.expandable_segments else "False"
        if self.max_split_size_mb is not None:
            out["max_split_size_mb"] = str(int(self.max_split_size_mb))
        if self.garbage_collection_threshold is not None:
            out["garbage_collection_threshold"] = f"{float(self.garbage_collection_threshold):g}"
        return out


def parse_alloc_conf(conf: str) -> dict[str, str]:
    """``"a:1,b:2"`` -> ``{"a": "1", "b": "2"}`` (PyTorch's ``PYTORCH_ALLOC_CONF`` syntax)."""
    out: dict[str, str] = {}
    for part in conf.split(","):
        part = part.strip()
        if not part:
            continue
        k, sep, v = part.partition(":")
        if not sep:
            raise ValueError(
                f"allocator setting {part!r} in {conf!r} is not `key:value`; e.g. `max_split_size_mb:256`."
            )
        out[k.strip()] = v.strip()
    return out


def merge_alloc_conf(existing: str, ours: Mapping[str, str]) -> tuple[str, list[str]]:
    """Merge our settings into an existing conf string; returns the merged string and the keys we overrode."""
    merged = parse_alloc_conf(existing) if existing else {}
    overridden = [k for k, v in ours.items() if k in merged and merged[k] != v]
    merged.update(ours)
    return ",".join(f"{k}:{v}" for k, v in merged.items()), overridden


@dataclass
class AppliedSettings:
    """What :func:`apply_allocator_settings` did.

    Attributes:
        conf: the merged allocator string.
        env_set: True when written to the environment before CUDA initialised (takes full effect).
        runtime_set: True when the allocator's runtime setter accepted it.
        cuda_was_initialized: CUDA had already been initialised (the allocator existed).
        overridden: keys whose value in a pre-existing environment conf we replaced.
        messages: human-readable notes (what did not take effect and how to fix it).
    """

    conf: str
    env_set: bool = False
    runtime_set: bool = False
    cuda_was_initialized: bool = False
    overridden: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def _runtime_setter() -> Callable[[str], Any] | None:
    from lightning_accel._utils.compat import allocator_settings_setter  # imports torch: only when applying

    return allocator_settings_setter()


def apply_allocator_settings(
    settings: AllocatorSettings,
    *,
    environ: dict[str, str] | None = None,
    cuda_initialized: Callable[[], bool] | None = None,
    runtime_setter: Callable[[str], Any] | None = None,
) -> AppliedSettings:
    """Apply ``settings`` to the CUDA caching allocator, as early as possible.

    Before CUDA initialises: merge into ``PYTORCH_ALLOC_CONF`` (the allocator reads it when created) and call the
    runtime setter too. After: only the runtime setter, which affects segments reserved from now on; a message says
    that memory already reserved keeps its layout and how to get the full effect (set the variable before the
    process starts, or create the callback before anything touches CUDA).

    Args:
        settings: the knobs.
        environ: environment mapping to write (``os.environ`` by default; injectable for tests).
        cuda_initialized: ``() -> bool`` (``torch.cuda.is_initialized`` by default).
        runtime_setter: ``(conf) -> None`` (``torch._C._accelerator_setAllocatorSettings`` by default).
    """
    import torch

    env = os.environ if environ is None else environ
    is_init = (cuda_initialized or torch.cuda.is_initialized)()
    ours = settings.as_dict()
    source, existing = next(((n, env[n]) for n in ENV_NAMES if env.get(n)), ("", ""))
    try:
        conf, overridden = merge_alloc_conf(existing, ours)
    except ValueError as e:
        # the string is the user's environment, not an argument: say which variable, or the error points nowhere
        raise ValueError(
            f"`{source}` in the environment is {existing!r}, which is not the allocator's `key:value,key:value` "
            f"syntax ({e}) Fix it (e.g. `{source}=expandable_segments:True`) or unset it."
        ) from None
    res = AppliedSettings(conf=conf, cuda_was_initialized=is_init, overridden=overridden)
    if overridden:
        res.messages.append(
            f"replaced {', '.join(overridden)} from the environment's allocator conf {existing!r} with this "
            "callback's values; pass None for a knob to keep the environment's value."
        )
    if not ours:
        return res
    if not is_init:
        for n in ENV_NAMES:
            env[n] = conf
        res.env_set = True
    setter = runtime_setter if runtime_setter is not None else _runtime_setter()
    if setter is not None:
        try:
            setter(conf)
            res.runtime_set = True
        except Exception as e:  # an older torch that rejects a key: say which and keep going
            res.messages.append(f"the allocator rejected {conf!r} at runtime ({type(e).__name__}: {one_line(e)}).")
    if is_init:
        res.messages.append(
            f"CUDA was already initialised, so {conf!r} only applies to memory reserved from now on "
            f"({'applied through the runtime setter' if res.runtime_set else 'and the runtime setter failed'}); "
            "memory already reserved keeps its layout. For the full effect set "
            f"`PYTORCH_ALLOC_CONF={conf}` before starting Python, or create CudaMemoryManager before any CUDA call."
        )
    return res


@dataclass(frozen=True)
class FragmentationStats:
    """Allocator health from ``torch.cuda.memory_stats()``.

    Attributes:
        allocated: bytes in live tensors.
        reserved: bytes the allocator holds from the driver.
        fragmentation: ``1 - allocated / reserved`` (0 when nothing is reserved): cached but unused.
        inactive_split: bytes in split blocks that are free but cannot serve larger requests (true fragmentation).
        alloc_retries: ``cudaMalloc`` failures that forced a cache flush and retry (each costs a device sync).
        ooms: out-of-memory errors raised so far.
    """

    allocated: int
    reserved: int
    fragmentation: float
    inactive_split: int
    alloc_retries: int
    ooms: int

    def as_metrics(self, prefix: str = "mem/") -> dict[str, float]:
        """Flat metrics in GB and fractions, for a logger."""
        return {
            f"{prefix}allocated_gb": self.allocated / 1e9,
            f"{prefix}reserved_gb": self.reserved / 1e9,
            f"{prefix}fragmentation": self.fragmentation,
            f"{prefix}inactive_split_gb": self.inactive_split / 1e9,
            f"{prefix}alloc_retries": float(self.alloc_retries),
            f"{prefix}ooms": float(self.ooms),
        }


def fragmentation_stats(stats: Mapping[str, Any]) -> FragmentationStats:
    """Summarise a ``torch.cuda.memory_stats()`` dict (missing keys count as 0)."""
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    return FragmentationStats(
        allocated=allocated,
        reserved=reserved,
        fragmentation=(1.0 - allocated / reserved) if reserved > 0 else 0.0,
        inactive_split=int(stats.get("inactive_split_bytes.all.current", 0)),
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        ooms=int(stats.get("num_ooms", 0)),
    )


def should_release(frag: FragmentationStats, *, threshold: float | None, min_reserved_bytes: int = 1 << 30) -> bool:
    """True when cached blocks are worth returning: fragmentation above ``threshold`` on a non-trivial pool.

    ``empty_cache`` costs a device sync and makes the next allocations hit ``cudaMalloc`` again, so it is only
    worth it when a large share of a large pool is idle (default: at least 1 GiB reserved).
    """
    if threshold is None:
        return False
    return frag.reserved >= min_reserved_bytes and frag.fragmentation > threshold


def dump_memory_snapshot(path: str | os.PathLike[str], snapshot: Callable[[], Any] | None = None) -> str:
    """Write the allocator's snapshot (``torch.cuda.memory._snapshot()``) as a pickle that
    https://pytorch.org/memory_viz opens (drag the file in), atomically. Returns the path.

    The file is produced by us and read by the viewer; this project never unpickles it.
    """
    from lightning_accel._utils.atomic import atomic_write_bytes

    if snapshot is None:
        from lightning_accel._utils.compat import cuda_memory_snapshot

        snapshot = cuda_memory_snapshot
    data = pickle.dumps(snapshot())
    atomic_write_bytes(path, data)
    return os.fspath(path)


def host_memory_stats() -> dict[str, float]:
    """This process's host memory in GB: ``mem/host_rss_gb`` (resident now, from ``/proc/self/statm`` on Linux) and
    ``mem/host_peak_rss_gb`` (the peak, from ``getrusage``); what a CPU run has instead of the CUDA pool.

    Empty where neither source exists (e.g. Windows).
    """
    out: dict[str, float] = {}
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        out["mem/host_rss_gb"] = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["mem/host_peak_rss_gb"] = peak / (2**30 if sys.platform == "darwin" else 2**20)
    except (ImportError, OSError, ValueError):
        pass
    return out
