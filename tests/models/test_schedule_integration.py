"""The LR schedules follow the current fit when a run is extended or resumed at another world size.

Straight runs are the oracle: an extended run (2 epochs, then resumed to 4) and a run resumed at another world size
must use the learning rates the uninterrupted run uses from the same point on, and end at the same final rate.
The default schedule's test uses Adam(W)'s defaults of ``ImageClassifier``; the world-size test ``PerStepLR`` with
``WarmupCosineLR`` from a LightningCLI-style ``configure_optimizers``, on 2 gloo processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.recipes import PerStepLR
from lightning_accel.recipes.lr import WarmupCosineLR
from tests.helpers import run_in_processes
from tests.tiny import LRProbe, classifier, loader, trainer

LR = 0.01


def _fit(root: Path, max_epochs: int, ckpt_path: str | None = None, **kw: Any) -> tuple[list[float], float, float]:
    """ImageClassifier with its default AdamW + cosine; returns (lrs used per step, final lr, val_loss)."""
    pl.seed_everything(0)
    probe = LRProbe()
    t = trainer(
        max_epochs=max_epochs,
        limit_train_batches=8,
        limit_val_batches=2,
        callbacks=[probe, ModelCheckpoint(dirpath=root, save_last=True)],
        enable_checkpointing=True,
        default_root_dir=root,
        **kw,
    )
    t.fit(classifier(width=4, lr=LR), loader(32, 256, shuffle=True), loader(32, 64), ckpt_path=ckpt_path)
    final = float(t.optimizers[0].param_groups[0]["lr"])
    return probe.lrs, final, float(t.callback_metrics["val_loss"])


def test_default_schedule_extended_run_matches_the_straight_run(tmp_path: Path) -> None:
    straight_lrs, straight_final, straight_loss = _fit(tmp_path / "straight", 4)
    first_lrs, _, first_loss = _fit(tmp_path / "ext", 2)
    ext_lrs, ext_final, ext_loss = _fit(tmp_path / "ext", 4, ckpt_path=str(tmp_path / "ext" / "last.ckpt"))
    # the first fit ran its own (2-epoch) cosine; the extension continues on the 4-epoch one from step 16
    assert len(ext_lrs) == 16 and ext_lrs == pytest.approx(straight_lrs[16:], rel=1e-9)
    assert first_lrs[-1] < LR * 0.1 and ext_lrs[0] > first_lrs[-1]  # the 4-epoch cosine is higher half-way
    assert straight_final == pytest.approx(LR * 0.01, rel=1e-12)  # min_lr, reached at the last step
    assert ext_final == pytest.approx(straight_final, rel=1e-12)
    # the weights differ (the first fit annealed over 2 epochs); the 2 extra epochs must still improve on them
    assert ext_loss < first_loss, (first_loss, ext_loss, straight_loss)


def _perstep_model() -> Any:
    m = classifier(width=4, lr=LR)

    def configure_optimizers() -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        return {"optimizer": opt, "lr_scheduler": WarmupCosineLR(opt, warmup_steps=2, min_lr=1e-4)}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return m


def _perstep_fit(root: str, max_epochs: int, devices: int, ckpt_path: str | None) -> dict[str, Any]:
    pl.seed_everything(0)
    probe = LRProbe()
    t = trainer(
        max_epochs=max_epochs,
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        callbacks=[PerStepLR(), probe, ModelCheckpoint(dirpath=root, save_last=True)],
        enable_checkpointing=True,
        default_root_dir=root,
        limit_train_batches=None,
    )
    t.fit(_perstep_model(), loader(32, 256), ckpt_path=ckpt_path)
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, WarmupCosineLR)
    return {
        "lrs": probe.lrs,
        "final": float(t.optimizers[0].param_groups[0]["lr"]),
        "total": sched.total_steps,
        "world": t.world_size,
    }


def _ddp(rank: int, world_size: int, root: str, max_epochs: int, ckpt_path: str | None) -> dict[str, Any]:
    return _perstep_fit(root, max_epochs, world_size, ckpt_path)


@pytest.mark.slow
def test_per_step_lr_resumed_at_another_world_size_continues_the_progress_fraction(tmp_path: Path) -> None:
    # oracle: a straight single-process run, 8 batches of 32 per epoch, 3 epochs = 24 steps
    straight = _perstep_fit(str(tmp_path / "straight"), 3, 1, None)
    assert straight["total"] == 24 and straight["final"] == pytest.approx(1e-4, rel=1e-12)

    # 2 -> 1: one epoch on 2 gloo processes (4 steps each), then the rest on one process
    root = str(tmp_path / "two_to_one")
    r0, r1 = run_in_processes(_ddp, 2, (root, 1, None), init_process_group=False, timeout=300)
    assert r0["world"] == 2 and r0["total"] == 4 and r0["lrs"] == r1["lrs"]
    resumed = _perstep_fit(root, 3, 1, str(Path(root) / "last.ckpt"))
    assert resumed["total"] == 24
    # one epoch done = position 8 of this fit's 24 steps: the straight run's rates from there on, none at min_lr early
    assert resumed["lrs"] == pytest.approx(straight["lrs"][8:], rel=1e-9)
    assert resumed["final"] == pytest.approx(straight["final"], rel=1e-12)

    # 1 -> 2: one epoch on one process (8 steps), the rest on 2 processes (4 steps per epoch each)
    root = str(tmp_path / "one_to_two")
    _perstep_fit(root, 1, 1, None)
    q0, q1 = run_in_processes(_ddp, 2, (root, 3, str(Path(root) / "last.ckpt")), init_process_group=False, timeout=300)
    assert q0["total"] == 12 and q0["lrs"] == q1["lrs"] and len(q0["lrs"]) == 8
    half = WarmupCosineLR(torch.optim.SGD([torch.zeros(1)], lr=LR), total_steps=12, warmup_steps=2, min_lr=1e-4)
    expected = []
    for _ in range(4):
        half.step()
    for _ in range(8):
        expected.append(half.get_last_lr()[0])
        half.step()
    assert q0["lrs"] == pytest.approx(expected, rel=1e-9)
    assert q0["final"] == pytest.approx(straight["final"], rel=1e-12)
