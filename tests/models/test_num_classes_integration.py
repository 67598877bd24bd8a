"""`ImageClassifier(num_classes="auto")` under 2-process gloo DDP: every rank sizes the same head, one model trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_in_processes
from tests.models.test_num_classes import _image_folder


def _ddp_auto(rank: int, world_size: int, origin: str, cache_dir: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_accel.data import CachedDataModule
    from lightning_accel.models import ImageClassifier

    pl.seed_everything(0)
    model = ImageClassifier(num_classes="auto", width=4, blocks=(1,))
    dm = CachedDataModule(
        origin=origin, image_size=8, cache_dir=cache_dir, ram_bytes=0, batch_size=4, num_workers=0, val_fraction=0.25
    )
    t = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(model, datamodule=dm)
    return {
        "out": model.model.fc.out_features,
        "hparam": model.hparams["num_classes"],
        "steps": t.global_step,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    }


@pytest.mark.slow
def test_auto_under_ddp_builds_the_same_head_on_every_rank(tmp_path: Path) -> None:
    origin = _image_folder(tmp_path / "imgs", 12, per_class=3)
    r0, r1 = run_in_processes(
        _ddp_auto, 2, (str(origin), str(tmp_path / "cache")), init_process_group=False, timeout=240
    )
    assert r0["out"] == r1["out"] == 12 and r0["hparam"] == r1["hparam"] == 12
    assert r0["steps"] == r1["steps"] > 0
    assert torch.allclose(torch.tensor(r0["weights"]), torch.tensor(r1["weights"]))  # DDP kept one model
