"""BackgroundWriter and async DeltaCheckpointIO under pressure: bounded saves in flight, coalescing, ordering, bounded
memory over 200 saves, teardown waiting only for what is in flight, errors never lost.

Ordering is explicit: jobs block on events, and the tests wait for the writer's observable state (a submit counted,
nothing pending), never for a duration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO
from lightning_accel.checkpoint.background import BackgroundWriter


def _until(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait until ``done()`` (state another thread changes without an event to wait on); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_at_most_max_pending_saves_and_a_waiting_save_is_counted() -> None:
    gate = threading.Event()
    ran: list[int] = []
    w = BackgroundWriter(max_pending=2)

    def job(i: int) -> None:
        gate.wait(5)
        ran.append(i)

    w.submit(job, 0, bounded=True)
    w.submit(job, 1, bounded=True)
    assert w.pending == 2
    blocked = threading.Thread(target=w.submit, args=(job, 2), kwargs={"bounded": True})
    blocked.start()
    _until(lambda: w.stats.submitted == 3, "the third save was submitted")
    # Both jobs wait for the gate, so no slot can free up: the third save is waiting for one.
    assert blocked.is_alive() and w.pending == 2 and w.stats.stalls == 0
    gate.set()
    blocked.join(5)
    w.close()
    assert ran == [0, 1, 2]
    assert w.stats.stalls == 1 and w.stats.stall_s > 0 and w.stats.pending_peak == 2


def test_a_queued_save_of_the_same_path_is_replaced_unless_a_removal_follows_it() -> None:
    gate, running = threading.Event(), threading.Event()
    done: list[tuple[str, str]] = []
    w = BackgroundWriter(max_pending=2)

    def save(payload: str, path: str) -> None:
        running.set()
        gate.wait(5)
        done.append(("save", f"{path}:{payload}"))

    def remove(path: str) -> None:
        done.append(("remove", path))

    w.submit(save, "a", "step=1", key="step=1", bounded=True)  # running (blocked on the gate)
    assert running.wait(5)
    w.submit(save, "b", "last", key="last", bounded=True)  # queued
    w.submit(save, "c", "last", key="last", bounded=True)  # replaces "b": no wait although both slots are taken
    assert w.stats.coalesced == 1 and w.stats.stalls == 0
    w.submit(remove, "last", key="last")
    gate.set()
    w.submit(save, "d", "last", key="last", bounded=True)  # a removal of `last` is queued after it: no coalescing
    w.close()
    assert done == [("save", "step=1:a"), ("save", "last:c"), ("remove", "last"), ("save", "last:d")]


def test_errors_are_raised_once_and_later_jobs_still_run() -> None:
    w = BackgroundWriter(max_pending=1)
    out: list[int] = []
    w.submit(lambda: 1 / 0, bounded=True)
    _until(lambda: w.pending == 0, "the failing job finished")  # its error is recorded before it counts as done
    with pytest.raises(ZeroDivisionError):
        w.submit(out.append, 1, bounded=True)
    w.submit(out.append, 2, bounded=True)
    w.close()
    assert out == [2]
    with pytest.raises(ValueError, match="`max_pending` must be an integer >= 1"):
        BackgroundWriter(max_pending=0)


def test_memory_stays_bounded_over_200_saves() -> None:
    """200 saves of a 4 MB snapshot submitted faster than the worker writes them (every_n_train_steps=1 with a save
    slower than a step): without the bound the queue would hold ~100-200 snapshots (400-800 MB)."""
    w = BackgroundWriter(max_pending=2, nice=0)
    written: list[float] = []
    n = 200

    def save(snap: torch.Tensor, path: str) -> None:
        i = int(snap[0])
        # Save i finishes only once the save two later was submitted (and found both slots taken): the worker is
        # always behind the producer, whatever the machine's speed.
        _until(lambda: w.stats.submitted >= min(i + 3, n), f"save {i + 2} was submitted")
        written.append(float(snap[0]))

    rss0, peak = _rss_bytes(), 0
    for i in range(n):
        w.submit(save, torch.full((1 << 20,), float(i)), f"s{i}.ckpt", key=f"s{i}.ckpt", bounded=True)
        peak = max(peak, _rss_bytes() - rss0)
    assert w.pending <= 2  # close waits for the 2 saves in flight, not a backlog
    w.close()
    assert written == [float(i) for i in range(n)]  # every save ran, in order
    assert w.stats.pending_peak == 2 and w.stats.stalls == n - 2  # every save after the first two waited
    assert peak < 64 * 2**20, f"RSS grew by {peak / 2**20:.0f} MB"


def test_trainer_saving_every_step_keeps_at_most_max_pending(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    io = DeltaCheckpointIO(async_save=True, max_pending=1)
    cb = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    model = CheckpointModel()
    ckpt_trainer(tmp_path, [io], [cb]).fit(model, tiny_loader())
    assert io.writer_stats.pending_peak == 1 and io.writer_stats.submitted >= 2 * 16
    last = io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(last["state_dict"][k], v), k
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))[-1] == "last.ckpt"
