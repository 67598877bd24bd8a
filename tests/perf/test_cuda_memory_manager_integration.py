"""CudaMemoryManager: the CPU no-op, the CUDA path with mocked allocator calls, and a real GPU test."""

from __future__ import annotations

import csv
import logging
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_accel.callbacks import CudaMemoryManager
from tests.tiny import TimedModule, loaders

GB = 1 << 30


class ListLogger:
    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((dict(metrics), step))


def fake_trainer(tmp_path: Path, logger: ListLogger) -> Any:
    return SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
        log_every_n_steps=2,
        is_global_zero=True,
        loggers=[logger],
        global_step=0,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0)),
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
    )


# no allocator setting: a `setup` on the fake CUDA device then leaves the environment and the allocator alone
NO_KNOBS: dict[str, Any] = {
    "expandable_segments": None,
    "max_split_size_mb": None,
    "garbage_collection_threshold": None,
}
AUTOMATIC = SimpleNamespace(automatic_optimization=True)  # the LightningModule attribute the callback reads


def run_batches(mm: CudaMemoryManager, trainer: Any, n: int) -> None:
    """``n`` training batches as Lightning calls the hooks: the optimizer steps between start and end, and the
    batches-that-stepped counter moves after the end."""
    for i in range(n):
        mm.on_train_batch_start(trainer, AUTOMATIC, None, i)  # type: ignore[arg-type]
        trainer.global_step += 1
        mm.on_train_batch_end(trainer, AUTOMATIC, None, None, i)  # type: ignore[arg-type]
        trainer.fit_loop.epoch_loop._batches_that_stepped += 1


def test_cpu_run_says_so_once_and_logs_host_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    from lightning.pytorch.loggers import CSVLogger

    mm = CudaMemoryManager(log_every_n_steps=2)
    assert mm.applied is None  # no CUDA: the environment is left alone
    logger = CSVLogger(tmp_path, name="logs")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=logger,
        callbacks=[mm],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    train, _ = loaders(None, 0.0)
    with caplog.at_level(logging.INFO):
        trainer.fit(TimedModule(), train)
    lines = [r.getMessage() for r in caplog.records if "CudaMemoryManager" in r.getMessage()]
    assert len(lines) == 1 and "do nothing" in lines[0] and "mem/host_rss_gb" in lines[0]
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header, values = rows[0].split(","), [r.split(",") for r in rows[1:]]
    rss = [float(v[header.index("mem/host_rss_gb")]) for v in values if v[header.index("mem/host_rss_gb")]]
    assert len(rss) == 2 and all(0.01 < x < 64 for x in rss)  # steps 2 and 4; a Python + torch process is > 10 MB


def test_cuda_path_with_mocked_allocator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(n, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # what the constructor asks (fork-safe)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    confs: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", confs.append)
    mm = CudaMemoryManager(max_split_size_mb=256, release_threshold=0.5, snapshot_dir=str(tmp_path))
    assert mm.applied is not None and mm.applied.env_set
    import os

    assert "max_split_size_mb:256" in os.environ["PYTORCH_ALLOC_CONF"] and confs

    stats = {
        "allocated_bytes.all.current": 1 * GB,
        "reserved_bytes.all.current": 4 * GB,
        "inactive_split_bytes.all.current": GB,
        "num_alloc_retries": 3,
        "num_ooms": 0,
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    logger = ListLogger()
    trainer = fake_trainer(tmp_path, logger)
    mm.setup(trainer, None, "fit")  # type: ignore[arg-type]
    run_batches(mm, trainer, 4)
    assert [step for _, step in logger.rows] == [1, 3]  # every 2nd batch, on Lightning's step axis
    m = logger.rows[0][0]
    assert m["mem/fragmentation"] == pytest.approx(0.75) and m["mem/alloc_retries"] == 3.0
    assert len(emptied) == 2 and mm.releases == 2  # 75 % idle of a 4 GiB pool > 50 % threshold

    snap = {"segments": [{"total_size": 4 * GB}], "device_traces": []}
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snap)
    mm.on_exception(trainer, None, RuntimeError("some other failure"))  # type: ignore[arg-type]
    assert mm.snapshot_path is None
    mm.setup(trainer, None, "fit")  # type: ignore[arg-type]  # an exception ends its fit: this is the next one
    mm.on_exception(trainer, None, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))  # type: ignore[arg-type]
    assert mm.snapshot_path == str(tmp_path / "oom_snapshot_rank0.pickle")
    with open(str(mm.snapshot_path), "rb") as f:
        assert pickle.load(f) == snap  # written by this test a moment ago


