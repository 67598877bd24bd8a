"""``Trainer(strategy="diloco")`` (``LocalStepsStrategy``) in two real gloo processes.

One pair of processes runs every scenario in turn: the alias and a plain fit (no gradient traffic, the ranks end
identical), training features (clipping, accumulation, a frozen parameter, bf16-mixed, an LR scheduler, BatchNorm
buffers averaged, a parameter unfrozen mid-fit), resume from a checkpoint taken with an exchange in flight against an
uninterrupted run (through Lightning's CheckpointIO and through ``DeltaCheckpointIO``, and a second ``fit`` of the same
Trainer), and the argument checks. One process resumes that checkpoint too (refused: it cannot continue two ranks'
local steps).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import run_in_processes


def _module(
    frozen: bool = False, sched: bool = False, bn: bool = False, overflow_at: int | None = None, manual: bool = False
):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = [nn.Linear(16, 48)]
            if bn:
                layers.append(nn.BatchNorm1d(48))
            self.net = nn.Sequential(*layers, nn.ReLU(), nn.Linear(48, 4))
            self.frozen = nn.Linear(16, 16) if frozen else None
            if self.frozen is not None:
                self.frozen.requires_grad_(False)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.frozen is not None:
                x = x + self.frozen(x)
            loss = F.cross_entropy(self.net(x).float(), y)
            if overflow_at == self.global_step and self.global_rank == 1:  # this rank's GradScaler skips the step
                loss = loss * float("inf")
            if manual:
                opt = self.optimizers()
                assert not isinstance(opt, list)
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            if sched:
                sched_ = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched_, "interval": "step"}}
            return opt

    return Net()


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g) + 0.1 * torch.arange(2).repeat(64)[:, None]  # the ranks' halves differ
    y = x[:, :4].argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def _fit(strategy, model, root: str, ckpt: str | None = None, callbacks=(), **kw):
    import lightning as L

    kw.setdefault("max_steps", 16)
    kw.setdefault("devices", 2)
    kw.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=list(callbacks),
        **kw,
    )
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return trainer


def _params(model) -> np.ndarray:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy().copy()


def _plain(tmp: str) -> dict:
    import lightning_accel as la

    before = _params(_module())
    model = _module()
    trainer = _fit(la.LocalStepsStrategy(sync_every=4, fragments=2), model, tmp)
    alias = _fit("diloco", _module(), tmp, max_steps=2)
    local = trainer.strategy.local_steps
    return {
        "params": _params(model),
        "moved": float(np.abs(_params(model) - before).max()),
        "syncs": local.syncs,
        "steps": local.step_count,
        "bytes": local.bytes_sent,
        "alias": type(alias.strategy).__name__,
    }


def _features(tmp: str) -> dict:
    from lightning_accel.comm import LocalStepsStrategy

    model = _module(frozen=True, sched=True, bn=True)
    frozen_before = model.frozen.weight.detach().clone()
    trainer = _fit(
        LocalStepsStrategy(sync_every=2, overlap_steps=1, compression="fp32"),
        model,
        tmp,
        max_steps=6,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
    )
    local = trainer.strategy.local_steps
    return {
        "params": _params(model),
        "bn_mean": model.net[1].running_mean.detach().numpy().copy(),
        "frozen_same": bool(torch.equal(frozen_before, model.frozen.weight.detach())),
        "frozen_tracked": any(p is model.frozen.weight for p in local.params),
        "steps": local.step_count,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }


def _resume(tmp: str, delta: bool = False) -> dict:
    from lightning.pytorch.callbacks import Callback

    from lightning_accel import DeltaCheckpointIO
    from lightning_accel.comm import LocalStepsStrategy

    ckpt = str(Path(tmp) / ("local-delta.ckpt" if delta else "local.ckpt"))

    def io() -> dict:  # the delta CheckpointIO stores the per-rank payload like any other tensors
        return {"plugins": [DeltaCheckpointIO()]} if delta else {}

    class SaveAfterEpoch0(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                self.in_flight = trainer.strategy.local_steps.in_flight
                trainer.save_checkpoint(ckpt)

    def strategy():  # 8 steps per epoch: fragment 1 is sent at step 8 and applied at step 9, across the save
        return LocalStepsStrategy(sync_every=4, fragments=2, overlap_steps=1, block_size=16)

    saver = SaveAfterEpoch0()
    full = _module(sched=True)
    first = _fit(strategy(), full, tmp, max_steps=-1, max_epochs=2, callbacks=[saver], **io())
    resumed = _module(sched=True)
    trainer = _fit(strategy(), resumed, tmp, max_steps=-1, max_epochs=2, ckpt=ckpt, **io())
    out = {
        "full": _params(full),
        "resumed": _params(resumed),
        "in_flight": saver.in_flight,
        "steps": trainer.strategy.local_steps.step_count,
    }
    if not delta:
        payload = torch.load(ckpt, weights_only=True)["lightning_accel_localsteps"]
        out["ranks_saved"] = len(payload["ranks"])
        out["ckpt"] = ckpt
        # the Trainer of the uninterrupted fit resumes the checkpoint in a second fit: the same as a fresh Trainer
        again = _module(sched=True)
        first.fit(again, _data(), ckpt_path=ckpt)
        out["refit"] = _params(again)
        out["refit_steps"] = first.strategy.local_steps.step_count
    return out


def _resume_rank_state(tmp: str) -> dict:
    """Each rank's own buffers and loss scale across a resume: BatchNorm statistics of each rank's data (the ranks'
    halves differ), and a GradScaler that only rank 1's skipped step (step 3) halved. Saved after epoch 0, resumed."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_accel.comm import LocalStepsStrategy

    ckpt = str(Path(tmp) / "rank-state.ckpt")

    class SaveAfterEpoch0(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(ckpt)

    def run(path: str | None, callbacks=()) -> tuple:
        model = _module(bn=True, overflow_at=3)
        scaler = torch.amp.GradScaler("cpu")
        strategy = LocalStepsStrategy(sync_every=4, fragments=2, overlap_steps=1, block_size=16)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        _fit(strategy, model, tmp, ckpt=path, max_steps=-1, max_epochs=2, plugins=[plugin], callbacks=callbacks)
        buffers = {k: b.detach().numpy().copy() for k, b in model.named_buffers()}
        return _params(model), buffers, float(scaler.get_scale())

    full, full_buffers, full_scale = run(None, [SaveAfterEpoch0()])
    resumed, resumed_buffers, resumed_scale = run(ckpt)
    return {
        "full": full,
        "resumed": resumed,
        "full_buffers": full_buffers,
        "resumed_buffers": resumed_buffers,
        "full_scale": full_scale,
        "resumed_scale": resumed_scale,
    }


def _last_checkpoint(tmp: str) -> dict:
    """The checkpoints saved at the end of a fit hold θ_global: ended by ``max_steps`` (a checkpoint every 3 steps,
    the last one at the last step), by ``max_epochs`` (the checkpoint of the epoch's end), and under manual
    optimization."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.comm import LocalStepsStrategy

    out = {}
    cases: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
        "max_steps": ({"max_steps": 6}, {"every_n_train_steps": 3}, {}),
        "max_epochs": ({"max_steps": -1, "max_epochs": 1}, {}, {}),
        "manual": ({"max_steps": 6}, {"every_n_train_steps": 3}, {"manual": True}),
    }
    for case, (limits, every, module_kw) in cases.items():
        dirpath = Path(tmp) / f"last-{case}"
        model = _module(**module_kw)
        saver = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1, **every)
        trainer = _fit(
            LocalStepsStrategy(sync_every=4, fragments=2),
            model,
            tmp,
            callbacks=[saver],
            enable_checkpointing=True,
            **limits,
        )
        ck = torch.load(dirpath / "last.ckpt", weights_only=True)
        saved = torch.cat([v.float().reshape(-1) for k, v in ck["state_dict"].items() if "running" not in k])
        ranks = ck["lightning_accel_localsteps"]["ranks"]
        out[case] = {
            "params": _params(model),
            "saved": saved.numpy().copy(),
            "ranks_equal": all(
                torch.equal(a, b) for r in ranks[1:] for a, b in zip(ranks[0]["local"], r["local"], strict=True)
            ),
            "steps": trainer.strategy.local_steps.step_count,
            "syncs": trainer.strategy.local_steps.syncs,
        }
    return out


def _groups(tmp: str) -> dict:
    from torch.distributed.distributed_c10d import _world

    from lightning_accel.comm import LocalStepsStrategy

    counts = []
    for _ in range(2):  # a strategy per fit, as a tuning loop builds them
        trainer = _fit(LocalStepsStrategy(sync_every=2), _module(), tmp, max_steps=4)
        counts.append(len(_world.pg_map))  # every process group this process holds, the default one included
    # after the fit its own group is gone: a checkpoint saved now gathers the ranks' states on the default group
    ckpt = str(Path(tmp) / "after-fit.ckpt")
    trainer.save_checkpoint(ckpt)
    payload = torch.load(ckpt, weights_only=True)["lightning_accel_localsteps"]
    # a weights-only checkpoint holds rank 0's weights alone (Lightning cannot resume training from it)
    weights = str(Path(tmp) / "after-fit-weights.ckpt")
    trainer.save_checkpoint(weights, weights_only=True)
    weights_keys = sorted(torch.load(weights, weights_only=True))
    return {"counts": counts, "ranks_saved": len(payload["ranks"]), "weights_keys": weights_keys}


def _unfreeze(tmp: str) -> dict:
    """A parameter frozen at the start is unfrozen mid-fit by a callback (as ``BaseFinetuning`` unfreezes a backbone):
    from then on it trains, and is averaged like the others."""
    import lightning as L

    from lightning_accel.comm import LocalStepsStrategy

    class Unfreeze(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 5:
                pl_module.frozen.requires_grad_(True)

    model = _module(frozen=True)
    before = model.frozen.weight.detach().clone()
    trainer = _fit(LocalStepsStrategy(sync_every=4), model, tmp, max_steps=12, callbacks=[Unfreeze()])
    return {
        "params": _params(model),
        "frozen_moved": float((model.frozen.weight.detach() - before).abs().max()),
        "tracked": len(trainer.strategy.local_steps.params),
    }


def _toggled_gan(tmp: str) -> dict:
    """Manual optimization with Lightning's GAN recipe: ``toggle_optimizer`` turns off ``requires_grad`` outside the
    optimizer about to step, inside the training step, and ``untoggle_optimizer`` turns it back on. Not a change of
    the trained parameters: the schedule syncs every ``sync_every`` inner steps, with one outer state for all."""
    import lightning as L

    from lightning_accel.comm import LocalStepsStrategy

    class GAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gen = nn.Linear(16, 16)
            self.disc = nn.Linear(16, 1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, _ = batch
            opt_g, opt_d = self.optimizers()
            for opt, loss_fn in (
                (opt_g, lambda: -self.disc(self.gen(x)).mean()),
                (opt_d, lambda: self.disc(self.gen(x).detach()).mean() - self.disc(x).mean()),
            ):
                self.toggle_optimizer(opt)
                self.manual_backward(loss_fn())
                opt.step()
                opt.zero_grad()
                self.untoggle_optimizer(opt)

        def configure_optimizers(self):
            return torch.optim.SGD(self.gen.parameters(), lr=0.01), torch.optim.SGD(self.disc.parameters(), lr=0.01)

    model = GAN()
    strategy = LocalStepsStrategy(sync_every=8, compression="fp32", find_unused_parameters=True)
    trainer = _fit(strategy, model, tmp, max_steps=16)  # 8 batches of 2 inner steps each
    local = trainer.strategy.local_steps
    return {"params": _params(model), "steps": local.step_count, "syncs": local.syncs, "tracked": len(local.params)}


SCENARIOS = {
    "plain": _plain,
    "groups": _groups,
    "features": _features,
    "resume": _resume,
    "resume_delta": lambda tmp: _resume(tmp, delta=True),
    "resume_rank_state": _resume_rank_state,
    "last_checkpoint": _last_checkpoint,
    "unfreeze": _unfreeze,
    "toggled_gan": _toggled_gan,
}


def _run(rank: int, world: int, tmp: str) -> dict:
    import lightning_accel  # noqa: F401  (registers "diloco")

    out: dict = {}
    for name, fn in SCENARIOS.items():
        try:
            out[name] = fn(tmp)
        except Exception:  # noqa: BLE001 - reported by the scenario's own tests
            out[name] = {"error": f"rank {rank}, scenario {name!r}:\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("diloco")
    return run_in_processes(_run, 2, args=(str(tmp),), init_process_group=False, timeout=420)


def _get(results: list[dict], name: str) -> list[dict]:
    for res in results:
        assert "error" not in res[name], res[name].get("error")
    return [res[name] for res in results]


def test_fit_trains_without_gradient_traffic_and_ends_identical(results: list[dict]) -> None:
    r0, r1 = _get(results, "plain")
    np.testing.assert_array_equal(r0["params"], r1["params"])
    assert r0["moved"] > 1e-3
    assert r0["steps"] == 16
    # fragments sent at 2, 6, 10, 14 and 4, 8, 12, 16 (the last applied at the end, at the step it was sent: its
    # parameters are θ_global already), then one last sync of the fragment that moved since step 15
    assert r0["syncs"] == 9
    assert r0["bytes"] > 0
    assert r0["alias"] == "LocalStepsStrategy"


def test_clipping_accumulation_frozen_bf16_scheduler_and_buffers(results: list[dict]) -> None:
    r0, r1 = _get(results, "features")
    np.testing.assert_array_equal(r0["params"], r1["params"])
    np.testing.assert_array_equal(r0["bn_mean"], r1["bn_mean"])  # averaged, then identical
    assert r0["frozen_same"] and not r0["frozen_tracked"]
    assert r0["steps"] == 6  # optimizer steps, not micro-batches
    assert r0["lr"] == pytest.approx(0.01 * 0.1**2)  # StepLR(step_size=3) after 6 inner steps


def test_a_parameter_unfrozen_mid_fit_is_averaged_and_the_ranks_end_identical(results: list[dict]) -> None:
    r0, r1 = _get(results, "unfreeze")
    assert r0["frozen_moved"] > 1e-4  # it trained once unfrozen
    assert r0["tracked"] == 6  # the outer state syncs it: the 4 tensors of `net` and the 2 of `frozen`
    np.testing.assert_array_equal(r0["params"], r1["params"])


def test_toggle_optimizer_inside_a_manual_step_keeps_the_sync_schedule(results: list[dict]) -> None:
    r0, r1 = _get(results, "toggled_gan")
    assert r0["steps"] == 16
    # the syncs at inner steps 8 and 16 only (the last one ends the fit): not a sync and a new outer state at every
    # step, as when the toggled `requires_grad` passed for a change of the trained parameters
    assert r0["syncs"] == 2
    assert r0["tracked"] == 4  # one outer state for the generator's and the discriminator's parameters
    np.testing.assert_array_equal(r0["params"], r1["params"])


@pytest.mark.parametrize("name", ["resume", "resume_delta"])
def test_resume_with_an_exchange_in_flight_equals_the_uninterrupted_run(results: list[dict], name: str) -> None:
    for res in _get(results, name):
        assert res["in_flight"]
        assert res["steps"] == 16
        np.testing.assert_array_equal(res["full"], res["resumed"])
        assert res.get("ranks_saved", 2) == 2


def test_resume_gives_each_rank_its_own_buffers_and_loss_scale(results: list[dict]) -> None:
    """Lightning's own checkpoint holds rank 0's buffers and GradScaler; each rank must continue with its own."""
    r0, r1 = _get(results, "resume_rank_state")
    assert r1["full_scale"] == r0["full_scale"] / 2  # only rank 1 skipped a step
    for res in (r0, r1):
        assert res["resumed_scale"] == res["full_scale"]
        np.testing.assert_array_equal(res["full"], res["resumed"])
        assert res["full_buffers"].keys() == res["resumed_buffers"].keys()
        for k, v in res["full_buffers"].items():
            np.testing.assert_array_equal(v, res["resumed_buffers"][k], err_msg=k)


@pytest.mark.parametrize("case", ["max_steps", "max_epochs", "manual"])
def test_the_checkpoint_saved_at_the_end_of_the_fit_holds_the_synced_model(results: list[dict], case: str) -> None:
    r0, r1 = (res[case] for res in _get(results, "last_checkpoint"))
    np.testing.assert_array_equal(r0["params"], r1["params"])  # every rank ends with θ_global ...
    np.testing.assert_array_equal(r0["saved"], r0["params"])  # ... and last.ckpt holds it
    assert r0["ranks_equal"]  # every rank's own parameters in it are θ_global too
    # one final sync, not a second one at the end of the fit: fragments sent at 2 and 4, the one sent at 6
    # (max_epochs: 8) applied by the final sync at that step (it holds θ_global: no outer step more), then the other
    # one, which moved since its last sync, synced once more
    steps = 8 if case == "max_epochs" else 6
    assert r0["steps"] == steps and r0["syncs"] == steps // 2 + 1


def test_a_second_fit_of_the_same_trainer_resumes_like_a_fresh_one(results: list[dict]) -> None:
    for res in _get(results, "resume"):
        assert res["refit_steps"] == 16
        np.testing.assert_array_equal(res["full"], res["refit"])


def _single(rank: int, world: int, ckpt: str, tmp: str) -> str:
    from lightning_accel.comm import LocalStepsStrategy

    strategy = LocalStepsStrategy(sync_every=4, fragments=2, overlap_steps=1, block_size=16)
    try:
        _fit(strategy, _module(sched=True), tmp, ckpt=ckpt, max_steps=-1, max_epochs=2, devices=1)
    except ValueError as err:
        return str(err)
    return "resumed"


def test_one_process_refuses_a_checkpoint_of_several_ranks(results: list[dict], tmp_path: Path) -> None:
    """Its checkpoint holds each rank's own parameters; one process can continue none of them (and would otherwise
    hand the stale payload on to its own checkpoints)."""
    ckpt = _get(results, "resume")[0]["ckpt"]
    (msg,) = run_in_processes(_single, 1, args=(ckpt, str(tmp_path)), init_process_group=False, timeout=180)
    assert "`ckpt_path`" in msg and "2 ranks" in msg and "Resume with 2 processes" in msg, msg


def test_default_overlap_follows_the_schedule() -> None:
    from lightning_accel.comm import LocalStepsStrategy

    assert LocalStepsStrategy().local_steps_config.overlap_steps == 1
    # a fragment due every step leaves no step to overlap with: the default waits instead of refusing
    assert LocalStepsStrategy(sync_every=1, compression="fp32").local_steps_config.overlap_steps == 0
    assert LocalStepsStrategy(sync_every=4, fragments=4).local_steps_config.overlap_steps == 0


def test_bad_arguments_are_refused_at_construction() -> None:
    from lightning_accel.comm import LocalStepsStrategy

    with pytest.raises(ValueError, match="`overlap_steps`"):
        LocalStepsStrategy(sync_every=4, fragments=2, overlap_steps=2)
    with pytest.raises(ValueError, match="`outer_lr`"):
        LocalStepsStrategy(outer_lr=float("inf"))
    with pytest.raises(ValueError, match="`sync_evry`"):
        LocalStepsStrategy(sync_evry=4)
    with pytest.raises(ValueError, match="`ddp_comm_hook`"):
        LocalStepsStrategy(ddp_comm_hook=lambda s, b: None)


def test_fits_leave_no_process_group_behind_and_save_after_the_fit(results: list[dict]) -> None:
    for res in _get(results, "groups"):
        assert res["counts"] == [1, 1]  # the default group alone: each fit destroyed the outer group it made
        assert res["ranks_saved"] == 2


def test_a_weights_only_checkpoint_holds_no_local_steps_state(results: list[dict]) -> None:
    for res in _get(results, "groups"):
        assert "lightning_accel_localsteps" not in res["weights_keys"]
        assert "state_dict" in res["weights_keys"] and "optimizer_states" not in res["weights_keys"]


def test_a_checkpoint_of_other_ranks_or_layout_is_refused_naming_it(one_process_group: None) -> None:
    """In one process (the strategy's checks, without a fit): the refusal names `ckpt_path`, its value and the fix."""
    from lightning_accel.comm import LocalStepsStrategy
    from lightning_accel.comm.localsteps import LocalSteps

    strategy = LocalStepsStrategy(sync_every=4)
    config = strategy.local_steps_config
    strategy._local = LocalSteps([nn.Parameter(torch.zeros(8))], config)
    with pytest.raises(
        ValueError, match=r"^`ckpt_path` '/ckpts/a.ckpt' holds the local-steps state of 2 ranks .* Resume"
    ):
        strategy._restore_local({"format": 2, "ranks": [{}, {}]}, "/ckpts/a.ckpt")
    other = LocalSteps([nn.Parameter(torch.zeros(16))], config).state_dict()  # other trainable parameters
    with pytest.raises(ValueError, match=r"^`ckpt_path` '/ckpts/b.ckpt': .* Resume with the same `fragments`"):
        strategy._restore_local({"format": 2, "ranks": [{"outer": other, "local": []}]}, "/ckpts/b.ckpt")
