"""DeltaCheckpointIO under DDP (2 CPU processes, gloo): rank 0 writes, every rank resumes from the same manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fit_and_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel import DeltaCheckpointIO
    from tests.tiny import CheckpointModel, tiny_loader
    from tests.tiny import ckpt_trainer as trainer

    torch.manual_seed(0)
    ckpt = ModelCheckpoint(
        dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    kw = dict(strategy="ddp", devices=world_size, use_distributed_sampler=True, max_epochs=1)
    t = trainer(root, [DeltaCheckpointIO(async_save=True)], [ckpt], **kw)
    t.fit(CheckpointModel(), tiny_loader(64))
    saved_step = t.global_step
    resumed = CheckpointModel()
    t2 = trainer(root, [DeltaCheckpointIO()], [], enable_checkpointing=False, **{**kw, "max_epochs": 2})
    t2.fit(resumed, tiny_loader(64), ckpt_path=f"{root}/ckpt/last.ckpt")
    weights = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    return {"saved_step": saved_step, "final_step": t2.global_step, "checksum": float(weights.double().sum())}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_rank_zero_writes_and_all_ranks_resume(tmp_path: Path) -> None:
    results = run_in_processes(_fit_and_resume, 2, (str(tmp_path),), init_process_group=False, timeout=240)
    assert results[0]["saved_step"] == results[1]["saved_step"] == 2  # 64 samples / 2 ranks / batch 16
    assert results[0]["final_step"] == results[1]["final_step"] == 4
    assert results[0]["checksum"] == results[1]["checksum"]  # both ranks restored the same state and stayed in sync
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert "last.ckpt" in names


def _outage_at_the_name_check(rank: int, world_size: int, root: str) -> str:
    from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint
    from tests.checkpoint.test_async_names import _Outage
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    io = DeltaCheckpointIO(async_save=True)  # on_save_error="raise"
    cb = DeltaModelCheckpoint(
        dirpath=f"{root}/ckpt", filename="{epoch}", every_n_train_steps=2, save_top_k=-1, monitor="train_loss"
    )
    kw = dict(strategy="ddp", devices=world_size, use_distributed_sampler=True, max_epochs=1)
    t = ckpt_trainer(root, [io], [cb, _Outage(cb)], **kw)
    try:
        t.fit(CheckpointModel(), tiny_loader(64))
    except (ConnectionError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_store_error_at_the_name_check_stops_every_rank(tmp_path: Path) -> None:
    """The existence check runs on rank 0; its failure reaches every rank through the same collective, so every rank
    stops with an error instead of the others waiting in the collective until its timeout."""
    results = run_in_processes(_outage_at_the_name_check, 2, (str(tmp_path),), init_process_group=False, timeout=120)
    assert "Could not connect" in results[0]
    assert results[1].startswith("OSError") and "failed on global rank 0" in results[1]


#: Lightning's multiprocessing launcher with forked workers: the launcher of ``ddp_spawn``, which hands rank 0's final
#: weights to the main process through a file saved by this plugin, but its ranks end in ``os._exit``. A spawned gloo
#: rank of torch 2.14 now and then dies with "terminate called without an active exception" (SIGABRT) in the
#: interpreter's exit after its fit has returned, a failure of neither the fit nor the plugin. What only ``spawn``
#: does, pickling the plugin, is checked directly in the test.
LAUNCHED = "ddp_fork"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", [False, True])
def test_ddp_spawn_trains_and_hands_rank_zeros_weights_to_the_main_process(
    tmp_path: Path, async_save: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ddp_spawn` pickles the Trainer, this plugin included, to start each rank; rank 0 then saves the final weights
    through it after `teardown`, and the main process loads them once the ranks have exited and removes the file."""
    import pickle

    import torch

    # the ranks' temporary folders, where the launcher's hand-over file goes (a fresh `mkdtemp()` folder)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel import DeltaCheckpointIO
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    torch.manual_seed(0)
    model = CheckpointModel()
    before = [p.detach().clone() for p in model.parameters()]
    io = DeltaCheckpointIO(async_save=async_save)
    # what `ddp_spawn` does to the plugin to start each rank: the copy works as the original
    copy = pickle.loads(pickle.dumps(io))
    assert isinstance(copy, DeltaCheckpointIO) and copy.async_save is async_save
    copy.save_checkpoint({"w": torch.ones(3)}, tmp_path / "pickled" / "a.ckpt")
    copy.teardown()
    assert torch.equal(DeltaCheckpointIO().load_checkpoint(tmp_path / "pickled" / "a.ckpt")["w"], torch.ones(3))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=1)
    kw = dict(strategy=LAUNCHED, devices=2, max_epochs=1, limit_val_batches=0)
    ckpt_trainer(tmp_path, [io], [ckpt], **kw).fit(model, tiny_loader(64))
    # the main process's model holds what rank 0 trained (read back from its save after the ranks exited)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [p.name for p in (tmp_path / "ckpt").glob("*.ckpt")] == ["epoch=0-step=2.ckpt"]
    io.wait()  # an async removal runs on the writer's thread
    # the hand-over file is gone with its blobs: they used to wait out the grace period for a collection that never
    # came, a copy of the final weights left in the temporary folder by every fit
    left = [p for p in temp.rglob("*") if ".delta_blobs" in p.parts or p.name == ".temp.ckpt"]
    assert not left, left


def test_the_hand_over_files_blobs_wait_when_other_checkpoints_share_its_folder(tmp_path: Path) -> None:
    """Older Lightning releases hand the weights over in `default_root_dir`, beside the user's files and maybe their
    checkpoints: those keep their grace period and everything that is not the plugin's stays."""
    import torch

    from lightning_accel import DeltaCheckpointIO

    (tmp_path / "notes.txt").write_text("mine")
    io = DeltaCheckpointIO()
    io.save_checkpoint({"w": torch.arange(1000.0)}, tmp_path / "kept.ckpt")
    io.save_checkpoint({"w": torch.arange(1000.0) + 1}, tmp_path / ".temp.ckpt")
    blobs = sorted(p for p in (tmp_path / ".delta_blobs").rglob("*") if p.is_file() and len(p.name) == 40)
    io.remove_checkpoint(tmp_path / ".temp.ckpt")
    io.teardown()
    assert not (tmp_path / ".temp.ckpt").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert torch.equal(DeltaCheckpointIO().load_checkpoint(tmp_path / "kept.ckpt")["w"], torch.arange(1000.0))
    # the removed file's blobs wait out the grace period (a reader of it may still be reading)
    assert sorted(p for p in (tmp_path / ".delta_blobs").rglob("*") if p.is_file() and len(p.name) == 40) == blobs

    alone = tmp_path / "alone"
    alone.mkdir()
    io2 = DeltaCheckpointIO()
    io2.save_checkpoint({"w": torch.arange(1000.0)}, alone / ".temp.ckpt")
    assert torch.equal(io2.load_checkpoint(alone / ".temp.ckpt")["w"], torch.arange(1000.0))
    io2.remove_checkpoint(alone / ".temp.ckpt")
    io2.teardown()
    assert not alone.exists()  # nothing but the hand-over was there: its blobs and the blob store went at once
