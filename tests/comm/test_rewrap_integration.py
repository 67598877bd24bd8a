"""A model wrapped in DDP again during the fit (``StructuredPruning`` re-wraps it after slicing its parameters), under
``strategy="ddp_1bit"`` and ``strategy="diloco"``, in two real processes (gloo).

``ddp_1bit``: the schedule continues on the new parameters (the step count, a resolved ``warmup_steps="auto"``, the
compressed momentum: no second warm-up, no silent switch to gradient compression), the ranks stay identical after
every step, and a checkpoint saved after the pruning resumes exactly. ``diloco``: the sync schedule keeps its phase
(no second synchronous start) and the fit ends with every rank holding the same parameters.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel.comm.localsteps import LocalStepsConfig
from lightning_accel.models import ImageClassifier
from tests.helpers import run_in_processes
from tests.tiny import loader, trainer


class _Net(ImageClassifier):
    """The digits SmallResNet (convolutions + BatchNorm), with SGD momentum or AdamW."""

    def __init__(self, opt: str) -> None:
        super().__init__(width=8)
        self.opt = opt
        self.example_input_array = torch.zeros(2, 3, 8, 8)

    @override
    def configure_optimizers(self) -> Any:
        if self.opt == "sgdm":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class _Record(Callback):
    """After every training batch: the strategy's schedule and a digest of the parameters (compared across ranks)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        row: dict[str, Any] = {
            "global_step": trainer.global_step,
            "numel": flat.numel(),
            "digest": hashlib.sha1(flat.numpy().tobytes()).hexdigest(),
        }
        state = getattr(trainer.strategy, "onebit_state", None)
        if state is not None:
            row.update(
                step=state.step,
                mode=state.mode,
                warmup_end=state.warmup_end,
                compressing=state.compressing,
                compressed_calls=state.stats.compressed_calls,
            )
        self.rows.append(row)


def _fit(strategy: Any, opt: str, *, epochs: int, batches: int, prune_at: int, ckpt: str | None = None) -> Any:
    import lightning.pytorch as pl

    from lightning_accel.callbacks import StructuredPruning

    pl.seed_everything(0)
    record = _Record()
    model = _Net(opt)
    callbacks = [StructuredPruning(amount=0.3, schedule=prune_at), record]
    t = trainer(devices=2, strategy=strategy, max_epochs=epochs, limit_train_batches=batches, callbacks=callbacks)
    t.fit(model, loader(batch_size=16, n=192, shuffle=True), ckpt_path=ckpt)
    return t, model, record.rows


