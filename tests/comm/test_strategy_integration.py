"""``Trainer(strategy="ddp_1bit", accelerator="cpu", devices=2)`` in two real processes (gloo).

Every scenario runs in one pair of processes (spawning costs ~5 s each on a busy 2-core machine): plain training with
the registered alias, gradient accumulation, ``static_graph``, unused parameters, NaN steps under a GradScaler,
``bf16-mixed``, and resume-from-checkpoint against an uninterrupted run.
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
        def __init__(self, unused: bool = False, nan_at: int | None = None) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4))
            self.unused = nn.Linear(8, 8) if unused else None
            self.nan_at = nan_at
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x).float(), y)
            if self.nan_at is not None and self.global_step == self.nan_at and self.global_rank == 1:
                loss = loss * float("nan")
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            # while DDP wraps the module (the strategy unwraps it at teardown): which comm hook is registered?
            self.hook_name = self.trainer.strategy.model._get_ddp_logging_data().get("comm_hook")

        def configure_optimizers(self):
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


def _scenarios(rank: int, world: int, tmp: str) -> dict:
    from lightning.pytorch.plugins.precision import MixedPrecision

    import lightning_accel  # noqa: F401  (registers "ddp_1bit")
    from lightning_accel.strategies import OneBitDDPStrategy

    out: dict = {}
    Model = _module_cls()

    # 1. the registered alias, default warm-up (10) and a few compressed steps
    trainer, model = _fit("ddp_1bit", max_steps=14)
    st = trainer.strategy.onebit_state
    out["alias"] = {
        "cls": type(trainer.strategy).__name__,
        "hook": model.hook_name,
        "compressed": st.compressed_calls,
        "step": st.step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")},
        "params": _params(model),
        "losses": model.losses,
    }

    # 2. gradient accumulation: the hook runs once per optimizer step
    trainer, model = _fit(OneBitDDPStrategy(warmup_steps=WARMUP), max_steps=5, accumulate_grad_batches=2)
    st = trainer.strategy.onebit_state
    out["accumulate"] = {"step": st.step, "compressed": st.compressed_calls, "groups": len(st.groups)}

    # 3. static graph
    trainer, model = _fit(OneBitDDPStrategy(warmup_steps=WARMUP, static_graph=True))
    out["static"] = {"compressed": trainer.strategy.onebit_state.compressed_calls, "params": _params(model)}

    # 4. unused parameters stay untouched
    model = Model(unused=True)
    before = model.unused.weight.detach().clone()
    trainer, model = _fit(OneBitDDPStrategy(warmup_steps=WARMUP, find_unused_parameters=True), model=model)
    st = trainer.strategy.onebit_state
    out["unused"] = {
        "grad_none": model.unused.weight.grad is None,
        "unchanged": bool(torch.equal(before, model.unused.weight.detach())),
        "compressed": st.compressed_calls,
    }

    # 5. a NaN step under a GradScaler: skipped everywhere, error state untouched, training goes on
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    model = Model(nan_at=4)
    trainer, model = _fit(OneBitDDPStrategy(warmup_steps=WARMUP), model=model, plugins=[plugin], max_steps=8)
    st = trainer.strategy.onebit_state
    out["nan"] = {
        "nonfinite": st.nonfinite_groups,
        "finite_params": bool(all(torch.isfinite(p).all() for p in model.parameters())),
        "scale": float(scaler.get_scale()),
        "errors_finite": bool(all(torch.isfinite(g.worker_error).all() for g in st.groups.values())),
        "compressed": st.compressed_calls,
    }

    # 6. bf16-mixed on CPU
    trainer, model = _fit(OneBitDDPStrategy(warmup_steps=WARMUP), precision="bf16-mixed")
    out["bf16"] = {"compressed": trainer.strategy.onebit_state.compressed_calls, "losses": model.losses}

    # 7. resume = uninterrupted (2 epochs of 8 steps; checkpoint after epoch 1, well past warm-up). Small buckets:
    # DDP's first iteration after the resume uses its initial bucket layout (one bucket), not the rebuilt one
    # (several), so the hook must process that bucket as the saved groups.
    def strategy():
        return OneBitDDPStrategy(warmup_steps=WARMUP, bucket_cap_mb=0.0001)

    _, full = _fit(strategy(), max_steps=-1, max_epochs=2)
    trainer, _ = _fit(strategy(), max_steps=-1, max_epochs=1)
    ckpt = str(Path(tmp) / "epoch1.ckpt")
    trainer.save_checkpoint(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, resumed = _fit(strategy(), max_steps=-1, max_epochs=2, ckpt=ckpt)
    out["resume"] = {
        "full": _params(full),
        "resumed": _params(resumed),
        "step": trainer.strategy.onebit_state.step,
        "groups": len(trainer.strategy.onebit_state.groups),
        "reset_warnings": [str(w.message) for w in caught if "reset" in str(w.message)],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = torch.load(ckpt, weights_only=True)
    out["resume"]["ckpt_world"] = ck["lightning_accel_onebit"]["world_size"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("onebit")
    return run_in_processes(_scenarios, 2, args=(str(tmp),), init_process_group=False, timeout=240)


def test_alias_trains_with_the_hook_attached_on_cpu(results: list[dict]) -> None:
    r0, r1 = results[0]["alias"], results[1]["alias"]
    assert r0["cls"] == "OneBitDDPStrategy"
    assert "onebit_hook" in r0["hook"], "Lightning skips comm hooks on CPU; the strategy must register its own"
    assert r0["step"] == 14 and r0["compressed"] == 14 - 10
    np.testing.assert_array_equal(r0["params"], r1["params"])  # replicas bit-identical
    assert r0["metrics"]["comm/compression_ratio"] > 20
    assert r0["metrics"]["comm/bytes_sent"] > 0
    assert math.isfinite(r0["losses"][-1])


def test_accumulation_compresses_once_per_optimizer_step(results: list[dict]) -> None:
    r = results[0]["accumulate"]
    assert r["step"] == 5
    assert r["compressed"] == (5 - WARMUP) * r["groups"]


def test_static_graph(results: list[dict]) -> None:
    assert results[0]["static"]["compressed"] > 0
    np.testing.assert_array_equal(results[0]["static"]["params"], results[1]["static"]["params"])


def test_unused_parameters_untouched(results: list[dict]) -> None:
    r = results[0]["unused"]
    assert r["compressed"] > 0 and r["grad_none"] and r["unchanged"]


def test_nan_step_is_skipped_and_state_survives(results: list[dict]) -> None:
    for r in (results[0]["nan"], results[1]["nan"]):
        assert r["nonfinite"] >= 1
        assert r["finite_params"] and r["errors_finite"]
        assert r["compressed"] > r["nonfinite"]
    assert results[0]["nan"]["scale"] == results[1]["nan"]["scale"]


def test_bf16_mixed(results: list[dict]) -> None:
    r = results[0]["bf16"]
    assert r["compressed"] > 0 and all(math.isfinite(v) for v in r["losses"])


def test_resume_continues_exactly(results: list[dict]) -> None:
    for r in results:
        res = r["resume"]
        assert res["ckpt_world"] == 2 and res["step"] == 16
        assert res["groups"] > 1 and not res["reset_warnings"]
        np.testing.assert_array_equal(res["full"], res["resumed"])
