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
    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=82, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(used=3_000_000_000, total=80_000_000_000)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1


def test_nvml_sampler_reads_utilisation() -> None:
    fake = FakeNvml()
    s = NvmlSampler(1, nvml=fake)
    assert s.sample() == {"gpu_util": 82.0, "mem_util": 40.0, "mem_used_gb": 3.0}
    s.close()
    assert fake.shutdowns == 1


def test_nvml_sampler_without_driver_is_quiet() -> None:
    s = NvmlSampler(0, nvml=FakeNvml(fail_init=True))
    assert s.sample() == {} and "NVML Shared Library" in (s.error or "")
    assert s.sample() == {}  # no retry storm
    s.close()
