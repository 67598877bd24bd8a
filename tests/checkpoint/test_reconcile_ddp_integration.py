"""``DeltaModelCheckpoint``'s reconciliation of a resumed run's directory under DDP (2 CPU processes, gloo): it runs
on global rank zero only, so when it fails there (a store that cannot be listed) every rank raises before the first
step, none left waiting in the step's collectives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _resume_with_a_failing_listing(rank: int, world_size: int, root: str) -> str:
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    io = DeltaCheckpointIO()

    def untracked_manifests(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the store could not be listed")

    io.store.untracked_manifests = untracked_manifests  # type: ignore[method-assign]
    ckpt = DeltaModelCheckpoint(
        dirpath=f"{root}/ckpt", every_n_train_steps=1, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
    strategy = DDPStrategy(timeout=timedelta(seconds=20))
    t = ckpt_trainer(root, [io], [ckpt], strategy=strategy, devices=world_size, max_steps=6, max_epochs=None)
    try:
        t.fit(CheckpointModel(), tiny_loader(256), ckpt_path=f"{root}/ckpt/last.ckpt")
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reconciliation_failing_on_rank_zero_stops_every_rank_before_the_first_step(tmp_path: Path) -> None:
    from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    ckpt = DeltaModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    ckpt_trainer(tmp_path, [DeltaCheckpointIO()], [ckpt], max_steps=3, max_epochs=None).fit(
        CheckpointModel(), tiny_loader(256)
    )
    results = run_in_processes(
        _resume_with_a_failing_listing, 2, (str(tmp_path),), init_process_group=False, timeout=240
    )
    assert results[0] == "OSError: the store could not be listed", results
    assert results[1] == results[0], results  # the same type and line on every rank
