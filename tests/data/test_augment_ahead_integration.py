"""CPU augmentation off the training thread (``cpu_augment="thread"``): the same batches as in the step, per seed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_accel.data import CachedDataModule, GpuAugment
from lightning_accel.models import ImageClassifier
from tests.helpers import run_in_processes


class _Recording(ImageClassifier):
    """Keeps every training batch it receives (16 px, so a few KB each)."""

    def __init__(self) -> None:
        super().__init__(width=8, blocks=(1,))
        self.example_input_array = None
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[0].detach().clone())
        return super().training_step(batch, batch_idx)


class _ThreadNoting(GpuAugment):
    """Records the thread each training batch is augmented on."""

    threads: set[str]

    def forward(self, x: torch.Tensor, train: bool | None = None, call: int | None = None) -> torch.Tensor:
        if train:
            self.threads.add(threading.current_thread().name)
        return super().forward(x, train=train, call=call)


def _fit(
    origin: str, tmp: Path, mode: str, seed: int, devices: int = 1, epochs: int = 3, workers: int = 1
) -> tuple[list[torch.Tensor], set[str], int]:
    L.seed_everything(seed, verbose=False)
    aug = _ThreadNoting((0.2,) * 3, (0.3,) * 3, crop_scale=(0.3, 1.0), flip_p=0.5, brightness=0.2, contrast=0.2)
    aug.threads = set()
    dm = CachedDataModule(
        origin,
        cache_dir=str(tmp / mode / "cache"),
        ram_dir=str(tmp / mode / "ram"),
        ram_bytes="4MiB",
        image_size=16,
        batch_size=16,
        num_workers=workers,
        val_fraction=0.2,
        train_augment=aug,
        mean=(0.2,) * 3,
        std=(0.3,) * 3,
        cpu_augment=mode,
    )
    model = _Recording()
    trainer = L.Trainer(
        max_epochs=epochs,
        limit_train_batches=3,  # passes left unfinished: batches drawn ahead but never taken
        limit_val_batches=1,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    return model.seen, aug.threads, aug.calls


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_thread_and_step_give_identical_batches_for_a_seed(small_digits: Path, tmp_path: Path) -> None:
    ahead, threads, calls = _fit(str(small_digits), tmp_path, "thread", seed=3)
    step, step_threads, step_calls = _fit(str(small_digits), tmp_path, "step", seed=3)
    assert len(ahead) == 9 and _same(ahead, step)  # 3 epochs x 3 batches, bit for bit
    assert calls == step_calls == 9  # the stream advanced by the batches taken, not by those drawn ahead
    assert threads == {"la-transform-ahead"} and threading.main_thread().name in step_threads
    other, _, _ = _fit(str(small_digits), tmp_path / "b", "thread", seed=4)
    assert not torch.equal(other[0], ahead[0])  # another seed, another stream


def _ddp_rank(rank: int, world: int, origin: str, tmp: str) -> list[list[Any]]:
    out = []
    for mode in ("thread", "step"):
        seen, _, _ = _fit(origin, Path(tmp) / f"r{rank}", mode, seed=5, devices=2, epochs=2, workers=0)
        out.append([x.numpy() for x in seen])  # numpy arrays cross the result queue by value
    return out


def test_two_processes_thread_matches_step_and_ranks_differ(small_digits: Path, tmp_path: Path) -> None:
    out = run_in_processes(_ddp_rank, 2, (str(small_digits), str(tmp_path)), init_process_group=False, timeout=240)
    (t0, s0), (t1, s1) = ([[torch.from_numpy(x) for x in run] for run in rank] for rank in out)
    assert len(t0) == 6 and _same(t0, s0) and _same(t1, s1)
    assert not torch.equal(t0[0], t1[0])  # ranks draw their own streams (and read their own samples)


def test_cpu_augment_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`cpu_augment`"):
        CachedDataModule(str(tmp_path), cpu_augment="workers")
