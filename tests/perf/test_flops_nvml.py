"""FLOP counting of one step and the NVML sampler (with a fake pynvml module)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_accel.perf import NvmlSampler, StepFlopCounter, precision_dtype


def test_flop_counter_counts_one_linear_step() -> None:
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    fc = StepFlopCounter()
    assert fc.stop() is None  # stop without start is harmless
    fc.start()
    assert fc.active
    lin(x).sum().backward()
    flops = fc.stop()
    # forward 2*B*I*O, backward: grad wrt weight 2*B*I*O (input does not require grad)
    assert flops == 2 * 16 * 64 * 32 * 2
    assert not fc.active and fc.stop() == flops
    lin(x)  # counting has stopped: no dispatch mode left behind
    assert fc.flops == flops


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16), ("32-true", torch.float32), (None, torch.float32)],
)
def test_precision_dtype(precision: str | None, dtype: torch.dtype) -> None:
    assert precision_dtype(precision) is dtype


class FakeNvml:
    """A ``pynvml`` stand-in for a machine with ``len(gpus)`` GPUs, each ``(uuid, pci_bus_id, gpu_util)`` in NVML's
    order; it counts starts and shutdowns, and can fail its start, its shutdown or a read (lookups of unknown GPUs
    fail as NVML's do)."""

    def __init__(
        self,
        fail_init: bool = False,
        gpus: list[tuple[str, str, int]] | None = None,
        fail_shutdown: bool = False,
        fail_read: bool = False,
    ) -> None:
        self.fail_init = fail_init
        self.fail_shutdown = fail_shutdown
        self.fail_read = fail_read
        self.gpus = gpus or [(f"GPU-{i}000", f"00000000:{0x10 + i:02X}:00.0", 82) for i in range(2)]
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < len(self.gpus):
            raise RuntimeError("Invalid Argument")
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i, g in enumerate(self.gpus):
            if g[0] == uuid:
                return i
        raise RuntimeError("Not Found")

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> int:
        for i, g in enumerate(self.gpus):
            if g[1] == bus_id:
                return i
        raise RuntimeError("Not Found")

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if self.fail_read:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=self.gpus[h][2], memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=3_000_000_000, total=80_000_000_000)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        if self.fail_shutdown:
            raise RuntimeError("Uninitialized")


def test_nvml_sampler_reads_utilisation() -> None:
    fake = FakeNvml()
    s = NvmlSampler(1, nvml=fake)
    assert s.sample() == {"gpu_util": 82.0, "mem_util": 40.0, "mem_used_gb": 3.0}
    s.close()
    assert fake.shutdowns == 1


def test_nvml_sampler_without_driver_is_quiet() -> None:
    fake = FakeNvml(fail_init=True)
    s = NvmlSampler(0, nvml=fake)
    assert s.sample() == {} and "NVML Shared Library" in (s.error or "")
    assert s.sample() == {}  # no retry storm
    s.close()
    s.close()
    assert fake.shutdowns == 0  # NVML never started: nothing to shut down


# a machine with four GPUs; the job sees NVML's GPUs 2 and 3 (`CUDA_VISIBLE_DEVICES=2,3`, or their UUIDs)
_GPUS = [
    ("GPU-aaaa0000-0000-0000-0000-000000000000", "00000000:17:00.0", 10),
    ("GPU-bbbb0000-0000-0000-0000-000000000000", "00000000:31:00.0", 20),
    ("GPU-cccc0000-0000-0000-0000-000000000000", "00000000:B1:00.0", 30),
    ("GPU-dddd0000-0000-0000-0000-000000000000", "00000000:CA:00.0", 40),
]


def _torch_props(nvml_index: int, *, uuid: bool = True, pci: bool = True) -> SimpleNamespace:
    """What ``torch.cuda.get_device_properties`` reports for NVML's GPU ``nvml_index``: the UUID without NVML's
    ``GPU-`` prefix, the PCI location as integers."""
    bus = int(_GPUS[nvml_index][1].split(":")[1], 16)
    return SimpleNamespace(
        uuid=_GPUS[nvml_index][0].removeprefix("GPU-") if uuid else "00000000-0000-0000-0000-000000000000",
        pci_domain_id=0,
        pci_bus_id=bus if pci else 0,
        pci_device_id=0,
    )


@pytest.mark.parametrize(
    ("visible", "order"),
    [
        ("2,3", [2, 3]),  # torch's cuda:0 is NVML's 2
        (f"{_GPUS[3][0]},{_GPUS[2][0]}", [3, 2]),  # UUIDs: no index arithmetic can map these
        ("", [1, 0, 2, 3]),  # CUDA_DEVICE_ORDER=FASTEST_FIRST put NVML's GPU 1 first
    ],
)
def test_nvml_sampler_for_device_reads_torchs_gpu_not_the_same_index(
    monkeypatch: pytest.MonkeyPatch, visible: str, order: list[int]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _torch_props(order[i]))
    for torch_index, nvml_index in enumerate(order[:2]):
        fake = FakeNvml(gpus=_GPUS)
        s = NvmlSampler.for_device(torch.device("cuda", torch_index), nvml=fake)
        assert s.sample()["gpu_util"] == _GPUS[nvml_index][2]
        assert s.found_by == "uuid" and s.note is None
        s.close()
        assert fake.shutdowns == fake.inits == 1


