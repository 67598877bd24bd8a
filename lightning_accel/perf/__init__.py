"""Measure before optimising: step-time attribution, FLOPs/MFU, NVML sampling, bottleneck reports, CUDA allocator.

The core (``timers``, ``flops``, ``nvml``, ``report``, ``cuda_memory``) is plain torch; the Lightning adapters,
:class:`PerformanceMonitor`, :class:`CudaMemoryManager` and :class:`HostMemoryManager` (over
``lightning_accel/_utils/malloc.py``), live in ``callbacks.py``.
"""

from lightning_accel.perf.callbacks import CudaMemoryManager, HostMemoryManager, PerformanceMonitor
from lightning_accel.perf.cuda_memory import (
    AllocatorSettings,
    AppliedSettings,
    FragmentationStats,
    apply_allocator_settings,
    dump_memory_snapshot,
    fragmentation_stats,
    host_memory_stats,
    should_release,
)
from lightning_accel.perf.flops import StepFlopCounter, precision_dtype
from lightning_accel.perf.nvml import NvmlSampler, nvml_available
from lightning_accel.perf.plot import epoch_breakdown_png, plot_available
from lightning_accel.perf.report import BottleneckReport, build_report, mfu, verdict_text
from lightning_accel.perf.timers import CATEGORIES, CudaEventClock, HostClock, StepTimer, TimerTotals

__all__ = [
    "CATEGORIES",
    "AllocatorSettings",
    "AppliedSettings",
    "BottleneckReport",
    "CudaMemoryManager",
    "CudaEventClock",
    "FragmentationStats",
    "HostMemoryManager",
    "HostClock",
    "NvmlSampler",
    "PerformanceMonitor",
    "StepFlopCounter",
    "StepTimer",
    "TimerTotals",
    "apply_allocator_settings",
    "build_report",
    "dump_memory_snapshot",
    "epoch_breakdown_png",
    "fragmentation_stats",
    "host_memory_stats",
    "mfu",
    "nvml_available",
    "plot_available",
    "precision_dtype",
    "should_release",
    "verdict_text",
]
