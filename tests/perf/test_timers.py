"""StepTimer and the bottleneck report, driven by an injected clock (no real timing)."""

from __future__ import annotations

import pytest

from lightning_accel.perf import CATEGORIES, HostClock, StepTimer, build_report
from lightning_accel.perf.timers import TimerTotals
from tests.tiny import VirtualTime as FakeTime


def make(skip: int = 0) -> tuple[FakeTime, StepTimer]:
    ft = FakeTime()
    return ft, StepTimer(clock=HostClock(ft), span_clock=HostClock(ft), skip_steps=skip)


def run_step(ft: FakeTime, timer: StepTimer, data: float, compute: float, samples: int = 8) -> None:
    ft.advance(data)
    timer.batch_start()
    ft.advance(compute)
    timer.batch_end(samples)


def test_gap_is_data_and_step_is_compute() -> None:
    ft, timer = make()
    run_step(ft, timer, data=0.0, compute=1.0)  # first batch: no gap before it is known
    run_step(ft, timer, data=0.5, compute=1.0)
    run_step(ft, timer, data=0.25, compute=2.0)
    w = timer.flush()
    assert w.seconds["data"] == pytest.approx(0.75)
    assert w.seconds["compute"] == pytest.approx(4.0)
    assert (w.steps, w.samples) == (3, 24)
    assert timer.totals.seconds["compute"] == pytest.approx(4.0)
    assert timer.flush().steps == 0  # the window restarts after a flush
    assert timer.totals.steps == 3


def test_skip_steps_excludes_warmup_and_its_gap() -> None:
    ft, timer = make(skip=2)
    run_step(ft, timer, 0.0, 10.0)
    run_step(ft, timer, 7.0, 10.0)
    run_step(ft, timer, 0.5, 1.0)
    t = timer.flush()
    assert t.steps == 1
    assert t.seconds["data"] == pytest.approx(0.5)
    assert t.seconds["compute"] == pytest.approx(1.0)


def test_spans_are_subtracted_from_the_enclosing_segment_and_nest() -> None:
    ft, timer = make()
    run_step(ft, timer, 0.0, 1.0)
    # gap: 0.1 data, then validation 2.0 containing a 0.5 checkpoint save, then 0.2 more data
    ft.advance(0.1)
    timer.begin("eval")
    ft.advance(1.5)
    timer.begin("checkpoint")
    ft.advance(0.5)
    assert timer.end("checkpoint") == pytest.approx(0.5)
    assert timer.end("eval") == pytest.approx(1.5)
    ft.advance(0.2)
    timer.batch_start()
    # a save inside the step itself
    ft.advance(1.0)
    timer.begin("checkpoint")
    ft.advance(0.3)
    timer.end("checkpoint")
    timer.batch_end(4)
    t = timer.flush()
    assert t.seconds["data"] == pytest.approx(0.3)
    assert t.seconds["eval"] == pytest.approx(1.5)
    assert t.seconds["checkpoint"] == pytest.approx(0.8)
    assert t.seconds["compute"] == pytest.approx(2.0)
    assert t.wall == pytest.approx(0.3 + 1.5 + 0.8 + 2.0)


def test_stop_drops_the_trailing_gap_and_unmatched_end_is_ignored() -> None:
    ft, timer = make()
    run_step(ft, timer, 0.0, 1.0)
    ft.advance(100.0)
    timer.stop()
    assert timer.end("eval") == 0.0
    assert timer.flush().seconds["data"] == 0.0


def test_sync_steps_count_only_the_counted_batches_that_synchronised() -> None:
    """What a per-allreduce cost is multiplied by: accumulation micro-batches (``synced=False``) send nothing."""
    ft, timer = make(skip=1)
    for i in range(9):
        ft.advance(0.1)
        timer.batch_start()
        ft.advance(1.0)
        timer.batch_end(4, synced=i % 4 == 3)  # steps at batches 3 and 7
    assert (timer.window_steps, timer.window_sync_steps) == (8, 2)
    timer.flush()
    assert (timer.window_steps, timer.window_sync_steps) == (0, 0)
    run_step(ft, timer, 0.1, 1.0)  # synced by default
    assert timer.window_sync_steps == 1


def test_move_and_bad_category() -> None:
    ft, timer = make()
    run_step(ft, timer, 0.0, 1.0)
    timer.move(0.25, src="compute", dst="comm")
    t = timer.flush()
    assert t.seconds["compute"] == pytest.approx(0.75)
    assert t.seconds["comm"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="`category`"):
        timer.begin("io")
    with pytest.raises(ValueError, match="`skip_steps` must be an integer >= 0, got -1"):
        StepTimer(skip_steps=-1)
    with pytest.raises(TypeError, match="`skip_steps`"):
        StepTimer(skip_steps=False)


