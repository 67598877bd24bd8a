"""RollbackGuard under 2 gloo processes with ``ddp_1bit``: a NaN on one rank rolls every rank back at the same step,
and switching 1-bit off really moves the averaging to the fp32 allreduce (no compressed bytes afterwards)."""

from __future__ import annotations

from typing import Any

from tests.helpers import run_in_processes


def _fit(rank: int, world_size: int) -> dict[str, Any]:
    import math

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch import Callback

    from lightning_accel.callbacks import RollbackGuard
    from lightning_accel.strategies import OneBitDDPStrategy
    from tests import tiny

    class NaNOnRank1(Callback):
        def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
            if trainer.global_step == 9 and trainer.global_rank == 1:
                loss.mul_(math.nan)

    class Bytes(Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[int, int, int]] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            state = trainer.strategy.onebit_state  # type: ignore[attr-defined]
            last = state.stats.last_step
            self.rows.append((trainer.global_step, last.compressed_sent, last.sent) if last else (0, 0, 0))

    torch.manual_seed(0)
    strategy = OneBitDDPStrategy(warmup_steps=3, compression="1bit", min_compress_numel=0, process_group_backend="gloo")
    guard = RollbackGuard(snapshot_every=4, check_every=1, grad_norm_every=1, verbose=False)
    probe = Bytes()
    model = tiny.classifier()
    trainer = tiny.trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=16,
        callbacks=[guard, NaNOnRank1(), probe],
    )
    trainer.fit(model, tiny.loader(batch_size=8, n=256))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "events": guard.events,
        "switched_off": guard.switched_off,
        "rows": probe.rows,
        "decision": strategy.onebit_state.decision if strategy.onebit_state else None,
        "params": params.tolist(),
        "finite": bool(torch.isfinite(params).all()),
    }


def test_a_nan_on_one_rank_rolls_back_every_rank_and_1bit_falls_back_to_fp32() -> None:
    a, b = run_in_processes(_fit, 2, init_process_group=False)
    # the same decision on both ranks; the reason names what this rank saw (rank 1 the NaN, rank 0 "another rank")
    same = [{k: v for k, v in e.items() if k != "reason"} for e in a["events"]]
    assert same == [{k: v for k, v in e.items() if k != "reason"} for e in b["events"]] and len(same) == 1
    assert "non-finite" in b["events"][0]["reason"] and "another rank" in a["events"][0]["reason"]
    e = a["events"][0]
    assert e["step"] == 10 and e["switched_off"] == "ddp_1bit" and e["restored_step"] == 8
    assert a["switched_off"] == b["switched_off"] == ["ddp_1bit"]
    assert a["decision"] == b["decision"] == "fp32"
    assert a["finite"] and b["finite"]
    assert max(abs(x - y) for x, y in zip(a["params"], b["params"], strict=True)) < 1e-6  # ranks stayed in step
    compressed = [c for s, c, _ in a["rows"] if 5 <= s <= 9]
    after = [(c, sent) for s, c, sent in a["rows"] if s >= 12]
    assert compressed and all(c > 0 for c in compressed)  # the compressed stage ran before the rollback
    assert after and all(c == 0 and sent > 0 for c, sent in after)  # then fp32 averaging only


def _sharded_fit(rank: int, world_size: int) -> dict[str, Any]:
    import math

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_accel.callbacks import RollbackGuard
    from lightning_accel.parallel import ShardedStrategy

    class Deep(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
            self.example_input_array = torch.zeros(4, 8)
            self.fired = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self(batch[0]), batch[0])
            if self.trainer.global_step == 9 and not self.fired:  # the NaN reaches the weights of step 10
                self.fired, loss = True, loss * math.nan
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    guard = RollbackGuard(snapshot_every=4, check_every=2, grad_norm_every=1, verbose=False)
    model = Deep()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardedStrategy(),
        max_steps=16,
        callbacks=[guard],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randn(256, 8))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # DTensor: its shard
    return {
        "events": [{k: v for k, v in e.items() if k != "reason"} for e in guard.events],
        "sharded": all(hasattr(p, "to_local") for p in model.parameters()),
        "finite": all(bool(t.isfinite().all()) for t in shards),
        "step": trainer.global_step,
    }


def test_a_sharded_fit_is_rolled_back_on_every_rank() -> None:
    # the parameters and the optimizer state of `fully_shard` are DTensors: the first snapshot raised ("got mixed
    # torch.Tensor and DTensor"), and the sharded gradient norm failed the snapshot's soundness all-reduce
    a, b = run_in_processes(_sharded_fit, 2, init_process_group=False)
    assert a["sharded"] and b["sharded"]
    assert a["events"] == b["events"] and len(a["events"]) == 1
    assert a["events"][0]["restored_step"] == 8 and a["events"][0]["action"] == "rollback"
    assert a["finite"] and b["finite"] and a["step"] == b["step"] == 16


