"""``lightning_accel._utils.compat``: every private Lightning/torch name it relies on still exists, and every shim
still does what its callers need.

The presence checks fail with the attribute's name, the installed versions and the shim to update, so a Lightning or
torch upgrade that drops one is caught here rather than as an ``AttributeError`` deep inside a training run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel._utils import compat

VERSIONS = f"torch {torch.__version__}, lightning {lightning.__version__}"


def _trainer(**kw: Any) -> pl.Trainer:
    args: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    args.update(kw)
    return pl.Trainer(**args)


def _tv_ops() -> Any:
    importlib.import_module("torchvision.io")  # registers the image ops
    return torch.ops.image


def _module(name: str) -> Callable[[], Any]:
    return lambda: importlib.import_module(name)


def _loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.zeros(2)), batch_size=1)


def _scheduler() -> Any:
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1)


# (what, the object that must have it, attribute, the shim that needs it)
PRIVATE_NAMES: list[tuple[str, Callable[[], Any], str, str]] = [
    ("Trainer._accelerator_connector", _trainer, "_accelerator_connector", "set_trainer_strategy"),
    ("_AcceleratorConnector.strategy", lambda: _trainer()._accelerator_connector, "strategy", "set_trainer_strategy"),
    ("ParallelStrategy._layer_sync", DDPStrategy, "_layer_sync", "get_layer_sync / set_layer_sync"),
    ("Strategy._launcher", DDPStrategy, "_launcher", "set_launcher"),
    (
        "torch.distributed.distributed_c10d._get_default_store",
        lambda: torch.distributed.distributed_c10d,
        "_get_default_store",
        "default_process_group_store",
    ),
    (
        "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher",
        _module("lightning.pytorch.strategies.launchers.multiprocessing"),
        "_MultiProcessingLauncher",
        "carry_callback_results_from_workers",
    ),
    ("ModelCheckpoint._fs", lambda: ModelCheckpoint(), "_fs", "set_checkpoint_filesystem"),
    (
        "ModelCheckpoint._save_checkpoint",
        lambda: ModelCheckpoint(),
        "_save_checkpoint",
        "wrap_model_checkpoint_writes",
    ),
    (
        "ModelCheckpoint._remove_checkpoint",
        lambda: ModelCheckpoint(),
        "_remove_checkpoint",
        "wrap_model_checkpoint_writes",
    ),
    (
        "ModelCheckpoint._every_n_train_steps",
        lambda: ModelCheckpoint(every_n_train_steps=4),
        "_every_n_train_steps",
        "model_checkpoint_step_interval",
    ),
    (
        "DistributedDataParallel._set_ddp_runtime_logging_sample_rate",
        lambda: torch.nn.parallel.DistributedDataParallel,
        "_set_ddp_runtime_logging_sample_rate",
        "set_ddp_runtime_logging_sample_rate",
    ),
    (
        "DistributedDataParallel._get_ddp_logging_data",
        lambda: torch.nn.parallel.DistributedDataParallel,
        "_get_ddp_logging_data",
        "ddp_logging_data",
    ),
    ("GradScaler._scale", lambda: torch.amp.GradScaler("cpu"), "_scale", "grad_scaler_scale"),
    ("LRScheduler._last_lr", _scheduler, "_last_lr", "scheduler_last_lr / set_scheduler_last_lr"),
    ("nn.Module._modules", lambda: nn.Linear(1, 1), "_modules", "child_modules / set_child_modules"),
    (
        "Module.state_dict()._metadata",
        lambda: nn.Linear(1, 1).state_dict(),
        "_metadata",
        "state_dict_metadata / set_state_dict_metadata",
    ),
    ("nn.Module._forward_hooks", lambda: nn.Linear(1, 1), "_forward_hooks", "module_has_hooks"),
    ("nn.Module._forward_pre_hooks", lambda: nn.Linear(1, 1), "_forward_pre_hooks", "module_has_hooks"),
    ("nn.Module._backward_hooks", lambda: nn.Linear(1, 1), "_backward_hooks", "module_has_hooks"),
    ("nn.Module._backward_pre_hooks", lambda: nn.Linear(1, 1), "_backward_pre_hooks", "module_has_hooks"),
    (
        "ModelParallelStrategy._data_parallel_size",
        lambda: __import__("lightning.pytorch.strategies", fromlist=["x"]).ModelParallelStrategy(),
        "_data_parallel_size",
        "set_model_parallel_sizes",
    ),
    (
        "ModelParallelStrategy._tensor_parallel_size",
        lambda: __import__("lightning.pytorch.strategies", fromlist=["x"]).ModelParallelStrategy(),
        "_tensor_parallel_size",
        "set_model_parallel_sizes",
    ),
    (
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        lambda: torch.nn.parallel.DistributedDataParallel,
        "_set_params_and_buffers_to_ignore_for_model",
        "ddp_ignored_names",
    ),
    ("nn.Module._call_impl", lambda: nn.Linear(1, 1), "_call_impl", "module_call_impl"),
    ("nn.Module._compiled_call_impl", lambda: nn.Linear(1, 1), "_compiled_call_impl", "compiled_call_impl"),
    (
        "torch._dynamo.exc.TorchDynamoException",
        _module("torch._dynamo.exc"),
        "TorchDynamoException",
        "compile_error_types",
    ),
    ("torch._inductor.exc", _module("torch._inductor"), "exc", "compile_error_types"),
    (
        "torch.utils.data._utils.pin_memory.pin_memory",
        _module("torch.utils.data._utils.pin_memory"),
        "pin_memory",
        "pin_memory",
    ),
    ("DataLoader._iterator", _loader, "_iterator", "shutdown_persistent_workers"),
    ("DataLoader._index_sampler", _loader, "_index_sampler", "index_sampler / wrap_index_sampler"),
    (
        "_MultiProcessingDataLoaderIter._shutdown_workers",
        lambda: torch.utils.data.dataloader._MultiProcessingDataLoaderIter,
        "_shutdown_workers",
        "shutdown_persistent_workers",
    ),
    ("ArgumentParser._actions", lambda: argparse.ArgumentParser(), "_actions", "parser_option_keys"),
    ("threading._register_atexit", lambda: threading, "_register_atexit", "register_before_thread_shutdown"),
    ("torch._C._storage_Use_Count", lambda: torch._C, "_storage_Use_Count", "storage_use_count_fn"),
    ("UntypedStorage._cdata", lambda: torch.empty(1).untyped_storage(), "_cdata", "storage_use_count_fn"),
    ("Tensor._typed_storage", lambda: torch.empty(1), "_typed_storage", "empty_shared"),
    ("TypedStorage._new_shared", lambda: torch.empty(1)._typed_storage(), "_new_shared", "empty_shared"),
    ("torch.ops.image.decode_jpeg", lambda: _tv_ops(), "decode_jpeg", "jpeg_decode_ops"),
    ("torch.ops.image.decode_jpegs_cuda", lambda: _tv_ops(), "decode_jpegs_cuda", "jpeg_decode_ops"),
    ("torch.cuda.memory._snapshot", lambda: torch.cuda.memory, "_snapshot", "cuda_memory_snapshot"),
    (
        "torch.cuda.memory._record_memory_history",
        lambda: torch.cuda.memory,
        "_record_memory_history",
        "record_cuda_memory_history / stop_cuda_memory_history",
    ),
]


@pytest.mark.parametrize(("what", "owner", "attr", "shim"), PRIVATE_NAMES, ids=[p[0] for p in PRIVATE_NAMES])
def test_private_name_exists(what: str, owner: Callable[[], Any], attr: str, shim: str) -> None:
    assert hasattr(owner(), attr), (
        f"`{what}` is gone ({VERSIONS}), and lightning_accel._utils.compat.{shim} relies on it. Find its new "
        "spelling or a public replacement, update the shim and its version note, and this check."
    )


def test_an_allocator_settings_setter_exists() -> None:
    names = ("torch._C._accelerator_setAllocatorSettings", "torch.cuda.memory._set_allocator_settings")
    assert compat.allocator_settings_setter() is not None, (
        f"Neither {' nor '.join(f'`{n}`' for n in names)} exists ({VERSIONS}): "
        "lightning_accel._utils.compat.allocator_settings_setter (CudaMemoryManager's run-time settings) needs one."
    )


def test_path_type_matches_lightnings_private_alias() -> None:
    from lightning.fabric.utilities.types import _PATH

    assert set(get_args(compat.PathType)) == set(get_args(_PATH)) == {str, Path}, (
        f"`lightning.fabric.utilities.types._PATH` is now {_PATH} ({VERSIONS}); compat.PathType must stay the same "
        "union so CheckpointIO/Strategy overrides keep Lightning's signature."
    )


def test_lightning_cli_hyper_parameter_keys_are_still_used() -> None:
    import inspect

    from lightning.pytorch import cli

    source = inspect.getsource(cli)
    missing = [k for k in ('"_class_path"', '"_instantiator"') if k not in source]
    assert not missing, (
        f"LightningCLI no longer uses the hyper-parameter key(s) {missing} ({VERSIONS}); update "
        "lightning_accel._utils.compat.cli_model_config to its new checkpoint format."
    )


def test_lightning_still_keeps_its_logging_step_and_compiled_forward() -> None:
    import inspect

    from lightning.pytorch.loops import training_epoch_loop
    from lightning.pytorch.utilities import compile as lightning_compile

    assert "self._batches_that_stepped" in inspect.getsource(training_epoch_loop), (
        f"Lightning's epoch loop no longer counts `_batches_that_stepped` ({VERSIONS}); update "
        "lightning_accel._utils.compat.logger_step."
    )
    assert "_compiler_ctx" in inspect.getsource(lightning_compile), (
        f"Lightning no longer keeps a compiled module's `_compiler_ctx` ({VERSIONS}); update "
        "lightning_accel._utils.compat.lightning_compiled_forward."
    )


def test_logger_step_is_the_batches_that_stepped(tmp_path: Path) -> None:
    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            for opt, layer in zip(self.optimizers(), (self.a, self.b), strict=True):
                opt.zero_grad()
                self.manual_backward(layer(batch[0]).sum())
                opt.step()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.a.parameters(), 0.1), torch.optim.SGD(self.b.parameters(), 0.1)

    trainer = pl.Trainer(
        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(TwoOptimizers(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    assert trainer.global_step == 6 and compat.logger_step(trainer) == 3  # two optimizer steps per batch


def test_lightning_cli_still_keeps_its_subcommand_parsers() -> None:
    import inspect

    from lightning.pytorch.cli import LightningCLI

    assert "self._subcommand_parsers" in inspect.getsource(LightningCLI), (
        f"LightningCLI no longer keeps `_subcommand_parsers` ({VERSIONS}); update "
        "lightning_accel._utils.compat.cli_subcommand_parsers."
    )


# -- behaviour ---------------------------------------------------------------------------------------------------


def test_parser_option_keys_and_cli_subcommand_parsers() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--trainer.max_steps", type=int)
    parser.add_argument("--seed_everything", type=int)
    assert compat.parser_option_keys(parser) == {"trainer", "seed_everything"}

    class NoSubcommands:
        pass

    assert compat.cli_subcommand_parsers(NoSubcommands(), parser) == {"": parser}
    cli = NoSubcommands()
    cli._subcommand_parsers = {"fit": parser}  # type: ignore[attr-defined]
    assert compat.cli_subcommand_parsers(cli, parser) == {"fit": parser}


def test_cli_model_config() -> None:
    saved = {"_instantiator": "lightning.pytorch.cli.instantiate_module", "_class_path": "pkg.Model", "width": 8}
    assert compat.cli_model_config(saved) == {"class_path": "pkg.Model", "dict_kwargs": {"width": 8}}
    assert compat.cli_model_config({"width": 8}) == {"width": 8}
    assert compat.cli_model_config({"_instantiator": "x"}) is None and compat.cli_model_config({}) is None
    assert "_class_path" in saved  # the input is left alone


def test_set_trainer_strategy_and_what_a_strategy_hands_over() -> None:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    trainer = _trainer(strategy="ddp", sync_batchnorm=True)
    old = trainer.strategy
    assert isinstance(compat.get_layer_sync(old), TorchSyncBatchNorm)
    new = DDPStrategy()
    assert compat.set_layer_sync(new, compat.get_layer_sync(old)) and compat.get_layer_sync(new) is not None
    assert not compat.set_layer_sync(SingleDeviceStrategy(), None)  # no layer sync on a single-device strategy
    compat.set_launcher(new, old.launcher)
    assert new.launcher is old.launcher is not None
    compat.set_trainer_strategy(trainer, new)
    assert trainer.strategy is new


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ddp_runtime_statistics_on_a_one_process_group() -> None:
    assert not compat.set_ddp_runtime_logging_sample_rate(nn.Linear(2, 2), 10)
    assert compat.ddp_logging_data(nn.Linear(2, 2)) is None and compat.ddp_logging_data(None) is None
    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        assert compat.set_ddp_runtime_logging_sample_rate(ddp, 1)
        for _ in range(3):  # DDP starts timing after its first iteration
            ddp(torch.ones(3, 2)).sum().backward()
        data = compat.ddp_logging_data(ddp)
        assert data is not None and "avg_backward_comm_time" in data and data["world_size"] == 1
    finally:
        dist.destroy_process_group()


def test_grad_scaler_scale_is_the_device_tensor() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert compat.grad_scaler_scale(scaler) is None  # created lazily, at the first `scale`
    scaler.scale(torch.tensor(1.0))
    scale = compat.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and float(scale) == 1024.0 == scaler.get_scale()


def test_scheduler_last_lr_round_trip() -> None:
    sched = _scheduler()
    assert compat.scheduler_last_lr(sched) == sched.get_last_lr() == [0.1]
    compat.set_scheduler_last_lr(sched, [0.5])
    assert sched.get_last_lr() == [0.5]
    assert compat.scheduler_last_lr(object()) is None


def test_module_has_hooks_sees_each_kind() -> None:
    lin = nn.Linear(1, 1)
    assert not compat.module_has_hooks(lin)
    handles = [
        lin.register_forward_hook(lambda m, i, o: None),
        lin.register_forward_pre_hook(lambda m, i: None),
        lin.register_full_backward_hook(lambda m, gi, go: None),
        lin.register_full_backward_pre_hook(lambda m, go: None),
    ]
    for h in handles:
        assert compat.module_has_hooks(lin)
        h.remove()
    assert not compat.module_has_hooks(lin)


def test_child_modules_keep_repeats_and_order() -> None:
    relu = nn.ReLU()
    seq = nn.Sequential(relu, nn.Linear(2, 2), relu)
    assert list(compat.child_modules(seq)) == ["0", "1", "2"] and len(list(seq.children())) == 2
    children = dict(compat.child_modules(seq))
    compat.set_child_modules(seq, {"1": children["1"], "0": relu})
    assert list(compat.child_modules(seq)) == ["1", "0"] and list(seq.state_dict()) == ["1.weight", "1.bias"]


def test_compiled_call_impl_replaces_the_call() -> None:
    lin = nn.Linear(2, 2)
    assert compat.compiled_call_impl(lin) is None
    eager = compat.module_call_impl(lin)
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return eager(*args, **kwargs)

    compat.set_compiled_call_impl(lin, wrapped)
    assert compat.compiled_call_impl(lin) is wrapped
    x = torch.ones(1, 2)
    assert torch.equal(lin(x), lin.forward(x)) and calls == [1]


def test_compile_error_types() -> None:
    from torch._dynamo.exc import TorchDynamoException

    errors = compat.compile_error_types()
    assert TorchDynamoException in errors and all(issubclass(e, BaseException) for e in errors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_pin_memory_walks_nested_batches() -> None:
    out = compat.pin_memory({"x": [torch.zeros(2)], "y": (torch.ones(1),)})
    assert out["x"][0].is_pinned() and out["y"][0].is_pinned()


def test_shutdown_persistent_workers_stops_them_now() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(4)), batch_size=2, num_workers=1, persistent_workers=True)
    assert len(list(loader)) == 2
    it: Any = loader._iterator
    workers = list(it._workers)
    assert workers and all(w.is_alive() for w in workers)
    compat.shutdown_persistent_workers(loader)
    assert loader._iterator is None and not any(w.is_alive() for w in workers)
    assert len(list(loader)) == 2  # the next epoch starts new workers
    workers = list(loader._iterator._workers)  # type: ignore[union-attr]
    t = compat.shutdown_persistent_workers(loader, wait=False)  # detached now, stopped behind
    assert loader._iterator is None and t is not None
    assert not t.daemon  # the interpreter waits for it: no thread left inside torch at shutdown
    t.join(30)
    assert not any(w.is_alive() for w in workers)
    compat.shutdown_persistent_workers(_loader())  # no workers: nothing to do


def test_storage_use_count_counts_tensors_over_a_storage() -> None:
    count = compat.storage_use_count_fn()
    assert count is not None
    storage = torch.empty(4).untyped_storage()
    assert count(storage) == 1
    t = torch.empty(0).set_(storage, 0, (4,))
    view = t[1:]
    assert count(storage) == 3
    del t, view
    assert count(storage) == 1


def test_empty_shared_is_in_shared_memory() -> None:
    t = compat.empty_shared((2, 3), torch.uint8)
    assert t.shape == (2, 3) and t.dtype == torch.uint8 and t.is_shared()


@pytest.mark.gpu
def test_cuda_memory_history_and_snapshot() -> None:
    compat.record_cuda_memory_history(100)
    try:
        x = torch.empty(1024, device="cuda")
        snap = compat.cuda_memory_snapshot()
        assert "segments" in snap and "device_traces" in snap
        del x
    finally:
        compat.stop_cuda_memory_history()


def test_jpeg_decode_ops_decode_what_torchvision_decodes() -> None:
    import io as _io

    from PIL import Image

    buf = _io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 90)).save(buf, format="JPEG")
    ops = compat.jpeg_decode_ops()
    assert ops is not None
    decode_cpu, _, unchanged, _ = ops
    out = decode_cpu(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8), unchanged)
    assert out.shape == (3, 6, 8) and out.dtype == torch.uint8 and abs(int(out[0, 0, 0]) - 200) < 8


# --- cli: the texts of jsonargparse, Lightning and torch errors the CLI reads ----------------------------------------


class _Refuses:
    def __init__(self, n: int = 1) -> None:
        if n < 0:
            raise ValueError(f"`n` must be an integer >= 0, got {n}.")


class _Other:
    def __init__(self, s: str = "") -> None:
        self.s = s


def _jsonargparse_error(args: list[str], *, instantiate: bool = False) -> BaseException:
    from typing import Literal, Optional, Union  # noqa: UP035

    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--trainer.max_epochs", type=int)
    parser.add_argument("--mode", type=Literal["int8", "int4"])
    parser.add_argument("--trainer.max_steps", type=Optional[int])  # noqa: UP045
    parser.add_argument("--cbs", type=Optional[list[Union[_Refuses, _Other]]])  # noqa: UP007, UP045
    try:
        cfg = parser.parse_args(args)
        if instantiate:
            parser.instantiate(cfg)
    except Exception as e:  # noqa: BLE001 - the error is what is tested
        return e
    raise AssertionError(f"jsonargparse accepted {args}")


def test_jsonargparse_error_readers_on_real_parse_errors():
    e = _jsonargparse_error(["--trainer.max_epochs=x"])
    assert compat.jsonargparse_error_key(str(e)) == "trainer.max_epochs"
    assert compat.jsonargparse_useful_line(str(e)) == ("", "Expected a <class 'int'>. Got value: x")
    e = _jsonargparse_error(["--mode=int2"])
    assert compat.jsonargparse_error_key(str(e)) == "mode"
    assert "Literal['int8', 'int4']" in compat.jsonargparse_useful_line(str(e))[1]
    e = _jsonargparse_error(["--trainer.max_steps=five"])  # every line of the Union dump is scaffolding
    assert compat.jsonargparse_error_key(str(e)) == "trainer.max_steps"
    assert compat.jsonargparse_useful_line(str(e)) == ("", "expected int or None, got 'five'.")


def test_jsonargparse_error_readers_on_a_class_that_refuses_its_arguments():
    path = f"{__name__}._Refuses"
    e = _jsonargparse_error([f'--cbs=[{{"class_path":"{path}","init_args":{{"n":-1}}}}]'], instantiate=True)
    assert compat.is_jsonargparse_union_error(e)
    assert compat.jsonargparse_error_class_path(str(e)) == path
    assert compat.jsonargparse_useful_line(str(e))[1] == "`n` must be an integer >= 0, got -1."
    assert not compat.is_jsonargparse_union_error(ValueError("x"))


class _Outer:
    def __init__(self, aug: _Other | None = None) -> None:
        self.aug = aug


def _parse_error(parser: Any, args: list[str]) -> str:
    try:
        parser.parse_args(args)
    except Exception as e:  # noqa: BLE001 - the error is what is tested
        return str(e)
    raise AssertionError(f"jsonargparse accepted {args}")


def test_jsonargparse_readers_of_names_options_and_keys(tmp_path: Path) -> None:
    from typing import Union  # noqa: UP035

    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    here = f"{__name__}"
    p = ArgumentParser(exit_on_error=False)
    p.add_argument("--model", type=_Other)
    p.add_argument("--strategy", type=Union[str, _Other], default="auto")  # noqa: UP007
    p.add_argument("--data", type=_Outer)
    text = _parse_error(p, ["--model=ImageClassifierX"])
    assert compat.jsonargparse_bare_class_name(text) == (None, "ImageClassifierX")
    assert compat.jsonargparse_name_given_option(text) is None
    text = _parse_error(p, ["--strategy=ddp", "--strategy.s=3"])
    assert compat.jsonargparse_name_given_option(text) == ("ddp", "s")
    text = _parse_error(p, ["--trainner.max_steps=1"])
    assert compat.jsonargparse_top_level_option(text) == (None, "trainner.max_steps")
    nested = f'{{"class_path":"{here}._Outer","init_args":{{"aug":{{"class_path":"{here}._Other","init_args":'
    text = _parse_error(p, [f'--data={nested}{{"m":2}}}}}}}}'])
    assert compat.jsonargparse_nested_option_key(text, "data") == (
        "data.aug",
        text.splitlines().index(next(ln for ln in text.splitlines() if "Option 'm' is not accepted" in ln)),
    )
    assert compat.jsonargparse_top_level_option(text) is None
    # a class config whose class_path key is misspelt, given to a base class with subclasses
    q = ArgumentParser(exit_on_error=False)
    q.add_subclass_arguments(LightningModule, "model")
    text = _parse_error(q, ['--model={"clas_path":"lightning_accel.models.ImageClassifier","init_args":{"width":1}}'])
    key, at = compat.jsonargparse_nested_option_key(text, "model", at="not a subclass")
    assert key == "model" and at > 0
    lines = [ln.strip() for ln in text.splitlines()[at:]]
    assert compat.jsonargparse_given_dict_keys(lines) == ["clas_path", "init_args", "width"]
    assert compat.jsonargparse_nested_option_key(text, "model")[1] == -1
    # subcommands: a missing required class, a YAML key no subcommand option takes
    fit = ArgumentParser(exit_on_error=False)
    fit.add_argument("--config", action="config")
    fit.add_argument("--model", type=_Other, required=True)
    fit.add_argument("--data", type=_Other, required=True)
    top = ArgumentParser(exit_on_error=False)
    top.add_subcommands().add_subcommand("fit", fit)
    assert compat.argparse_required_keys(_parse_error(top, ["fit"])) == ["fit.model", "fit.data"]
    (tmp_path / "job.yaml").write_text("trainner: {max_steps: 1}\n")
    text = _parse_error(top, ["fit", f"--config={tmp_path / 'job.yaml'}"])
    assert compat.jsonargparse_top_level_option(text) == ("fit", "trainner.max_steps")
    assert compat.argparse_required_keys(text) is None


def test_missing_module_attribute_reads_pythons_attribute_error() -> None:
    import importlib

    with pytest.raises(AttributeError) as exc:
        _ = importlib.import_module("lightning_accel").PerStepLRR
    assert compat.missing_module_attribute(str(exc.value)) == ("lightning_accel", "PerStepLRR")
    assert compat.missing_module_attribute("something else") is None


def test_resume_past_max_epochs_reads_lightnings_refusal(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    def trainer(epochs: int) -> pl.Trainer:
        return pl.Trainer(
            default_root_dir=tmp_path, max_epochs=epochs, limit_train_batches=1, limit_val_batches=0, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    trainer(3).fit(BoringModel())  # saved at current_epoch=2, past max_epochs=1
    ckpt = next(tmp_path.rglob("*.ckpt"))
    with pytest.raises(MisconfigurationException) as info:
        trainer(1).fit(BoringModel(), ckpt_path=ckpt)
    assert compat.is_resume_past_max_epochs(info.value)
    assert not compat.is_resume_past_max_epochs(MisconfigurationException("other"))


def _fails_in_worker(_: int) -> None:
    raise ValueError("bad sample 3")


def test_dataloader_worker_error_line_reads_torchs_reraise():
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(4)), num_workers=1, collate_fn=_fails_in_worker)
    with pytest.raises(ValueError) as info:
        next(iter(loader))
    assert compat.dataloader_worker_error_line(info.value) == "ValueError: bad sample 3"
    assert compat.dataloader_worker_error_line(ValueError("plain")) is None


# --- parallel: meta-device materialisation of a parallelised module ------------------------------------------------


def test_materialize_distributed_module_is_what_model_parallel_strategy_calls() -> None:
    import inspect

    from lightning.pytorch.strategies import ModelParallelStrategy

    assert "_materialize_distributed_module(" in inspect.getsource(ModelParallelStrategy.setup)
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    compat.materialize_distributed_module(m, torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert bool(torch.all(m[1].weight == 1)) and bool(m[0].weight.abs().sum() > 0)  # reset_parameters ran
    real = nn.Linear(2, 2)
    before = real.weight.detach().clone()
    compat.materialize_distributed_module(real, torch.device("cpu"))  # nothing on meta: left alone
    assert torch.equal(real.weight, before)


# --- comm: Lightning's unused-parameters advice


def test_ddp_unused_parameters_advice_is_the_text_the_comm_strategy_redirects() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    err = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    DDPStrategy().on_exception(err)
    msg = str(err)
    assert compat.DDP_FIND_UNUSED_ALIAS_ADVICE in msg, f"Lightning {lightning.__version__} changed its advice: {msg}"
    assert compat.DDP_FIND_UNUSED_CLASS_ADVICE in msg, f"Lightning {lightning.__version__} changed its advice: {msg}"
    compat.redirect_find_unused_parameters_advice(err, "my_alias", "Mine(find_unused_parameters=True)")
    assert "`strategy='my_alias'`" in str(err) and "`strategy=Mine(find_unused_parameters=True)`" in str(err)
    assert "ddp_find_unused_parameters_true" not in str(err) and "DDPStrategy(" not in str(err)
    other = ValueError("something else", 3)
    compat.redirect_find_unused_parameters_advice(other, "my_alias", "Mine()")
    assert other.args == ("something else", 3)


# --- checkpoint: ModelCheckpoint.setup's directory listing


def test_model_checkpoint_setup_without_listing_skips_the_listing(tmp_path: Path) -> None:
    import warnings

    (tmp_path / "old.ckpt").write_bytes(b"x")
    trainer = _trainer(default_root_dir=tmp_path)

    def setup_warnings(cb: ModelCheckpoint, skip: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with compat.model_checkpoint_setup_without_listing(cb):
                    cb.setup(trainer, pl.LightningModule(), "fit")
            else:
                cb.setup(trainer, pl.LightningModule(), "fit")
        return [str(w.message) for w in caught if "exists and is not empty" in str(w.message)]

    listed = ModelCheckpoint(dirpath=tmp_path, save_top_k=3, monitor="step")
    assert setup_warnings(listed, skip=False), f"{VERSIONS}: ModelCheckpoint.setup no longer lists its dirpath"
    quiet = ModelCheckpoint(dirpath=tmp_path, save_top_k=3, monitor="step")
    assert not setup_warnings(quiet, skip=True), (
        f"{VERSIONS}: ModelCheckpoint.setup lists its dirpath even with save_top_k=0; update "
        "compat.model_checkpoint_setup_without_listing"
    )
    assert quiet.save_top_k == 3  # restored after the block


# --- checkpoint: which checkpoints a resumed ModelCheckpoint tracks ---------------------------------------------------


def test_wrap_model_checkpoint_writes_routes_every_save_and_removal(tmp_path: Path) -> None:
    """A fit with ``save_top_k=1`` saves each epoch and removes the one before: every write goes through ``around``,
    which decides whether it happens; restored, the callback writes directly again."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen: list[tuple[str, int]] = []

    def around(kind: str, trainer: Any, write: Callable[[], None]) -> None:
        seen.append((kind, trainer.current_epoch))
        write()

    cb = ModelCheckpoint(dirpath=tmp_path, monitor="step", mode="max", save_top_k=1, filename="{epoch}")
    patches = compat.wrap_model_checkpoint_writes(cb, around, key="t")
    trainer = pl.Trainer(
        max_epochs=3, limit_train_batches=2, limit_val_batches=0, callbacks=[cb], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert seen == [("save", 0), ("save", 1), ("remove", 1), ("save", 2), ("remove", 2)]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch=2.ckpt"]
    for p in patches:
        p.restore()
    assert "_save_checkpoint" not in vars(cb) and "_remove_checkpoint" not in vars(cb)


def test_model_checkpoint_step_interval_is_every_n_train_steps() -> None:
    assert compat.model_checkpoint_step_interval(ModelCheckpoint(every_n_train_steps=4)) == 4
    assert compat.model_checkpoint_step_interval(ModelCheckpoint()) == 0
    assert compat.model_checkpoint_step_interval(object()) == 0


def test_model_checkpoint_state_names_what_it_tracks(tmp_path: Path) -> None:
    """A real fit's saved ``callbacks`` state: found by its keys, and its tracked paths are the top-k and last."""
    x = torch.randn(32, 4)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.lin(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = ModelCheckpoint(
        dirpath=tmp_path / "ck",
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=2,
        save_last=True,
        monitor="step",
        mode="max",
    )
    trainer = pl.Trainer(
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        accelerator="cpu",
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8))
    saved = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=True)
    (state,) = compat.model_checkpoint_states(saved["callbacks"])
    tracked = {os.path.basename(p) for p in compat.model_checkpoint_tracked(state)}
    on_disk = {p.name for p in (tmp_path / "ck").iterdir()}
    assert tracked == on_disk == {"step=3.ckpt", "step=4.ckpt", "last.ckpt"}, (tracked, on_disk, VERSIONS)
    assert compat.model_checkpoint_states({"Other": {"x": 1}, "ModelCheckpoint{}": [1]}) == []