def _onebit(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from lightning_accel.strategies import OneBitDDPStrategy

    out: dict[str, Any] = {}
    # SGD momentum, compressing from step 2; pruned at step 4 (epoch 1)
    _, _, out["sgdm"] = _fit(
        OneBitDDPStrategy(warmup_steps=2, compression="1bit"), "sgdm", epochs=3, batches=4, prune_at=1
    )
    # AdamW, warmup_steps="auto" resolved at setup (10 steps with the variance refreshes); pruned at step 12
    _, _, out["adamw"] = _fit(OneBitDDPStrategy(compression="1bit"), "adamw", epochs=3, batches=6, prune_at=2)
    # the SGD-momentum fit again, checkpointed after 2 epochs (after the pruning), then resumed for the third
    trainer, _, _ = _fit(OneBitDDPStrategy(warmup_steps=2, compression="1bit"), "sgdm", epochs=2, batches=4, prune_at=1)
    path = str(Path(tmp) / "pruned.ckpt")
    trainer.save_checkpoint(path)
    _, _, out["resumed"] = _fit(
        OneBitDDPStrategy(warmup_steps=2, compression="1bit"), "sgdm", epochs=3, batches=4, prune_at=1, ckpt=path
    )
    return out


@pytest.fixture(scope="module")
def onebit(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rewrap")
    return run_in_processes(_onebit, 2, args=(str(tmp),), init_process_group=False, timeout=300)


def _same_on_both_ranks(r0: list[dict[str, Any]], r1: list[dict[str, Any]]) -> None:
    assert [r["digest"] for r in r0] == [r["digest"] for r in r1]


@pytest.mark.parametrize(("name", "pruned_at", "warmup"), [("sgdm", 4, 2), ("adamw", 12, 10)])
def test_onebit_schedule_continues_after_a_rewrap(
    onebit: list[dict[str, Any]], name: str, pruned_at: int, warmup: int
) -> None:
    r0, r1 = onebit[0][name], onebit[1][name]
    _same_on_both_ranks(r0, r1)  # one model after every step, across the pruning
    assert r0[pruned_at - 1]["numel"] > r0[pruned_at]["numel"]  # the pruning happened there
    # one state, one schedule: the step counts every step, the warm-up is not run again, momentum stays compressed
    assert [r["step"] for r in r0] == [r["global_step"] for r in r0]
    assert {r["warmup_end"] for r in r0} == {warmup}
    assert {r["mode"] for r in r0} == {"momentum"}
    assert all(r["compressing"] for r in r0[warmup:])
    calls = [r["compressed_calls"] for r in r0]
    assert calls[-1] > calls[pruned_at - 1] > 0  # compressed averaging continued after the pruning


def test_onebit_checkpoint_after_a_rewrap_resumes_exactly(onebit: list[dict[str, Any]]) -> None:
    whole, resumed = onebit[0]["sgdm"], onebit[0]["resumed"]
    _same_on_both_ranks(resumed, onebit[1]["resumed"])
    assert [r["step"] for r in resumed] == [9, 10, 11, 12]
    assert all(r["compressing"] and r["mode"] == "momentum" for r in resumed)
    assert [r["digest"] for r in resumed] == [r["digest"] for r in whole[8:]]


def _diloco(rank: int, world: int) -> dict[str, Any]:
    from lightning_accel.strategies import LocalStepsStrategy

    strategy = LocalStepsStrategy(sync_every=2, sync_start=2, outer_momentum=0.9, nesterov=True)
    trainer, model, rows = _fit(strategy, "sgdm", epochs=3, batches=4, prune_at=1)
    local = trainer.strategy.local_steps
    return {
        "rows": rows,
        "step_count": local.step_count,
        "syncs": local.syncs,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
    }


def test_diloco_keeps_its_sync_schedule_across_a_rewrap() -> None:
    r0, r1 = run_in_processes(_diloco, 2, init_process_group=False, timeout=300)
    assert r0["rows"][3]["numel"] > r0["rows"][4]["numel"]  # pruned at step 4
    # the schedule counted every inner step (a new outer state restarted at 0 and ran the synchronous start again)
    assert r0["step_count"] == r1["step_count"] == 12
    # 2 synchronous steps, then sends at 4 (dropped by the re-wrap), 6, 8, 10 and 12; the last one applied by the
    # final sync at the step it was sent, so the model holds θ_global and no further outer step runs
    assert r0["syncs"] == r1["syncs"] == 2 + 4
    np.testing.assert_array_equal(r0["params"], r1["params"])  # the fit ends on θ_global


# ------------------------------------------------------------------------- the core's parts, in one process


def test_replace_parameters_keeps_the_error_state_of_groups_whose_sizes_held() -> None:
    """Groups over a parameter that changed size (and loaded state not yet adopted over one) are dropped; the others,
    and the schedule, are kept; another number of parameters drops every group."""
    from lightning_accel.comm import OneBitState
    from lightning_accel.comm.compress import GroupLayout
    from lightning_accel.comm.state import GroupState

    def params(*numels: int) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.zeros(n)) for n in numels]

    state = OneBitState(parameters=params(4, 6, 3), warmup_steps=2)
    state.step, state.decision = 7, "1bit"
    for key in [(0, 1), (2,)]:
        numels = [state.param_numels[i] for i in key]
        state.groups[key] = GroupState(key, GroupLayout(numels, 1, 8, torch.device("cpu")))
    state.pending[(1, 2)] = (torch.zeros(16), torch.zeros(16))
    kept = state.groups[(2,)]
    assert state.replace_parameters(params(4, 5, 3)) == 2  # (0, 1) and the pending (1, 2) held parameter 1
    assert list(state.groups) == [(2,)] and state.groups[(2,)] is kept and not state.pending
    assert state.param_numels == [4, 5, 3] and state.step == 7 and state.compressing
    assert state.replace_parameters(params(4, 5)) == 1 and not state.groups  # other indices: nothing maps


def test_abandon_completes_the_exchanges_in_flight_and_changes_nothing(one_process_group: None) -> None:
    from lightning_accel.comm.localsteps import LocalSteps

    for compression, blocks in (("1bit", {"block_size": 8}), ("fp32", {})):  # fp32 has no scale blocks
        p = torch.nn.Parameter(torch.arange(12, dtype=torch.float32))
        local = LocalSteps([p], LocalStepsConfig(sync_every=2, overlap_steps=1, compression=compression, **blocks))
        local.step()
        with torch.no_grad():
            p.add_(1.0)
        local.step()  # sends the only fragment (applied one step later)
        assert local.in_flight
        before, outer = p.detach().clone(), local.fragments[0].outer.clone()
        local.abandon()
        assert not local.in_flight and local.syncs == 0
        assert torch.equal(p, before) and torch.equal(local.fragments[0].outer, outer)
