"""HostMemoryManager: glibc keeps freed host memory in every training process (each rank's), checked arguments."""

from __future__ import annotations

import os
import platform
import resource
from typing import Any

import pytest

from lightning_accel.callbacks import HostMemoryManager
from tests.helpers import run_in_processes

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize(
    ("value", "err"),
    [("1MiB", ValueError), (16 << 20, ValueError), ("lots", ValueError), (True, TypeError), (2.5e9, TypeError)],
)
def test_bad_keep_freed_bytes_is_named_in_init(value: Any, err: type[Exception]) -> None:
    with pytest.raises(err, match=r"`keep_freed_bytes`.*32MiB"):
        HostMemoryManager(value)


def test_sizes_are_parsed() -> None:
    assert HostMemoryManager().keep_freed_bytes == 256 << 20
    assert HostMemoryManager("1GiB").keep_freed_bytes == 1 << 30
    assert HostMemoryManager(64 << 20).keep_freed_bytes == 64 << 20


def _fit(rank: int, world_size: int, root: str, fake: bool) -> dict[str, Any]:
    import torch

    from lightning_accel._utils import malloc as m
    from lightning_accel.callbacks import HostMemoryManager
    from tests.tiny import TimedModule, loaders, trainer

    m._applied = None  # a forked process starts from its parent's record; this one applies its own
    if fake:  # as where the C library is not glibc: no mallopt to call
        m._mallopt = lambda: None
    torch.manual_seed(0)
    cb = HostMemoryManager("64MiB")
    fit = trainer(
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        max_steps=4,
        default_root_dir=root,
        callbacks=[cb],
    )
    train, _ = loaders(None, 0.0)
    fit.fit(TimedModule(), train)
    return {"applied": cb.applied, "record": m._applied, "pid": os.getpid()}


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
def test_every_rank_keeps_freed_memory_in_its_own_process(tmp_path) -> None:
    a, b = run_in_processes(_fit, 2, (str(tmp_path), False), init_process_group=False)
    for r in (a, b):
        assert r["applied"] is True
        assert r["record"] == (r["pid"], 64 << 20)  # applied in that rank's process, at the callback's size
    assert a["pid"] != b["pid"]


def test_without_glibc_the_fit_runs_and_says_nothing_changed(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    (r,) = run_in_processes(_fit, 1, (str(tmp_path), True), init_process_group=False)
    assert r["applied"] is False and r["record"] is None


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
def test_kept_memory_stops_training_steps_from_faulting_their_memory_in_again() -> None:
    # What the callback is for, counted in page faults (not timed): training steps of a small ResNet on the CPU in a
    # fresh process, under glibc's defaults and then with the setting
    (faults,) = run_in_processes(_faults_per_step, 1, (), init_process_group=False)
    default, kept = faults
    assert default > 500 and kept * 10 < default, faults


def _faults_per_step(rank: int, world_size: int) -> tuple[float, float]:
    import torch

    from lightning_accel._utils import malloc as m
    from lightning_accel.models import SmallResNet

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = SmallResNet(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))

    def steps(n: int) -> float:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n

    steps(3)
    default = steps(10)
    m._applied = None
    assert m.keep_freed_memory(256 << 20)
    steps(3)
    return default, steps(10)
