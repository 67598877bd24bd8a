"""PerformanceMonitor under 2-process DDP (gloo): comm from DDP's own timers, totals reduced over ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_accel.callbacks import PerformanceMonitor
    from tests.tiny import TimedModule, loaders

    torch.manual_seed(0)
    mon = PerformanceMonitor(log_every_n_steps=5, report_path="", verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=12,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[mon],
    )
    train, _ = loaders(None, 0.0)
    trainer.fit(TimedModule(), train)
    r = mon.report
    assert r is not None
    return {
        "seconds": r.seconds,
        "steps": r.steps,
        "extras": r.extras,
        "samples_per_s": r.samples_per_s,
        "step_time_s": r.step_time_s,
    }


def test_ddp_two_ranks_agree_and_comm_is_sourced(tmp_path) -> None:
    a, b = run_in_processes(_fit, 2, (str(tmp_path),), init_process_group=False)
    assert a["seconds"] == b["seconds"]  # the report is the mean over ranks, identical everywhere
    assert a["steps"] == 10
    assert a["extras"]["comm_source"].startswith("DDP runtime stats")
    assert a["extras"]["world_size"] == 2
    assert a["seconds"]["comm"] > 0.0 and a["seconds"]["compute"] > 0.0  # gloo allreduce is never free
    # the job's throughput: each rank reads its own batch of 4, so a step trains on 2 x 4 samples
    assert a["samples_per_s"] * a["step_time_s"] == pytest.approx(8)