def test_move_resolves_pending_time_and_caps_at_the_source() -> None:
    ft, timer = make()
    run_step(ft, timer, 0.0, 1.0)
    run_step(ft, timer, 0.5, 1.0)
    assert timer.window_steps == 2
    assert timer.move(0.0, src="compute", dst="comm") == 0.0
    assert timer.move(5.0, src="compute", dst="comm") == pytest.approx(2.0)  # only 2 s of compute to move
    t = timer.flush()
    assert t.seconds["compute"] == pytest.approx(0.0) and t.seconds["comm"] == pytest.approx(2.0)
    assert t.seconds["data"] == pytest.approx(0.5) and t.wall == pytest.approx(2.5)
    assert timer.totals.seconds["comm"] == pytest.approx(2.0) and timer.window_steps == 0
    with pytest.raises(ValueError, match="`dst`"):
        timer.move(1.0, src="compute", dst="network")


class EventClock:
    """Marks are opaque tokens; elapsed looks them up (like CUDA events resolved later)."""

    def __init__(self, ft: FakeTime) -> None:
        self.ft = ft
        self.resolved = 0

    def mark(self) -> object:
        return {"t": self.ft.t}

    def elapsed(self, a: dict, b: dict) -> float:
        self.resolved += 1
        return b["t"] - a["t"]


def test_deferred_clock_is_resolved_only_on_flush() -> None:
    ft = FakeTime()
    clock = EventClock(ft)
    timer = StepTimer(clock=clock, span_clock=HostClock(ft), skip_steps=0)
    for _ in range(5):
        run_step(ft, timer, 0.1, 0.2)
    assert clock.resolved == 0  # nothing synchronises per step
    t = timer.flush()
    assert clock.resolved == 9  # 5 steps + 4 gaps
    assert t.seconds["data"] == pytest.approx(0.4)


def _totals(**sec: float) -> TimerTotals:
    t = TimerTotals(steps=10, samples=640)
    t.seconds.update(sec)
    return t


def test_report_shares_dominant_and_verdict() -> None:
    r = build_report(_totals(data=6.1, compute=3.9), context={"num_workers": 2})
    assert r.dominant == "data"
    assert r.shares["data"] == pytest.approx(0.61)
    assert "61 % of step time waits for data" in r.verdict and "num_workers (now 2)" in r.verdict
    assert r.step_time_s == pytest.approx(1.0)
    assert r.samples_per_s == pytest.approx(64.0)
    assert set(r.shares) == set(CATEGORIES)
    text = r.format()
    assert "Verdict [data]" in text and "samples/s" in text

    c = build_report(_totals(data=1.0, compute=9.0), flops_per_step=5e11, peak_flops=1e12)
    assert c.dominant == "compute"
    assert c.mfu == pytest.approx(0.5)  # 5e11 FLOPs per 1 s step on a 1e12 FLOP/s device
    assert "50 % MFU" in c.verdict
    assert build_report(_totals(compute=1.0, comm=3.0)).verdict.count("ddp_1bit") == 1
    assert "AsyncCheckpointIO" in build_report(_totals(compute=1.0, checkpoint=3.0)).verdict
    assert "limit_val_batches" in build_report(_totals(compute=1.0, eval=3.0)).verdict


