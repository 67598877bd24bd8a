"""``select_strategy`` and ``AutoStrategy`` refuse a model or an example batch they can only fail on, in one line
naming the argument, instead of an ``AttributeError`` deep in the estimate or a silent lower-bound estimate."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel.parallel import AutoStrategy, select_strategy


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("batch", ["abc", 5, 2.5, [1, 2], {"x": 1}, object()], ids=lambda b: type(b).__name__)
def test_an_example_batch_without_a_tensor_is_refused_naming_it(batch: Any) -> None:
    # its forward could only fail: the estimate fell back to model state alone, with a warning, and chose DDP
    with pytest.raises(TypeError, match=r"^`example_batch` must be one per-device batch of forward inputs") as e:
        select_strategy(_net(), devices=2, device_memory_bytes=10**9, example_batch=batch)
    msg = str(e.value)
    assert "\n" not in msg and f"({type(batch).__name__}). Pass e.g. `example_batch=torch.randn(" in msg


@pytest.mark.parametrize("batch", [torch.randn(3, 4), (torch.randn(3, 4),), [torch.randn(3, 4)], None])
def test_an_example_batch_holding_a_tensor_is_measured(batch: Any) -> None:
    c = select_strategy(_net(), devices=2, device_memory_bytes=10**9, example_batch=batch)
    assert c.strategy == "ddp"
    assert c.facts["activations_source"] == ("none" if batch is None else "measured")


@pytest.mark.parametrize("model", ["net", None, torch.randn(2)], ids=lambda m: type(m).__name__)
def test_a_model_that_is_not_a_module_is_refused_naming_it(model: Any) -> None:
    with pytest.raises(TypeError, match=r"^`model` must be an `nn.Module` \(or a LightningModule\), got ") as e:
        select_strategy(model, devices=2, device_memory_bytes=10**9)
    assert "\n" not in str(e.value) and str(e.value).endswith("Pass the network to train.")


class _WrongExample(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.example_input_array = "a batch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_auto_strategy_names_an_example_input_array_without_a_tensor() -> None:
    strategy = AutoStrategy(device_memory_bytes=10**9)
    with pytest.raises(TypeError, match=r"^`_WrongExample.example_input_array` must be one per-device batch") as e:
        strategy.resolve(_WrongExample(), accelerator="cpu", devices=1)
    assert "\n" not in str(e.value) and str(e.value).endswith("pass `AutoStrategy(use_example_input=False)`.")
    # without it the estimate runs on model state alone, as documented
    assert AutoStrategy(device_memory_bytes=10**9, use_example_input=False).resolve(
        _WrongExample(), accelerator="cpu", devices=1
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"microbatches": 1, "pipeline_size": 2}, r"^`microbatches`=1 is smaller than `pipeline_size`=2: "),
        (
            {"microbatches": 3, "pipeline_size": 2, "schedule": "interleaved1f1b"},
            r"^`microbatches`=3 with `schedule`='interleaved1f1b' and `pipeline_size`=2: .* Use `microbatches`=4",
        ),
    ],
)
def test_micro_batches_the_pipeline_cannot_run_are_refused_where_they_are_written(
    kwargs: dict[str, Any], match: str
) -> None:
    # `PipelineStrategy` refuses them when it is built: `AutoStrategy` builds it at setup, once every process runs
    with pytest.raises(ValueError, match=match):
        select_strategy(_net(), devices=4, device_memory_bytes=10**9, **kwargs)
    with pytest.raises(ValueError, match=match):
        AutoStrategy(device_memory_bytes=10**9, pipeline_kwargs=kwargs)


def test_a_pipeline_over_every_device_with_too_few_micro_batches_never_fits() -> None:
    # 1 micro-batch for a pipeline over 4 devices: `PipelineStrategy` refuses it, so the estimate must not pick it
    net = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    c = select_strategy(net, devices=4, device_memory_bytes=16 * 256 * 256, headroom=0.0, microbatches=1)
    assert c.plan != "pipeline" and not c.fits  # only the pipeline fit the memory: nothing does now
    assert c.estimates["pipeline"].blocker.startswith("cannot run: `microbatches`=1 is smaller than `pipeline_size`=4")
    ok = select_strategy(net, devices=4, device_memory_bytes=16 * 256 * 256, headroom=0.0, microbatches=4)
    assert ok.plan == "pipeline" and ok.fits and not ok.estimates["pipeline"].blocker
