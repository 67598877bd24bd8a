"""A synchronous ``DeltaCheckpointIO`` under DDP (2 CPU processes, gloo) whose write fails on global rank 0 alone: a
removal of an older top-k checkpoint that fails (a file that cannot be deleted), and a direct
``trainer.save_checkpoint`` after the fit that fails. Every rank raises, the others naming rank 0 and the file; none is
left waiting in the collective that follows (the process group's timeout is short, so a wait fails the test fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit_then_save(rank: int, world_size: int, root: str) -> tuple[str, str]:
    import errno
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    def fit(name: str, io: Any, max_steps: int) -> Any:
        ckpt = DeltaModelCheckpoint(
            dirpath=f"{root}/{name}", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max"
        )
        # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
        strategy = DDPStrategy(timeout=timedelta(seconds=15))
        t = ckpt_trainer(
            root, [io], [ckpt], strategy=strategy, devices=world_size, max_steps=max_steps, use_distributed_sampler=True
        )
        t.fit(CheckpointModel(), tiny_loader(64))
        return t

    # 1. the first removal of an older top-k checkpoint fails
    io = DeltaCheckpointIO()
    real_remove = io.store.remove

    def remove(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    io.store.remove = remove  # type: ignore[method-assign]
    try:
        fit("removal", io, max_steps=3)
        removal = "no error"
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        removal = f"{type(e).__name__}: {e}"
    io.store.remove = real_remove  # type: ignore[method-assign]

    # 2. a save after the fit, requested by the user, fails
    io = DeltaCheckpointIO()
    t = fit("direct", io, max_steps=1)
    return removal, failed_final_save(t, io, f"{root}/direct/final.ckpt")


def failed_final_save(t: Any, io: Any, path: str) -> str:
    """``t.save_checkpoint(path)`` (a save after the fit) with the ``DeltaCheckpointIO`` ``io``'s store refusing any
    ``final.ckpt``: what this rank raised (``"no error"`` when nothing)."""
    import errno

    real_save = io.store.save

    def save(checkpoint: dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("final.ckpt"):
            raise OSError(errno.EACCES, "Permission denied")
        return real_save(checkpoint, path, *args, **kwargs)

    io.store.save = save  # type: ignore[method-assign]
    try:
        t.save_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_failed_sync_removal_or_direct_save_on_rank_zero_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_in_processes(_fit_then_save, 2, (str(tmp_path),), init_process_group=False, timeout=180)
    (removal0, direct0), (removal1, direct1) = results
    # the removal: rank 0 raises its own failure, rank 1 one naming rank 0; the checkpoint stays on disk
    assert "Permission denied" in removal0 and "epoch=0-step=1.ckpt" in removal0, results
    assert "Permission denied" in removal1 and "epoch=0-step=1.ckpt" in removal1, results
    assert "global rank 0" in removal1 and "\n" not in removal1, results
    assert (tmp_path / "removal" / "epoch=0-step=1.ckpt").is_file()
    # the direct save: the same, and nothing was published under its name
    assert "Permission denied" in direct0 and "final.ckpt" in direct0, results
    assert "Permission denied" in direct1 and "final.ckpt" in direct1, results
    assert "global rank 0" in direct1 and "\n" not in direct1, results
    assert not (tmp_path / "direct" / "final.ckpt").exists()
