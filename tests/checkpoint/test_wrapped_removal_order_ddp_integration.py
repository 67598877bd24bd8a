"""Lightning's ``AsyncCheckpointIO`` around a synchronous ``DeltaCheckpointIO`` under DDP (2 CPU processes, gloo), with
the wrapper's thread behind the training: ``save_top_k`` rotates older checkpoints out while the newer saves are still
queued, and those saves then fail (a full disk). The removals wait for the saves queued before them and are dropped
after the failure, so the directory still loads its complete checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit_with_a_late_failure(rank: int, world_size: int, root: str) -> str:
    import errno
    import threading
    from datetime import timedelta

    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    second_saved = threading.Event()
    trained_on = threading.Event()
    inner = DeltaCheckpointIO()
    real = inner.store.save

    def save(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        step = checkpoint["global_step"]
        if step >= 3:  # the disk is full from step 3 on, found only once training has gone past step 4
            trained_on.wait(60)
            raise OSError(errno.ENOSPC, "No space left on device")
        out = real(checkpoint, *args, **kwargs)
        if step == 2:
            second_saved.set()
        return out

    inner.store.save = save  # type: ignore[method-assign]

    class Pace(Callback):
        """Rank 0: step 4's rotation (which removes step 2's checkpoint) only once that checkpoint is written; the
        failing saves run once training has gone past it."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if not trainer.is_global_zero:
                return
            if trainer.global_step == 4:
                second_saved.wait(60)
            if trainer.global_step >= 5:
                trained_on.set()

    ckpt = DeltaModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
    strategy = DDPStrategy(timeout=timedelta(seconds=20))
    t = ckpt_trainer(
        root,
        [AsyncCheckpointIO(inner)],
        [Pace(), ckpt],  # before the checkpoint callback: its hook runs first
        strategy=strategy,
        devices=world_size,
        max_steps=8,
        use_distributed_sampler=True,
    )
    try:
        t.fit(CheckpointModel(hidden=8), tiny_loader(256))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    finally:
        trained_on.set()
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_removals_wait_for_the_saves_queued_in_async_checkpoint_io(tmp_path: Path) -> None:
    from lightning_accel.checkpoint import read_checkpoint

    results = run_in_processes(_fit_with_a_late_failure, 2, (str(tmp_path),), init_process_group=False, timeout=180)
    for r in results:
        assert r.startswith("CheckpointSaveError") and "No space left on device" in r, results
    steps = sorted(read_checkpoint(p)["global_step"] for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert steps == [1, 2], steps  # nothing rotated out for the saves that failed
