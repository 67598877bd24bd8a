"""Async saves that cannot finish or whose after-work fails: a value still being produced that never arrives fails
its save within ``deferred_timeout_s`` (naming the checkpoint) instead of leaving ``teardown`` waiting forever, and a
collection of old blobs that fails after the manifest was published neither fails the save nor stops training.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel._utils.deferred import Deferred
from lightning_accel.checkpoint import CheckpointSaveError, DeltaCheckpointIO, read_checkpoint


def test_a_deferred_value_that_never_arrives_fails_its_save_naming_the_checkpoint(tmp_path: Path) -> None:
    # a rank that died before joining the gather: the value never arrives, and `teardown` waited for it forever
    never = threading.Event()
    io = DeltaCheckpointIO(async_save=True, deferred_timeout_s=0.2)
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.ones(3)}, path)
    io.wait()
    io.save_checkpoint({"w": torch.zeros(3), "gathered": Deferred(lambda: never.wait())}, path)
    finished: list[BaseException | None] = []

    def teardown() -> None:
        try:
            io.teardown()
            finished.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            finished.append(e)

    t = threading.Thread(target=teardown, daemon=True)
    t.start()
    t.join(60)  # far above the bound: only a wait that is not bounded gets here alive
    try:
        assert not t.is_alive(), "teardown still waits for a value that never arrives"
        err = finished[0]
        assert isinstance(err, CheckpointSaveError) and isinstance(err.__cause__, TimeoutError)
        line = str(err)
        assert "\n" not in line and path in line and "deferred_timeout_s" in line, line
    finally:
        never.set()
    assert torch.equal(read_checkpoint(path)["w"], torch.ones(3))  # the previous checkpoint is intact


def test_a_deferred_value_in_time_is_saved_with_a_bound_set(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True, deferred_timeout_s=30)
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.ones(3), "gathered": Deferred(lambda: {"e": torch.arange(3.0)})}, path)
    io.teardown()
    assert torch.equal(read_checkpoint(path)["gathered"]["e"], torch.arange(3.0))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "10", True, float("inf"), 1e12])
def test_deferred_timeout_s_is_checked_in_init(value: Any) -> None:
    # inf and 1e12 passed here and failed every save with a deferred value later, on the writer thread
    # ("OverflowError: timestamp out of range for platform time_t")
    with pytest.raises((ValueError, TypeError), match="`deferred_timeout_s`") as e:
        DeltaCheckpointIO(deferred_timeout_s=value)
    assert "\n" not in str(e.value)


def test_the_longest_deferred_timeout_s_accepted_saves(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True, deferred_timeout_s=threading.TIMEOUT_MAX)
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.ones(3), "gathered": Deferred(lambda: {"e": torch.arange(3.0)})}, path)
    io.teardown()
    assert io.writer_stats.failed == 0
    assert torch.equal(read_checkpoint(path)["gathered"]["e"], torch.arange(3.0))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_collection_after_the_manifest_is_published_keeps_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    # the blob collection that follows a replacing save (an old blob that cannot be deleted: a permission, an object
    # store's transient error) failed that save, although its checkpoint was on disk, and stopped the run
    io = DeltaCheckpointIO(async_save=async_save, gc_grace_s=0)
    path = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"w": torch.ones(1000)}, path)
    io.wait() if async_save else None

    def broken(*args: Any, **kwargs: Any) -> int:
        raise PermissionError(13, "Permission denied", "blob")

    monkeypatch.setattr(io.store, "collect_garbage", broken)
    with pytest.warns(UserWarning, match="saved, but collecting") as rec:
        io.save_checkpoint({"w": torch.full((1000,), 2.0)}, path)
        io.wait() if async_save else None
    assert any(path in str(w.message) and "Permission denied" in str(w.message) for w in rec.list)
    with warnings.catch_warnings():
        # the run goes on: nothing raised at the next save, and the same failure is not warned again at every save
        warnings.simplefilter("error")
        io.save_checkpoint({"w": torch.full((1000,), 3.0)}, path)
        io.wait() if async_save else None
    monkeypatch.undo()
    io.teardown()
    assert torch.equal(read_checkpoint(path)["w"], torch.full((1000,), 3.0))
    assert io.writer_stats.failed == 0


def test_a_failed_collection_after_a_removal_does_not_fail_the_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = DeltaCheckpointIO(async_save=True, gc_grace_s=0)
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io.save_checkpoint({"w": torch.ones(1000)}, a)
    io.save_checkpoint({"w": torch.full((1000,), 2.0)}, b)
    io.wait()

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(io.store, "collect_garbage", broken)
    with pytest.warns(UserWarning, match="collecting"):
        io.remove_checkpoint(a)
        io.wait()
    monkeypatch.undo()
    io.teardown()
    assert not Path(a).exists() and torch.equal(read_checkpoint(b)["w"], torch.full((1000,), 2.0))


def test_a_held_failure_is_not_raised_inside_the_block_and_is_taken_once(tmp_path: Path) -> None:
    """What `DeltaModelCheckpoint` relies on under DDP: inside `save_errors_held()` a failed save is not raised by
    the calls on rank zero (the other ranks do not make them), nothing runs behind it, and `take_save_error` hands
    it over once, at a point every rank reaches."""
    io = DeltaCheckpointIO(async_save=True, write_delay_s=0.0)
    good, bad = tmp_path / "good.ckpt", tmp_path / "good.ckpt" / "x.ckpt"  # a folder that is a file: fails
    io.save_checkpoint({"w": torch.ones(600)}, good)
    io.wait()
    with io.save_errors_held():
        io.save_checkpoint({"w": torch.ones(600)}, bad)
        io.wait()  # failed meanwhile: not raised here
        io.save_checkpoint({"w": torch.full((600,), 2.0)}, tmp_path / "later.ckpt")  # behind the failure: dropped
        io.remove_checkpoint(good)  # dropped too: the good checkpoint stays
        io.wait()
    error = io.take_save_error()
    assert isinstance(error, CheckpointSaveError) and "x.ckpt" in str(error)
    assert io.take_save_error() is None
    io.teardown()  # taken: not raised again
    assert not (tmp_path / "later.ckpt").exists() and torch.equal(read_checkpoint(good)["w"], torch.ones(600))
    assert io.writer_stats.failed == 1 and io.writer_stats.skipped == 2


def test_a_held_failure_is_raised_by_the_first_call_after_the_block(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(async_save=True, write_delay_s=0.0)
    io.save_checkpoint({"w": torch.ones(600)}, tmp_path / "good.ckpt")
    with io.save_errors_held():
        io.save_checkpoint({"w": torch.ones(600)}, tmp_path / "good.ckpt" / "x.ckpt")
        io.wait()
    with pytest.raises(CheckpointSaveError, match="x.ckpt"):
        io.save_checkpoint({"w": torch.ones(600)}, tmp_path / "next.ckpt")
    io.teardown()