def test_verdict_advises_only_what_is_not_already_on() -> None:
    compute = _totals(data=1.0, compute=9.0)
    fp32 = build_report(compute, context={"precision": "32-true"}).verdict
    assert "bf16-mixed / FusedPrecision (precision now 32-true)" in fp32
    amp = build_report(compute, context={"precision": "bf16-mixed", "precision_plugin": ["MixedPrecision"]}).verdict
    assert "bf16-mixed /" not in amp and "FusedPrecision (fused" in amp and "torch.compile" in amp
    fused = build_report(
        compute, context={"precision": "bf16-mixed", "precision_plugin": ["MyFused", "FusedPrecision"]}
    ).verdict
    assert "FusedPrecision" not in fused and "torch.compile, a larger batch per device." in fused
    compiled = build_report(compute, context={"precision": "32-true", "compiled": True}).verdict
    assert "torch.compile" not in compiled and "a larger batch per device." in compiled
    data = _totals(data=9.0, compute=1.0)
    assert "augmentation to the GPU" in build_report(data, context={"device": "cuda"}).verdict
    on_cpu = build_report(data, context={"device": "cpu", "num_workers": 2}).verdict
    assert "use CachedDataModule" in on_cpu and "num_workers (now 2)" in on_cpu and "GPU" not in on_cpu
    cached = build_report(data, context={"datamodule": ["MyData", "CachedDataModule"], "device": "cuda"}).verdict
    assert "already read through CachedDataModule" in cached and "use CachedDataModule" not in cached
    assert "GPU" not in cached
    comm = _totals(compute=1.0, comm=3.0)
    onebit = build_report(comm, context={"strategy": ["OneBitDDPStrategy", "DDPStrategy"]}).verdict
    assert "already 1-bit compressed" in onebit and "strategy='diloco'" in onebit and "ddp_1bit" not in onebit
    # a run that ended in ddp_1bit's fp32 warm-up (or with `compression="auto"` keeping fp32) compressed nothing
    fp32 = build_report(
        comm, context={"strategy": ["OneBitDDPStrategy", "DDPStrategy"], "strategy_lever_active": False}
    ).verdict
    assert "averaged in fp32 by ddp_1bit" in fp32 and "already 1-bit compressed" not in fp32
    ckpt = _totals(compute=1.0, checkpoint=3.0)
    plain = build_report(ckpt, context={"checkpoint_io": ["TorchCheckpointIO", "CheckpointIO"]}).verdict
    assert "AsyncCheckpointIO" in plain and "DeltaCheckpointIO to write less" in plain
    delta = build_report(ckpt, context={"checkpoint_io": ["DeltaCheckpointIO", "CheckpointIO"]}).verdict
    assert "already written as deltas" in delta and "DeltaCheckpointIO(async_save=True)" in delta
    assert "AsyncCheckpointIO" not in delta and "to write less" not in delta
    wrapped = ["AsyncCheckpointIO", "_WrappingCheckpointIO", "CheckpointIO", "TorchCheckpointIO", "CheckpointIO"]
    background = build_report(ckpt, context={"checkpoint_io": wrapped}).verdict
    assert "already written in the background" in background and "use AsyncCheckpointIO" not in background
    assert "DeltaCheckpointIO to write less" in background
    for ctx in (
        {"checkpoint_io": ["AsyncCheckpointIO", "CheckpointIO", "DeltaCheckpointIO", "CheckpointIO"]},
        {"checkpoint_io": ["DeltaCheckpointIO", "CheckpointIO"], "checkpoint_async": True},
    ):
        both = build_report(ckpt, context=ctx).verdict
        assert "already written as deltas in the background" in both and "every_n_train_steps" in both
        assert "AsyncCheckpointIO" not in both and "DeltaCheckpointIO" not in both


def test_report_without_steps_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match="limit_train_batches"):
        build_report(TimerTotals())


def test_report_json_roundtrip() -> None:
    import json

    r = build_report(_totals(data=1.0, compute=2.0))
    d = json.loads(r.to_json())
    assert d["dominant"] == "compute" and d["steps"] == 10


def test_fetch_start_splits_the_gap_into_the_loops_own_work_and_the_data_wait() -> None:
    ft, timer = make()
    run_step(ft, timer, 0.0, 1.0)
    ft.advance(0.3)  # later callbacks' hooks, logging
    timer.begin("checkpoint")  # a save before the fetch: charged to itself, not to `other`
    ft.advance(2.0)
    timer.end("checkpoint")
    timer.fetch_start()
    ft.advance(0.2)
    timer.fetch_start()  # a second mark in the same gap does not move the split
    ft.advance(0.05)
    timer.batch_start()
    ft.advance(1.0)
    timer.batch_end(8)
    run_step(ft, timer, 0.4, 1.0)  # a gap without a fetch mark: all of it is data, as before
    t = timer.flush()
    assert t.seconds["other"] == pytest.approx(0.3)
    assert t.seconds["checkpoint"] == pytest.approx(2.0)
    assert t.seconds["data"] == pytest.approx(0.25 + 0.4)
    assert t.seconds["compute"] == pytest.approx(3.0)
    assert t.wall == pytest.approx(0.3 + 2.0 + 0.65 + 3.0)


def test_fetch_start_inside_a_step_changes_nothing() -> None:
    ft, timer = make()
    timer.batch_start()
    timer.fetch_start()  # a training_step drawing from `dataloader_iter`: its fetch stays compute
    ft.advance(1.0)
    timer.batch_end(8)
    ft.advance(0.5)
    run_step(ft, timer, 0.0, 1.0)
    t = timer.flush()
    assert t.steps == 2
    assert t.seconds["compute"] == pytest.approx(2.0)
    assert t.seconds["data"] == pytest.approx(0.5) and t.seconds["other"] == 0.0
