"""An async save that fails on rank 0 under DDP (2 CPU processes, gloo): every rank stops with the save's error,
none is left waiting in a collective the failing rank never reaches, and the directory still loads its last complete
checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit_with_a_full_disk(rank: int, world_size: int, root: str, full_from: int) -> str:
    import errno
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import CheckpointGuard, DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    io = DeltaCheckpointIO(async_save=True)  # on_save_error="raise"
    real = io.store.save

    def save(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if checkpoint["global_step"] >= full_from:  # the disk is full from this step's saves on
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(checkpoint, *args, **kwargs)

    io.store.save = save  # type: ignore[method-assign]
    ckpt = DeltaModelCheckpoint(
        dirpath=f"{root}/ckpt", every_n_train_steps=1, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    callbacks: list[Any] = [ckpt, CheckpointGuard()]
    # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
    strategy = DDPStrategy(timeout=timedelta(seconds=60))
    t = ckpt_trainer(
        root, [io], callbacks, strategy=strategy, devices=world_size, max_steps=8, use_distributed_sampler=True
    )
    try:
        t.fit(CheckpointModel(), tiny_loader(256))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("full_from", [3, 8], ids=["mid-fit", "last-step"])
def test_a_failed_async_save_on_rank_zero_stops_every_rank_and_the_last_complete_checkpoint_loads(
    tmp_path: Path, full_from: int
) -> None:
    """``full_from=8``: the last step's saves fail (no later save reports it): the end of training reports it on
    every rank, not ``teardown`` on rank 0 alone."""
    from lightning_accel.checkpoint import read_checkpoint

    results = run_in_processes(
        _fit_with_a_full_disk, 2, (str(tmp_path), full_from), init_process_group=False, timeout=240
    )
    assert results[0].startswith("CheckpointSaveError") and "No space left on device" in results[0], results
    assert results[1].startswith("CheckpointSaveError") and "No space left on device" in results[1], results
    assert "on global rank 0" in results[1], results
    # the directory holds complete checkpoints of before the failure: the failed saves published nothing, and no
    # removal ran after them (`last.ckpt` may be older than the newest top-k one: a queued save of a path is replaced
    # by a newer save of it, here the one that failed)
    steps = {p.name: read_checkpoint(p)["global_step"] for p in (tmp_path / "ckpt").glob("*.ckpt")}
    assert "last.ckpt" in steps and len(steps) == 3, steps
    assert all(0 < step < full_from for step in steps.values()), steps
    assert steps[f"epoch=0-step={full_from - 1}.ckpt"] == full_from - 1, steps
