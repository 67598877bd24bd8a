"""GPU utilisation and memory through NVML (``nvidia-ml-py``, optional: ``pip install nvidia-ml-py``).

NVML's utilisation is the fraction of the last sample period (1/6 s to 1 s, driver dependent) in which a kernel ran;
it says whether the GPU was busy, not how well it was used (that is MFU). One query costs tens of microseconds, so
the monitor samples only when it logs.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from lightning_accel._utils.imports import module_available

__all__ = ["NvmlSampler", "nvml_available"]


def nvml_available() -> bool:
    """True when the ``pynvml`` module (from ``nvidia-ml-py``) can be imported."""
    return module_available("pynvml")


class NvmlSampler:
    """Reads utilisation and memory of one GPU by index; every call is a no-op returning ``{}`` when NVML is absent.

    Args:
        index: the NVML device index (the CUDA device's index unless ``CUDA_VISIBLE_DEVICES`` reorders them;
            the adapter maps it through the device's PCI bus id when it can).
        nvml: the ``pynvml`` module, injectable for tests (imported lazily otherwise).
    """

    def __init__(self, index: int = 0, nvml: Any = None) -> None:
        self.index = index
        self._nvml = nvml
        self._handle: Any = None
        self.error: str | None = None

    def _ensure(self) -> bool:
        if self._handle is not None:
            return True
        if self.error is not None:
            return False
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
            self._nvml.nvmlInit()
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as e:  # missing package, no driver, bad index: report once, then stay quiet
            self.error = f"{type(e).__name__}: {e}"
            return False
        return True

    def sample(self) -> dict[str, float]:
        """``{"gpu_util": %, "mem_util": %, "mem_used_gb": GB}``, or ``{}`` when NVML is unavailable."""
        if not self._ensure():
            return {}
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            self._handle = None
            return {}
        return {"gpu_util": float(util.gpu), "mem_util": float(util.memory), "mem_used_gb": mem.used / 1e9}

    def close(self) -> None:
        """Shut NVML down if this sampler started it."""
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._handle = None
