"""The perf callbacks under 2-process DDP (gloo): every rank reaches the same collectives in the same order, in a fit
with validation every other epoch and a short last batch, ``validate`` / ``test`` alone, and a second fit."""

from __future__ import annotations

import os
from typing import Any

from tests.helpers import run_in_processes


def _record_collectives(strategy: Any, calls: list[str]) -> None:
    for name in ("reduce", "barrier", "broadcast", "all_gather", "reduce_boolean_decision"):
        original = getattr(strategy, name)

        def recorded(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(strategy, name, recorded)


def _symmetric_run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.loggers import CSVLogger

    from lightning_accel.callbacks import CudaMemoryManager, HostMemoryManager, PerformanceMonitor
    from tests.tiny import TimedModule, loaders

    class Model(TimedModule):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y))

    torch.manual_seed(0)
    mon = PerformanceMonitor(log_every_n_steps=2, verbose=False)
    callbacks = [mon, CudaMemoryManager(log_every_n_steps=2), HostMemoryManager()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, check_val_every_n_epoch=2,
        limit_train_batches=7, logger=CSVLogger(root), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
    )  # fmt: skip
    calls: list[str] = []
    _record_collectives(trainer.strategy, calls)
    # 32 samples per rank in batches of 5: 7 batches, the last one of 2
    train, val = loaders(None, 0.0, batch_size=5)
    model = Model()
    trainer.fit(model, train, val)
    first = mon.report
    trainer.validate(model, val)
    trainer.test(model, val)
    trainer.fit_loop.max_epochs = 5
    trainer.fit(model, train, val)
    second = mon.report
    assert first is not None and second is not None
    report = os.path.join(trainer.log_dir or "", "perf_report.json")
    return {
        "calls": calls,
        "first_epochs": [e["epoch"] for e in first.epochs],
        "second_epochs": [e["epoch"] for e in second.epochs],
        "report": os.path.exists(report) if rank == 0 else None,
    }


def test_every_rank_reaches_the_same_collectives_in_every_hook(tmp_path) -> None:
    a, b = run_in_processes(_symmetric_run, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    assert a["calls"] == b["calls"]
    assert a["calls"].count("reduce") >= 4  # the end of each fit reduces its totals and its epochs
    assert a["first_epochs"] == [0.0, 1.0, 2.0]
    assert a["second_epochs"] == [3.0, 4.0]
    assert a["report"] is True


def _with_test_step() -> type:
    import torch.nn.functional as F

    from tests.tiny import TimedModule

    class WithTest(TimedModule):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y))

    return WithTest


def _validate_only(rank: int, world_size: int, root: str) -> list[str]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_accel.callbacks import CudaMemoryManager, HostMemoryManager, PerformanceMonitor
    from tests.tiny import loaders

    with_test = _with_test_step()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=CSVLogger(root), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        callbacks=[PerformanceMonitor(verbose=False), CudaMemoryManager(), HostMemoryManager()],
    )  # fmt: skip
    calls: list[str] = []
    _record_collectives(trainer.strategy, calls)
    _, val = loaders(None, 0.0)
    trainer.validate(with_test(), val)
    trainer.test(with_test(), val)
    return calls


def test_validate_and_test_alone_reach_the_same_collectives_on_every_rank(tmp_path) -> None:
    a, b = run_in_processes(_validate_only, 2, (str(tmp_path),), init_process_group=False, timeout=180)
    assert a == b


def _one_rank_raises(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import datetime

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.callbacks import CudaMemoryManager, HostMemoryManager, PerformanceMonitor
    from tests.tiny import TimedModule, loaders

    class Stop(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_rank == 1 and batch_idx == 4:
                raise RuntimeError("stopped on rank 1")

    mon = PerformanceMonitor(log_every_n_steps=2, report_path=os.path.join(root, f"r{rank}.json"), verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=datetime.timedelta(seconds=30)), max_epochs=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=[mon, CudaMemoryManager(), HostMemoryManager(), Stop()],
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    try:
        trainer.fit(TimedModule(), train)
    except Exception as e:
        return {"error": type(e).__name__, "report": mon.report is not None}
    return {"error": None, "report": mon.report is not None}


def test_an_exception_on_one_rank_ends_the_fit_on_every_rank(tmp_path) -> None:
    a, b = run_in_processes(_one_rank_raises, 2, (str(tmp_path),), init_process_group=False, timeout=120)
    assert b["error"] == "RuntimeError" and b["report"]
    assert a["error"] is not None
