"""Lightning's ``AsyncCheckpointIO`` around a synchronous ``DeltaCheckpointIO`` under DDP (2 CPU processes, gloo): a
save that fails in the wrapper's thread on rank 0 stops every rank with the same error when ``DeltaModelCheckpoint``
or ``CheckpointGuard`` is there, none left waiting in the barrier that follows the next save, and the directory
still loads its last complete checkpoint. The same for a synchronous ``DeltaCheckpointIO`` on its own, whose failed
save was raised on rank 0 inside ``trainer.save_checkpoint``, before the barrier that follows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit_with_a_full_disk(
    rank: int, world_size: int, root: str, callback: str, full_from: int, wrapped: bool = True
) -> str:
    import errno
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import CheckpointGuard, DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    inner = DeltaCheckpointIO()
    real = inner.store.save

    def save(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if checkpoint["global_step"] >= full_from:  # the disk is full from this step's saves on
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(checkpoint, *args, **kwargs)

    inner.store.save = save  # type: ignore[method-assign]
    kwargs: dict[str, Any] = {"every_n_train_steps": 1, "save_top_k": 2, "monitor": "step", "mode": "max"}
    if callback == "delta":
        callbacks: list[Any] = [DeltaModelCheckpoint(dirpath=f"{root}/ckpt", **kwargs)]
    else:
        callbacks = [ModelCheckpoint(dirpath=f"{root}/ckpt", **kwargs), CheckpointGuard()]
    # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
    strategy = DDPStrategy(timeout=timedelta(seconds=20))
    t = ckpt_trainer(
        root,
        [AsyncCheckpointIO(inner) if wrapped else inner],
        callbacks,
        strategy=strategy,
        devices=world_size,
        max_steps=8,
        use_distributed_sampler=True,
    )
    try:
        t.fit(CheckpointModel(), tiny_loader(256))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("callback", ["delta", "guard"])
@pytest.mark.parametrize("full_from", [3, 8], ids=["mid-fit", "last-step"])
def test_a_save_failed_in_async_checkpoint_io_stops_every_rank(tmp_path: Path, callback: str, full_from: int) -> None:
    """``full_from=8``: the last step's save fails (no later save reports it): the end of training reports it on
    every rank, not the wrapper's ``teardown`` on rank 0 alone."""
    from lightning_accel.checkpoint import read_checkpoint

    results = run_in_processes(
        _fit_with_a_full_disk, 2, (str(tmp_path), callback, full_from), init_process_group=False, timeout=240
    )
    for r in results:
        assert r.startswith("CheckpointSaveError") and "No space left on device" in r, results
    assert "on global rank 0" in results[1], results
    steps = {p.name: read_checkpoint(p)["global_step"] for p in (tmp_path / "ckpt").glob("*.ckpt")}
    assert steps and all(0 < step < full_from for step in steps.values()), steps


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("callback", ["delta", "guard"])
def test_a_failed_synchronous_save_on_rank_zero_stops_every_rank(tmp_path: Path, callback: str) -> None:
    """The same with a synchronous ``DeltaCheckpointIO``: its save raised on rank 0 inside ``trainer.save_checkpoint``,
    before the barrier the other ranks wait in."""
    from lightning_accel.checkpoint import read_checkpoint

    results = run_in_processes(
        _fit_with_a_full_disk, 2, (str(tmp_path), callback, 3, False), init_process_group=False, timeout=240
    )
    for r in results:
        assert "No space left on device" in r and "Connection closed" not in r, results
    assert results[1].startswith("CheckpointSaveError") and "on global rank 0" in results[1], results
    steps = {p.name: read_checkpoint(p)["global_step"] for p in (tmp_path / "ckpt").glob("*.ckpt")}
    assert steps and all(0 < step < 3 for step in steps.values()), steps
