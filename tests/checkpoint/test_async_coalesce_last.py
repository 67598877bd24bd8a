"""Latest wins, but never at the cost of the resume point: a queued save of ``last.ckpt`` that is the only pending
write of a path with no complete checkpoint yet is not replaced by a newer save of it (which may fail); once
``last.ckpt`` is complete, newer saves replace the queued one as before (the older file stays if the newer save
fails)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO, read_checkpoint
from lightning_accel.checkpoint.plugin import CheckpointSaveError
from lightning_accel.checkpoint.reader import resolve_last


def _state(step: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((300,), float(step))}, "global_step": step}


def _failing_from(io: DeltaCheckpointIO, step: int) -> None:
    real = io.store.save

    def save(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if checkpoint["global_step"] >= step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(checkpoint, *args, **kwargs)

    io.store.save = save  # type: ignore[method-assign]


def test_a_failing_save_never_replaces_the_only_queued_save_of_last(tmp_path: Path) -> None:
    # a long start delay: nothing starts before `wait`, so every save below is queued when the next one comes
    io = DeltaCheckpointIO(async_save=True, max_pending=3, write_delay_s=10.0)
    _failing_from(io, 2)
    io.save_checkpoint(_state(1), tmp_path / "epoch=0-step=1.ckpt")
    io.save_checkpoint(_state(1), tmp_path / "last.ckpt")
    io.save_checkpoint(_state(2), tmp_path / "epoch=0-step=2.ckpt")
    io.save_checkpoint(_state(2), tmp_path / "last.ckpt")  # would have replaced the queued save of step 1
    assert io.writer_stats.coalesced == 0
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        io.teardown()
    # the resume point survives the failure: `ckpt_path="last"` finds step 1, not a fresh start
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 1
    assert resolve_last(str(tmp_path)) == str(tmp_path / "last.ckpt")


def test_once_last_is_complete_a_newer_save_replaces_the_queued_one_and_a_failure_keeps_the_old_file(
    tmp_path: Path,
) -> None:
    io = DeltaCheckpointIO(async_save=True, max_pending=2, write_delay_s=10.0)
    io.save_checkpoint(_state(1), tmp_path / "last.ckpt")
    io.wait()
    _failing_from(io, 3)
    io.save_checkpoint(_state(2), tmp_path / "last.ckpt")
    io.save_checkpoint(_state(3), tmp_path / "last.ckpt")  # latest wins: replaces step 2, still queued
    assert io.writer_stats.coalesced == 1
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        io.teardown()
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 1