def test_carry_callback_results_from_workers_hands_a_workers_results_to_the_main_instance(caplog) -> None:
    """What the spawning launcher does around the fit, without the processes: rank 0's worker packs ``extra`` from
    its copies of the callbacks, the main process unpacks it onto the instances with the same token."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    class Made(Callback):
        def __init__(self, token: str, value: Any = None, fail: bool = False) -> None:
            self.worker_results_token, self.value, self.fail, self.loaded = token, value, fail, None

        def worker_results(self) -> Any:
            if self.fail:
                raise OSError("no report")
            return {"value": self.value}

        def load_worker_results(self, results: Any) -> None:
            self.loaded = results

    owner = Made("owner")
    compat.carry_callback_results_from_workers(owner)
    compat.carry_callback_results_from_workers(owner)  # idempotent: wrapped once
    launcher = _MultiProcessingLauncher(DDPStrategy(), start_method="spawn")
    worker = _trainer(callbacks=[Made("a", 1), Made("b", fail=True), Callback()])
    with caplog.at_level("WARNING"):
        extra = launcher.get_extra_results(worker)
    assert extra[compat.WORKER_RESULTS_KEY] == {"a": {"value": 1}}  # the failing one skipped, said once
    assert "callback_metrics_bytes" in extra  # Lightning's own part untouched
    assert [r.message for r in caplog.records if "stay in the worker" in r.message] == [
        "Made: its results stay in the worker process: OSError('no report')"
    ]
    mine, other = Made("a"), Made("c")
    launcher.update_main_process_results(_trainer(callbacks=[other, mine]), extra)
    assert mine.loaded == {"value": 1} and other.loaded is None
    # restored once no callback that asked is alive
    import gc

    del owner
    gc.collect()
    assert not any(True for _ in compat._carriers)
    assert "wrapped" not in _MultiProcessingLauncher.get_extra_results.__qualname__
    assert "wrapped" not in _MultiProcessingLauncher.update_main_process_results.__qualname__


def test_state_dict_metadata_round_trips_the_module_versions() -> None:
    sd = nn.BatchNorm1d(2).state_dict()
    meta = compat.state_dict_metadata(sd)
    assert meta is not None and meta[""]["version"] == nn.BatchNorm1d._version
    rebuilt = type(sd)(sd)
    assert compat.state_dict_metadata(rebuilt) is None  # a copy of the mapping loses it
    compat.set_state_dict_metadata(rebuilt, meta)
    assert compat.state_dict_metadata(rebuilt) == meta
    assert compat.state_dict_metadata({"a": 1}) is None


def test_on_train_fetch_fires_at_each_training_fetch_and_keeps_the_users_profiler() -> None:
    calls: list[int] = []
    trainer = pl.Trainer(
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        profiler="simple",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    p = compat.on_train_fetch(trainer, lambda: calls.append(trainer.global_step), key="test")
    assert p is not None
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 6), batch_size=2))
    # one call per batch fetched, before the batch's step: the action Lightning names has not changed
    assert calls == [0, 1, 2, 3, 4, 5], (
        f"Lightning no longer starts the profiler action {compat._TRAIN_FETCH_ACTION!r} before each training fetch "
        f"({VERSIONS}); update lightning_accel._utils.compat.on_train_fetch."
    )
    # the user's profiler still records the action
    assert len(trainer.profiler.recorded_durations[compat._TRAIN_FETCH_ACTION]) >= 6
    p.restore()
    assert "start" not in vars(trainer.profiler)
    assert compat.on_train_fetch(object(), lambda: None, key="test") is None  # type: ignore[arg-type]


def test_the_launchers_hand_over_file_name_is_still_used() -> None:
    import inspect

    from lightning.pytorch.strategies.launchers import multiprocessing as launcher

    assert f'"{compat._LAUNCHER_WEIGHTS_NAME}"' in inspect.getsource(launcher), (
        f"Lightning's multiprocessing launcher no longer hands the weights over in {compat._LAUNCHER_WEIGHTS_NAME!r} "
        f"({VERSIONS}); update lightning_accel._utils.compat.is_launcher_weights_file."
    )
    assert compat.is_launcher_weights_file("/tmp/tmpab12/.temp.ckpt")
    assert not compat.is_launcher_weights_file("/tmp/run/last.ckpt")
    assert not compat.is_launcher_weights_file("s3://b/x/temp.ckpt")


def test_ddp_ignored_names_reads_what_ddp_is_told_to_ignore() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert compat.ddp_ignored_names(m) == set()
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, ["1.weight", "1.bias"])
    assert compat.ddp_ignored_names(m) == {"1.weight", "1.bias"}


def test_fsdp1_flattened_reads_fsdps_mark() -> None:
    from torch.distributed.fsdp._flat_param import _set_fsdp_flattened

    t = nn.Parameter(torch.zeros(3))
    assert not compat.fsdp1_flattened(t) and not compat.fsdp1_flattened(torch.zeros(1))
    _set_fsdp_flattened(t)  # what FSDP1 does to each original parameter it flattens
    assert compat.fsdp1_flattened(t)


def test_set_dcp_fqn_modifiers_is_what_dcp_asks_a_module_for() -> None:
    from torch.distributed.checkpoint.state_dict import _StateDictInfo

    class M(nn.Module):
        pass

    compat.set_dcp_fqn_modifiers(M, lambda self: {"a": "b"})
    name = _StateDictInfo.__dataclass_fields__["dsd_fqn_modifiers"].default  # the attribute DCP looks up
    assert getattr(M(), name)() == {"a": "b"}


def test_wrap_index_sampler_bounds_what_every_iterator_draws() -> None:
    class Loader(DataLoader):
        pass

    compat.wrap_index_sampler(Loader, lambda loader, base: list(base)[:2])
    loader = Loader(TensorDataset(torch.arange(10)), batch_size=2)
    assert compat.index_sampler(loader) == [[0, 1], [2, 3]]
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3]]  # the iterator draws from it
    assert len(compat.index_sampler(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))) == 5