def _timed_save_fit(rank: int, world_size: int, root: str, sharded: bool) -> dict[str, Any]:
    import math
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.callbacks import RollbackGuard
    from lightning_accel.parallel import ShardedStrategy
    from tests import tiny

    class NaNGradOnRank0(Callback):
        """NaN gradients on rank 0 after the gradient averaging, at global step 7, once: its update makes rank 0's
        weights NaN while its loss (and rank 1's everything) stays finite."""

        def __init__(self) -> None:
            self.fired = False

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt: Any) -> None:
            if trainer.global_step == 7 and trainer.global_rank == 0 and not self.fired:
                self.fired = True
                for p in pl_module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(math.nan)

    class Saves(Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ckpt: Any) -> None:
            self.steps.append(trainer.global_step)

    torch.manual_seed(0)
    # the default gradient-norm sampling on a CPU (every 10th step) leaves step 7 unsampled
    guard, saves = RollbackGuard(snapshot_every=2, verbose=False), Saves()
    callbacks: list[Callback] = [guard, NaNGradOnRank0(), saves]
    if not sharded:  # the clock's saves (0 s: at every step); the sharded fit checks the save at the epoch's end
        callbacks.append(ModelCheckpoint(dirpath=root, train_time_interval=timedelta(0), save_top_k=-1))
    trainer = tiny.trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardedStrategy() if sharded else "ddp",
        max_epochs=1,
        limit_train_batches=8,
        enable_checkpointing=not sharded,
        callbacks=callbacks,
    )
    model = tiny.classifier()
    trainer.fit(model, tiny.loader(batch_size=8, n=256))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {
        "events": [{k: v for k, v in e.items() if k != "reason"} for e in guard.events],
        "reasons": [e["reason"] for e in guard.events],
        "saves": saves.steps,
        "finite": all(bool(torch.isfinite(t).all()) for t in local),
    }


def test_a_nan_update_on_one_rank_never_reaches_a_save_and_every_rank_rolls_back(tmp_path: Any) -> None:
    # a save every step by the clock held the NaN weights of rank 0's update of step 7: its loss was finite, its
    # gradient norm not sampled, and the next check came only after the save
    import torch

    a, b = run_in_processes(_timed_save_fit, 2, (str(tmp_path), False), init_process_group=False)
    assert a["events"] == b["events"] and len(a["events"]) == 1 and a["events"][0]["step"] == 8
    assert "weights non-finite" in a["reasons"][0] and "another rank" in b["reasons"][0]
    assert a["saves"] == b["saves"] == list(range(1, 9)) and a["finite"] and b["finite"]
    for path in tmp_path.glob("*.ckpt"):
        state = torch.load(path, weights_only=False)["state_dict"]
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()), path.name


def test_a_sharded_update_is_checked_before_the_epochs_end_on_every_rank(tmp_path: Any) -> None:
    # the weights' check before a save takes the norm of sharded parameters (DTensors): one collective, every rank
    a, b = run_in_processes(_timed_save_fit, 2, (str(tmp_path), True), init_process_group=False)
    assert a["events"] == b["events"] and len(a["events"]) == 1 and a["events"][0]["step"] == 8
    assert a["finite"] and b["finite"]


def _spike_fit(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch import Callback

    from lightning_accel.callbacks import RollbackGuard
    from tests import tiny

    class LossSpikeOnRank1(Callback):
        """Rank 1's recorded loss (not its gradients) 50x at steps 12 and 13, once each: a spike only it sees."""

        def __init__(self) -> None:
            self.left = {12, 13}

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *a: Any) -> None:
            if trainer.global_rank == 1 and trainer.global_step in self.left:
                self.left.discard(trainer.global_step)
                with torch.no_grad():
                    outputs["loss"].mul_(50.0)

    torch.manual_seed(0)
    guard = RollbackGuard(
        snapshot_every=4, check_every=3, arm_after=4, spike_steps=2, watch_grad_norm=False, verbose=False
    )
    trainer = tiny.trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=3,
        max_steps=20,
        limit_train_batches=32,
        callbacks=[LossSpikeOnRank1(), guard],  # the spike is in the outputs before the guard reads them
    )
    model = tiny.classifier()
    trainer.fit(model, tiny.loader(batch_size=8, n=256))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "events": [{k: v for k, v in e.items() if k != "reason"} for e in guard.events],
        "reasons": [e["reason"] for e in guard.events],
        "step": trainer.global_step,
        "params": params.tolist(),
    }


def test_a_loss_spike_seen_by_one_rank_rolls_every_rank_back_together() -> None:
    # the spike rule runs on each rank's own loss: rank 0 never sees it, and must still roll back with rank 1 (a
    # rollback on one rank only would leave the ranks' weights apart and their collectives out of step)
    a, b = run_in_processes(_spike_fit, 2, init_process_group=False)
    assert a["events"] == b["events"] and len(a["events"]) == 1, (a["events"], b["events"])
    assert a["events"][0]["action"] == "rollback" and a["events"][0]["streak_start"] == 12
    assert "another rank" in a["reasons"][0] and "loss spike" in b["reasons"][0]
    assert a["step"] == b["step"] == 20, (a["step"], b["step"], a["events"])
    assert max(abs(x - y) for x, y in zip(a["params"], b["params"], strict=True)) < 1e-6  # still in step
