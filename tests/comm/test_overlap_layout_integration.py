"""``strategy="ddp_1bit"`` with overlapping when a parameter's layout changes the overlap's safety mid-fit, in two real
processes (gloo): a frozen channels_last convolution unfrozen by a callback (``BaseFinetuning``), or a module converted
to channels_last after setup.

DDP hands the hook contiguous views of a channels_last parameter's gradient whose elements are not the gradient's,
so a step that compresses during backward would average wrong momentum for it. ``overlap="auto"`` must fall back to
compressing after backward (bit-identical to ``overlap=False``), ``overlap=True`` must refuse in one line.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import run_in_processes

WARMUP = 2


def _module(frozen: bool) -> Any:
    import lightning as L

    class ConvNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.body = nn.Conv2d(8, 8, 3, padding=1)
            self.head = nn.Linear(8, 4)
            if frozen:  # a pretrained backbone: frozen at setup, in the layout the precision plugin picked
                self.body.to(memory_format=torch.channels_last)
                self.body.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.body(torch.relu(self.stem(x))))
            return self.head(x.mean((2, 3)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return ConvNet()


def _data() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 6, 6, generator=g)
    y = torch.randint(0, 4, (64,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def _fit(overlap: Any, change: str) -> dict[str, Any]:
    import lightning as L

    from lightning_accel.strategies import OneBitDDPStrategy

    class Change(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == WARMUP:  # the first compressed step
                if change == "unfreeze":
                    pl_module.body.requires_grad_(True)
                else:
                    pl_module.body.to(memory_format=torch.channels_last)

    model = _module(frozen=change == "unfreeze")
    strategy = OneBitDDPStrategy(warmup_steps=WARMUP, compression="1bit", overlap=overlap, min_compress_numel=1)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=WARMUP + 3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Change()],
    )  # fmt: skip
    trainer.fit(model, _data())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
    return {"params": params, "overlap": trainer.strategy.overlap, "step": trainer.strategy.onebit_state.step}


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        return f"{type(e).__name__}: {e}"
    return ""


def _run(rank: int, world: int) -> dict[str, Any]:
    import lightning_accel  # noqa: F401  (registers "ddp_1bit")

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for change in ("unfreeze", "convert"):
        out[f"{change}/serial"] = _fit(False, change)
        out[f"{change}/auto"] = _fit("auto", change)
    out["unfreeze/true"] = _error(lambda: _fit(True, "unfreeze"))  # last: a refused fit may leave a rank behind
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_in_processes(_run, 2, init_process_group=False, timeout=400)


@pytest.mark.parametrize("change", ["unfreeze", "convert"])
def test_auto_stops_overlapping_when_a_trained_parameter_becomes_channels_last(
    results: list[dict[str, Any]], change: str
) -> None:
    for got in results:
        auto, serial = got[f"{change}/auto"], got[f"{change}/serial"]
        assert auto["step"] == serial["step"] == WARMUP + 3
        assert auto["overlap"] is False
        np.testing.assert_array_equal(auto["params"], serial["params"])  # both orders are bit-identical
    np.testing.assert_array_equal(results[0][f"{change}/auto"]["params"], results[1][f"{change}/auto"]["params"])


def test_overlap_true_refuses_a_trained_parameter_that_becomes_channels_last(results: list[dict[str, Any]]) -> None:
    for got in results:
        msg = got["unfreeze/true"]
        assert msg.startswith("ValueError: `overlap=True` cannot start compressing during backward"), msg
        assert "channels_last" in msg and "overlap='auto'" in msg and "\n" not in msg
