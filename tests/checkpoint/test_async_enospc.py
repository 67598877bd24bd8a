"""A real full disk under async saves: a 30 MB tmpfs filled by saves at every step. The fit stops at the next save
call with one line naming the first failed save, the last good checkpoint stays loadable, and the failed save's blobs
are gone (every blob left is referenced by a manifest). Needs root (``mount -t tmpfs``); skipped otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.checkpoint import DeltaCheckpointIO
from lightning_accel.checkpoint.plugin import CheckpointSaveError
from tests.helpers import mounted_tmpfs


def _until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", "30m") as d:
        yield d


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))  # ~0.5M params: ~6 MB/save

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _OneStepAtATime(L.Callback):
    def __init__(self, io: DeltaCheckpointIO) -> None:
        self.io = io

    def on_train_batch_start(self, *args: Any, **kw: Any) -> None:
        _until(lambda: self.io._writer.pending == 0, "the writer is idle")


def _referenced(d: Path) -> set[str]:
    keys: set[str] = set()
    for m in d.glob("*.ckpt"):
        raw = json.loads(m.read_text())
        keys.add(raw["skeleton"])
        for entry in raw["tensors"].values():
            keys.update(entry["chain"])
    return keys


def test_a_full_disk_stops_the_fit_at_the_next_save_and_leaves_no_failed_blobs(small_disk: Path) -> None:
    io = DeltaCheckpointIO(async_save=True)
    cb = ModelCheckpoint(dirpath=small_disk, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    data = DataLoader(TensorDataset(torch.randn(64 * 4, 512)), batch_size=4)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[_OneStepAtATime(io), cb],
    )
    with pytest.raises(CheckpointSaveError) as info:
        trainer.fit(_Model(), data)
    msg = str(info.value)
    assert "\n" not in msg and "No space left on device" in msg, msg
    assert isinstance(info.value, OSError) and io.writer_stats.failed == 1
    saved = sorted((int(p.stem.split("=")[1]) for p in small_disk.glob("*.ckpt")), reverse=True)
    assert saved and saved[0] < trainer.global_step <= saved[0] + 2  # the failed step, or the next one, stopped it
    assert f"step={saved[0] + 1}.ckpt" in msg  # the first failure is the one named
    blobs = {p.name for p in (small_disk / ".delta_blobs").rglob("*") if p.is_file() and p.name != ".lock"}
    assert blobs == _referenced(small_disk)  # the failed save's blobs were deleted
    last_good = DeltaCheckpointIO().load_checkpoint(small_disk / f"step={saved[0]}.ckpt")
    assert last_good["global_step"] == saved[0]
