"""Faults a user meets on one machine: a second Trainer writing the same ``dirpath``, the disk filling in the middle of
a save, a corrupt manifest planted beside good ones. Each leaves a directory whose last complete checkpoint loads, and
each message names the file (or directory) and the fix."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.checkpoint import (
    CheckpointGuard,
    DeltaCheckpointIO,
    DeltaModelCheckpoint,
    read_checkpoint,
    resolve_last,
)
from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader


def _callback(dirpath: Path) -> DeltaModelCheckpoint:
    return DeltaModelCheckpoint(
        dirpath=str(dirpath), every_n_train_steps=2, save_top_k=2, save_last=True, monitor="step", mode="max"
    )


def test_a_second_trainer_on_the_same_dirpath_is_refused_before_training(tmp_path: Path) -> None:
    from lightning_accel.checkpoint import CheckpointDirectoryLockedError

    ckpt = tmp_path / "ckpt"
    first_io = DeltaCheckpointIO()
    first = ckpt_trainer(tmp_path, [first_io], [_callback(ckpt)], max_epochs=1)
    first.fit(CheckpointModel(), tiny_loader())
    first_io.claim(str(ckpt))  # the first run writes there again (a notebook's next fit)
    second = ckpt_trainer(tmp_path, [DeltaCheckpointIO()], [_callback(ckpt), CheckpointGuard()], max_epochs=2)
    with pytest.raises(CheckpointDirectoryLockedError) as e:
        second.fit(CheckpointModel(), tiny_loader())
    assert str(ckpt) in str(e.value) and "\n" not in str(e.value)
    assert second.global_step == 0  # refused before the first step
    first_io.teardown()
    last = resolve_last(str(ckpt))
    assert last is not None and read_checkpoint(last)["global_step"] == first.global_step


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_disk_filling_in_the_middle_of_a_save_keeps_the_last_complete_checkpoint(
    tmp_path: Path, async_save: bool
) -> None:
    ckpt = tmp_path / "ckpt"
    io = DeltaCheckpointIO(async_save=async_save)
    fs, store = io.store.fs, io.store
    real_write, real_save = fs.write, store.save
    state = {"full": False, "writes": 0}

    def write(url: str, data: Any, *args: Any, **kwargs: Any) -> Any:
        if state["full"]:
            state["writes"] += 1
            if state["writes"] > 1:  # the save's first blob lands, the disk is full from the next write on
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(url, data, *args, **kwargs)

    def save(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        state["full"] = state["full"] or checkpoint["global_step"] >= 6
        return real_save(checkpoint, *args, **kwargs)

    fs.write = write  # type: ignore[method-assign]
    store.save = save  # type: ignore[method-assign]
    trainer = ckpt_trainer(tmp_path, [io], [_callback(ckpt)], max_epochs=1)
    with pytest.raises(OSError) as e:
        trainer.fit(CheckpointModel(), tiny_loader())
    message = str(e.value)
    assert e.value.errno == errno.ENOSPC and "No space left on device" in message, message
    failed = re.search(r"save of '.*/(epoch=0-step=6|last)\.ckpt' failed", message)  # which file
    assert failed is not None, message
    assert "Free space on the device" in message and "\n" not in message, message  # and the fix
    state["full"] = False
    # every file left loads, and none is of the failed step (an async `last.ckpt` still queued may have been
    # replaced by the failed one: the top-k checkpoints remain)
    steps = {p.name: read_checkpoint(p)["global_step"] for p in ckpt.glob("*.ckpt")}
    assert steps and set(steps.values()) <= {2, 4} and steps.get("epoch=0-step=4.ckpt", 4) == 4, steps
    if not async_save:
        assert steps == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4, "last.ckpt": 4}, steps


def test_a_corrupt_manifest_beside_good_ones_names_the_file_and_last_still_resolves(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    io = DeltaCheckpointIO()
    ckpt_trainer(tmp_path, [io], [_callback(ckpt)], max_epochs=1).fit(CheckpointModel(), tiny_loader())
    good = sorted(ckpt.glob("epoch=*.ckpt"))
    bad = ckpt / "epoch=9-step=99.ckpt"
    bad.write_bytes(good[0].read_bytes()[:40])
    with pytest.raises(Exception) as e:
        read_checkpoint(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value), str(e.value)
    for p in good:
        assert read_checkpoint(p)["global_step"] > 0
    assert resolve_last(str(ckpt)) == str(ckpt / "last.ckpt")
    (ckpt / "last-v1.ckpt").write_bytes((ckpt / "last.ckpt").read_bytes()[:40])  # a newer `last` cut short
    with pytest.warns(UserWarning, match=r"skipped '.*last-v1\.ckpt': a manifest cut short.*Remove or replace"):
        assert resolve_last(str(ckpt)) == str(ckpt / "last.ckpt")  # `ckpt_path="last"` resumes from the complete one
