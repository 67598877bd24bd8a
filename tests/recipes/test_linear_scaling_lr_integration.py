"""Trainer-level tests of LinearScalingLR: the global batch (model-parallel ranks that share a batch counted once),
schedulers scaled along, idempotent resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.callbacks import LinearScalingLR
from lightning_accel.recipes.lr import WarmupCosineLR
from tests.helpers import run_in_processes
from tests.tiny import LRProbe, classifier, loader, trainer


def _constant_model(lr: float = 0.01):
    m = classifier(lr=lr)
    m.configure_optimizers = lambda: torch.optim.SGD(m.parameters(), lr=lr)  # type: ignore[method-assign]
    return m


def test_scales_by_global_batch_including_accumulation() -> None:
    probe = LRProbe()
    cb = LinearScalingLR(base_batch_size=16)
    t = trainer(callbacks=[cb, probe], accumulate_grad_batches=2)
    t.fit(_constant_model(0.01), loader(batch_size=32))
    assert cb.global_batch_size == 32 * 1 * 1 * 2
    assert cb.factor == 4.0
    assert probe.lrs and all(lr == pytest.approx(0.04) for lr in probe.lrs)
    assert cb.state_dict() == {"base_batch_size": 16, "global_batch_size": 64, "factor": 4.0}


def test_scheduler_follows_the_scaled_rate() -> None:
    probe = LRProbe()
    m = classifier(lr=0.01)

    def configure_optimizers() -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        sched = WarmupCosineLR(opt, total_steps=4, warmup_steps=2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    m.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    trainer(callbacks=[LinearScalingLR(base_batch_size=8), probe]).fit(m, loader(batch_size=16))
    assert probe.lrs == pytest.approx([0.01, 0.02, 0.02, 0.01])  # peak 0.02 = 2 x 0.01, then cosine


def test_resume_does_not_compound(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    cb = LinearScalingLR(base_batch_size=16)
    t = trainer(callbacks=[cb, ckpt], enable_checkpointing=True, default_root_dir=tmp_path)
    t.fit(_constant_model(0.01), loader(batch_size=32))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["callbacks"]["LinearScalingLR"]["factor"] == 2.0
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.02)
    probe = LRProbe()
    t2 = trainer(callbacks=[LinearScalingLR(base_batch_size=16), probe], max_epochs=2)
    t2.fit(_constant_model(0.01), loader(batch_size=32), ckpt_path=tmp_path / "last.ckpt")
    assert probe.lrs and all(lr == pytest.approx(0.02) for lr in probe.lrs)  # not 0.04
    probe3 = LRProbe()  # resumed with a batch twice as large: total factor 4, relative to the unscaled rate
    t3 = trainer(callbacks=[LinearScalingLR(base_batch_size=16), probe3], max_epochs=2)
    t3.fit(_constant_model(0.01), loader(batch_size=64), ckpt_path=tmp_path / "last.ckpt")
    assert probe3.lrs and all(lr == pytest.approx(0.04) for lr in probe3.lrs)


def test_a_later_fit_without_a_checkpoint_scales_the_fresh_rates(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(callbacks=[LinearScalingLR(base_batch_size=16), ckpt], enable_checkpointing=True)
    t.fit(_constant_model(0.01), loader(batch_size=32))
    cb = LinearScalingLR(base_batch_size=16)
    trainer(callbacks=[cb], max_epochs=2).fit(
        _constant_model(0.01), loader(batch_size=32), ckpt_path=tmp_path / "last.ckpt"
    )
    probe = LRProbe()  # the same callback, a fresh model, no checkpoint: x2 of 0.01, not "already x2" from the last fit
    trainer(callbacks=[cb, probe]).fit(_constant_model(0.01), loader(batch_size=32))
    assert probe.lrs and all(lr == pytest.approx(0.02) for lr in probe.lrs)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`base_batch_size`"):
        LinearScalingLR(base_batch_size=0)
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1 or None, got -2"):
        LinearScalingLR(base_batch_size=8, batch_size=-2)
    with pytest.raises(TypeError, match="`base_batch_size`"):
        LinearScalingLR(base_batch_size=True)


def _model_parallel_fits(rank: int, world_size: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accel.models import TinyGPT
    from lightning_accel.parallel import PipelineStrategy, ShardedStrategy

    found = {}
    for name, strategy in (("pipeline", PipelineStrategy()), ("tensor", ShardedStrategy(tensor_parallel_size=2))):
        torch.manual_seed(0)  # every rank builds the same data: the two ranks of the group read the same batch of 8
        tokens = torch.randint(0, 27, (32, 17))
        cb = LinearScalingLR(base_batch_size=8)
        t = trainer(devices=2, strategy=strategy, max_steps=1, callbacks=[cb])
        t.fit(TinyGPT(n_layer=2, n_embd=32, block_size=17), DataLoader(TensorDataset(tokens), batch_size=8))
        found[name] = (cb.global_batch_size, cb.factor)
    return found


@pytest.mark.slow
def test_ranks_of_a_pipeline_or_tensor_parallel_group_are_one_replica() -> None:
    # 2 processes, 1 data-parallel replica: the global batch is the one batch of 8 the group reads, not 2 x 8
    for found in run_in_processes(_model_parallel_fits, 2, init_process_group=False, timeout=300):
        assert found == {"pipeline": (8, 1.0), "tensor": (8, 1.0)}
