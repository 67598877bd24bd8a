"""The levers the tuner tries, as edits of a job's config (the mapping a LightningCLI YAML holds).

A job is ``{"seed_everything": ..., "trainer": {...}, "model": {...}, "data": {...}}`` with ``class_path`` /
``init_args`` entries, exactly what ``lightning-accel fit --config`` reads. Each :class:`Option` edits a copy of it, so
the best job is written back as YAML unchanged in form. The options of each lever (see ``docs/tune.md``):

* ``data``: DataLoader workers (0 and ``min(4, cpus)``, whichever the job does not use); an image-folder data module
  (``DigitsDataModule`` or any module with a ``data_dir`` holding class folders) swapped for
  :class:`~lightning_accel.data.CachedDataModule` over the same folder;
* ``precision``: ``32-true``/``bf16-mixed`` (the one not configured), ``FusedPrecision("bf16-mixed")`` and
  ``FusedPrecision("bf16-mixed", compile=True)`` (``torch.compile`` after the fused surgery);
* ``host_memory`` (a job that trains on the CPU, under glibc, without one): the ``HostMemoryManager`` callback,
  which keeps freed host memory in the training processes (no page faults for each step's activations and gradients);
* ``strategy`` (``devices x num_nodes > 1``): ``ddp``, ``ddp_1bit``, ``AutoStrategy(policy="measure")`` (which
  times the sharded and pipeline plans itself);
* ``checkpoint`` (a job that saves): ``torch.save``, ``DeltaCheckpointIO``, ``DeltaCheckpointIO(async_save=True)``;
* ``batch`` (only when allowed): twice the per-device batch with ``LinearScalingLR``.

An option that sets a plugin the job already has (``FusedPrecision``, ``DeltaCheckpointIO``) edits that entry's
``init_args``: the user's other arguments (``ignore_modules``, ``quantize``, ``storage_options``, ...) stay.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel._utils.imports import import_object

__all__ = [
    "Option",
    "as_list",
    "has_checkpoints",
    "job_precision",
    "options_for",
    "trains_on_cpu",
    "world_of",
]

_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
_FUSED = "lightning_accel.plugins.FusedPrecision"
_DELTA = "lightning_accel.plugins.DeltaCheckpointIO"
#: Normalisation of image-folder modules whose statistics are known (others get CachedDataModule's ImageNet default).
_KNOWN_STATS = {
    "lightning_accel.datasets.DigitsDataModule": ([0.188, 0.188, 0.188], [0.318, 0.318, 0.318]),
    "lightning_accel.datasets.datamodule.DigitsDataModule": ([0.188, 0.188, 0.188], [0.318, 0.318, 0.318]),
}


@dataclass
class Option:
    """One setting of one lever.

    Attributes:
        lever: ``"data"``, ``"precision"``, ``"host_memory"``, ``"strategy"``, ``"checkpoint"`` or ``"batch"``.
        name: what it sets, in words (``"precision: bf16-mixed"``).
        edit: ``job -> job`` (on a copy).
        changes: the config keys it sets (dotted) -> values, for the report.
        reorders: the trial sees samples in another order (numerics tolerance, see ``core.check_numerics``).
        samples_ratio: trial batch over the baseline's.
        cost: the trial's expected wall time over the baseline trial's (the budget's estimate), plus ``extra_s``.
    """

    lever: str
    name: str
    edit: Callable[[dict[str, Any]], dict[str, Any]]
    changes: dict[str, Any] = field(default_factory=dict)
    reorders: bool = False
    samples_ratio: int = 1
    cost: float = 1.0
    extra_s: float = 0.0

    def apply(self, job: dict[str, Any]) -> dict[str, Any]:
        """This option applied to a deep copy of ``job``."""
        return self.edit(copy.deepcopy(job))


def as_list(value: Any) -> list[Any]:
    """A config's list-or-single entry (``callbacks``, ``plugins``) as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _class_path(entry: Any) -> str:
    return str(entry.get("class_path", "")) if isinstance(entry, dict) else str(entry)


def _accepts(class_path: str, arg: str) -> tuple[bool, Any]:
    """Whether the class takes ``arg`` (or ``**kwargs``), and the default it has there."""
    cls = import_object(class_path)
    if cls is None:
        return False, None
    params = inspect.signature(cls.__init__).parameters
    if arg in params:
        d = params[arg].default
        return True, None if d is inspect.Parameter.empty else d
    return any(p.kind is p.VAR_KEYWORD for p in params.values()), None


def _device_count(devices: Any) -> int:
    """How many devices a ``trainer.devices`` value asks for, read as Lightning reads it: a list of indices, a count,
    or a string of either (``"2"``; ``"0,1"`` and ``"1,"`` are index lists, as ``--trainer.devices=0,1`` passes them);
    ``"auto"``, -1 and anything unreadable count as 1 (the number is not in the config)."""
    if isinstance(devices, str):
        # the spelling of lightning.fabric's `_normalize_parse_gpu_string_input` (private: not imported)
        text = devices.strip()
        if "," in text:
            ids = [x.strip() for x in text.split(",") if x.strip()]
            return len(ids) if ids and all(x.isdigit() for x in ids) else 1
        return int(text) if text.isdigit() and int(text) > 0 else 1
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    return 1


def world_of(job: dict[str, Any]) -> int:
    """``devices x num_nodes`` of the job (``devices`` read as :func:`_device_count` says; ``"auto"``/-1 count as 1)."""
    t = job.get("trainer") or {}
    return _device_count(t.get("devices", 1)) * int(t.get("num_nodes", 1) or 1)


def job_precision(job: dict[str, Any]) -> str:
    """The job's precision in Lightning's full spelling (``core.canonical_precision``): a ``FusedPrecision`` plugin's
    mode, else ``trainer.precision`` (default 32-true)."""
    from lightning_accel.tune.core import canonical_precision

    t = job.get("trainer") or {}
    fused = _fused_entry(job)
    if fused is not None:
        return canonical_precision(_init_args(fused).get("precision", "bf16-mixed"))
    return canonical_precision(t.get("precision") or "32-true")


def has_checkpoints(job: dict[str, Any]) -> bool:
    """Whether the job saves checkpoints (a ``ModelCheckpoint`` callback, or Lightning's default one)."""
    t = job.get("trainer") or {}
    if any(_class_path(c).endswith("ModelCheckpoint") for c in as_list(t.get("callbacks"))):
        return True
    return t.get("enable_checkpointing", True) is not False


#: the word in the channels_last option's name (``tune_job`` skips it for a model without 4-D weights)
CHANNELS_LAST = "channels_last"


def _init_args(entry: Any) -> dict[str, Any]:
    """A ``class_path`` entry's ``init_args`` (a bare class path string has none)."""
    return dict(entry.get("init_args") or {}) if isinstance(entry, dict) else {}


def _fused_entry(job: dict[str, Any]) -> Any:
    """The job's ``FusedPrecision`` plugin entry, or None."""
    plugins = as_list((job.get("trainer") or {}).get("plugins"))
    return next((p for p in plugins if _class_path(p).endswith("FusedPrecision")), None)


#: the ``FusedPrecision`` arguments the precision lever sets, with the plugin's defaults; the others
#: (``ignore_modules``, ``fusions``, ``backend``, ...) are the user's and every option keeps them
_FUSED_LEVER_ARGS = {"precision": "bf16-mixed", "compile": False, "memory_format": "preserve"}


def _fused_setting(init: dict[str, Any]) -> tuple[str, bool, str]:
    """What the precision lever controls in ``FusedPrecision`` ``init_args``: (mode, compile, memory format)."""
    from lightning_accel.tune.core import canonical_precision

    full = {**_FUSED_LEVER_ARGS, **{k: v for k, v in init.items() if k in _FUSED_LEVER_ARGS}}
    return canonical_precision(full["precision"]), bool(full["compile"]), str(full["memory_format"])


def _set_precision(
    job: dict[str, Any], mode: str, *, fused: bool = False, compile: bool = False, channels_last: bool = False
) -> dict[str, Any]:
    """Set the precision; a fused option edits the job's own ``FusedPrecision`` entry (in its place among the
    plugins) so the user's other arguments stay, and adds one when there is none."""
    t = job.setdefault("trainer", {})
    t.pop("precision", None)
    mine = _fused_entry(job)
    entry: dict[str, Any] | None = None
    if fused:
        init = _init_args(mine)
        layout = CHANNELS_LAST if channels_last else "preserve"
        want = {"precision": mode, "compile": compile, "memory_format": layout}
        for key, value in want.items():
            # a default is left out (or dropped): the YAML says only what differs from the plugin's own defaults
            if key != "precision" and value == _FUSED_LEVER_ARGS[key]:
                init.pop(key, None)
            else:
                init[key] = value
        entry = {"class_path": _class_path(mine) if mine is not None else _FUSED, "init_args": init}
    else:
        t["precision"] = mode
    _place_plugin(t, "Precision", mine, entry)
    return job


def _place_plugin(trainer: dict[str, Any], kind: str, mine: Any, entry: dict[str, Any] | None) -> None:
    """Put ``entry`` among ``trainer["plugins"]`` in place of the plugins whose class path holds ``kind``: where
    ``mine`` (the job's own, edited into ``entry``) stood, else at the end; ``entry=None`` only removes them."""
    plugins = []
    for p in as_list(trainer.get("plugins")):
        if kind not in _class_path(p):
            plugins.append(p)
        elif p is mine and entry is not None:
            plugins.append(entry)
            entry = None
    if entry is not None:
        plugins.append(entry)
    trainer["plugins"] = plugins
    if not plugins:
        trainer.pop("plugins")


def _precision_options(job: dict[str, Any]) -> list[Option]:
    """The precision options but the job's own setting (however Lightning lets it be spelt)."""
    now = job_precision(job)
    mine = _fused_entry(job)
    current = _fused_setting(_init_args(mine)) if mine is not None else None
    out = []
    for mode in ("32-true", "bf16-mixed"):
        if mode != now or mine is not None:
            out.append(
                Option(
                    "precision",
                    f"precision: {mode}",
                    functools.partial(_set_precision, mode=mode),
                    {"trainer.precision": mode},
                )
            )
    fused_opts = [
        Option(
            "precision",
            "precision: FusedPrecision(bf16-mixed)",
            lambda j: _set_precision(j, "bf16-mixed", fused=True),
            {"trainer.plugins": "FusedPrecision(bf16-mixed)"},
        ),
        # NHWC conv weights: ~30 % faster bf16 convolutions on x86 CPUs (oneDNN) and tensor cores; the tuner leaves
        # this out for a model without 4-D weights (its baseline trial says)
        Option(
            "precision",
            f"precision: FusedPrecision(bf16-mixed, {CHANNELS_LAST})",
            lambda j: _set_precision(j, "bf16-mixed", fused=True, channels_last=True),
            {"trainer.plugins": "FusedPrecision(bf16-mixed, memory_format=channels_last)"},
        ),
        # torch.compile: the first steps compile (66 s for the 4-wide ResNet on 2 CPU cores), hence the estimate
        Option(
            "precision",
            "precision: FusedPrecision(bf16-mixed, compile)",
            lambda j: _set_precision(j, "bf16-mixed", fused=True, compile=True),
            {"trainer.plugins": "FusedPrecision(bf16-mixed, compile=True)"},
            cost=2.0,
            extra_s=60.0,
        ),
    ]
    # an option that would set what the job's own FusedPrecision already has is no option
    settings = [
        ("bf16-mixed", False, "preserve"),
        ("bf16-mixed", False, CHANNELS_LAST),
        ("bf16-mixed", True, "preserve"),
    ]
    out += [o for o, setting in zip(fused_opts, settings, strict=True) if setting != current]
    return out


def _image_folder(data: dict[str, Any]) -> str | None:
    """The ImageFolder directory a data module reads (a ``data_dir`` holding class folders of images), or None."""
    cp = _class_path(data)
    if "CachedDataModule" in cp:
        return None
    init = data.get("init_args") or {}
    d = init.get("data_dir")
    if d is None:
        ok, d = _accepts(cp, "data_dir")
        if not ok or d is None:
            return None
    root = Path(str(d)).expanduser()
    if cp in _KNOWN_STATS:
        return str(root.resolve())  # rendered by the module itself at prepare time
    try:
        sub = [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return None
    if sub and any(f.suffix.lower() in _IMAGE_SUFFIXES for f in next(iter(sub)).iterdir()):
        return str(root.resolve())
    return None


def _swap_to_cache(job: dict[str, Any], folder: str) -> dict[str, Any]:
    old = job["data"]
    init = dict(old.get("init_args") or {})
    mean, std = _KNOWN_STATS.get(_class_path(old), (None, None))
    new: dict[str, Any] = {"origin": folder, "warm_on_prepare": True}
    for key in ("image_size", "batch_size", "num_workers", "val_fraction", "seed", "mean", "std"):
        if key in init:
            new[key] = init[key]
        else:
            ok, default = _accepts(_class_path(old), key)
            if ok and default is not None:
                new[key] = default
    if mean is not None:  # a module whose statistics are known (it hard-codes them)
        new["mean"], new["std"] = mean, std
    for key in ("mean", "std"):
        if key in new:
            new[key] = list(new[key])
    job["data"] = {"class_path": "lightning_accel.data.CachedDataModule", "init_args": new}
    return job


def _set_data_arg(job: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    job["data"].setdefault("init_args", {})[key] = value
    return job


def _data_options(job: dict[str, Any]) -> list[Option]:
    data = job.get("data")
    if not isinstance(data, dict):
        return []
    out = []
    folder = _image_folder(data)
    if folder is not None:
        out.append(
            Option(
                "data",
                "data: CachedDataModule over the image folder",
                lambda j: _swap_to_cache(j, folder),
                {"data.class_path": "CachedDataModule"},
                reorders=True,
                cost=2.0,
            )
        )
    ok, default = _accepts(_class_path(data), "num_workers")
    if ok:
        now = (data.get("init_args") or {}).get("num_workers", default)
        for n in sorted({0, min(4, os.cpu_count() or 1)}):
            if n != now:
                out.append(
                    Option(
                        "data",
                        f"data: num_workers={n}",
                        functools.partial(_set_data_arg, key="num_workers", value=n),
                        {"data.init_args.num_workers": n},
                    )
                )
    return out


def _set_strategy(job: dict[str, Any], strategy: Any) -> dict[str, Any]:
    job.setdefault("trainer", {})["strategy"] = copy.deepcopy(strategy)
    return job


def _strategy_options(job: dict[str, Any]) -> list[Option]:
    now = (job.get("trainer") or {}).get("strategy", "auto")
    now = "ddp" if now in ("auto", None) else now
    auto = {"class_path": "lightning_accel.strategies.AutoStrategy", "init_args": {"policy": "measure"}}
    cands: list[tuple[str, Any, float]] = [("ddp", "ddp", 1.0), ("ddp_1bit", "ddp_1bit", 1.0)]
    cands.append(('AutoStrategy(policy="measure")', auto, 3.0))  # it times its plans before training
    return [
        Option(
            "strategy",
            f"strategy: {name}",
            functools.partial(_set_strategy, strategy=value),
            {"trainer.strategy": name},
            cost=cost,
        )
        for name, value, cost in cands
        if value != now
    ]


def _set_checkpoint_io(job: dict[str, Any], io: dict[str, Any] | None) -> dict[str, Any]:
    """Set the checkpoint IO (None: Lightning's ``torch.save``). The job's own ``DeltaCheckpointIO`` entry is edited
    in its place among the plugins, so its other arguments (``quantize``, ``storage_options``, ``redundancy``, ...)
    stay; another IO is replaced."""
    t = job.setdefault("trainer", {})
    mine = next((p for p in as_list(t.get("plugins")) if "CheckpointIO" in _class_path(p)), None)
    entry = copy.deepcopy(io)
    if entry is not None and mine is not None and _class_path(mine).endswith("DeltaCheckpointIO"):
        entry = {"class_path": _class_path(mine), "init_args": {**_init_args(mine), **_init_args(io)}}
    _place_plugin(t, "CheckpointIO", mine, entry)
    return job


def _checkpoint_options(job: dict[str, Any]) -> list[Option]:
    current = next(
        (p for p in as_list((job.get("trainer") or {}).get("plugins")) if "CheckpointIO" in _class_path(p)), None
    )
    now = "torch.save"
    if current is not None:
        asyn = bool((current.get("init_args") or {}).get("async_save", False)) if isinstance(current, dict) else False
        now = f"DeltaCheckpointIO(async_save={asyn})" if "Delta" in _class_path(current) else _class_path(current)
    cands: list[tuple[str, dict[str, Any] | None]] = [
        ("torch.save", None),
        ("DeltaCheckpointIO(async_save=False)", {"class_path": _DELTA, "init_args": {"async_save": False}}),
        ("DeltaCheckpointIO(async_save=True)", {"class_path": _DELTA, "init_args": {"async_save": True}}),
    ]
    return [
        Option(
            "checkpoint",
            f"checkpoint: {name}",
            functools.partial(_set_checkpoint_io, io=io),
            {"trainer.plugins": name},
        )
        for name, io in cands
        if name != now
    ]


_HOST_MEMORY = "lightning_accel.callbacks.HostMemoryManager"


def trains_on_cpu(job: dict[str, Any]) -> bool:
    """Whether ``job`` trains on the CPU here: ``accelerator: cpu``, or ``auto`` (the default) without a GPU."""
    accelerator = str((job.get("trainer") or {}).get("accelerator", "auto")).lower()
    if accelerator == "cpu":
        return True
    if accelerator != "auto":
        return False
    import torch

    mps = getattr(torch.backends, "mps", None)
    return not torch.cuda.is_available() and not (mps is not None and mps.is_available())


def _add_host_memory(job: dict[str, Any]) -> dict[str, Any]:
    t = job.setdefault("trainer", {})
    t["callbacks"] = [*as_list(t.get("callbacks")), {"class_path": _HOST_MEMORY}]
    return job


def _host_memory_options(job: dict[str, Any]) -> list[Option]:
    """``HostMemoryManager`` for a job that trains on the CPU under glibc and has none (it changes nothing else)."""
    from lightning_accel._utils.malloc import can_keep_freed_memory

    callbacks = as_list((job.get("trainer") or {}).get("callbacks"))
    if any(_class_path(c).endswith("HostMemoryManager") for c in callbacks):
        return []
    if not trains_on_cpu(job) or not can_keep_freed_memory():
        return []
    return [
        Option(
            "host_memory",
            "host memory: HostMemoryManager (keep 256 MiB of freed memory)",
            _add_host_memory,
            {"trainer.callbacks": "+HostMemoryManager"},
        )
    ]


def _double_batch(job: dict[str, Any], batch: int) -> dict[str, Any]:
    """Twice the per-device ``batch``, with the learning rate scaled along by ``LinearScalingLR``.

    A job that already has a ``LinearScalingLR`` keeps it with its ``base_batch_size`` (the batch its learning rate
    was tuned for): it scales by the new global batch over that base, i.e. twice what it scaled by before. Replacing
    its base with the current global batch would scale the already scaled rate once more. A job without one gets one
    whose base is the current global batch (its configured rate was right for that batch).
    """
    job["data"].setdefault("init_args", {})["batch_size"] = 2 * batch
    t = job.setdefault("trainer", {})
    cbs = as_list(t.get("callbacks"))
    mine = [c for c in cbs if isinstance(c, dict) and _class_path(c).endswith("LinearScalingLR")]
    if mine:
        for c in mine:
            args = c.get("init_args") or {}
            if isinstance(args.get("batch_size"), int):  # a per-device batch given to it, not read from the loader
                args["batch_size"] = 2 * args["batch_size"]
                c["init_args"] = args
    else:
        cbs = [c for c in cbs if not _class_path(c).endswith("LinearScalingLR")]  # a bare class path: no base known
        base = batch * world_of(job) * int(t.get("accumulate_grad_batches", 1) or 1)
        cbs.append({"class_path": "lightning_accel.callbacks.LinearScalingLR", "init_args": {"base_batch_size": base}})
    t["callbacks"] = cbs
    return job


def _batch_options(job: dict[str, Any]) -> list[Option]:
    data = job.get("data")
    if not isinstance(data, dict):
        return []
    ok, default = _accepts(_class_path(data), "batch_size")
    batch = (data.get("init_args") or {}).get("batch_size", default)
    if not ok or not isinstance(batch, int):
        return []
    return [
        Option(
            "batch",
            f"batch: {2 * batch} per device + LinearScalingLR",
            lambda j: _double_batch(j, batch),
            {"data.init_args.batch_size": 2 * batch},
            samples_ratio=2,
            cost=2.0,
        )
    ]


_BUILDERS: dict[str, Callable[[dict[str, Any]], list[Option]]] = {
    "data": _data_options,
    "precision": _precision_options,
    "host_memory": _host_memory_options,
    "strategy": _strategy_options,
    "checkpoint": _checkpoint_options,
    "batch": _batch_options,
}


def options_for(lever: str, job: dict[str, Any]) -> list[Option]:
    """The options of ``lever`` for ``job`` as it is now (the current setting left out)."""
    if lever not in _BUILDERS:
        raise ValueError(f"`lever` must be one of {sorted(_BUILDERS)}, got {lever!r}.")
    return _BUILDERS[lever](job)
