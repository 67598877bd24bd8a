"""``Trainer(strategy="ddp_1bit", accelerator="cpu", devices=2)`` in two real processes (gloo).

Every scenario runs in one pair of processes (spawning costs ~5 s each on a busy 2-core machine): plain training with
the registered alias (``compression="auto"`` measuring for real), the ``auto`` decision on both branches with injected
timings, gradient accumulation, gradient clipping, ``static_graph``, unused and frozen parameters, NaN steps under a
GradScaler, ``bf16-mixed``, and resume-from-checkpoint against an uninterrupted run (gradient compression,
SGD-momentum and AdamW compressed momentum).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import run_in_processes

WARMUP = 2


def _module_cls():
    import lightning as L

    class TinyMLP(L.LightningModule):
        def __init__(
            self, unused: bool = False, nan_at: int | None = None, opt: str = "adamw", frozen: bool = False
        ) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4))
            self.unused = nn.Linear(8, 8) if unused else None
            self.frozen = nn.Linear(16, 16) if frozen else None
            if self.frozen is not None:
                self.frozen.requires_grad_(False)
            self.nan_at = nan_at
            self.opt = opt
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.frozen is not None:
                x = x + self.frozen(x)
            loss = F.cross_entropy(self.net(x).float(), y)
            if self.nan_at is not None and self.global_step == self.nan_at and self.global_rank == 1:
                loss = loss * float("nan")
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            # while DDP wraps the module (the strategy unwraps it at teardown): which comm hook is registered?
            self.hook_name = self.trainer.strategy.model._get_ddp_logging_data().get("comm_hook")

        def configure_optimizers(self):
            if self.opt == "sgdm":
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if self.opt == "rmsprop":
                return torch.optim.RMSprop(self.parameters(), lr=0.01)
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return TinyMLP


def _data(n: int = 128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1)).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def _fit(strategy, root: Path | None = None, ckpt: str | None = None, model=None, **trainer_kwargs):
    import lightning as L

    trainer_kwargs.setdefault("max_steps", 6)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **trainer_kwargs,
    )
    model = model or _module_cls()()
    trainer.fit(model, _data(), ckpt_path=ckpt)
    return trainer, model


def _params(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _opt_state(trainer) -> dict[str, np.ndarray]:
    """Every optimizer state tensor (momentum, exp_avg, exp_avg_sq) and every error buffer, flattened by name."""
    out = {}
    opt = trainer.optimizers[0]
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v.detach().reshape(-1).numpy().copy()
    for k, g in trainer.strategy.onebit_state.groups.items():
        out[f"err.{k}.w"] = g.worker_error.numpy().copy()
        out[f"err.{k}.s"] = g.server_error.numpy().copy()
    return out


def _resume(strategy, tmp: str, name: str, **model_kwargs) -> dict:
    """2 epochs of 8 steps uninterrupted, against 1 epoch + checkpoint + resume (well past warm-up)."""
    Model = _module_cls()
    _, full = _fit(strategy(), max_steps=-1, max_epochs=2, model=Model(**model_kwargs))
    trainer, _ = _fit(strategy(), max_steps=-1, max_epochs=1, model=Model(**model_kwargs))
    ckpt = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, resumed = _fit(strategy(), max_steps=-1, max_epochs=2, ckpt=ckpt, model=Model(**model_kwargs))
    st = trainer.strategy.onebit_state
    out = {
        "full": _params(full),
        "resumed": _params(resumed),
        "step": st.step,
        "groups": len(st.groups),
        "compressed": st.compressed_calls,
        "mode": st.mode,
        "reset_warnings": [str(w.message) for w in caught if "reset" in str(w.message)],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = torch.load(ckpt, weights_only=True)
    out["ckpt_world"] = ck["lightning_accel_onebit"]["world_size"]
    out["ckpt_decision"] = ck["lightning_accel_onebit"]["decision"]
    return out


def _auto_summary(trainer, model) -> dict:
    """What a ``compression="auto"`` fit decided, and what it did."""
    st = trainer.strategy.onebit_state
    return {
        "decisions": st.decisions,
        "decision": st.decision,
        "compressed": st.compressed_calls,
        "groups": len(st.groups),
        "last_compressed": st.local_grads,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")},
        "params": _params(model),
    }


def _scenarios(rank: int, world: int, tmp: str) -> dict:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    import lightning_accel  # noqa: F401  (registers "ddp_1bit")
    from lightning_accel.strategies import OneBitDDPStrategy

    out: dict = {}
    Model = _module_cls()

    def onebit(**kw):
        kw.setdefault("warmup_steps", WARMUP)
        kw.setdefault("compression", "1bit")
        return OneBitDDPStrategy(**kw)

    # 1. the registered alias with every default: AdamW -> compressed momentum, compression="auto" measured here
    trainer, model = _fit("ddp_1bit", max_steps=16)
    st = trainer.strategy.onebit_state
    out["alias"] = {
        "cls": type(trainer.strategy).__name__,
        "hook": model.hook_name,
        "mode": st.mode,
        "decisions": st.decisions,
        "compressed": st.compressed_calls,
        "last_compressed": st.local_grads,
        "step": st.step,
        "params": _params(model),
        "losses": model.losses,
    }

    # 2. compression="auto" on both branches, with injected timings
    for name, timings in (("auto_1bit", (0.010, 0.001)), ("auto_fp32", (0.001, 0.010))):
        strategy = OneBitDDPStrategy(warmup_steps=WARMUP, compression="auto", recheck_every=3)
        strategy.measure_fn = lambda state, t=timings: t
        out[name] = _auto_summary(*_fit(strategy, max_steps=9))

    # 2b. compression="auto" from real steps, with a clock that makes a compressed step cost `cost` and an fp32 one 1
    class Clock:
        def __init__(self, cost: float) -> None:
            self.t, self.cost, self.strategy = 0.0, cost, None

        def __call__(self) -> float:
            st = self.strategy.onebit_state
            self.t += self.cost if st is not None and st.local_grads else 1.0  # the step that just ended
            return self.t

    for name, cost in (("trial_1bit", 0.5), ("trial_fp32", 2.0)):
        strategy = OneBitDDPStrategy(warmup_steps=4, compression="auto")
        clock = Clock(cost)
        clock.strategy = strategy
        strategy.step_clock = clock
        out[name] = _auto_summary(*_fit(strategy, max_steps=12))

    # 3. gradient accumulation: one compression per optimizer step (momentum and gradients)
    for mode in ("momentum", "gradients"):
        trainer, model = _fit(onebit(compress=mode), max_steps=5, accumulate_grad_batches=2)
        st = trainer.strategy.onebit_state
        out[f"accumulate_{mode}"] = {
            "step": st.step,
            "compressed": st.compressed_calls,
            "groups": len(st.groups),
            "params": _params(model),
        }

    # 4. gradient clipping clips the local gradient, before the momentum update
    class Spy(L.Callback):
        def on_train_start(self, trainer, pl_module):
            comp = next(iter(trainer.strategy._compressors.values()))
            inner = comp.compressed_step
            self.norms = []

            def spy():
                grads = [p.grad.reshape(-1) for p in pl_module.parameters() if p.grad is not None]
                self.norms.append(float(torch.cat(grads).norm()))
                inner()

            comp.compressed_step = spy

    spy = Spy()
    trainer, model = _fit(onebit(), max_steps=6, gradient_clip_val=0.05, callbacks=[spy], model=Model(opt="sgdm"))
    out["clip"] = {"norms": spy.norms, "params": _params(model)}

    # 5. static graph
    trainer, model = _fit(onebit(static_graph=True))
    out["static"] = {"compressed": trainer.strategy.onebit_state.compressed_calls, "params": _params(model)}

    # 6. unused and frozen parameters stay untouched (the alias that keeps compression)
    model = Model(unused=True, frozen=True)
    before_unused = model.unused.weight.detach().clone()
    before_frozen = model.frozen.weight.detach().clone()
    trainer, model = _fit(onebit(find_unused_parameters=True), model=model)
    st = trainer.strategy.onebit_state
    out["unused"] = {
        "grad_none": model.unused.weight.grad is None,
        "unchanged": bool(torch.equal(before_unused, model.unused.weight.detach())),
        "frozen_unchanged": bool(torch.equal(before_frozen, model.frozen.weight.detach())),
        "compressed": st.compressed_calls,
        "mode": st.mode,
        "params": _params(model),
    }

    # 6b. the same with gradient compression: the comm thread's collectives run beside DDP's unused-parameter map
    model = Model(unused=True, frozen=True)
    before_unused = model.unused.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "proven only for plain SGD"
        trainer, model = _fit(onebit(compress="gradients", find_unused_parameters=True), model=model)
    st = trainer.strategy.onebit_state
    out["unused_gradients"] = {
        "grad_none": model.unused.weight.grad is None,
        "unchanged": bool(torch.equal(before_unused, model.unused.weight.detach())),
        "compressed": st.compressed_calls,
        "mode": st.mode,
        "worker_stopped": st.comm_worker is None,
        "params": _params(model),
    }

    # 7. a NaN step under a GradScaler (rank 1 only): every rank skips it, no state changes, training goes on
    for mode in ("momentum", "gradients"):

        class Snap(L.Callback):
            def __init__(self) -> None:
                self.snaps: dict[int, dict] = {}

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.snaps[batch_idx] = _opt_state(trainer)

        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
        snap = Snap()
        trainer, model = _fit(
            onebit(compress=mode), model=Model(nan_at=4), plugins=[plugin], max_steps=8, callbacks=[snap]
        )
        st = trainer.strategy.onebit_state
        out[f"nan_{mode}"] = {
            "nonfinite": st.nonfinite_groups,
            "finite_params": bool(all(torch.isfinite(p).all() for p in model.parameters())),
            "scale": float(scaler.get_scale()),
            "errors_finite": bool(all(torch.isfinite(g.worker_error).all() for g in st.groups.values())),
            "compressed": st.compressed_calls,
            "snaps": snap.snaps if mode == "momentum" else {},
            "params": _params(model),
        }

    # 8. bf16-mixed on CPU
    trainer, model = _fit(onebit(), precision="bf16-mixed")
    out["bf16"] = {"compressed": trainer.strategy.onebit_state.compressed_calls, "losses": model.losses}

    # 9. resume = uninterrupted. Gradient compression with small buckets: DDP's first iteration after the resume uses
    # its initial bucket layout (one bucket), not the rebuilt one (several), so the hook must process that bucket as
    # the saved groups. Compressed momentum: SGD-momentum and AdamW (momentum, frozen variance, errors, stage).
    out["resume"] = _resume(lambda: onebit(compress="gradients", bucket_cap_mb=0.0001), tmp, "grads")
    out["resume_sgdm"] = _resume(lambda: onebit(group_numel=500), tmp, "sgdm", opt="sgdm")
    out["resume_adamw"] = _resume(lambda: onebit(group_numel=500), tmp, "adamw")

    # 10. another optimizer: gradient compression, with a warning naming it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model = _fit(onebit(), max_steps=4, model=Model(opt="rmsprop"))
    out["rmsprop"] = {
        "mode": trainer.strategy.onebit_state.mode,
        "warnings": [str(w.message) for w in caught if "RMSprop" in str(w.message)],
        "compressed": trainer.strategy.onebit_state.compressed_calls,
    }

    # 11. overlap: groups started during backward (several buckets, groups that span buckets) give bit-identical
    # parameters, momentum, variance and error state to groups started after backward
    class Early(L.Callback):
        def on_train_start(self, trainer, pl_module):
            comp = next(iter(trainer.strategy._compressors.values()))
            inner = comp.on_bucket
            self.calls, self.started = 0, []

            def spy(params, grads):
                inner(params, grads)
                self.calls += 1
                self.started.append(len(comp._early.started))

            comp.on_bucket = spy

    for opt in ("sgdm", "adamw"):
        for overlap in (True, False):
            early = Early()
            kw = {"group_numel": 300, "bucket_cap_mb": 0.0005}
            trainer, model = _fit(onebit(overlap=overlap, **kw), max_steps=7, callbacks=[early], model=Model(opt=opt))
            out[f"overlap_{opt}_{overlap}"] = {
                "resolved": trainer.strategy.overlap,
                "calls": early.calls,
                "started": early.started,
                "compressed": trainer.strategy.onebit_state.compressed_calls,
                "state": _opt_state(trainer),
                "params": _params(model),
            }
    # "auto" turns overlap off for what needs the whole gradient; True refuses it with the reason
    trainer, _ = _fit(onebit(), max_steps=3, gradient_clip_val=1.0)
    out["overlap_auto_clip"] = trainer.strategy.overlap
    try:
        _fit(onebit(overlap=True), max_steps=3, gradient_clip_val=1.0)
        out["overlap_true_clip"] = ""
    except ValueError as err:
        out["overlap_true_clip"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("onebit")
    return run_in_processes(_scenarios, 2, args=(str(tmp),), init_process_group=False, timeout=420)


def _same_on_both_ranks(results: list[dict], name: str) -> None:
    np.testing.assert_array_equal(results[0][name]["params"], results[1][name]["params"])


def test_alias_trains_with_the_hook_attached_on_cpu(results: list[dict]) -> None:
    r0, r1 = results[0]["alias"], results[1]["alias"]
    assert r0["cls"] == "OneBitDDPStrategy"
    assert "onebit_hook" in r0["hook"], "Lightning skips comm hooks on CPU; the strategy must register its own"
    assert r0["mode"] == "momentum" and r0["step"] == 16
    # compression="auto" decided once, from real steps: 10 fp32 warm-up steps, then 4 compressed ones timed against
    # them, the same verdict on every rank
    assert len(r0["decisions"]) == 1 and r0["decisions"] == r1["decisions"]
    d = r0["decisions"][0]
    assert d["step"] == 10 and d["source"] == "steps" and d["fp32_s"] > 0 and d["onebit_s"] > 0
    assert r0["compressed"] > 0  # the trial steps
    assert r0["last_compressed"] == (d["decision"] == "1bit")
    np.testing.assert_array_equal(r0["params"], r1["params"])  # replicas bit-identical
    assert math.isfinite(r0["losses"][-1])


def test_auto_decides_on_both_branches(results: list[dict]) -> None:
    one, fp = results[0]["auto_1bit"], results[0]["auto_fp32"]
    assert one["decision"] == "1bit" and one["compressed"] > 0
    assert [d["step"] for d in one["decisions"]] == [WARMUP, WARMUP + 3, WARMUP + 6]  # recheck_every=3
    assert one["metrics"]["comm/compression_ratio"] > 20
    assert fp["decision"] == "fp32" and fp["compressed"] == 0
    assert all(d["decision"] == "fp32" and d["fp32_s"] == 0.001 for d in fp["decisions"])
    assert fp["metrics"]["comm/compression_ratio"] == pytest.approx(1.0)
    _same_on_both_ranks(results, "auto_1bit")
    _same_on_both_ranks(results, "auto_fp32")


@pytest.mark.parametrize("mode", ["momentum", "gradients"])
def test_accumulation_compresses_once_per_optimizer_step(results: list[dict], mode: str) -> None:
    r = results[0][f"accumulate_{mode}"]
    assert r["step"] == 5
    assert r["compressed"] == (5 - WARMUP) * r["groups"] > 0
    _same_on_both_ranks(results, f"accumulate_{mode}")


def test_clipping_clips_the_local_gradient_before_the_momentum_update(results: list[dict]) -> None:
    n0, n1 = results[0]["clip"]["norms"], results[1]["clip"]["norms"]
    assert len(n0) == 6 - WARMUP
    assert all(n <= 0.05 * (1 + 1e-5) for n in n0 + n1), "the compressed step saw an unclipped gradient"
    assert n0 != n1, "the compressed step must see each rank's own (local) gradient"
    _same_on_both_ranks(results, "clip")


def test_static_graph(results: list[dict]) -> None:
    assert results[0]["static"]["compressed"] > 0
    _same_on_both_ranks(results, "static")


def test_unused_and_frozen_parameters_untouched(results: list[dict]) -> None:
    r = results[0]["unused"]
    assert r["mode"] == "momentum" and r["compressed"] > 0
    assert r["grad_none"] and r["unchanged"] and r["frozen_unchanged"]
    _same_on_both_ranks(results, "unused")


def test_unused_parameters_with_gradient_compression_in_the_comm_thread(results: list[dict]) -> None:
    r = results[0]["unused_gradients"]
    assert r["mode"] == "gradients" and r["compressed"] > 0
    assert r["grad_none"] and r["unchanged"] and r["worker_stopped"]  # teardown stopped the thread
    _same_on_both_ranks(results, "unused_gradients")


@pytest.mark.parametrize("mode", ["momentum", "gradients"])
def test_nan_step_is_skipped_and_state_survives(results: list[dict], mode: str) -> None:
    for r in (results[0][f"nan_{mode}"], results[1][f"nan_{mode}"]):
        assert r["finite_params"] and r["errors_finite"]
        assert r["compressed"] > 0
        if mode == "gradients":
            assert r["nonfinite"] >= 1 and r["compressed"] > r["nonfinite"]
        else:
            # the NaN batch (index 4) changed no momentum, variance or error state on either rank
            before, after = r["snaps"][3], r["snaps"][4]
            assert before.keys() == after.keys() and any(k.startswith("err.") for k in before)
            for k in before:
                if not k.endswith(".step"):
                    np.testing.assert_array_equal(before[k], after[k], err_msg=k)
            # ... while a finite compressed step does change them
            assert any(not np.array_equal(after[k], r["snaps"][5][k]) for k in after if k.startswith("err."))
    assert results[0][f"nan_{mode}"]["scale"] == results[1][f"nan_{mode}"]["scale"]
    _same_on_both_ranks(results, f"nan_{mode}")


def test_bf16_mixed(results: list[dict]) -> None:
    r = results[0]["bf16"]
    assert r["compressed"] > 0 and all(math.isfinite(v) for v in r["losses"])


@pytest.mark.parametrize("name", ["resume", "resume_sgdm", "resume_adamw"])
def test_resume_continues_exactly(results: list[dict], name: str) -> None:
    for r in results:
        res = r[name]
        assert res["ckpt_world"] == 2 and res["step"] == 16 and res["ckpt_decision"] == "1bit"
        assert res["groups"] > 1 and not res["reset_warnings"] and res["compressed"] > 0
        assert res["mode"] == ("gradients" if name == "resume" else "momentum")
        np.testing.assert_array_equal(res["full"], res["resumed"])
    np.testing.assert_array_equal(results[0][name]["resumed"], results[1][name]["resumed"])


def test_other_optimizers_compress_gradients_with_a_warning(results: list[dict]) -> None:
    r = results[0]["rmsprop"]
    assert r["mode"] == "gradients" and r["compressed"] > 0
    assert r["warnings"] and "proven only for plain SGD" in r["warnings"][0]


@pytest.mark.parametrize("opt", ["sgdm", "adamw"])
def test_overlap_starts_groups_during_backward_with_identical_results(results: list[dict], opt: str) -> None:
    on, off = results[0][f"overlap_{opt}_True"], results[0][f"overlap_{opt}_False"]
    assert on["resolved"] is True and off["resolved"] is False
    assert on["compressed"] == off["compressed"] > 0
    # several buckets per backward, and groups were started inside the hook (before backward finished)
    assert on["calls"] >= 2 * (7 - WARMUP) and max(on["started"]) > 0 and off["calls"] == 0
    np.testing.assert_array_equal(on["params"], off["params"])
    assert on["state"].keys() == off["state"].keys()
    for k in on["state"]:
        np.testing.assert_array_equal(on["state"][k], off["state"][k], err_msg=k)
    _same_on_both_ranks(results, f"overlap_{opt}_True")


def test_overlap_is_refused_or_turned_off_with_clipping(results: list[dict]) -> None:
    assert results[0]["overlap_auto_clip"] is False
    msg = results[0]["overlap_true_clip"]
    assert "`overlap=True`" in msg and "gradient_clip_val=1.0" in msg and "overlap='auto'" in msg


@pytest.mark.parametrize("branch", ["1bit", "fp32"])
def test_auto_trial_of_real_steps_decides_on_both_branches(results: list[dict], branch: str) -> None:
    r = results[0][f"trial_{branch}"]
    other = results[1][f"trial_{branch}"]
    assert [r[k] for k in ("decisions", "decision", "compressed")] == [
        other[k] for k in ("decisions", "decision", "compressed")
    ]  # the same decision and figures everywhere
    (d,) = r["decisions"]
    # steps 1-3 (fp32) against 5-7 (1-bit; step 4 builds the compression state): 1.0 s against 0.5 s or 2.0 s
    assert d["step"] == 4 and d["source"] == "steps"
    assert d["fp32_s"] == 1.0 and d["onebit_s"] == (0.5 if branch == "1bit" else 2.0)
    assert r["decision"] == branch and r["last_compressed"] == (branch == "1bit")
    # fp32: the 4 trial steps were compressed, the rest not; 1bit: every step from 4 on
    assert r["compressed"] == (4 if branch == "fp32" else 8) * max(1, r["groups"])
    _same_on_both_ranks(results, f"trial_{branch}")
