"""A synchronous ``DeltaCheckpointIO`` with a plain Lightning ``ModelCheckpoint`` under DDP (2 CPU processes, gloo).

Without ``CheckpointGuard`` (or ``DeltaModelCheckpoint``) a failed save or removal is raised on global rank 0 alone:
that is warned once, on rank 0, naming the fix. With the guard nothing is warned, a save after the fit is still raised
on every rank, and a finished Trainer's model is not kept alive by the wrapper that covers such saves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_in_processes


def _fits(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import gc
    import warnings
    import weakref
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.checkpoint import CheckpointGuard, DeltaCheckpointIO
    from tests.checkpoint.test_sync_failures_ddp_integration import failed_final_save
    from tests.tiny import CheckpointModel, ckpt_trainer, tiny_loader

    def fit(name: str, guard: bool) -> tuple[Any, Any, list[str]]:
        io = DeltaCheckpointIO()
        ckpt = ModelCheckpoint(
            dirpath=f"{root}/{name}", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max"
        )
        callbacks: list[Any] = [ckpt, CheckpointGuard()] if guard else [ckpt]
        # a collective left waiting would wait this long, not Lightning's 30 minutes, before failing the test
        strategy = DDPStrategy(timeout=timedelta(seconds=15))
        t = ckpt_trainer(
            root, [io], callbacks, strategy=strategy, devices=world_size, max_steps=3, use_distributed_sampler=True
        )
        model = CheckpointModel(hidden=8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(model, tiny_loader(64))
        return t, model, [str(w.message) for w in caught if "CheckpointGuard" in str(w.message)]

    out: dict[str, Any] = {}
    _, _, out["unguarded"] = fit("unguarded", guard=False)
    t, model, out["guarded"] = fit("guarded", guard=True)

    # a save after the fit that fails on rank 0 is raised on every rank (the guard covers it after its teardown too)
    io = t.strategy.checkpoint_io
    out["direct"] = failed_final_save(t, io, f"{root}/guarded/final.ckpt")
    t.save_checkpoint(f"{root}/guarded/after.ckpt", weights_only=True)  # a later save is not affected

    # the finished Trainer, once dropped, does not keep its model alive
    alive = weakref.ref(model)
    del t, model, io
    gc.collect()
    out["model_alive"] = alive() is not None
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sync_plain_model_checkpoint_is_warned_without_the_guard_and_frees_the_model_with_it(tmp_path: Path) -> None:
    r0, r1 = run_in_processes(_fits, 2, (str(tmp_path),), init_process_group=False, timeout=180)
    # without the guard: warned once, on global rank 0 alone (the rank that saves), naming both fixes
    assert len(r0["unguarded"]) == 1, r0
    assert "rank 0 alone" in r0["unguarded"][0] and "DeltaModelCheckpoint" in r0["unguarded"][0], r0
    assert "async_save" not in r0["unguarded"][0], r0  # the synchronous plugin's own sentence
    assert r1["unguarded"] == [], r1
    # with it: nothing to warn about, a failed save after the fit raised on every rank, and the model freed
    assert r0["guarded"] == [] and r1["guarded"] == [], (r0, r1)
    assert "Permission denied" in r0["direct"] and "final.ckpt" in r0["direct"], r0
    assert "Permission denied" in r1["direct"] and "global rank 0" in r1["direct"], r1
    assert not (tmp_path / "guarded" / "final.ckpt").exists()
    assert (tmp_path / "guarded" / "after.ckpt").is_file()
    assert not r0["model_alive"] and not r1["model_alive"], (r0, r1)
