"""HostMemoryManager says what it set once per process and setting, on global rank 0 only: not at every stage."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from tests.helpers import run_in_processes


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "HostMemoryManager" in record.getMessage():
            self.lines.append(record.getMessage())


def _stages(rank: int, world_size: int, root: str, fake: bool) -> dict[str, Any]:
    import torch

    from lightning_accel._utils import malloc as m
    from lightning_accel.callbacks import HostMemoryManager
    from tests.tiny import TimedModule, loaders, trainer

    m._applied = None
    if fake:  # as where the C library is not glibc: no mallopt to call
        m._mallopt = lambda: None
    handler = _Lines()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    torch.manual_seed(0)
    train, val = loaders(None, 0.0)
    first = HostMemoryManager("64MiB")
    kw: dict[str, Any] = {"devices": world_size, "strategy": "ddp" if world_size > 1 else "auto"}
    fit = trainer(max_steps=2, default_root_dir=root, callbacks=[first], limit_val_batches=1, **kw)
    model = TimedModule()
    fit.fit(model, train)
    fit.validate(model, val)
    fit.validate(model, val)
    after_first = len(handler.lines)
    # a larger setting is a new line; the same one again in a new Trainer is not, nor a smaller one (glibc keeps the
    # larger: "keeps up to 32 MiB" would be wrong)
    for cb in (HostMemoryManager("128MiB"), HostMemoryManager("128MiB"), HostMemoryManager("32MiB")):
        trainer(max_steps=2, default_root_dir=root, callbacks=[cb], limit_val_batches=1, **kw).validate(model, val)
    return {"first": after_first, "all": len(handler.lines), "pid": os.getpid()}


@pytest.mark.parametrize("fake", [False, True])
def test_one_line_per_setting_across_stages(tmp_path, fake: bool) -> None:
    (r,) = run_in_processes(_stages, 1, (str(tmp_path), fake), init_process_group=False)
    assert r["first"] == 1
    assert r["all"] == (1 if fake else 2)  # without glibc nothing changes with the size: one line says so


def test_under_ddp_only_global_rank_zero_says_it(tmp_path) -> None:
    a, b = run_in_processes(_stages, 2, (str(tmp_path), False), init_process_group=False)
    assert (a["first"], a["all"]) == (1, 2)
    assert (b["first"], b["all"]) == (0, 0)
