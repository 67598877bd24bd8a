"""Lightning callbacks, one per file, each a thin wrapper over a functional core."""

from lightning_accel.callbacks.cuda_memory_manager import CudaMemoryManager
from lightning_accel.callbacks.performance_monitor import PerformanceMonitor

__all__ = ["CudaMemoryManager", "PerformanceMonitor"]