class LoggedLoss(TimedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _steps(trainer: pl.Trainer, column: str) -> list[int]:
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        return sorted({int(r["step"]) for r in csv.DictReader(f) if r.get(column)})


def _memory_fit(
    tmp_path: Path, mm: CudaMemoryManager, max_steps: int, ckpt_path: str | None = None, **kw: Any
) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, limit_val_batches=0, log_every_n_steps=4, callbacks=[mm],
        logger=CSVLogger(tmp_path, name="logs"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kw,
    )  # fmt: skip
    train, _ = loaders(None, 0.0)
    trainer.fit(LoggedLoss(), train, ckpt_path=ckpt_path)
    return trainer


def test_memory_lands_on_the_loss_rows_in_every_fit_after_a_resume_and_with_accumulation(tmp_path: Path) -> None:
    """The window was a batch counter kept across fits and never told of a resume: a second fit of the same
    callback logged at steps 1, 5, 9 beside a loss at 3, 7, 11, a resumed one at 9 only; with gradient accumulation
    it counted micro-batches, so a window was a fraction of the optimizer steps the trainer's window is."""
    mm = CudaMemoryManager(log_every_n_steps=4)  # on a GPU machine too: a CPU trainer logs host memory
    first = _memory_fit(tmp_path, mm, 6)
    assert _steps(first, "mem/host_rss_gb") == _steps(first, "train_loss") == [3]
    ckpt = tmp_path / "six.ckpt"
    first.save_checkpoint(ckpt)
    again = _memory_fit(tmp_path, mm, 12)
    assert _steps(again, "mem/host_rss_gb") == _steps(again, "train_loss") == [3, 7, 11]
    resumed = _memory_fit(tmp_path, CudaMemoryManager(log_every_n_steps=4), 12, ckpt_path=str(ckpt))
    assert _steps(resumed, "mem/host_rss_gb") == _steps(resumed, "train_loss") == [7, 11]
    accumulated = _memory_fit(tmp_path, CudaMemoryManager(log_every_n_steps=4), 8, accumulate_grad_batches=2)
    assert _steps(accumulated, "mem/host_rss_gb") == _steps(accumulated, "train_loss") == [3, 7]


def test_an_exception_stops_the_allocation_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning calls no callback `teardown` after an exception: the allocation history (a stack trace per
    allocation) kept recording for the rest of the process after an OOM."""
    from lightning_accel._utils import compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    calls: list[str] = []
    monkeypatch.setattr(compat, "record_cuda_memory_history", lambda n: calls.append("record"))
    monkeypatch.setattr(compat, "stop_cuda_memory_history", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"segments": []})
    mm = CudaMemoryManager(record_history=True, snapshot_dir=str(tmp_path), **NO_KNOBS)
    trainer = fake_trainer(tmp_path, ListLogger())
    mm.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert calls == ["record"]
    mm.on_exception(trainer, None, torch.OutOfMemoryError("CUDA out of memory"))  # type: ignore[arg-type]
    assert calls == ["record", "stop"] and mm.snapshot_path == str(tmp_path / "oom_snapshot_rank0.pickle")
    mm.teardown(trainer, None, "fit")  # type: ignore[arg-type]  # stopped once only
    assert calls == ["record", "stop"]


def test_an_oom_snapshot_never_overwrites_a_file_already_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second out-of-memory error (a retry in the same process, another run into the same `snapshot_dir`)
    replaced the first snapshot, and a file of the user's of that name, with its own."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    users = tmp_path / "oom_snapshot_rank0.pickle"
    users.write_bytes(b"the user's own file")
    snaps = iter([{"segments": ["first"]}, {"segments": ["second"]}])
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: next(snaps))
    mm = CudaMemoryManager(snapshot_dir=str(tmp_path), **NO_KNOBS)
    trainer = fake_trainer(tmp_path, ListLogger())
    written = []
    for _ in range(2):
        mm.setup(trainer, None, "fit")  # type: ignore[arg-type]
        mm.on_exception(trainer, None, torch.OutOfMemoryError("CUDA out of memory"))  # type: ignore[arg-type]
        written.append(mm.snapshot_path)
    assert written == [str(tmp_path / "oom_snapshot_rank0-2.pickle"), str(tmp_path / "oom_snapshot_rank0-3.pickle")]
    assert users.read_bytes() == b"the user's own file"
    with open(tmp_path / "oom_snapshot_rank0-2.pickle", "rb") as f:
        assert pickle.load(f) == {"segments": ["first"]}  # written by this test a moment ago


def test_late_cuda_init_warns_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # what the constructor asks (fork-safe)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: None)
    with pytest.warns(UserWarning, match="already initialised.*PYTORCH_ALLOC_CONF="):
        CudaMemoryManager()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`release_threshold`"):
        CudaMemoryManager(release_threshold=2.0)
    with pytest.raises(ValueError, match="`max_split_size_mb`"):
        CudaMemoryManager(max_split_size_mb=1)
    with pytest.raises(TypeError, match="`max_split_size_mb` must be an integer >= 20 or None, got True"):
        CudaMemoryManager(max_split_size_mb=True)
    with pytest.raises(ValueError, match="`log_every_n_steps`"):
        CudaMemoryManager(log_every_n_steps=0)
    with pytest.raises(ValueError, match="`release_min_reserved_gb` must be a number >= 0, got -5"):
        CudaMemoryManager(release_min_reserved_gb=-5)
    with pytest.raises(TypeError, match="`release_min_reserved_gb` must be a number >= 0, got None"):
        CudaMemoryManager(release_min_reserved_gb=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_history_entries` must be an integer >= 1, got -1"):
        CudaMemoryManager(max_history_entries=-1)
    with pytest.raises(TypeError, match="`record_history` must be True or False, got 'yes'"):
        CudaMemoryManager(record_history="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`expandable_segments` must be True or False, got 'false' \\(str\\)"):
        CudaMemoryManager(expandable_segments="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`snapshot_dir` must be a directory path"):
        CudaMemoryManager(snapshot_dir=5)  # type: ignore[arg-type]
    # an overflow with no word on the argument; "never release" is `release_threshold=None`
    with pytest.raises(ValueError, match="^`release_min_reserved_gb` must be a finite number >= 0, got inf. .*None"):
        CudaMemoryManager(release_min_reserved_gb=float("inf"))


def test_a_snapshot_dir_that_is_a_file_fails_in_init(tmp_path: Path) -> None:
    """The snapshot is written when the fit has already failed out of memory: a file in the directory's place lost
    it then, with one more error in the log."""
    afile = tmp_path / "snaps"
    afile.write_text("a file of the user's")
    with pytest.raises(ValueError, match=f"^`snapshot_dir` must be a directory, got '{afile}', an existing file"):
        CudaMemoryManager(snapshot_dir=str(afile))
    with pytest.raises(ValueError, match="^`snapshot_dir` must be a path under a directory, .* is a file"):
        CudaMemoryManager(snapshot_dir=afile / "deeper")
    assert CudaMemoryManager(snapshot_dir=tmp_path / "new" / "dir").snapshot_dir == str(tmp_path / "new" / "dir")
    # the snapshot's store is checked now, not when the fit has just failed out of memory
    with pytest.raises(ValueError, match="^`snapshot_dir` must be a local path or an fsspec URL, got 'sS3://b/oom'"):
        CudaMemoryManager(snapshot_dir="sS3://b/oom")


def test_oom_snapshot_goes_to_a_remote_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)  # a URL turned into a local path would land in here, in a folder named `memory:`
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    mm = CudaMemoryManager(snapshot_dir=f"memory://oom-{tmp_path.name}/logs")
    mm._active = True  # as `setup` leaves it on a CUDA device
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"segments": []})
    try:
        mm.on_exception(fake_trainer(tmp_path, ListLogger()), None, torch.OutOfMemoryError("CUDA out of memory"))  # type: ignore[arg-type]
        assert mm.snapshot_path == f"memory://oom-{tmp_path.name}/logs/oom_snapshot_rank0.pickle"
        assert fsspec.filesystem("memory").exists(f"/oom-{tmp_path.name}/logs/oom_snapshot_rank0.pickle")
        assert list(tmp_path.iterdir()) == []
    finally:
        fsspec.filesystem("memory").rm(f"/oom-{tmp_path.name}", recursive=True)


class Hog(TimedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # 1 PiB: always out of memory
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
def test_real_gpu_oom_writes_a_snapshot(tmp_path: Path) -> None:
    mm = CudaMemoryManager(snapshot_dir=str(tmp_path), record_history=True, log_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=2,
        logger=False,
        callbacks=[mm],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    train, _ = loaders(None, 0.0)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(Hog(), train)
    assert mm.snapshot_path and Path(mm.snapshot_path).stat().st_size > 0
    stats = torch.cuda.memory_stats()
    assert stats["num_ooms"] >= 1