def test_nvml_sampler_for_device_falls_back_to_the_pci_bus_id_then_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    # a MIG instance's UUID is not a GPU's: the PCI bus id still finds the GPU it lives on
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _torch_props(3, uuid=False))
    s = NvmlSampler.for_device(torch.device("cuda", 1), nvml=FakeNvml(gpus=_GPUS))
    assert s.sample()["gpu_util"] == 40 and s.found_by == "pci_bus_id" and s.note is None

    # neither is known to torch: the index through CUDA_VISIBLE_DEVICES, and one line that says so
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _torch_props(3, uuid=False, pci=False))
    s = NvmlSampler.for_device(torch.device("cuda", 1), nvml=FakeNvml(gpus=_GPUS))
    assert s.sample()["gpu_util"] == 40 and s.found_by == "index"
    assert s.note is not None and "\n" not in s.note
    assert "cuda:1" in s.note and "index 3" in s.note and "CUDA_VISIBLE_DEVICES" in s.note

    # torch names a GPU that NVML does not know: read by index, and the note names what was not found
    s = NvmlSampler(0, nvml=FakeNvml(gpus=_GPUS), uuid="eeee0000-0000-0000-0000-000000000000")
    assert s.sample()["gpu_util"] == 10 and s.found_by == "index"
    assert s.note is not None and "GPU-eeee0000" in s.note and "NVML index 0" in s.note


def test_nvml_sampler_close_answers_every_start_once_and_never_raises() -> None:
    # NVML started, then the GPU lookup failed: the start is still answered by one shutdown
    fake = FakeNvml(gpus=_GPUS)
    s = NvmlSampler(7, nvml=fake)
    assert s.sample() == {} and "Invalid Argument" in (s.error or "")
    s.close()
    s.close()
    assert (fake.inits, fake.shutdowns) == (1, 1)

    # NVML started and found the GPU, then a read failed (a GPU that fell off the bus): still one shutdown
    fake = FakeNvml(gpus=_GPUS, fail_read=True)
    s = NvmlSampler(0, nvml=fake)
    assert s.sample() == {} and "GPU is lost" in (s.error or "")
    s.close()
    assert (fake.inits, fake.shutdowns) == (1, 1)

    # a shutdown that raises is swallowed, once; a closed sampler does not start NVML again
    fake = FakeNvml(gpus=_GPUS, fail_shutdown=True)
    s = NvmlSampler(0, nvml=fake)
    assert s.sample()
    s.close()
    s.close()
    assert (fake.inits, fake.shutdowns) == (1, 1)
    assert s.sample() == {} and fake.inits == 1

    # closed before it ever started: nothing to shut down, and it stays closed
    fake = FakeNvml(gpus=_GPUS)
    s = NvmlSampler(0, nvml=fake)
    s.close()
    assert s.sample() == {} and (fake.inits, fake.shutdowns) == (0, 0)


@pytest.mark.parametrize("torch_reports", ["uuid", "pci_bus_id", "neither"])
def test_monitor_samples_the_gpu_it_trains_on(monkeypatch: pytest.MonkeyPatch, torch_reports: str) -> None:
    """With `CUDA_VISIBLE_DEVICES` listing UUIDs, the monitor read NVML's GPU 1 for cuda:1 (another job's GPU)."""
    import sys

    from lightning_accel.callbacks import PerformanceMonitor
    from lightning_accel.perf import HostClock, callbacks

    fake = FakeNvml(gpus=_GPUS)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(callbacks, "nvml_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{_GPUS[2][0]},{_GPUS[3][0]}")
    uuid, pci = torch_reports == "uuid", torch_reports == "pci_bus_id"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _torch_props(2 + i, uuid=uuid, pci=pci))
    warned: list[str] = []
    monkeypatch.setattr(callbacks, "rank_zero_warn", lambda msg, *a, **k: warned.append(str(msg)))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 1)),
        log_every_n_steps=5,
        save_checkpoint=lambda *a, **k: None,
    )
    mon = PerformanceMonitor(report_path="", verbose=False, clock=HostClock())
    mon.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert mon._sampler is not None
    if torch_reports == "neither":
        # nothing to match by: the index it falls back to is said before training, in one line
        assert len(warned) == 1 and "\n" not in warned[0]
        assert warned[0].startswith("PerformanceMonitor: NVML's GPU for cuda:1 is chosen by index 1")
    else:
        assert mon._sampler.sample()["gpu_util"] == 40  # NVML's GPU 3 is torch's cuda:1
        assert mon._sampler.found_by == torch_reports and warned == []
    mon.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert mon._sampler is None and fake.inits == fake.shutdowns == 1
