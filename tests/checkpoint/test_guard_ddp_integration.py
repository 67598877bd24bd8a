"""CheckpointGuard under DDP (2 CPU processes, gloo): whatever stops rank 0 from claiming the checkpoint directory,
every rank raises the same error before the first step, none left waiting in a collective."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_in_processes


def _fit_into_a_file(rank: int, world_size: int, root: str) -> tuple[str, str]:
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.checkpoint import CheckpointGuard, DeltaCheckpointIO
    from tests.tiny import CheckpointModel, tiny_loader
    from tests.tiny import ckpt_trainer as trainer

    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=f"{root}/not_a_dir")  # a file: rank 0 cannot claim it
    t = trainer(root, [DeltaCheckpointIO()], [ckpt, CheckpointGuard()], strategy="ddp", devices=world_size)
    try:
        t.fit(CheckpointModel(), tiny_loader(64))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return type(e).__name__, str(e)
    return "none", f"trained {t.global_step} steps"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_raises_rank_zeros_claim_error(tmp_path: Path) -> None:
    (tmp_path / "not_a_dir").write_text("a file where the checkpoint directory should be")
    results = run_in_processes(_fit_into_a_file, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    assert results[0] == results[1]
    assert results[0][0] == "NotADirectoryError" and "not_a_dir" in results[0][1] and "\n" not in results[0][1]
