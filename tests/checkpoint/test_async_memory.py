"""Async saves at every step keep memory within the documented bound and give it back at teardown (measured, not
assumed): peak RSS growth over 200 saves (100 steps, each saving ``step=N.ckpt`` and ``last.ckpt``) of a ~10 MB
checkpoint, and the RSS left after ``fit`` returned.

The bound (``docs/checkpoint.md``, "Async saves are bounded"): ``max_pending + 1`` snapshot buffers (one save may
overtake an unstarted one until the next call) and one chain base per tensor, plus the encode temporaries of
``io_threads`` tensors at a time. The model's own training state (Adam's moments, gradients) grows too and is counted
separately. No timing is asserted.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.checkpoint import DeltaCheckpointIO
from tests.tiny import ckpt_trainer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")

WIDTH = 640  # two 640x640 layers: ~0.8M parameters, a ~10 MB checkpoint with Adam's two moments


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 8))
        self.extra = nn.Linear(WIDTH, WIDTH)  # trained too (its output is added in)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x + self.extra(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class _PeakRSS(L.Callback):
    """RSS sampled after every step (after the step's saves were submitted) and at every save."""

    def __init__(self) -> None:
        self.samples: list[int] = []

    def on_train_batch_end(self, *args: Any, **kw: Any) -> None:
        self.samples.append(_rss())

    def on_save_checkpoint(self, *args: Any, **kw: Any) -> None:
        self.samples.append(_rss())


def test_rss_growth_over_200_saves_stays_within_the_bound_and_is_released(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100 * 4, WIDTH, generator=g)
    data = DataLoader(TensorDataset(x, torch.randint(0, 8, (len(x),), generator=g)), batch_size=4)
    model = _Wide()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ckpt = 3 * params  # weights + Adam's exp_avg and exp_avg_sq
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    io = DeltaCheckpointIO(async_save=True, max_pending=2, io_threads=2)
    probe = _PeakRSS()
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = ckpt_trainer(tmp_path, [io], [probe, cb], max_steps=100, max_epochs=None)
    gc.collect()
    rss0 = _rss()
    trainer.fit(model, data)
    gc.collect()
    after = _rss() - rss0
    stats = io.writer_stats
    assert stats.submitted >= 200 and stats.pending_peak <= 3
    # Warm runs allocate no snapshot buffers per save: at most max_pending + 1 per tensor of the checkpoint.
    last = io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    n_tensors = _count_tensors(last)
    assert stats.buffers_allocated <= 3 * n_tensors, (stats, n_tensors)
    training_state = 3 * params  # gradients + Adam's moments, held by the model and the optimizer
    bound = 3 * ckpt + ckpt + 2 * 4 * largest  # max_pending + 1 snapshots + one base + encode temporaries
    slack = 96 * 2**20
    peak = max(probe.samples) - rss0
    assert peak <= training_state + bound + slack, (
        f"peak RSS growth {peak / 2**20:.0f} MB > bound {(training_state + bound + slack) / 2**20:.0f} MB "
        f"(checkpoint {ckpt / 2**20:.0f} MB)"
    )
    # After teardown the snapshot buffers and chain bases are gone: only the training state stays.
    assert after <= training_state + slack, f"RSS still grown by {after / 2**20:.0f} MB after fit"
    assert last["global_step"] == 100


def _count_tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return 0
