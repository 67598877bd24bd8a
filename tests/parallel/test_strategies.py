"""The sharded and pipeline strategies in one CPU process: a meta-device model is materialised, every replaced method
comes back when the fit ends, and ``ShardedStrategy``'s arguments mean what ``ModelParallelStrategy``'s mean."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_accel.parallel import PipelineStrategy, ShardedStrategy


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.example_input_array = torch.zeros(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch[0]), batch[0])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g)), batch_size=4)


def trainer(strategy: Any, callbacks: list[Callback] | None = None, max_steps: int = 2, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks or [], **kw,
    )  # fmt: skip


class SeenInTraining(Callback):
    """What the precision plugin and the module look like while training runs."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.clip_patched = "clip_grad_by_norm" in vars(trainer.strategy.precision_plugin)
        self.module_patched = {"forward", "log"} & set(vars(pl_module))


def test_a_meta_device_model_is_materialised_and_trains() -> None:
    t = trainer(ShardedStrategy())
    with t.init_module(empty_init=True):
        model = Small()
    assert all(p.is_meta for p in model.parameters())
    t.fit(model, loader())
    params = list(model.parameters())
    assert not any(p.is_meta for p in params) and all(isinstance(p, DTensor) for p in params)
    assert all(bool(torch.isfinite(p.full_tensor()).all()) for p in params if isinstance(p, DTensor))
    assert t.global_step == 2 and torch.isfinite(t.callback_metrics["train_loss"])
    assert isinstance(t.strategy, ShardedStrategy) and "fsdp_units" in t.strategy.applied  # sharded on meta, then real


class TensorParallelClipping(ShardedStrategy):
    """A plan that reports tensor parallelism, so setup installs the mixed-DTensor clipping (one process: no mesh)."""

    def apply_plan(self, module: nn.Module) -> dict[str, Any]:
        return {**super().apply_plan(module), "tp": {}}


def test_the_sharded_clipping_is_restored_when_the_fit_ends() -> None:
    seen = SeenInTraining()
    t = trainer(TensorParallelClipping(), [seen], gradient_clip_val=0.5)
    plugin = t.strategy.precision_plugin
    t.fit(Small(), loader())
    assert seen.clip_patched and t.global_step == 2
    assert "clip_grad_by_norm" not in vars(plugin) and type(plugin).clip_grad_by_norm.__name__ == "clip_grad_by_norm"


def test_the_pipeline_restores_clipping_forward_and_log() -> None:
    seen = SeenInTraining()
    t = trainer(PipelineStrategy(), [seen], gradient_clip_val=0.5)
    plugin = t.strategy.precision_plugin
    model = Small()
    t.fit(model, loader())
    assert t.global_step == 2 and seen.clip_patched and not seen.module_patched  # forward/log: per step only
    assert "clip_grad_by_norm" not in vars(plugin)
    assert {"forward", "log"}.isdisjoint(vars(model)) and model(torch.zeros(1, 8)).shape == (1, 8)


def _sizes(strategy: ShardedStrategy, nodes: int, per_node: int) -> tuple[int, int]:
    strategy.num_nodes = nodes
    strategy.parallel_devices = [torch.device("cpu")] * per_node
    return strategy.mesh_sizes()


def test_mesh_sizes_mean_what_model_parallel_strategy_means() -> None:
    assert _sizes(ShardedStrategy(), 2, 2) == (4, 1)  # the default: shard over every rank
    assert _sizes(ShardedStrategy(2), 2, 2) == (2, 2)
    assert _sizes(ShardedStrategy("auto"), 2, 4) == (2, 4)  # tensor parallel: the devices of one node
    assert _sizes(ShardedStrategy(2, data_parallel_size="auto"), 3, 2) == (3, 2)  # data parallel: the nodes
    assert _sizes(ShardedStrategy(data_parallel_size=4), 1, 4) == (4, 1)
    with pytest.raises(ValueError, match=r"world size 4 is not `data_parallel_size` \(3\) x `tensor_parallel_size`"):
        _sizes(ShardedStrategy(data_parallel_size=3), 1, 4)


def test_data_parallel_auto_that_does_not_fill_the_world_keeps_the_old_meaning_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"`data_parallel_size='auto'` means the number of nodes.*=None"):
        assert _sizes(ShardedStrategy(data_parallel_size="auto"), 1, 4) == (4, 1)


def test_the_checkpoint_argument_has_lightnings_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ShardedStrategy().save_distributed_checkpoint is False  # default: a full file through CheckpointIO
        assert ShardedStrategy(save_distributed_checkpoint=True).save_distributed_checkpoint is True
    with pytest.warns(DeprecationWarning, match=r"`distributed_checkpoint` is deprecated; use `save_distributed_ch"):
        old = ShardedStrategy(distributed_checkpoint=True)
    assert old.save_distributed_checkpoint is True
    with pytest.raises(ValueError, match="pass only `save_distributed_checkpoint`"):
        ShardedStrategy(distributed_checkpoint=True, save_distributed_checkpoint=False)


