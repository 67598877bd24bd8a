"""A plain Lightning ``ModelCheckpoint`` with ``DeltaCheckpointIO(async_save=True)`` under DDP (2 CPU processes,
gloo): an async save that fails on rank 0 stops every rank with the same error when ``CheckpointGuard`` is there,
none left waiting in a collective; without it the combination is warned at the first save, naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit_with_a_full_disk(rank: int, world_size: int, root: str, guard: bool, full_from: int) -> str:
    import errno
    import warnings
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import CheckpointGuard, DeltaCheckpointIO
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    io = DeltaCheckpointIO(async_save=True)  # on_save_error="raise"
    real = io.store.save

    def save(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if checkpoint["global_step"] >= full_from:  # the disk is full from this step's saves on
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(checkpoint, *args, **kwargs)

    io.store.save = save  # type: ignore[method-assign]
    ckpt = ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    callbacks: list[Any] = [ckpt, CheckpointGuard()] if guard else [ckpt]
    # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
    strategy = DDPStrategy(timeout=timedelta(seconds=20))
    t = ckpt_trainer(
        root, [io], callbacks, strategy=strategy, devices=world_size, max_steps=8, use_distributed_sampler=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.fit(CheckpointModel(), tiny_loader(256))
            outcome = "no error"
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            outcome = f"{type(e).__name__}: {e}"
    warned = [str(w.message) for w in caught if "DeltaModelCheckpoint" in str(w.message)]
    return f"{outcome} | warned: {warned}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("full_from", [3, 8], ids=["mid-fit", "last-step"])
def test_checkpoint_guard_raises_a_plain_model_checkpoints_failed_async_save_on_every_rank(
    tmp_path: Path, full_from: int
) -> None:
    """``full_from=8``: the last step's saves fail (no later save reports it): the end of training reports it on
    every rank, not ``teardown`` on rank 0 alone."""
    results = run_in_processes(
        _fit_with_a_full_disk, 2, (str(tmp_path), True, full_from), init_process_group=False, timeout=240
    )
    assert results[0].startswith("CheckpointSaveError") and "No space left on device" in results[0], results
    assert results[1].startswith("CheckpointSaveError") and "No space left on device" in results[1], results
    assert "on global rank 0" in results[1], results
    assert "warned: []" in results[0], results  # routed: nothing to warn about


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_model_checkpoint_without_the_guard_is_warned_on_rank_zero(tmp_path: Path) -> None:
    results = run_in_processes(
        _fit_with_a_full_disk, 2, (str(tmp_path), False, 3), init_process_group=False, timeout=240
    )
    assert "CheckpointGuard" in results[0] and "DeltaModelCheckpoint" in results[0], results
    assert "warned: []" in results[1], results  # rank 1 saves nothing: nothing to warn about there
