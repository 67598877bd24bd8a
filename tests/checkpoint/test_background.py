"""BackgroundWriter and async DeltaCheckpointIO under pressure: bounded saves in flight, coalescing and cancelling,
ordering, reused snapshot buffers, bounded memory over 200 saves, teardown waiting only for what is in flight, the
first failure reported at once and nothing run behind it.

Ordering is explicit: jobs block on events, and the tests wait for the writer's observable state (a submit counted,
nothing pending), never for a duration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint import DeltaCheckpointIO
from lightning_accel.checkpoint.background import BackgroundWriter, CheckpointSaveError, SnapshotPool
from lightning_accel.checkpoint.skeleton import alias_groups, split


def _until(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait until ``done()`` (state another thread changes without an event to wait on); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_at_most_max_pending_saves_plus_one_overtaking_and_a_waiting_save_is_counted() -> None:
    gate = threading.Event()
    ran: list[int] = []
    w = BackgroundWriter(max_pending=2)

    def job(i: int) -> None:
        gate.wait(5)
        ran.append(i)

    w.submit(job, 0, bounded=True)
    w.submit(job, 1, bounded=True)
    assert w.pending == 2
    # Every slot taken, an older save still unstarted: the next save is admitted past max_pending (latest wins) ...
    w.submit(job, 2, bounded=True)
    assert w.pending == 3 and w.stats.overtaken == 1 and w.stats.stalls == 0
    # ... once: the call after it waits until the saves in flight are within max_pending again.
    blocked = threading.Thread(target=w.submit, args=(job, 3), kwargs={"bounded": True})
    blocked.start()
    _until(lambda: w.stats.submitted == 4, "the fourth save was submitted")
    assert blocked.is_alive() and w.pending == 3
    gate.set()
    blocked.join(5)
    w.close()
    assert ran == [0, 1, 2, 3]
    assert w.stats.stalls == 1 and w.stats.stall_s > 0 and w.stats.pending_peak == 3 and w.stats.overtaken == 1


def test_a_save_overtakes_an_unstarted_one_that_the_following_removal_cancels() -> None:
    """``ModelCheckpoint`` rotating ``save_top_k=1``: save ``step=N+1``, then remove ``step=N``. With the writer busy
    and ``step=N`` still queued, the new save does not wait; the removal cancels ``step=N`` and memory is back within
    ``max_pending`` snapshots before the call returns."""
    gate, running = threading.Event(), threading.Event()
    done: list[str] = []
    w = BackgroundWriter(max_pending=2)

    def save(path: str) -> None:
        running.set()
        gate.wait(5)
        done.append(path)

    w.submit(save, "step=1", key="step=1", bounded=True)  # running
    assert running.wait(5)
    for n in range(2, 6):
        w.submit(save, f"step={n}", key=f"step={n}", bounded=True)
        w.submit(done.append, f"rm step={n - 1}", key=f"step={n - 1}")
        assert w.pending <= 2 + n - 1  # the removals are queued too; the saves in flight stay within bound
    assert w.stats.stalls == 0 and w.stats.overtaken == 3 and w.stats.cancelled == 3
    gate.set()
    w.close()
    # step=1 was running (written, then removed); steps 2-4 were cancelled by their removals; step=5 is written
    assert [d for d in done if not d.startswith("rm")] == ["step=1", "step=5"]
    assert done[-1] == "step=5" or done[-1].startswith("rm")


def test_a_queued_save_of_the_same_path_is_replaced_and_a_removal_cancels_it() -> None:
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
    assert w.stats.coalesced == 1 and w.stats.stalls == 0 and w.pending == 2
    w.submit(remove, "last", key="last")  # Lightning drops the path: its unstarted save is cancelled, the slot freed
    assert w.stats.cancelled == 1 and w.pending == 2
    w.submit(save, "d", "step=2", key="step=2", bounded=True)  # takes the freed slot without waiting
    assert w.stats.stalls == 0
    w.submit(remove, "step=1", key="step=1")  # step=1 is running: the removal stays queued behind it
    gate.set()
    w.close()
    assert done == [("save", "step=1:a"), ("remove", "last"), ("save", "step=2:d"), ("remove", "step=1")]


def test_a_snapshot_save_of_the_same_path_coalesces_and_another_path_overtakes_once_then_waits() -> None:
    gate, running = threading.Event(), threading.Event()
    done: list[tuple[str, float]] = []
    w = BackgroundWriter(max_pending=2)

    def save(snap: Any, path: str) -> None:
        running.set()
        gate.wait(5)
        done.append((path, float(snap.tree["w"][0])))

    weights = torch.zeros(1000)

    def step(v: float, path: str) -> None:
        weights.fill_(v)
        w.submit_save(save, {"w": weights}, path)

    step(1, "s1")  # running (blocked on the gate)
    assert running.wait(5)
    step(2, "last")  # queued in the second slot
    step(3, "last")  # replaces it (refilled in place: no new buffer)
    assert w.stats.coalesced == 1 and w.stats.stalls == 0 and w.stats.buffers_allocated == 2
    step(4, "s4")  # another path, "last" still unstarted: admitted past max_pending once, never joins "last"
    assert w.stats.overtaken == 1 and w.stats.stalls == 0 and w.pending == 3
    blocked = threading.Thread(target=step, args=(5, "s5"))  # and the next one waits for a slot
    blocked.start()
    _until(lambda: w.stats.submitted == 5, "the save of s5 was submitted")
    assert blocked.is_alive() and w.pending == 3
    gate.set()
    blocked.join(5)
    w.close()
    # every path holds exactly the state saved there
    assert done == [("s1", 1.0), ("last", 3.0), ("s4", 4.0), ("s5", 5.0)] and w.stats.stalls == 1


def test_the_first_failure_is_raised_once_and_drops_what_is_queued_behind_it() -> None:
    gate = threading.Event()
    out: list[str] = []
    w = BackgroundWriter(max_pending=2)

    def fail(path: str) -> None:
        gate.wait(5)
        raise OSError(28, "No space left on device")

    w.submit(fail, "a.ckpt", key="a.ckpt", bounded=True)
    w.submit(fail, "b.ckpt", key="b.ckpt", bounded=True)  # would fail too: must not be the one reported
    w.submit(out.append, "removed old.ckpt", key="old.ckpt")  # depends on the saves before it
    gate.set()
    _until(lambda: w.pending == 0, "the failure dropped the queue")
    with pytest.raises(CheckpointSaveError) as info:
        w.submit(out.append, "next", bounded=True)
    msg = str(info.value)
    assert "'a.ckpt'" in msg and "b.ckpt" not in msg and "No space left" in msg and "\n" not in msg
    assert "2 later checkpoint job(s) were dropped" in msg and isinstance(info.value.__cause__, OSError)
    assert out == [] and w.stats.failed == 1 and w.stats.skipped == 2
    w.close()  # reported already: not raised again
    with pytest.raises(ValueError, match="`max_pending` must be an integer >= 1"):
        BackgroundWriter(max_pending=0)
    with pytest.raises(ValueError, match="`on_save_error` must be 'raise' or 'warn'"):
        BackgroundWriter(on_error="ignore")  # type: ignore[arg-type]


def test_a_failure_while_waiting_for_a_slot_is_raised_there() -> None:
    gate = threading.Event()
    w = BackgroundWriter(max_pending=1)

    def fail() -> None:
        gate.wait(5)
        raise RuntimeError("boom")

    w.submit(fail, key="a", bounded=True)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            w.submit(lambda: None, key="b", bounded=True)
        except CheckpointSaveError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    _until(lambda: w.stats.submitted == 2, "the second save waits for the slot")
    gate.set()
    t.join(5)
    assert len(errors) == 1 and "boom" in str(errors[0]) and w.pending == 0
    w.close()


def test_warn_mode_warns_every_failure_and_skips_a_removal_after_a_failed_save() -> None:
    w = BackgroundWriter(max_pending=2, on_error="warn")
    out: list[str] = []

    def fail(path: str) -> None:
        raise OSError(28, f"No space left on device ({path})")

    with pytest.warns(UserWarning) as record:  # any call after a failure warns it: all of them are inside
        w.submit(fail, "a", key="a", bounded=True)
        w.submit(out.append, "removed old", key="old")  # after a failed save: skipped, the old checkpoint stays
        w.submit(out.append, "saved b", key="b", bounded=True)
        w.submit(out.append, "removed older", key="older")  # after a good save: runs
        w.submit(fail, "c", key="c", bounded=True)
        w.wait()
    lines = [str(r.message) for r in record]
    assert out == ["saved b", "removed older"]
    assert any("'a' failed" in x for x in lines) and any("'c' failed" in x for x in lines)
    assert any("Skipped removing checkpoint 'old'" in x for x in lines)
    assert w.stats.failed == 2 and w.stats.skipped == 1
    w.close()


BIG = 20_000  # float32 elements: above the size from which an unchanged tensor is compared and shared


def test_snapshots_reuse_their_buffers_and_share_unchanged_tensors() -> None:
    """A large unchanged tensor shares the previous snapshot's buffer; a small one is copied again without being
    compared (cheaper than the comparison), into its own reused buffer, so it gets a new content id."""
    pool = SnapshotPool()
    w, b, s = torch.randn(1000), torch.zeros(BIG), torch.zeros(50)
    first = pool.take({"w": w, "b": b, "s": s, "step": 0})
    assert pool.stats.buffers_allocated == 3
    w.add_(1.0)  # the in-flight snapshot keeps the old values
    second = pool.take({"w": w, "b": b, "s": s, "step": 1})
    assert not torch.equal(first.tree["w"], second.tree["w"]) and torch.equal(second.tree["w"], w)
    assert second.tree["b"] is first.tree["b"] and pool.stats.tensors_shared == 1  # same bytes: no copy
    assert second.tree["s"] is not first.tree["s"] and torch.equal(second.tree["s"], s)  # small: copied
    assert second.content_id(second.tree["s"]) != first.content_id(first.tree["s"])
    assert second.content_id(second.tree["b"]) == first.content_id(first.tree["b"])
    assert second.content_id(second.tree["w"]) != first.content_id(first.tree["w"])
    assert second.content_id(w) is None  # a live tensor is no snapshot buffer
    pool.release(first)
    pool.release(second)
    allocated = pool.stats.buffers_allocated
    ids = set()
    for step in range(20):  # warm: every later snapshot refills the same buffers
        w.add_(1.0)
        snap = pool.take({"w": w, "b": b, "s": s, "step": step})
        assert torch.equal(snap.tree["w"], w) and snap.tree["step"] == step
        ids.add(snap.content_id(snap.tree["w"]))
        pool.release(snap)
    assert pool.stats.buffers_allocated == allocated and len(ids) == 20  # rewritten in place, new content ids
    z = torch.zeros(BIG)
    snap = pool.take({"z": z})
    z[0] = -0.0  # equal values, different bits: copied, not shared
    again = pool.take({"z": z})
    assert again.tree["z"] is not snap.tree["z"] and torch.equal(again.tree["z"].view(torch.int32), z.view(torch.int32))


def test_buffers_follow_positions_and_a_changed_structure_still_snapshots_every_tensor_exactly() -> None:
    """Buffers are keyed by a tensor's position in the checkpoint: when the structure changes (optimizer state that
    appears after the first step shifts every later tensor), each snapshot still holds each tensor's exact values,
    in its own container types, and the buffers the shift displaced are reused from the spares, not reallocated
    at every save."""
    from collections import OrderedDict

    pool = SnapshotPool()
    w = torch.nn.Parameter(torch.randn(6, 3))  # requires grad: copied like any tensor
    b = torch.randn(BIG)
    big = torch.randn(40_000)  # above the numpy copy threshold
    sd = OrderedDict([("w", w), ("b", b)])
    pool.release(pool.take({"state_dict": sd, "optimizer_states": [{"state": {}}], "big": big}))
    allocated = pool.stats.buffers_allocated
    assert allocated == 3
    mom = torch.zeros(6, 3)
    for _ in range(4):
        with torch.no_grad():
            w.add_(1.0)
            mom.add_(0.5)
            big.mul_(1.5)
        ck = {"state_dict": sd, "optimizer_states": [{"state": {0: {"momentum_buffer": mom}}}], "big": big}
        snap = pool.take(ck)
        assert type(snap.tree["state_dict"]) is OrderedDict and list(snap.tree["state_dict"]) == ["w", "b"]
        assert not snap.tree["state_dict"]["w"].requires_grad and torch.equal(snap.tree["state_dict"]["w"], w)
        assert torch.equal(snap.tree["optimizer_states"][0]["state"][0]["momentum_buffer"], mom)
        assert torch.equal(snap.tree["big"], big) and torch.equal(snap.tree["state_dict"]["b"], b)
        assert snap.tree["big"].data_ptr() != big.data_ptr()  # a private copy
        pool.release(snap)
    # the shift put `mom` where `big` was: one new buffer for the shifted position, none at later saves
    assert pool.stats.buffers_allocated == allocated + 1
    assert pool.stats.tensors_shared == 4  # `b` (same position throughout, never changed): shared at every later save


def test_a_write_the_version_counter_misses_is_still_caught_and_nan_bits_are_compared() -> None:
    """The version counter only lets a snapshot skip the comparison of a tensor modified in place; a write through
    ``.data`` (no version bump) is found by the comparison, and float tensors compare as bits."""
    pool = SnapshotPool()
    w = torch.randn(BIG)
    first = pool.take({"w": w})
    pool.release(first)
    w.data[3] = 123.0  # bypasses the version counter
    second = pool.take({"w": w})
    assert pool.stats.tensors_shared == 0 and second.tree["w"][3] == 123.0
    pool.release(second)
    same = pool.take({"w": w})  # untouched since: shared
    assert pool.stats.tensors_shared == 1 and torch.equal(same.tree["w"], w)
    pool.release(same)
    n = torch.full((BIG,), float("nan"))
    i = torch.arange(BIG)
    pool.release(pool.take({"n": n, "i": i}))
    again = pool.take({"n": n, "i": i})  # NaN bits equal themselves; integers compare by value
    assert pool.stats.tensors_shared == 3 and torch.isnan(again.tree["n"]).all()


@pytest.mark.parametrize("numel_scale", [1, 64])  # below and above the numpy copy threshold
def test_channels_last_sources_get_buffers_of_their_layout_reused_across_snapshots(numel_scale: int) -> None:
    """A channels_last weight is copied into a buffer with its own strides (one memcpy, no reorder), the buffer is
    reused across snapshots and holds the same values; a non-dense view gets a contiguous buffer, also reused."""
    pool = SnapshotPool()
    w = torch.randn(8 * numel_scale, 4, 5, 5).to(memory_format=torch.channels_last)
    view = torch.randn(32, 48 * numel_scale)[:, ::2]  # neither contiguous nor channels_last
    for _ in range(3):
        w.add_(1.0)
        view.add_(1.0)
        snap = pool.take({"w": w, "v": view})
        got = snap.tree["w"]
        assert got.stride() == w.stride() and torch.equal(got, w)
        assert snap.tree["v"].is_contiguous() and torch.equal(snap.tree["v"], view)
        pool.release(snap)
    assert pool.stats.buffers_allocated == 2
    pool.release(pool.take({"w": w}))  # unchanged since: compared (spans of one layout) and shared when large
    shared = 1 if numel_scale > 1 else 0
    assert pool.stats.tensors_shared == shared
    w.data[0, 0, 0, 0] = 7.0  # past the version counter: the comparison still sees it
    again = pool.take({"w": w})
    assert pool.stats.tensors_shared == shared and torch.equal(again.tree["w"], w)


def test_memory_stays_bounded_over_200_saves() -> None:
    """200 saves of a 4 MB snapshot submitted faster than the worker writes them (every_n_train_steps=1 with a save
    slower than a step): without the bound the queue would hold ~100-200 snapshots (400-800 MB)."""
    w = BackgroundWriter(max_pending=2)
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
    assert w.pending <= 3  # close waits for the saves in flight (max_pending, + 1 overtaking), not a backlog
    w.close()
    assert written == [float(i) for i in range(n)]  # every save ran, in order (no removal cancelled one)
    # every save after the first two overtook (once) or waited for a slot, never more than 3 in flight
    assert w.stats.pending_peak == 3 and w.stats.overtaken >= 1 and w.stats.stalls + w.stats.overtaken >= n - 2
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


def test_the_writer_pauses_while_a_snapshot_is_taken() -> None:
    """``SnapshotPool.yield_to`` (called by the writer between tensors) waits while ``take`` runs on another thread."""
    pool = SnapshotPool()
    inside, release = threading.Event(), threading.Event()

    class SlowDict(dict):  # a checkpoint whose walk blocks until released: a snapshot in progress
        def items(self) -> Any:
            inside.set()
            release.wait(5)
            return super().items()

    taker = threading.Thread(target=pool.take, args=({"state": SlowDict(w=torch.zeros(4))},))
    taker.start()
    assert inside.wait(5)
    waiter = threading.Thread(target=pool.yield_to, kwargs={"timeout": 5})
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # paused while the snapshot is being taken
    release.set()
    taker.join(5)
    waiter.join(5)
    assert not waiter.is_alive()
    pool.yield_to(timeout=5)  # no snapshot in progress: returns at once


def test_a_store_save_calls_pause_before_each_tensor(tmp_path: Path) -> None:
    from lightning_accel.checkpoint.store import DeltaStore

    calls: list[int] = []
    store = DeltaStore()
    ck = {"state_dict": {f"w{i}": torch.randn(4096) for i in range(3)}, "step": 1}
    store.save(ck, str(tmp_path / "a.ckpt"), pause=lambda: calls.append(1))
    store.close()
    assert len(calls) == 3


def test_a_job_starts_no_sooner_than_the_start_delay_and_wait_starts_it_at_once() -> None:
    started: list[float] = []
    w = BackgroundWriter(start_delay_s=0.2)
    t0 = time.monotonic()
    w.submit(lambda: started.append(time.monotonic()), bounded=True)
    _until(lambda: bool(started), "the delayed job ran")
    assert started[0] - t0 >= 0.2  # never before its delay (the machine's load can only make it later)
    slow = BackgroundWriter(start_delay_s=10.0)
    slow.submit(lambda: started.append(time.monotonic()), bounded=True)
    assert len(started) == 1
    t1 = time.monotonic()
    slow.wait()  # a caller waiting (teardown, a synchronous save) does not sit out the delay
    assert len(started) == 2 and started[1] - t1 < 5.0
    slow.close()
    w.close()


def test_a_removal_within_the_start_delay_cancels_the_save_before_any_work() -> None:
    """``ModelCheckpoint`` removing the older top-k path right after saving the newer one: with the writer idle, the
    save of the path that is then removed is still waiting out its delay, so it is dropped unwritten."""
    done: list[str] = []
    w = BackgroundWriter(max_pending=2, start_delay_s=10.0)
    w.submit(done.append, "save step=1", key="step=1", bounded=True)
    w.submit(done.append, "save step=2", key="step=2", bounded=True)
    w.submit(done.append, "rm step=1", key="step=1")
    assert w.stats.cancelled == 1 and w.pending == 2  # the save of step=2 and the removal, both still queued
    w.close()
    assert done == ["save step=2", "rm step=1"]


@pytest.mark.parametrize("bad", [-0.1, float("nan"), 11.0, "0.05"])
def test_write_delay_is_checked_in_init(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="`write_delay_s`"):
        DeltaCheckpointIO(async_save=True, write_delay_s=bad)
    assert DeltaCheckpointIO(async_save=True).write_delay_s == 0.05


def test_sparse_tensors_snapshot_and_a_failed_snapshot_releases_its_buffers(tmp_path: Path) -> None:
    sp = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (5,))
    io = DeltaCheckpointIO(async_save=True, gc_grace_s=0, write_delay_s=0)
    io.save_checkpoint({"sp": sp, "w": torch.ones(3)}, tmp_path / "sp.ckpt")
    io.wait()
    back = io.load_checkpoint(tmp_path / "sp.ckpt")
    assert torch.equal(back["sp"].to_dense(), sp.to_dense()) and torch.equal(back["w"], torch.ones(3))
    io.teardown()
    pool = SnapshotPool()
    w = torch.randn(1000)
    with pytest.raises((NotImplementedError, RuntimeError)):
        pool.take({"w": w, "meta": torch.empty(3, device="meta")})  # cannot be copied: the snapshot fails half-way
    snap = pool.take({"w": w, "meta": 0})
    # the buffer the failed snapshot had taken for `w` was released: refilled in place, not allocated again (the
    # other allocation is the failed tensor's)
    assert pool.stats.buffers_allocated == 2 and torch.equal(snap.tree["w"], w)
    pool.release(snap)


def test_a_snapshot_records_the_storages_its_tensors_shared_as_the_live_checkpoint_has_them() -> None:
    """Tied weights, views at offsets and strides, one score tensor under several keys (ModelCheckpoint's
    ``best_model_score`` / ``best_k_models``) are copied into buffers of their own: the snapshot records which of them
    shared a storage as it copies them, and names them as ``split`` names its buffers, giving the record
    ``alias_groups`` makes of the live checkpoint (lazy conjugate views, empty and unshared tensors left out)."""
    pool = SnapshotPool()
    w, score, c = torch.randn(10, 4), torch.tensor(0.5), torch.randn(4, dtype=torch.complex64)
    cases = [
        {"a": w, "b": w.t()},
        {"a": w[2:], "b": torch.randn(3), "c": w[:1], "d": {"e": [w[5], w]}},
        {"cb": {"best": score, "current": score, "k": {"p1": score, "p2": torch.tensor(0.1)}}, "w": w},
        {"c": c, "conj": c.conj(), "c2": c[1:]},
        {"a": torch.randn(3), "b": torch.randn(3), "e": torch.empty(0), "f": torch.empty(0)},
    ]
    for ck in cases:
        snap = pool.take(ck)
        want = alias_groups(split(ck)[1])
        assert snap.shares_memory == bool(want)
        assert snap.aliases(split(snap.tree)[1]) == want and (want or ck is cases[-1])
        pool.release(snap)