@pytest.mark.parametrize("spelling", ["save_distributed_checkpoint", "distributed_checkpoint"])
def test_either_spelling_parses_as_a_class_path(spelling: str) -> None:
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    value = f'{{"class_path": "lightning_accel.parallel.ShardedStrategy", "init_args": {{"{spelling}": true}}}}'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        st = parser.instantiate_classes(parser.parse_args(["--strategy", value])).strategy
    assert isinstance(st, ShardedStrategy) and st.save_distributed_checkpoint is True


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_parallel_size": 0}, ValueError, r"`tensor_parallel_size` must be an integer >= 1, got 0\. Or 'auto'"),
        ({"tensor_parallel_size": True}, TypeError, r"`tensor_parallel_size` must be an integer >= 1, got True \(bool"),
        ({"data_parallel_size": 0}, ValueError, r"`data_parallel_size` must be an integer >= 1, got 0\. Or None"),
        ({"save_distributed_checkpoint": 1}, TypeError, r"`save_distributed_checkpoint` must be True or False"),
        # `fully_shard` would refuse it only at setup, once every process has started
        ({"reshard_after_forward": "no"}, TypeError, r"`reshard_after_forward` must be True or False, got 'no' \(str"),
        (
            {"tensor_parallel_size": 2, "tp_plan": {"0.q": "columnwise"}},
            ValueError,
            r"`tp_plan` values must be one of \['colwise', 'rowwise', 'colwise_packed'\], got \{'0.q': 'columnwise'\}",
        ),
        (
            {"tensor_parallel_size": 2, "tp_plan": ["0.q", "0.proj"]},
            TypeError,
            r"`tp_plan` must be a dict \{module name: style\}, got \['0.q', '0.proj'\] \(list\)\. Map each",
        ),
    ],
)
def test_bad_sharded_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedStrategy(**kwargs)


def test_a_tp_plan_without_tensor_parallelism_warns_that_it_is_unused() -> None:
    with pytest.warns(UserWarning, match=r"`tp_plan` is unused with `tensor_parallel_size=1`: no module is split"):
        ShardedStrategy(tp_plan={"0.q": "colwise"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ShardedStrategy(2, tp_plan={"0.q": "colwise"}).tp_plan == {"0.q": "colwise"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "zigzag"}, ValueError, r"`schedule` must be one of '1f1b', 'gpipe', 'interleaved1f1b', got"),
        ({"pipeline_size": 0}, ValueError, r"`pipeline_size` must be an integer >= 1 or None, got 0"),
        ({"microbatches": True}, TypeError, r"`microbatches` must be an integer >= 1 or None, got True \(bool\)"),
        ({"stages_per_rank": 0}, ValueError, r"`stages_per_rank` must be an integer >= 1 or None, got 0"),
        # known together in `__init__`: refused here, not once every process has started
        (
            {"pipeline_size": 4, "microbatches": 2},
            ValueError,
            r"`microbatches`=2 is smaller than `pipeline_size`=4: some stages would idle .* >= 4, or None for 8",
        ),
        (
            {"pipeline_size": 2, "microbatches": 3, "schedule": "interleaved1f1b"},
            ValueError,
            r"`microbatches`=3 with `schedule`='interleaved1f1b' and `pipeline_size`=2: .* Use `microbatches`=4",
        ),
    ],
)
def test_bad_pipeline_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PipelineStrategy(**kwargs)


class SyncNormed(Small):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.SyncBatchNorm(16), nn.ReLU(), nn.Linear(16, 8))


def test_the_pipeline_refuses_sync_batchnorm_before_a_stage_runs() -> None:
    # a stage's SyncBatchNorm would wait in its collective for ranks running other stages: refused at setup, on
    # every rank alike, naming the module
    with pytest.raises(ValueError, match=r"PipelineStrategy: a pipeline cannot train `SyncNormed`.*`net\.1`"):
        trainer(PipelineStrategy()).fit(SyncNormed(), loader())


def test_the_pipeline_refuses_a_sharded_checkpoint_folder_naming_it(tmp_path: Path) -> None:
    t = trainer(ShardedStrategy(save_distributed_checkpoint=True))
    t.fit(Small(), loader())
    folder = tmp_path / "sharded.ckpt"
    t.save_checkpoint(folder)
    assert folder.is_dir()
    with pytest.raises(ValueError, match=r"PipelineStrategy cannot resume from `.*sharded\.ckpt`: it is a folder"):
        trainer(PipelineStrategy(), max_steps=4).fit(Small(), loader(), ckpt_path=folder)
    full = tmp_path / "full.ckpt"  # what the sharded plan saves by default resumes under the pipeline
    t = trainer(ShardedStrategy())
    t.fit(Small(), loader())
    t.save_checkpoint(full)
    t = trainer(PipelineStrategy(), max_steps=4)
    t.fit(Small(), loader(), ckpt_path=full)
    assert t.global_step == 4


def test_step_outputs_that_cannot_be_sent_to_the_other_stages_are_dropped_with_a_warning() -> None:
    import threading

    from lightning_accel.parallel.strategies.pipeline import _sendable

    outputs = {"preds": torch.ones(2), "acc": 0.5}
    assert _sendable(outputs) is outputs
    # the last stage broadcasts them: raising there would leave the other ranks waiting in the broadcast
    with pytest.warns(UserWarning, match="cannot be sent to the other ranks of the pipeline .*TypeError"):
        assert _sendable({"lock": threading.Lock()}) is None
