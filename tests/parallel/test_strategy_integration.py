"""AutoStrategy inside a Trainer: keeps DDP when it fits, swaps to the chosen strategy at setup, works from the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry
from torch import nn

import lightning_accel.parallel.strategy as strategy_mod
from lightning_accel.parallel import AutoStrategy


class Deep(pl.LightningModule):
    """60 tiny layers: the rules policy calls for a pipeline (runnable as FSDP)."""

    def __init__(self, depth: int = 60) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
        self.example_input_array = torch.zeros(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)


def trainer(strategy: Any, callbacks: list[Callback] | None = None, **kw: Any) -> pl.Trainer:
    args: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    args.update(kw)
    return pl.Trainer(strategy=strategy, callbacks=callbacks or [], **args)


def test_keeps_ddp_when_it_fits() -> None:
    st = AutoStrategy(device_memory_bytes=10**9, example_batch_size=16)
    t = trainer(st)
    t.fit(Deep(depth=3), loader())
    assert t.strategy is st and isinstance(t.strategy, DDPStrategy)
    assert st.choice is not None and st.choice.strategy == "auto" and st.choice.fits
    assert st.choice.facts["activations"] > 0  # measured on example_input_array, scaled to the real batch
    assert t.global_step == 3


class Stop(Exception):
    pass


class Inspect(Callback):
    """Records the strategy the Trainer uses after setup_environment, then stops before FSDP wraps (needs a GPU)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        s = trainer.strategy
        self.seen = (type(s), type(s.precision_plugin).__name__, s.parallel_devices, s.launcher, s.lightning_module)
        raise Stop


def test_swaps_to_fsdp_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strategy_mod, "_fsdp_runs_on", lambda device: True)  # torch's FSDP itself needs a GPU
    st = AutoStrategy(policy="rules")
    spy = Inspect()
    t = trainer(st, [spy])
    model = Deep()
    with pytest.raises(Stop):
        t.fit(model, loader())
    cls, prec, devices, launcher, module = spy.seen
    assert cls is FSDPStrategy and prec == "FSDPPrecision"
    assert devices == st.parallel_devices and launcher is st.launcher and module is model
    assert st.choice is not None and st.choice.plan == "pipeline" and st.chosen is t.strategy


def test_fsdp_on_cpu_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot run on `cpu`"):
        trainer(AutoStrategy(policy="rules")).fit(Deep(), loader())


def test_ddp_1bit_resolves_by_registered_name(monkeypatch: pytest.MonkeyPatch) -> None:
    st = AutoStrategy()
    if "ddp_1bit" not in StrategyRegistry:

        class Fake1Bit(DDPStrategy):
            pass

        monkeypatch.setitem(StrategyRegistry, "ddp_1bit", {"strategy": Fake1Bit, "init_params": {}, "description": ""})
    built = st._build("ddp_1bit", None)  # type: ignore[arg-type]
    assert isinstance(built, DDPStrategy)
    # Not monkeypatch.delitem: it saves the old value with `registry.get(name)`, which the registry overrides to
    # *instantiate* the strategy, so the "restored" entry would be a strategy object instead of its record.
    saved = dict.pop(StrategyRegistry, "ddp_1bit")
    try:
        with pytest.warns(UserWarning, match="no strategy of that name is registered"):
            assert st._build("ddp_1bit", None) is None  # type: ignore[arg-type]
    finally:
        dict.__setitem__(StrategyRegistry, "ddp_1bit", saved)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`policy`"):
        AutoStrategy(policy="magic")
    with pytest.raises(ValueError, match="`example_batch_size`"):
        AutoStrategy(example_batch_size=0)


def test_lightning_cli_instantiates_it(tmp_path: Path) -> None:
    from lightning_accel.cli import AccelCLI

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
        "  strategy:\n    class_path: lightning_accel.parallel.AutoStrategy\n"
        "    init_args: {policy: memory, device_memory_bytes: 1000000000, example_batch_size: 64}\n"
        "model:\n  class_path: lightning_accel.models.ImageClassifier\n  init_args: {width: 8}\n"
        "data:\n  class_path: lightning_accel.datasets.DigitsDataModule\n"
        f"  init_args: {{data_dir: {tmp_path / 'd'}}}\n"
    )
    cli = AccelCLI(args=["--config", str(cfg)], run=False)
    st = cli.trainer.strategy
    assert isinstance(st, AutoStrategy) and st.device_memory_bytes == 10**9 and st.example_batch_size == 64


@pytest.mark.gpu
def test_real_fsdp_swap_on_gpu() -> None:
    st = AutoStrategy(policy="rules")
    t = trainer(st, accelerator="cuda", devices=1)
    t.fit(Deep(), loader())
    assert isinstance(t.strategy, FSDPStrategy) and t.global_step == 3
