"""Every private Lightning and torch name this project touches, each behind one named function.

Private names change without a deprecation period, so they are gathered here: each shim says why no public API does
the job and since which version the private name has the shape used here. Lightning names were checked against the
``lightning`` 2.4.0, 2.5.0, 2.6.0 and 2.6.6 wheels, torch names against torch 2.14.1 (this project supports
``lightning>=2.4`` and ``torch>=2.4``). ``tests/_utils/test_compat.py`` fails, naming the attribute, when one
disappears; ``tests/test_layout.py`` fails when a private name is reached anywhere else in the package.

This module imports Lightning for type checking only (the Lightning shims take the objects they touch), so the
plain-torch cores can use it without importing Lightning.

Where a public API does the job, the code uses it and there is no shim:

- ``torch.utils.data.default_collate`` (public since torch 1.11), not ``torch.utils.data._utils.collate``;
- ``lightning_accel._utils.rank.distributed_ready`` (public ``torch.distributed`` calls), not Lightning's
  ``_distributed_is_initialized``;
- overriding ``DDPStrategy.configure_ddp`` and reading ``DistributedDataParallel.process_group``, not overriding
  ``DDPStrategy._register_ddp_hooks`` or reading ``DDPStrategy._ddp_kwargs``;
- ``LightningModule.trainer`` (raises ``RuntimeError`` when not attached), not ``._trainer``;
  ``LightningOptimizer.optimizer``, not ``._optimizer``;
- ``setattr(module, name, tensor)`` (``nn.Module.__setattr__`` keeps a registered buffer a buffer), not
  ``module._buffers[name] = tensor``;
- the ``Strategy.checkpoint_io`` and ``Strategy.launcher`` getters, not ``_checkpoint_io`` / ``_launcher`` reads;
- the public ``LightningCLI`` hooks ``parse_arguments``, ``before_instantiate_classes`` and ``instantiate_trainer``,
  not overriding ``_parse_ckpt_path`` / ``_instantiate_trainer``;
- the project's own checkpoint reader (``checkpoint/reader.py``: fsspec + ``torch.load``), not Lightning's
  ``cloud_io._load``;
- choosing ``AutoStrategy``'s strategy before the ``Trainer`` is built (the ``lightning-accel`` CLI does), rather
  than swapping it mid-setup; the mid-setup swap remains only for an ``AutoStrategy`` handed to ``Trainer`` directly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from lightning_accel._utils.patching import Patch, patch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.layer_sync import LayerSync
    from lightning.pytorch.strategies import Strategy
    from torch.utils.data import DataLoader

__all__ = [
    "DDP_FIND_UNUSED_ALIAS_ADVICE",
    "DDP_FIND_UNUSED_CLASS_ADVICE",
    "PathType",
    "allocator_settings_setter",
    "carry_callback_results_from_workers",
    "child_modules",
    "cli_model_config",
    "cli_subcommand_parsers",
    "compile_error_types",
    "compiled_call_impl",
    "cuda_memory_snapshot",
    "dataloader_worker_error_line",
    "ddp_logging_data",
    "default_process_group_store",
    "empty_shared",
    "get_layer_sync",
    "grad_scaler_scale",
    "is_jsonargparse_union_error",
    "is_resume_past_max_epochs",
    "jsonargparse_error_class_path",
    "jsonargparse_error_key",
    "jsonargparse_unknown_option",
    "jpeg_decode_ops",
    "lightning_compiled_forward",
    "is_launcher_weights_file",
    "logger_step",
    "on_train_fetch",
    "jsonargparse_useful_line",
    "materialize_distributed_module",
    "model_checkpoint_setup_without_listing",
    "parser_option_keys",
    "module_call_impl",
    "pin_memory",
    "redirect_find_unused_parameters_advice",
    "register_before_thread_shutdown",
    "record_cuda_memory_history",
    "scheduler_last_lr",
    "set_checkpoint_filesystem",
    "set_child_modules",
    "set_compiled_call_impl",
    "set_ddp_runtime_logging_sample_rate",
    "set_launcher",
    "set_layer_sync",
    "set_model_parallel_sizes",
    "set_scheduler_last_lr",
    "set_state_dict_metadata",
    "set_trainer_strategy",
    "shutdown_persistent_workers",
    "stop_cuda_memory_history",
    "state_dict_metadata",
    "storage_use_count_fn",
]

#: The path type of Lightning's ``CheckpointIO`` / ``Strategy`` checkpoint signatures. Lightning's own alias is private
#: (``lightning.fabric.utilities.types._PATH = Union[str, Path]``, that shape since Lightning 2.0); this one is the
#: same union, so overrides keep the base signature and pass the path on unchanged.
PathType: TypeAlias = str | Path


# -- Lightning: Trainer and Strategy ---------------------------------------------------------------------------------
# Used only when an `AutoStrategy` is given to `Trainer` directly: the model (and so the choice) is known only once
# `fit` runs, after the Trainer fixed its strategy. Lightning has no public way to replace a Trainer's strategy, nor
# to hand over what its accelerator connector gave the first one. The `lightning-accel` CLI avoids all three by
# choosing before the Trainer is built.


def set_trainer_strategy(trainer: pl.Trainer, strategy: Strategy) -> None:
    """Make ``strategy`` the one ``trainer.strategy`` returns.

    ``Trainer.strategy`` is a read-only property over ``trainer._accelerator_connector.strategy`` (that shape since
    Lightning 2.0; checked 2.4.0-2.6.6).
    """
    trainer._accelerator_connector.strategy = strategy


def get_layer_sync(strategy: Strategy) -> LayerSync | None:
    """The ``LayerSync`` (``Trainer(sync_batchnorm=True)``) the accelerator connector gave ``strategy``, or None.

    ``ParallelStrategy._layer_sync`` has no public accessor (attribute since Lightning 2.0; checked 2.4.0-2.6.6).
    """
    return getattr(strategy, "_layer_sync", None)


def set_layer_sync(strategy: Strategy, layer_sync: LayerSync | None) -> bool:
    """Give ``strategy`` the ``layer_sync`` the connector gave another one; False for a strategy without one.

    No public setter (see :func:`get_layer_sync`); only ``ParallelStrategy`` subclasses have the attribute.
    """
    if not hasattr(strategy, "_layer_sync"):
        return False
    strategy._layer_sync = layer_sync
    return True


def set_launcher(strategy: Strategy, launcher: Any) -> None:
    """Give ``strategy`` the launcher that started the processes (it must be able to stop them).

    ``Strategy.launcher`` is a read-only property over ``_launcher`` (since Lightning 2.0; checked 2.4.0-2.6.6).
    """
    strategy._launcher = launcher


# -- Lightning: callbacks' results from the processes of the multiprocessing launcher --------------------------------

log = logging.getLogger(__name__)

#: the key of ``extra`` (what rank 0's worker sends back to the main process) that carries callbacks' results
WORKER_RESULTS_KEY = "lightning_accel_callback_results"
_CARRY_KEY = "lightning_accel-callback-results"
_carry_lock = threading.Lock()
_carriers: weakref.WeakSet[Any] = weakref.WeakSet()  # the live callbacks that asked for the two patches below
_carry_patches: list[Patch] = []


def carry_callback_results_from_workers(callback: Any) -> None:
    """Make Lightning's multiprocessing launcher (``strategy="ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"``) send
    callbacks' results from rank 0's worker process back to the main process's callbacks, for as long as
    ``callback`` (or another that asked) is alive.

    Those strategies fit in processes they start, each on an unpickled copy of the callbacks, and send back only the
    weights and ``trainer.callback_metrics``: what a callback made (a report) stays in the worker, and the user's
    object in the main process keeps nothing. A callback takes part by defining ``worker_results_token`` (a string
    unique to the instance, copied with it), ``worker_results()`` (called in rank 0's worker once the fit has
    ended; returns something picklable) and ``load_worker_results(results)`` (called on the main process's instance
    with the same token). A ``worker_results()`` that raises is logged and skipped: the fit's own results still
    return.

    The launcher's hooks for this, ``get_extra_results`` / ``update_main_process_results``, are public methods of a
    private class, ``lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher`` (that shape
    since Lightning 2.0; checked 2.4.0-2.6.6), and no public API hands a callback the launcher in the main process
    (callbacks' hooks run in the workers only), so they are patched on the class: installed once, by the first
    callback that asks, and restored when the last of them is garbage-collected. Call it in the main process before
    the fit (the callback's ``__init__``) and in the worker (its ``setup``), since a spawned worker imports the
    modules afresh.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    def get_extra_results(p: Patch) -> Callable[..., dict[str, Any]]:
        def wrapped(self: Any, trainer: pl.Trainer) -> dict[str, Any]:
            extra = p.original(self, trainer)
            results: dict[str, Any] = {}
            for cb in trainer.callbacks:  # type: ignore[attr-defined]
                token, fn = getattr(cb, "worker_results_token", None), getattr(cb, "worker_results", None)
                if isinstance(token, str) and callable(fn):
                    try:
                        results[token] = fn()
                    except Exception as err:  # noqa: BLE001 - a callback's extra must not lose the fit's results
                        log.warning("%s: its results stay in the worker process: %r", type(cb).__name__, err)
            return {**extra, WORKER_RESULTS_KEY: results} if results else dict(extra)

        return wrapped

    def update_main_process_results(p: Patch) -> Callable[..., None]:
        def wrapped(self: Any, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
            p.original(self, trainer, extra)
            results = extra.get(WORKER_RESULTS_KEY) or {}
            for cb in trainer.callbacks:  # type: ignore[attr-defined]
                token, load = getattr(cb, "worker_results_token", None), getattr(cb, "load_worker_results", None)
                if isinstance(token, str) and token in results and callable(load):
                    load(results[token])

        return wrapped

    with _carry_lock:
        if callback not in _carriers:
            _carriers.add(callback)
            weakref.finalize(callback, _release_carry_patches)
        if not _carry_patches:
            _carry_patches.append(
                patch(_MultiProcessingLauncher, "get_extra_results", get_extra_results, key=f"{_CARRY_KEY}-get")
            )
            _carry_patches.append(
                patch(
                    _MultiProcessingLauncher,
                    "update_main_process_results",
                    update_main_process_results,
                    key=f"{_CARRY_KEY}-update",
                )
            )


def _release_carry_patches() -> None:
    """A callback that asked for the results patches died: restore them when no live one is left."""
    with _carry_lock:
        if any(True for _ in _carriers):  # iterating skips the callback being collected
            return
        while _carry_patches:
            _carry_patches.pop().restore()


# -- Lightning: ModelCheckpoint's filesystem -------------------------------------------------------------------------


def set_checkpoint_filesystem(callback: Any, fs: Any) -> None:
    """Make ``fs`` the fsspec filesystem a ``ModelCheckpoint`` lists, checks and writes its dirpath with.

    ``ModelCheckpoint`` builds ``_fs`` with ``get_filesystem(dirpath)`` and no storage options, in ``__init__`` and
    again in ``setup`` (attribute since Lightning 1.x; checked 2.4.0-2.6.6); there is no public way to give it options
    (a custom S3 endpoint, credentials), so ``DeltaModelCheckpoint`` sets it after ``setup``.
    """
    callback._fs = fs


# -- Lightning: LightningCLI's hyper-parameter format ----------------------------------------------------------------


def cli_model_config(hparams: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``model`` config LightningCLI makes of a checkpoint's ``hyper_parameters``; None when there are none.

    A model instantiated by LightningCLI saves its ``class_path`` under the private key ``_class_path`` and the
    instantiator under ``_instantiator`` (both since Lightning 2.4 at least; checked 2.4.0-2.6.6). LightningCLI >= 2.6
    turns them back into a config in its private ``_parse_ckpt_path``, which reads only ``torch.save`` files; this
    does the same for checkpoints it cannot read.
    """
    config = dict(hparams)
    config.pop("_instantiator", None)
    if not config:
        return None
    if "_class_path" in config:
        return {"class_path": config.pop("_class_path"), "dict_kwargs": config}
    return config


def cli_subcommand_parsers(cli: Any, parser: Any) -> dict[str, Any]:
    """The parser of each subcommand of a ``LightningCLI``, by name; ``{"": parser}`` without subcommands (or
    before ``setup_parser`` made them).

    LightningCLI keeps them only in its private ``_subcommand_parsers`` (set by ``_add_subcommands``; checked
    2.4.0-2.6.6), and jsonargparse's own map sits in a private action: no public API lists them.
    """
    return getattr(cli, "_subcommand_parsers", None) or {"": parser}


def parser_option_keys(parser: Any) -> set[str]:
    """The top-level keys of a (jsonargparse) parser's options: ``trainer`` for ``--trainer.max_steps``, ``help`` and
    suppressed entries left out.

    ``argparse.ArgumentParser`` lists its actions only in the private ``_actions`` (in every Python 3 release;
    jsonargparse's parser subclasses it): no public API enumerates a parser's options.
    """
    import argparse

    return {a.dest.split(".")[0] for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)}


# -- torch: DistributedDataParallel ----------------------------------------------------------------------------------
# DDP's runtime statistics (backward compute/comm times, the comm hook in use) have no public accessor; they are
# what separates exposed gradient communication from compute in `PerformanceMonitor`.


def set_ddp_runtime_logging_sample_rate(model: Any, rate: int) -> bool:
    """Ask DDP to time every ``rate``-th iteration; False when ``model`` is not a DDP module (nothing asked).

    A DDP that cannot time (e.g. its process group lacks the support) ignores the request: no comm timing, no error.
    ``DistributedDataParallel._set_ddp_runtime_logging_sample_rate`` (since torch 1.10; checked 2.14.1).
    """
    setter = getattr(model, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is None:
        return False
    with contextlib.suppress(Exception):
        setter(rate)
    return True


def ddp_logging_data(model: Any) -> dict[str, Any] | None:
    """DDP's logging data (``avg_backward_comm_time``, ``comm_hook``, ...); None for a non-DDP ``model`` or on error.

    ``DistributedDataParallel._get_ddp_logging_data`` (since torch 1.9; checked 2.14.1).
    """
    getter = getattr(model, "_get_ddp_logging_data", None)
    if getter is None:
        return None
    try:
        return dict(getter())
    except Exception:  # e.g. called before the reducer exists
        return None


# -- torch: the default process group's store ------------------------------------------------------------------------
# The ranks of a multi-process tune must learn that a trial failed on one of them while the others may be stuck in a
# collective of that trial: the group's own connections cannot carry the news, its key-value store (a TCP store of
# its own) can, and it outlives the group when the group is destroyed and made again on it.


def default_process_group_store() -> Any:
    """The store of the initialised default process group.

    ``torch.distributed.distributed_c10d._get_default_store`` (since torch 1.x; checked 2.14.1). The public
    ``ProcessGroup.get_group_store`` is missing from older supported torch releases.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


# -- torch: AMP and LR schedulers ------------------------------------------------------------------------------------


def grad_scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The loss scale as the device tensor the last backward used (None before the first ``scale``).

    ``GradScaler.get_scale()`` returns a Python float, i.e. a device-to-host sync per call; the 1-bit hook needs the
    scale once per bucket, so it reads ``GradScaler._scale`` (since torch 1.6; ``torch.amp.GradScaler`` since 2.3).
    """
    return scaler._scale


def scheduler_last_lr(scheduler: Any) -> list[Any] | None:
    """``scheduler.get_last_lr()``'s list, or None when the scheduler has not stepped yet (or is not one).

    ``LRScheduler.get_last_lr()`` raises ``AttributeError`` before the first step; ``_last_lr`` since torch 1.4.
    """
    last = getattr(scheduler, "_last_lr", None)
    return None if last is None else list(last)


def set_scheduler_last_lr(scheduler: Any, values: Sequence[Any]) -> None:
    """Make ``get_last_lr()`` report ``values`` after the learning rates were rescaled outside the scheduler.

    No public setter exists; ``LRScheduler._last_lr`` (since torch 1.4; checked 2.14.1).
    """
    scheduler._last_lr = list(values)


# -- torch: nn.Module internals --------------------------------------------------------------------------------------


def child_modules(module: nn.Module) -> Mapping[str, nn.Module | None]:
    """``module``'s children in registration order, repeats and ``None`` entries included (read only).

    ``children()`` / ``named_children()`` drop a module registered twice and ``None`` slots, so an index-based plan
    over an ``nn.Sequential`` would shift; ``nn.Module._modules`` (since torch 1.0) is the exact list.
    """
    return module._modules


def set_dcp_fqn_modifiers(cls: type, fn: Callable[[Any], dict[str, str]]) -> None:
    """Let ``torch.distributed.checkpoint.state_dict`` resolve the ``state_dict`` keys of ``cls``'s modules that do
    not name attributes: ``fn(module)`` maps a key's path segment to the attribute holding it (``{}``: none).

    ``get_model_state_dict`` / ``set_model_state_dict`` walk every key as an attribute path and ask each module on the
    way for its ``_fqn_modifiers()`` (``_StateDictInfo.dsd_fqn_modifiers``, private; since torch 2.4).
    """
    cls._fqn_modifiers = fn  # type: ignore[attr-defined]


def ddp_ignored_names(module: nn.Module) -> set[str]:
    """The parameter and buffer names DDP leaves out of ``module`` when it wraps it
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` stores them as
    ``module._ddp_params_and_buffers_to_ignore``, which DDP's ``__init__`` reads; since torch 1.8)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def fsdp1_flattened(t: torch.Tensor) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``) made ``t`` a view of its flat parameter
    (``torch.distributed.fsdp._flat_param`` marks such a tensor with ``_fsdp_flattened``; since torch 2.0)."""
    return bool(getattr(t, "_fsdp_flattened", False))


def set_child_modules(module: nn.Module, children: Mapping[str, nn.Module | None]) -> None:
    """Replace ``module``'s children by ``children``, in that order.

    ``nn.Module`` can add (``register_module``) and delete (``delattr``) a child but not insert one at a position;
    putting a fused module in its parts' place keeps ``named_modules()`` and ``state_dict()`` order.
    ``nn.Module._modules`` (since torch 1.0).
    """
    module._modules = dict(children)


def state_dict_metadata(state: Any) -> Any:
    """The module versions a state dict carries (``{module prefix: {"version": int, ...}}``), or None.

    ``Module.state_dict()`` returns an ``OrderedDict`` with a ``_metadata`` attribute (since torch 0.4) that
    ``load_state_dict`` hands to each module's ``_load_from_state_dict``; without it a module is loaded as if saved by
    a version before its format changed, and migrates its state (an observer's saved ``eps`` becomes the default). No
    public API reads or writes it; ``torch.save`` keeps it by pickling the attribute.
    """
    return getattr(state, "_metadata", None)


def set_state_dict_metadata(state: Any, metadata: Any) -> None:
    """Give the rebuilt state dict ``state`` the module versions ``metadata`` (see :func:`state_dict_metadata`)."""
    state._metadata = metadata


def module_has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward, forward-pre, backward or backward-pre hooks of its own (module-global hooks
    not counted).

    ``nn.Module`` has no public way to ask; a fused forward that reads a module's parameters instead of calling it
    must know whether calling it would run hooks (``torch.nn.utils.prune``'s mask, FSDP's unsharding).
    ``nn.Module._forward_hooks`` / ``_forward_pre_hooks`` / ``_backward_hooks`` (since torch 1.0),
    ``_backward_pre_hooks`` (since torch 2.0).
    """
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def module_call_impl(module: nn.Module) -> Callable[..., Any]:
    """``module``'s eager ``__call__`` body (hooks + ``forward``), which ``torch.compile`` compiles in place.

    ``nn.Module.compile()`` compiles ``nn.Module._call_impl`` (since torch 1.0; in-place compile since 2.2).
    """
    return module._call_impl


def compiled_call_impl(module: nn.Module) -> Callable[..., Any] | None:
    """What ``nn.Module.__call__`` runs instead of the eager body, or None (``nn.Module.compile()`` not used).

    ``nn.Module._compiled_call_impl`` (since torch 2.2, with ``nn.Module.compile``).
    """
    return getattr(module, "_compiled_call_impl", None)


def lightning_compiled_forward(module: nn.Module) -> Any:
    """What ``trainer.fit(torch.compile(model))`` left on the LightningModule ``model``, or None: Lightning keeps the
    compiled forward in the private ``_compiler_ctx`` (set by ``lightning.pytorch.utilities.compile``'s
    ``from_compiled``; checked 2.4.0-2.6.6); no public attribute says a LightningModule runs compiled."""
    return getattr(module, "_compiler_ctx", None)


def logger_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs its own metrics at (``self.log``, ``LearningRateMonitor``, ``DeviceStatsMonitor``):
    the batches that stepped the optimizers so far, once per batch whatever the number of optimizers.

    Lightning keeps it only in the fit loop's private ``epoch_loop._batches_that_stepped`` (checked 2.4.0-2.6.6);
    ``trainer.global_step`` counts optimizer steps instead (two per batch with two optimizers under manual
    optimization). Where a future Lightning drops the counter, ``trainer.global_step``.
    """
    step = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "_batches_that_stepped", None)
    return int(step) if isinstance(step, int) else int(trainer.global_step)


#: the file name Lightning's multiprocessing launcher (``strategy="ddp_spawn"``, ``"ddp_fork"``, ...) saves rank 0's
#: final weights under, through the strategy's checkpoint IO, for the main process to load and then remove (checked
#: 2.4.0-2.6.6: in the trainer's ``default_root_dir`` in older releases, in a fresh ``tempfile.mkdtemp()`` folder in
#: newer ones)
_LAUNCHER_WEIGHTS_NAME = ".temp.ckpt"


def is_launcher_weights_file(path: PathType) -> bool:
    """Whether ``path`` is the file Lightning's multiprocessing launcher hands rank 0's final weights over in.

    No public API marks that save or removal: the launcher calls ``save_checkpoint`` / ``remove_checkpoint`` of the
    checkpoint IO like any other caller, and only the private file name tells them apart.
    """
    return os.path.basename(os.fspath(path).rstrip("/")) == _LAUNCHER_WEIGHTS_NAME


#: the profiler action Lightning's training epoch loop starts right before it asks the train dataloader for the next
#: batch (``_TrainingEpochLoop._on_before_fetch``, checked 2.4.0-2.6.6)
_TRAIN_FETCH_ACTION = "[_TrainingEpochLoop].train_dataloader_next"


def on_train_fetch(trainer: pl.Trainer, fn: Callable[[], None], *, key: str) -> Patch | None:
    """Call ``fn()`` each time Lightning's training loop starts fetching a batch, for as long as the returned patch is
    installed (``.restore()`` removes it); None for an object without a profiler to shadow (a stand-in trainer).

    No public hook marks that moment: ``on_train_batch_end`` of the callbacks after the caller, logging, progress
    bars and LR schedulers all run before it. Lightning announces it to its profiler only, as the action
    ``_TRAIN_FETCH_ACTION`` (a private name): the trainer's profiler's ``start`` is shadowed on that instance, and
    calls through to the profiler the user chose. Where a future Lightning renames the action, ``fn`` is never
    called (the caller's fallback applies) and ``tests/_utils/test_compat.py`` fails, naming this shim.
    """

    def wrap(p: Patch) -> Callable[[str], Any]:
        # `p.original` is read at each call: a patch under this one restored first rewires it
        def start(action_name: str) -> Any:
            if action_name == _TRAIN_FETCH_ACTION:
                fn()
            return p.original(action_name)

        return start

    profiler = getattr(trainer, "profiler", None)
    if profiler is None or not callable(getattr(profiler, "start", None)):
        return None
    return patch(profiler, "start", wrap, key=key)


def set_compiled_call_impl(module: nn.Module, fn: Callable[..., Any]) -> None:
    """Install ``fn`` where ``nn.Module.compile()`` puts the compiled call, so the module object stays the same.

    ``nn.Module.compile()`` accepts no fallback; a guarded callable needs ``_compiled_call_impl`` (torch >= 2.2).
    """
    module._compiled_call_impl = fn


@functools.cache
def compile_error_types() -> tuple[type[BaseException], ...]:
    """Exception types that mean "compilation failed" (not "the model is wrong").

    torch exposes them only in ``torch._dynamo.exc`` (``TorchDynamoException``) and ``torch._inductor.exc`` (every
    class defined there); both modules since torch 2.0. Falls back to ``RuntimeError`` when neither imports.
    """
    errors: list[type[BaseException]] = []
    try:
        from torch._dynamo import exc as dynamo_exc

        errors.append(dynamo_exc.TorchDynamoException)
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    try:
        from torch._inductor import exc as inductor_exc

        mod = inductor_exc.__name__
        errors += [v for v in vars(inductor_exc).values() if isinstance(v, type) and v.__module__ == mod]
    except ImportError:  # pragma: no cover - torch without inductor
        pass
    return tuple(errors) or (RuntimeError,)


# -- torch: DataLoader and storages ----------------------------------------------------------------------------------


def pin_memory(data: Any) -> Any:
    """``data`` (tensors nested in lists, tuples, dicts, namedtuples) with every tensor in pinned memory.

    What the DataLoader's pin-memory thread does, for batches built outside it; only the private
    ``torch.utils.data._utils.pin_memory.pin_memory`` walks nested batches (since torch 1.2; checked 2.14.1).
    """
    from torch.utils.data._utils.pin_memory import pin_memory as _pin

    return _pin(data)


def index_sampler(loader: DataLoader[Any]) -> Any:
    """What ``loader``'s iterators draw each batch's indices from: its batch sampler, or its sampler when automatic
    batching is off (``DataLoader._index_sampler``, read once per pass by ``_BaseDataLoaderIter``; since torch 1.7)."""
    return loader._index_sampler


def wrap_index_sampler(cls: type, wrap: Callable[[Any, Any], Any]) -> None:
    """Make the DataLoader subclass ``cls`` hand its iterators ``wrap(loader, base)`` instead of its index sampler
    ``base`` (see :func:`index_sampler`): every pass reads it, the persistent workers' reset included, so a bound set
    there holds on every path."""
    from torch.utils.data import DataLoader as _Loader

    base = _Loader._index_sampler
    cls._index_sampler = property(lambda self: wrap(self, base.fget(self)))  # type: ignore[attr-defined]


def shutdown_persistent_workers(loader: DataLoader[Any], *, wait: bool = True) -> threading.Thread | None:
    """Stop ``loader``'s persistent worker processes now; its next ``iter()`` starts new ones.

    ``DataLoader`` keeps persistent workers in ``_iterator`` (since torch 1.7) and stops them only when that iterator
    is garbage-collected; ``_MultiProcessingDataLoaderIter._shutdown_workers`` (since torch 1.0) stops them now.

    Args:
        loader: the loader.
        wait: join the workers before returning; ``False``: detach them from ``loader`` now and stop them on a
            thread (returned; the interpreter waits for it at exit), e.g. while the loader already serves its next
            epoch in the main process (joining 2 idle workers took 64 ms on the 2-core development machine).
    """
    it: Any = getattr(loader, "_iterator", None)
    loader._iterator = None
    if getattr(it, "_shutdown_workers", None) is None:
        return None
    if wait:
        it._shutdown_workers()
        return None
    # Not a daemon: the interpreter waits for it at exit (bounded by the DataLoader's own worker-join timeouts), so the
    # iterator and the batches it still holds are released while the interpreter runs. A daemon thread that dropped
    # them during interpreter shutdown was killed inside torch's C++ deallocator, and the whole process aborted
    # ("terminate called without an active exception", SIGABRT) after a successful fit.
    t = threading.Thread(target=it._shutdown_workers, name="la-stop-workers")
    t.start()
    return t


def register_before_thread_shutdown(fn: Callable[[], None]) -> None:
    """Call ``fn`` at interpreter exit before non-daemon threads are joined and before ``concurrent.futures``'
    executors refuse new work, so background work can still finish there (``atexit`` runs after both).

    ``threading._register_atexit`` (CPython, since 3.9; private) calls its functions in reverse order of registration,
    and ``concurrent.futures.thread`` registers its shutdown when imported: importing it first puts ``fn`` before it.
    Where the hook is missing, ``atexit.register``.
    """
    import atexit
    import concurrent.futures.thread  # noqa: F401 - registers its exit hook now, so ``fn`` runs before it

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
    else:
        register(fn)


@functools.cache
def storage_use_count_fn() -> Callable[[torch.UntypedStorage], int] | None:
    """``storage -> number of references to it`` (tensors, views, numpy arrays), or None where torch lacks it.

    No public API says whether a storage is still referenced; ``torch._C._storage_Use_Count(storage._cdata)`` is
    what inductor's CUDA-graph trees use (present in every torch this project supports, >= 2.4; checked 2.14.1).
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None

    def count(storage: torch.UntypedStorage) -> int:
        return int(use_count(storage._cdata))

    return count


def empty_shared(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor allocated directly in shared memory.

    ``torch.empty(...).share_memory_()`` allocates private memory and then copies it into shared memory; allocating
    in shared memory is what ``default_collate`` does inside workers, through ``Tensor._typed_storage()`` and
    ``TypedStorage._new_shared`` (that shape since torch 2.0; checked 2.14.1).
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(numel, device=elem.device)
    return elem.new(storage).resize_(*[int(s) for s in shape])


# -- torchvision: JPEG decoding ops ---------------------------------------------------------------------------------


@functools.cache
def jpeg_decode_ops() -> tuple[Callable[[torch.Tensor, int], torch.Tensor], Callable[..., Any], int, int] | None:
    """``(decode_cpu(data, mode), decode_cuda(list_of_data, mode, device), UNCHANGED, RGB)``, or None without them.

    ``torchvision.io.decode_jpeg`` (libjpeg-turbo on CPU, nvJPEG batches on CUDA) warns on every call since
    torchvision 0.29 (``DeprecationWarning``: its codecs move to torchcodec, not a dependency here): under
    ``-W error`` that warning is an exception in the middle of a batch, and silencing it per call
    (``warnings.catch_warnings``) swaps the process's filters under other threads. So the ops it dispatches to
    are called directly: ``torch.ops.image.decode_jpeg(data, mode, apply_exif_orientation)`` and
    ``torch.ops.image.decode_jpegs_cuda(datas, mode, device)`` (that shape since torchvision 0.19; checked 0.29.1).
    """
    try:
        from torchvision import io as tv_io  # type: ignore[import-untyped]  # torchvision ships no type hints

        ops = torch.ops.image
        cpu, cuda = ops.decode_jpeg, ops.decode_jpegs_cuda
        modes = int(tv_io.ImageReadMode.UNCHANGED.value), int(tv_io.ImageReadMode.RGB.value)
    except (ImportError, AttributeError, RuntimeError, OSError):
        return None

    def decode_cpu(data: torch.Tensor, mode: int) -> torch.Tensor:
        return cpu(data, mode, False)  # no EXIF rotation: ImageFolder's PIL loader applies none

    return decode_cpu, cuda, modes[0], modes[1]


# -- torch: CUDA caching allocator -----------------------------------------------------------------------------------


def allocator_settings_setter() -> Callable[[str], Any] | None:
    """``conf -> None`` that changes the caching allocator's settings at run time, or None where torch lacks one.

    torch documents only the ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` variables, read once when the
    allocator is created. At run time: ``torch._C._accelerator_setAllocatorSettings`` (the device-generic binding
    of recent torch; in 2.14.1 ``torch.cuda.memory._set_allocator_settings`` delegates to it), else
    ``torch.cuda.memory._set_allocator_settings`` (older torch, back to 2.4). Looked up at each call, so tests can
    patch either.
    """
    fn = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if fn is not None:
        return fn
    return getattr(torch.cuda.memory, "_set_allocator_settings", None)


def cuda_memory_snapshot() -> Any:
    """The allocator state with allocation traces, as https://pytorch.org/memory_viz reads it.

    The public ``torch.cuda.memory_snapshot()`` returns the segments only, without the traces the viewer shows;
    ``torch.cuda.memory._snapshot()`` (since torch 2.0; the tool's documented input) has both.
    """
    return torch.cuda.memory._snapshot()


def record_cuda_memory_history(max_entries: int) -> None:
    """Start recording allocation stack traces (the last ``max_entries`` events) for :func:`cuda_memory_snapshot`.

    Only ``torch.cuda.memory._record_memory_history`` does this (this keyword form since torch 2.1).
    """
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Stop recording allocation stack traces (``_record_memory_history(enabled=None)``, since torch 2.1)."""
    torch.cuda.memory._record_memory_history(enabled=None)


# -- Lightning: ModelParallelStrategy ---------------------------------------------------------------------------------


def set_model_parallel_sizes(strategy: Strategy, data_parallel: int, tensor_parallel: int) -> None:
    """Fix a ``ModelParallelStrategy``'s mesh sizes once the world size is known (at ``setup_environment``).

    Its constructor takes them, but ``"auto"`` means "number of nodes" for the data-parallel size, not
    "world / tensor-parallel size", and the world size is unknown before the accelerator connector ran.
    ``ModelParallelStrategy._data_parallel_size`` / ``_tensor_parallel_size`` (since Lightning 2.4; checked 2.6.6).
    """
    strategy._data_parallel_size = data_parallel  # type: ignore[attr-defined]
    strategy._tensor_parallel_size = tensor_parallel  # type: ignore[attr-defined]


# --- cli: texts of jsonargparse, Lightning and torch errors the CLI reads -------------------------------------------
# None of these libraries gives the parts of its error as attributes: jsonargparse's `ArgumentError` carries one
# English text (the key as `Parser key "..."`, the instantiation's `class_path='...'`, scaffolding lines around the
# one that says what is wrong); Lightning's resume-epoch refusal and torch's re-raised DataLoader-worker error are
# plain messages. Each reader below is tested against the real library's text in tests/_utils/test_compat.py.

# jsonargparse's own lines around the one that says what is wrong (Union dumps list every subtype it tried)
_JSONARGPARSE_NOISE = re.compile(
    r"^(Expected a path but|Does not validate against any|Subtypes:|Errors:|Not a valid subclass|Subclass types|"
    r"a class path|a dict |Import path .* does not correspond|Given value|Problem with given class_path|Parser key|"
    r"Expected a <class '(NoneType|str|int|float|bool|dict|list)'>$|Validation failed)"
)
_JSONARGPARSE_KEY = re.compile(r'Parser key "([^"]+)"')
_JSONARGPARSE_EXPECTED = re.compile(r"^Expected a <class '([^']+)'>$")
_JSONARGPARSE_CLASS_PATH = re.compile(r"class_path='([^']+)'")


def jsonargparse_error_key(text: str) -> str:
    """The config key a jsonargparse error's first line names (``Parser key "trainer.max_epochs"``), or ``""``."""
    m = _JSONARGPARSE_KEY.search(text.splitlines()[0] if text else "")
    return m.group(1) if m else ""


def jsonargparse_error_class_path(text: str) -> str:
    """The ``class_path='...'`` an instantiation error of jsonargparse names, or ``""``."""
    m = _JSONARGPARSE_CLASS_PATH.search(text)
    return m.group(1) if m else ""


_JSONARGPARSE_OPTION = re.compile(r"^Option '([^']+)' is not accepted")
_JSONARGPARSE_GROUP_OPTION = re.compile(r"^Group '([^']+)' does not accept option '([^']+)'")
_JSONARGPARSE_UNRECOGNIZED = re.compile(r"^unrecognized arguments: --([^\s=]+)")
_JSONARGPARSE_NESTED_ARG = re.compile(r"^NestedArg\(key='[^']*', val=(.+)\)$")
_JSONARGPARSE_GIVEN_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)'")


def jsonargparse_unknown_option(text: str) -> tuple[str, str, str] | None:
    """``(key, class path, option)`` when a jsonargparse error is about an option nothing accepts, else None.

    Three texts say so: ``Option 'batchsize' is not accepted`` under ``Problem with given class_path '...'`` (a
    ``class_path:`` config, on the command line or in YAML: ``key`` is its ``Parser key``, the class path is given),
    ``Group 'trainer' does not accept option 'max_epocs'`` (a YAML key of a class group: the class path is ``""``)
    and ``unrecognized arguments: --trainer.max_epocs=3`` (the same on the command line: ``key`` is what precedes
    the last dot, ``""`` for a top-level option).
    """
    lines = [ln.strip().removeprefix("- ").strip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        m = _JSONARGPARSE_OPTION.match(ln)
        if m:
            paths = [p.group(1) for p in map(_JSONARGPARSE_GIVEN_CLASS_PATH.match, lines[:i]) if p]
            return jsonargparse_error_key(text), (paths[-1] if paths else ""), m.group(1)
        m = _JSONARGPARSE_GROUP_OPTION.match(ln)
        if m:
            return m.group(1), "", m.group(2)
        m = _JSONARGPARSE_UNRECOGNIZED.match(ln)
        if m:
            key, _, option = m.group(1).rpartition(".")
            return key, "", option
    return None


def jsonargparse_useful_line(text: str) -> tuple[str, str]:
    """``(inner key, message)``: the line of a jsonargparse error that says what is wrong.

    A line in backticks (this project's errors quote the argument) wins; otherwise the first line that is not
    jsonargparse's scaffolding (e.g. ``Expected a typing.Literal['int8', 'int4']``), with the rejected value appended.
    When every line is scaffolding (a plain value no subtype of an ``Optional[int]`` took), the message is built from
    it: ``expected int or None, got 'five'.``
    The inner key is the ``Parser key`` of the class argument above that line, when the parser named one below the
    outermost key.
    """
    lines = [ln.strip().removeprefix("- ").strip() for ln in text.splitlines()]
    keys = [(i, m.group(1)) for i, ln in enumerate(lines) for m in [_JSONARGPARSE_KEY.search(ln)] if m]
    candidates = [i for i, ln in enumerate(lines) if ln and not _JSONARGPARSE_NOISE.match(ln)]
    if not candidates:
        return "", _expected_got(lines) or " ".join(text.split())[:300]
    ticked = [i for i in candidates if "`" in lines[i]]
    pick = ticked[0] if ticked else candidates[0]
    message = lines[pick]
    if "got" not in message.lower():
        given = next((ln for ln in lines[pick + 1 :] if ln.startswith("Given value:")), None)
        if given is not None and len(given) < 120:
            value = given.removeprefix("Given value:").strip()
            # a `--key.sub=value` argument reaches the text as jsonargparse's internal `NestedArg(key=..., val=...)`:
            # only its value (already quoted) is shown
            nested = _JSONARGPARSE_NESTED_ARG.match(value)
            message = f"{message.rstrip('.')}, got {nested.group(1) if nested else repr(value)}."
    inner = [k for i, k in keys if i < pick]
    outer = keys[0][1] if keys else ""
    return (inner[-1] if inner and inner[-1] != outer else ""), message


def _expected_got(lines: list[str]) -> str:
    """``expected int or None, got 'five'.`` from a Union dump's ``Expected a <class '...'>`` and ``Given value:``
    lines, or ``""`` when it has neither."""
    types = [m.group(1) for ln in lines for m in [_JSONARGPARSE_EXPECTED.match(ln)] if m]
    given = next((ln.removeprefix("Given value:").strip() for ln in lines if ln.startswith("Given value:")), None)
    if not types or given is None:
        return ""
    words = dict.fromkeys("None" if t == "NoneType" else t for t in types)  # in order, once each
    return f"expected {' or '.join(words)}, got {given[:100]!r}."


_JSONARGPARSE_NAME_NOT_PATH = re.compile(r"^(?:- )?Expected a dot import path string: (\S+)$")
_JSONARGPARSE_NESTED_GIVEN = re.compile(r"^Given value: NestedArg\(key='([^']+)'")
_JSONARGPARSE_BARE_NAME = re.compile(
    r"^(?:(--[\w.]+): )?Expected a dot import path string: ([A-Za-z_]\w*)(?:, got .*)?$"
)


def jsonargparse_name_given_option(text: str) -> tuple[str, str] | None:
    """``(name, option)`` when a jsonargparse error says an option was nested under a plain name (``--trainer.strategy
    =ddp_1bit --trainer.strategy.warmup_steps=3``: ``Expected a dot import path string: ddp_1bit`` and ``Given value:
    NestedArg(key='warmup_steps', ...)``), else None: jsonargparse nests options only under a class path."""
    lines = [ln.strip() for ln in text.splitlines()]
    name = next((m.group(1) for ln in lines if (m := _JSONARGPARSE_NAME_NOT_PATH.match(ln))), None)
    option = next((m.group(1) for ln in lines if (m := _JSONARGPARSE_NESTED_GIVEN.match(ln))), None)
    return None if name is None or option is None else (name, option)


def jsonargparse_bare_class_name(text: str) -> tuple[str | None, str] | None:
    """``(option, name)`` when a jsonargparse error is about a class given by a bare name it could not resolve
    (``Expected a dot import path string: ImageClassifier``; ``option`` is the ``--model`` it was given to when the
    line names one, else None), or None for any other error."""
    lines = (ln.strip().removeprefix("- ") for ln in text.splitlines())
    found = next((m for ln in lines if (m := _JSONARGPARSE_BARE_NAME.match(ln))), None)
    return None if found is None else (found.group(1), found.group(2))


_NO_ATTRIBUTE = re.compile(r"^module '([\w.]+)' has no attribute '(\w+)'")


def missing_module_attribute(message: str) -> tuple[str, str] | None:
    """``(module, name)`` from Python's ``module 'x.y' has no attribute 'Name'`` (how jsonargparse reports a
    ``class_path`` whose module lacks the class), else None."""
    m = _NO_ATTRIBUTE.match(message)
    return None if m is None else (m.group(1), m.group(2))


_ARGPARSE_REQUIRED = re.compile(r"^the following arguments are required: (.+)$")


def argparse_required_keys(text: str) -> list[str] | None:
    """The keys argparse's ``the following arguments are required: fit.model, fit.data`` names (as written there),
    or None for any other error."""
    m = _ARGPARSE_REQUIRED.match(text.strip().splitlines()[0] if text.strip() else "")
    return None if m is None else [k.strip() for k in m.group(1).split(",")]


_JSONARGPARSE_NOT_A_SUBCLASS = re.compile(r"^Not a valid subclass of ")


def jsonargparse_nested_option_key(text: str, outer: str, *, at: str = "not accepted") -> tuple[str, int]:
    """The full config key of the class a jsonargparse error is about, and the index of the line saying what is wrong:
    ``data.train_augment`` for an option of the ``train_augment`` class nested in ``data`` (jsonargparse names each
    level in its own indented ``Parser key`` line, the outermost one first). The line is the first ``Option '...' is
    not accepted`` (``at="not accepted"``) or ``Not a valid subclass of ...`` (``at="not a subclass"``); ``(outer,
    -1)`` when no line is.
    """
    pattern = {"not accepted": _JSONARGPARSE_OPTION, "not a subclass": _JSONARGPARSE_NOT_A_SUBCLASS}[at]
    stack: list[tuple[int, str]] = []  # (indent, key) of the Parser keys enclosing the current line
    for n, raw in enumerate(text.splitlines()):
        indent = len(raw) - len(raw.lstrip())
        line = raw.strip().removeprefix("- ").strip()
        if pattern.match(line):
            keys: list[str] = []
            for _, k in stack:
                keys = [k] if keys and k.startswith(f"{keys[-1]}.") else [*keys, k]  # a level may repeat its parent
            return ".".join(keys) or outer, n
        m = _JSONARGPARSE_KEY.search(line)
        if m:
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, m.group(1))]
    return outer, -1


_JSONARGPARSE_GIVEN_DICT_KEY = re.compile(r"[{,]\s*'([A-Za-z_][A-Za-z0-9_]*)': ")


def jsonargparse_given_dict_keys(lines: list[str]) -> list[str]:
    """The keys of the first dict jsonargparse dumps as ``Given value: {...}`` among ``lines`` (stripped), in the
    order written, its nested dicts' keys included."""
    given = next((ln for ln in lines if ln.startswith("Given value: {")), None)
    return _JSONARGPARSE_GIVEN_DICT_KEY.findall(given or "")


_JSONARGPARSE_SUBCOMMAND_OPTION = re.compile(r"^Subcommand '([^']+)' does not accept option '([^']+)'")


def jsonargparse_top_level_option(text: str) -> tuple[str | None, str] | None:
    """``(subcommand, option)`` when the first line of a jsonargparse error refuses an option outside every group:
    ``Subcommand 'fit' does not accept option 'trainner.max_steps'`` (a YAML key: the subcommand is named),
    ``unrecognized arguments: --trainner.max_steps 1`` (the command line) or ``Option 'trainner.max_steps' is not
    accepted`` (YAML under ``--print_config``), the last two with ``subcommand`` None; else None."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if m := _JSONARGPARSE_SUBCOMMAND_OPTION.match(first):
        return m.group(1), m.group(2)
    if m := (_JSONARGPARSE_UNRECOGNIZED.match(first) or _JSONARGPARSE_OPTION.match(first)):
        return None, m.group(1)
    return None


#: How Lightning's `_CheckpointConnector` starts the error for a resume whose checkpoint epoch is at `max_epochs`.
_RESUME_EPOCH_PREFIX = "You restored a checkpoint with current_epoch="


def is_resume_past_max_epochs(error: BaseException) -> bool:
    """True for Lightning's refusal to resume a checkpoint saved at or past ``max_epochs``."""
    return str(error).lstrip().startswith(_RESUME_EPOCH_PREFIX)


def dataloader_worker_error_line(error: BaseException) -> str | None:
    """For an exception torch re-raised from a DataLoader worker, the worker's own last line (``ValueError: ...``).

    torch re-raises a worker's exception as ``Caught ValueError in DataLoader worker process 0. Original Traceback
    ...``: the traceback is the worker's, and its last line is the error the user made. None for any other error.
    """
    text = str(error)
    if "Original Traceback" not in text:
        return None
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    return " ".join(last.split()) or None


def is_jsonargparse_union_error(error: BaseException) -> bool:
    """True when jsonargparse reports a value that none of a Union's subtypes accepted (its instantiation of a class
    that refused its arguments arrives so, the class's own message nested inside)."""
    return "Does not validate against any of the Union subtypes" in str(error)


# --- parallel: meta-device materialisation of a parallelised module ------------------------------------------------


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Allocate a module built on the meta device (``Trainer.init_module(empty_init=True)``) on ``device`` and
    initialise it, after it was sharded: ``ModelParallelStrategy.setup``'s step (``to_empty`` on the root, then each
    module's ``reset_parameters``, a warning naming modules without one; nothing when no tensor is on meta).

    Lightning has no public API for it: ``lightning.fabric.utilities.init._materialize_distributed_module`` (since
    Lightning 2.4; checked 2.6.6), which ``ModelParallelStrategy.setup`` calls.
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


# --- comm: Lightning's unused-parameters advice --------------------------------------------------------------------

#: the two phrases of ``DDPStrategy.on_exception``'s advice for "Expected to have finished reduction in the prior
#: iteration" that name DDP (checked against Lightning 2.6.6); a strategy that registers its own aliases rewrites them
DDP_FIND_UNUSED_ALIAS_ADVICE = "`strategy='ddp_find_unused_parameters_true'`"
DDP_FIND_UNUSED_CLASS_ADVICE = "`strategy=DDPStrategy(find_unused_parameters=True)`"


def redirect_find_unused_parameters_advice(exception: BaseException, alias: str, constructor: str) -> None:
    """Point Lightning's "enable the detection of unused parameters" advice at another strategy, in place.

    ``DDPStrategy.on_exception`` rewrites DDP's unused-parameters error to suggest
    ``strategy='ddp_find_unused_parameters_true'`` or ``strategy=DDPStrategy(find_unused_parameters=True)``; a DDP
    subclass whose users would lose its behaviour by following that advice replaces both with ``alias`` and
    ``constructor`` (``"OneBitDDPStrategy(find_unused_parameters=True)"``). Lightning promises neither text; an
    exception without them is left unchanged.
    """
    msg = str(exception)
    if DDP_FIND_UNUSED_ALIAS_ADVICE not in msg and DDP_FIND_UNUSED_CLASS_ADVICE not in msg:
        return
    msg = msg.replace(DDP_FIND_UNUSED_ALIAS_ADVICE, f"`strategy='{alias}'`").replace(
        DDP_FIND_UNUSED_CLASS_ADVICE, f"`strategy={constructor}`"
    )
    exception.args = (msg, *exception.args[1:])


# --- checkpoint: ModelCheckpoint.setup's directory listing ------------------------------------------------------------


@contextlib.contextmanager
def model_checkpoint_setup_without_listing(callback: Any) -> Any:
    """Within the block, ``ModelCheckpoint.setup`` does not list its ``dirpath``.

    ``ModelCheckpoint.setup`` re-creates its filesystem without storage options and lists ``dirpath`` to warn when it
    is not empty; on a custom S3 endpoint that listing fails. Its private ``__warn_if_dir_not_empty`` skips the
    listing when ``save_top_k == 0`` (an undocumented side effect; checked 2.4.0-2.6.6), so ``save_top_k`` is 0 inside
    the block and restored after it, whatever happens.
    """
    top_k = callback.save_top_k
    callback.save_top_k = 0
    try:
        yield
    finally:
        callback.save_top_k = top_k


# --- checkpoint: when a ModelCheckpoint saves during an epoch ------------------------------------------------------


def model_checkpoint_step_interval(callback: Any) -> int:
    """``every_n_train_steps`` of a ``ModelCheckpoint`` (0: none), which it keeps only as the private
    ``_every_n_train_steps`` (checked 2.4.0-2.6.6): it saves in ``on_train_batch_end`` when the global step is a
    multiple of it. 0 for a callback without one (another ``Checkpoint``)."""
    n = getattr(callback, "_every_n_train_steps", 0)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


# --- checkpoint: around a ModelCheckpoint's saves and removals -------------------------------------------------------


def wrap_model_checkpoint_writes(
    callback: Any, around: Callable[[str, Any, Callable[[], None]], None], *, key: str
) -> list[Patch]:
    """Route every save and removal of ``callback`` (a ``ModelCheckpoint``) through ``around(kind, trainer, write)``:
    ``kind`` is ``"save"`` or ``"remove"``, ``write()`` does it. Returns the two patches (restore them at teardown).

    ``ModelCheckpoint`` saves through its private ``_save_checkpoint(trainer, filepath)``, on every rank (it calls
    ``trainer.save_checkpoint``), and removes through ``_remove_checkpoint(trainer, filepath)`` (checked 2.4.0-2.6.6);
    no public hook runs at each of them (a callback's ``on_save_checkpoint`` is skipped for weights-only saves).
    Installed per instance at ``setup``, in the process that trains: the closures would not pickle for ``ddp_spawn``.
    """

    def through(kind: str) -> Callable[[Patch], Any]:
        def replacement(p: Patch) -> Any:
            def method(trainer: Any, filepath: str) -> None:
                around(kind, trainer, lambda: p.original(trainer, filepath))

            return method

        return replacement

    return [
        patch(callback, "_save_checkpoint", through("save"), key=f"{key}-save"),
        patch(callback, "_remove_checkpoint", through("remove"), key=f"{key}-remove"),
    ]


# --- checkpoint: which checkpoints a resumed ModelCheckpoint tracks ---------------------------------------------------


def model_checkpoint_states(callbacks: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The ``ModelCheckpoint`` states in a checkpoint's ``"callbacks"`` dict.

    Lightning stores each callback's ``state_dict()`` under its ``state_key`` (``"ModelCheckpoint{'monitor': ...}"``,
    a subclass under its own class name); a ``ModelCheckpoint``'s holds ``dirpath``, ``best_k_models``,
    ``best_model_path``, ``kth_best_model_path`` and ``last_model_path`` (checked 2.4.0-2.6.6). They are recognised by
    those keys, whatever the class name.
    """
    want = ("dirpath", "best_k_models", "last_model_path")
    return [v for v in callbacks.values() if isinstance(v, Mapping) and all(k in v for k in want)]


def model_checkpoint_tracked(state: Mapping[str, Any]) -> set[str]:
    """The checkpoint paths a ``ModelCheckpoint`` restored from ``state`` keeps track of, i.e. the only files of its
    directory it will ever overwrite or remove: the keys of ``best_k_models`` (the top-k it compares new saves
    against), ``kth_best_model_path``, ``best_model_path`` and ``last_model_path`` (``_save_last_checkpoint`` sets
    the latter before saving, so ``last.ckpt``'s state names itself; checked 2.4.0-2.6.6). Any other checkpoint in the
    directory — e.g. one a killed run saved after its last ``last.ckpt`` — Lightning never removes.
    """
    paths: set[str] = set()
    best_k = state.get("best_k_models")
    if isinstance(best_k, Mapping):
        paths.update(str(k) for k in best_k if k)
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        value = state.get(key)
        if isinstance(value, str) and value:
            paths.add(value)
    return paths


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (``Tensor._version``): every in-place op through torch bumps it, writes
    through ``.data``, numpy views or foreign code do not. Used only to skip work whose result would be "changed"
    anyway, never to conclude "unchanged"."""
    return int(t._version)


def rewind_global_step(trainer: Any, steps: int) -> bool:
    """Take ``steps`` back from ``trainer.global_step`` (Lightning's optimizer-step progress counters, which
    ``max_steps`` and step-indexed callbacks read), so a fit that restored an earlier state trains the steps it lost.
    Returns False, changing nothing, when this Lightning keeps the counter elsewhere."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    module = getattr(trainer, "lightning_module", None)
    try:
        if module is None or module.automatic_optimization:
            tracker = loop.automatic_optimization.optim_progress.optimizer.step  # type: ignore[union-attr]
        else:
            tracker = loop.manual_optimization.optim_step_progress  # type: ignore[union-attr]
        total, current = tracker.total, tracker.current
        n = min(int(steps), int(total.completed))
        for t in (total, current):
            t.ready, t.completed = max(0, t.ready - n), max(0, t.completed - n)
    except AttributeError:
        return False
    return True


def copy_tensors(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    """``d.copy_(s)`` for each pair, in one ``torch._foreach_copy_`` call (one dispatch instead of one per tensor: a
    few microseconds each, which add up over a model's hundreds of tensors; pairs across devices take its per-tensor
    route), or pair by pair where this torch has no ``_foreach_copy_``."""
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is not None:
        fn(list(dst), list(src), non_blocking=non_blocking)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=non_blocking)
