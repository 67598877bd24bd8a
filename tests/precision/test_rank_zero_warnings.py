"""Surgery warnings under DDP: said once, on global rank 0, while every rank does the same surgery (each rank would
otherwise print the same "nothing to fuse" and unknown-`ignore_modules` lines, once per process)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.precision import FusedPrecision, apply_fusions
from lightning_accel.precision.modules import is_fused
from tests.helpers import run_in_processes


def _surgery_warnings(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        apply_fusions(model, ignore_modules=["missing"])
    return [str(w.message) for w in record]


@pytest.mark.parametrize("rank, expected", [("0", 2), ("1", 0)])
def test_nothing_to_fuse_and_unknown_names_warn_on_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, rank: str, expected: int
) -> None:
    monkeypatch.setenv("RANK", rank)
    messages = _surgery_warnings(nn.Sequential(nn.ReLU()))
    assert len(messages) == expected, messages
    if expected:
        assert any("found nothing to fuse" in m for m in messages) and any("`ignore_modules`" in m for m in messages)


def test_other_ranks_still_do_the_surgery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    assert _surgery_warnings(model) == []  # the unknown name is still said nowhere but on rank 0
    assert is_fused(model)


class _Plain(L.LightningModule):
    """Nothing to fuse: a bare Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _ddp_worker(rank: int, world_size: int, root: str) -> list[str]:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=1, logger=False,
        plugins=[FusedPrecision("bf16-mixed", ignore_modules=["missing"])], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(_Plain(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    words = ("FusedPrecision", "fuse", "ignore_modules")
    return [str(w.message) for w in record if any(word in str(w.message) for word in words)]


def test_a_ddp_fit_warns_on_rank_zero_only(tmp_path: Path) -> None:
    rank0, rank1 = run_in_processes(_ddp_worker, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    assert any("found nothing to fuse" in m for m in rank0), rank0
    assert any("`ignore_modules` names ['missing']" in m for m in rank0), rank0
    assert rank1 == [], rank1


@pytest.mark.parametrize("rank, expected", [(0, 1), (1, 0)])
def test_unused_compile_kwargs_warn_on_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, rank: int, expected: int
) -> None:
    """Every DDP process builds the plugin (Lightning's launcher reruns the script)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        FusedPrecision("bf16-mixed", device="cpu", compile_kwargs={"backend": "eager"})
    messages = [str(w.message) for w in record if "compile_kwargs" in str(w.message)]
    assert len(messages) == expected, messages
    assert all(w.filename == __file__ for w in record if "compile_kwargs" in str(w.message))  # points at the caller
