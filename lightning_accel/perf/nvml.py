"""GPU utilisation and memory through NVML (``nvidia-ml-py``, optional: ``pip install nvidia-ml-py``).

NVML's utilisation is the fraction of the last sample period (1/6 s to 1 s, driver dependent) in which a kernel ran;
it says whether the GPU was busy, not how well it was used (that is MFU). One query costs tens of microseconds, so
the monitor samples only when it logs, on the calling thread (the sampler starts no thread of its own).

Which GPU: NVML numbers every GPU of the machine in PCI bus order, while torch numbers only the GPUs that
``CUDA_VISIBLE_DEVICES`` leaves visible, in ``CUDA_DEVICE_ORDER`` (fastest first unless set to ``PCI_BUS_ID``): with
``CUDA_VISIBLE_DEVICES=2,3`` torch's ``cuda:0`` is NVML's GPU 2, and with ``CUDA_VISIBLE_DEVICES=GPU-<uuid>`` or on a
machine whose fastest GPU is not the first on the bus no index arithmetic finds it. :meth:`NvmlSampler.for_device`
therefore matches torch's device to NVML's by its UUID, then its PCI bus id, and uses an index only when neither
matches.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any

import torch

from lightning_accel._utils.errors import one_line
from lightning_accel._utils.imports import module_available

__all__ = ["NvmlSampler", "nvml_available"]

# what torch reports as the UUID of a device that has none (ROCm builds, some virtual GPUs)
_NO_UUID = "00000000-0000-0000-0000-000000000000"


def nvml_available() -> bool:
    """True when the ``pynvml`` module (from ``nvidia-ml-py``) can be imported."""
    return module_available("pynvml")


class NvmlSampler:
    """Reads utilisation and memory of one GPU; every call is a no-op returning ``{}`` when NVML is absent.

    The GPU is looked up, at the first :meth:`open` or :meth:`sample`, by ``uuid`` when given, else (or when NVML does
    not know that UUID) by ``pci_bus_id``, else by ``index``. When neither ``uuid`` nor ``pci_bus_id`` found it,
    :attr:`note` says so in one line: the index may name another GPU than torch's (see the module docstring). An NVML
    that cannot start (no package, no driver) or cannot find the GPU leaves the reason in :attr:`error` and the
    sampler returns ``{}`` from then on, without retrying.

    :meth:`close` shuts NVML down exactly once for each start of it, also when the GPU lookup failed after NVML
    started; it is idempotent, never raises, and a closed sampler stays closed (it returns ``{}``).

    Args:
        index: the NVML device index, used when neither ``uuid`` nor ``pci_bus_id`` is given or found.
        nvml: the ``pynvml`` module, injectable for tests (imported lazily otherwise).
        uuid: the GPU's UUID, as torch gives it (``str(torch.cuda.get_device_properties(i).uuid)``) or as NVML does
            (with its ``GPU-`` or ``MIG-`` prefix).
        pci_bus_id: the GPU's PCI bus id, ``"<domain>:<bus>:<device>.<function>"`` in hexadecimal
            (``"00000000:65:00.0"``).
    """

    def __init__(
        self, index: int = 0, nvml: Any = None, *, uuid: str | None = None, pci_bus_id: str | None = None
    ) -> None:
        self.index = index
        self.uuid = uuid
        self.pci_bus_id = pci_bus_id
        self._nvml = nvml
        self._handle: Any = None
        self._started = False  # nvmlInit succeeded and no nvmlShutdown answered it yet (NVML counts its starts)
        self._closed = False
        self.error: str | None = None
        self.note: str | None = None
        self.found_by: str | None = None  # "uuid", "pci_bus_id" or "index" once the GPU was found

    @classmethod
    def for_device(cls, device: torch.device | int, nvml: Any = None) -> NvmlSampler:
        """A sampler of the GPU torch calls ``device`` (``cuda:1`` or ``1``; the current device when it has no index),
        matched by the UUID and the PCI bus id torch reports for it.

        The index fallback maps torch's index through ``CUDA_VISIBLE_DEVICES`` when that lists integers. When torch
        reports neither a UUID nor a PCI bus id (the properties cannot be read, a ROCm build), :attr:`note` says so.
        """
        if isinstance(device, int):
            idx = device
        elif device.index is not None:
            idx = device.index
        else:
            idx = torch.cuda.current_device()
        uuid = pci = None
        try:
            props: Any = torch.cuda.get_device_properties(idx)
        except Exception as e:  # no CUDA in this process after all, an index out of range: the index is all there is
            props, reason = None, one_line(e, expected=(RuntimeError,))
        else:
            reason = "torch reports neither a UUID nor a PCI bus id for it"
        if props is not None:
            raw = getattr(props, "uuid", None)
            text = str(raw).strip() if raw is not None else ""
            uuid = text if text and text.lower().removeprefix("gpu-") != _NO_UUID else None
            parts = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
            # (0, 0, 0) is what a build without PCI information reports; no real GPU sits at bus 0, device 0
            if all(isinstance(p, int) for p in parts) and any(parts):
                pci = f"{parts[0]:08X}:{parts[1]:02X}:{parts[2]:02X}.0"
        sampler = cls(_visible_index(idx), nvml, uuid=uuid, pci_bus_id=pci)
        if uuid is None and pci is None:
            sampler.note = (
                f"NVML's GPU for cuda:{idx} is chosen by index {sampler.index} ({reason}): if CUDA_VISIBLE_DEVICES or "
                "CUDA_DEVICE_ORDER renumbers the GPUs, the utilisation and memory read are another GPU's."
            )
        return sampler

    def open(self) -> bool:
        """Start NVML and find the GPU (once); False when that failed (the reason is in :attr:`error`)."""
        if self._handle is not None:
            return True
        if self.error is not None or self._closed:
            return False
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
            self._nvml.nvmlInit()
            self._started = True
            self._handle = self._find()
        except Exception as e:  # missing package, no driver, bad index: report once, then stay quiet
            self.error = f"{type(e).__name__}: {e}"
            return False
        return True

    def _find(self) -> Any:
        """The handle of the GPU: by UUID, then PCI bus id, then index (:attr:`note` says why it came to the index)."""
        nvml = self._nvml
        missed: list[str] = []
        if self.uuid:
            uuid = self.uuid if self.uuid.upper().startswith(("GPU-", "MIG-")) else f"GPU-{self.uuid}"
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            except Exception as e:
                missed.append(f"UUID {uuid} ({one_line(e, expected=(RuntimeError,))})")
            else:
                self.found_by = "uuid"
                return handle
        if self.pci_bus_id:
            try:
                handle = nvml.nvmlDeviceGetHandleByPciBusId(self.pci_bus_id)
            except Exception as e:
                missed.append(f"PCI bus id {self.pci_bus_id} ({one_line(e, expected=(RuntimeError,))})")
            else:
                self.found_by = "pci_bus_id"
                return handle
        handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
        self.found_by = "index"
        if missed:
            self.note = (
                f"NVML found no GPU by {' nor by '.join(missed)}, so it reads the GPU at NVML index {self.index}, "
                "which may be another GPU than the one training."
            )
        return handle

    def sample(self) -> dict[str, float]:
        """``{"gpu_util": %, "mem_util": %, "mem_used_gb": GB}``, or ``{}`` when NVML is unavailable."""
        if not self.open():
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
        """Shut NVML down if this sampler started it (also when finding the GPU or a later read failed); idempotent,
        and never raises (an NVML that fails to shut down is left as it is)."""
        self._closed = True
        self._handle = None
        if self._started:
            self._started = False
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


def _visible_index(idx: int) -> int:
    """Torch's device index mapped through ``CUDA_VISIBLE_DEVICES`` when that lists integers (``2,3``: 0 -> 2); the
    index itself otherwise (unset, or UUIDs, which only :meth:`NvmlSampler.for_device`'s UUID match resolves)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts) and idx < len(parts):
        return int(parts[idx])
    return idx
