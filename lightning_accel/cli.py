"""The ``lightning-accel`` command: LightningCLI with subcommands ``fit | validate | test | predict``.

Models and data modules are chosen by ``class_path`` in YAML (``--config FILE``) or on the command line, so any
LightningModule / LightningDataModule works, not only ours. When the config sets no logger, runs log with
``CSVLogger`` (``metrics.csv`` under ``trainer.default_root_dir``) and TensorBoard when it is installed.

User mistakes (a missing config, an unknown class path, a misspelled key or strategy name, a bad argument, an
unwritable data directory, a missing optional package, an origin that cannot be reached or has no credentials) end
with one ``lightning-accel: error: <key>: <message>`` line and exit code 2: for a value a class refuses, ``<key>`` is
the config key (``trainer.plugins``, ``data``, ...) and ``<message>`` the line that class raised, picked out of
jsonargparse's Union dump; a misspelled key, strategy name or subcommand gets the closest accepted one. Set
``LIGHTNING_ACCEL_DEBUG=1`` to see the full text and traceback instead.

Besides LightningCLI's subcommands, ``lightning-accel ckpt verify|export|gc`` (delta checkpoints),
``lightning-accel data pack`` (shards) and ``lightning-accel tune`` (measure the levers on a job, write the tuned
config; :mod:`lightning_accel.tune`) are plain argparse tools; ``--help`` lists them.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import importlib
import inspect
import os
import pickle
import re
import sys
import typing
import warnings
from collections.abc import Iterator
from typing import Any, Union

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

import lightning_accel  # noqa: F401 - registers the strategy aliases on import
from lightning_accel._utils import compat
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.fs import StorageUnavailableError
from lightning_accel._utils.imports import import_object
from lightning_accel.checkpoint.callbacks import CheckpointGuard, ElasticExit
from lightning_accel.checkpoint.lock import CheckpointDirectoryLockedError
from lightning_accel.data.origin import OriginError
from lightning_accel.parallel.strategies import resolve_trainer_kwargs

__all__ = [
    "AccelArgumentParser",
    "AccelCLI",
    "ConfigError",
    "SaveConfigBesideLogs",
    "VersionRichProgressBar",
    "check_trainer_values",
    "config_error",
    "main",
]

# Errors our code raises for bad input carry the argument, the value and the fix; show them without a traceback.
_USER_ERRORS = (ValueError, TypeError, PermissionError, FileNotFoundError, ModuleNotFoundError, NotADirectoryError)


class ConfigError(ValueError):
    """A value of the config that a class (or the parser) refused: ``key`` is where it is, ``message`` why.

    ``str()`` is the one line the CLI prints; ``detail`` keeps the full text jsonargparse produced.
    """

    def __init__(self, key: str, message: str, detail: str = "") -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message
        self.detail = detail


def _config_key_of(config: Any, class_path: str) -> str:
    """The shortest config key whose value (or list item) is an instance config of ``class_path``."""
    found: list[str] = []

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, dict):
            if obj.get("class_path") == class_path:
                found.append(key)
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, list):
            for v in obj:
                if isinstance(v, dict) and v.get("class_path") == class_path:
                    found.append(key)
                walk(v, key)

    walk(config, "")
    found = [k.replace(".init_args", "") for k in found]
    return min(found, key=len) if found else ""


def config_error(exc: BaseException, config: Any = None) -> ConfigError:
    """One :class:`ConfigError` from a jsonargparse parsing error or a refused instantiation.

    A key no argument takes (``--data.batchsize``, ``batch_sise:`` in YAML, ``--trainer.max_epocs``) becomes
    ``data.batchsize: not an option of <class>; did you mean 'batch_size'?`` (see :func:`_unknown_option_error`).

    Args:
        exc: the error (``ArgumentError`` from parsing; ``ValueError``/``TypeError`` from instantiating classes).
        config: the parsed config as a dict, to find the key of the class that raised when the text does not say.
    """
    text = str(exc)
    if (err := _required_error(text)) is not None:
        return err
    unknown = compat.jsonargparse_unknown_option(text)
    if unknown is not None:
        key, class_path, option = unknown
        key = compat.jsonargparse_nested_option_key(text, key)[0]
        if (err := _unknown_option_error(key, class_path, option, detail=text)) is not None:
            return err
    outer = compat.jsonargparse_error_key(text)
    if (err := _misspelled_class_key_error(outer, text)) is not None:
        return err
    inner, message = compat.jsonargparse_useful_line(text)
    if not outer and config is not None:
        cp = compat.jsonargparse_error_class_path(text)
        outer = _config_key_of(config, cp) if cp else ""
    key = ".".join(k for k in (outer, inner) if k)
    if (err := _name_with_options_error(key, text)) is not None:
        return err
    if (err := _class_name_error(key, text)) is not None:
        return err
    return ConfigError(key, _missing_attribute_message(message), text)


def _name_with_options_error(key: str, text: str) -> ConfigError | None:
    """``trainer.strategy: 'ddp_1bit' is a name, which takes no options; ...`` for an option given under a value that
    is a registered name (``--trainer.strategy=ddp_1bit --trainer.strategy.warmup_steps=3``), else None.

    jsonargparse only nests options under a class, so it says ``Expected a dot import path string: ddp_1bit, got
    '3'``; the fix is the class's path, which for a strategy name the registry tells.
    """
    found = compat.jsonargparse_name_given_option(text)
    if found is None:
        return None
    name, option = found
    path = _strategy_class_path(name) if key == "trainer.strategy" else None
    cls = f"`--{key}={path}`" if path else f"the class by its import path (`--{key}=package.module.Class`)"
    options = _class_options(strategy) if path and (strategy := _import_class(path)) is not None else []
    if path and options and option.split(".")[0] not in options:
        # the class takes no such option either: pointing at `--key.<option>` would only lead to a second error
        close = _closest(option, options)
        fix = f"did you mean {close!r}?" if close else f"`--{key}.help {path}` lists its options."
        return ConfigError(
            f"{key}.{option}",
            f"{name!r} is a name, which takes no options, and its class {path.rsplit('.', 1)[-1]} has no option "
            f"{option!r}; {fix} (an option is given with the class: `--{key}={path}` `--{key}.<option>=...`).",
            text,
        )
    params = _strategy_init_params(name) if path else {}
    also = "".join(f" `--{key}.{k}={v}`" for k, v in params.items() if k != option)
    also = f" and{also} (what the name sets)" if also else ""
    return ConfigError(
        f"{key}.{option}",
        f"{name!r} is a name, which takes no options; to set {option!r}, give {cls}, then `--{key}.{option}=...`"
        f"{also} (in YAML: `class_path:` and `init_args:` under `{key.split('.')[-1]}:`).",
        text,
    )


# where a class named without its module is looked for: the package's public names, then the demo
_NAME_HOMES = ("lightning_accel", "lightning_accel.data", "lightning_accel.models", "lightning_accel.datasets")


def _class_name_error(key: str, text: str) -> ConfigError | None:
    """``model: 'ImageClassifier' is a class name without its module; give its import path, e.g.
    `--model=lightning_accel.models.ImageClassifier`.`` for a bare class name jsonargparse could not resolve, else None.

    jsonargparse resolves a bare name only among the subclasses imported so far: the demo's classes are not imported
    until a config names them, and its line (``Expected a dot import path string``) does not say what to write.
    """
    found = compat.jsonargparse_bare_class_name(text)
    if found is None:
        return None
    option, name = found
    key = option.removeprefix("--") if option else key
    flag = key.removesuffix(".help")
    cls = None
    for home in _NAME_HOMES:
        try:
            obj = vars(importlib.import_module(home)).get(name)  # vars: not the deprecated lazy aliases
        except ImportError:
            continue
        if isinstance(obj, type):
            cls = obj
            break
    fix = (
        f"give its import path, e.g. `--{key}={_public_path(cls)}`"
        if cls is not None
        else f"give its import path (`--{key}=package.module.{name}`)"
    )
    if flag != key:
        fix = fix.replace(f"`--{key}=", f"`--{key} ")  # `--model.help CLASS`
    return ConfigError(key, f"{name!r} is a class name without its module; {fix}.", text)


def _public_path(cls: type) -> str:
    """The shortest import path of ``cls`` through the modules that define it as an attribute (never a lazy alias)."""
    parts = cls.__module__.split(".")
    for n in range(1, len(parts) + 1):
        module = ".".join(parts[:n])
        try:
            if vars(importlib.import_module(module)).get(cls.__name__) is cls:
                return f"{module}.{cls.__name__}"
        except ImportError:
            continue
    return f"{cls.__module__}.{cls.__qualname__}"


def _strategy_init_params(name: str) -> dict[str, Any]:
    """The arguments the ``StrategyRegistry`` passes with ``name`` (``ddp_spawn``: ``start_method='spawn'``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return dict(StrategyRegistry[name].get("init_params") or {}) if name in StrategyRegistry else {}


def _strategy_class_path(name: str) -> str | None:
    """The shortest import path of the class the ``StrategyRegistry`` holds for ``name``, or None."""
    from lightning.pytorch.strategies import StrategyRegistry

    if name not in StrategyRegistry:
        return None
    return _public_path(StrategyRegistry[name]["strategy"])


def _missing_attribute_message(message: str) -> str:
    """``message`` for a ``class_path`` whose module lacks the class, rewritten to name the path and the closest public
    name of that module (``lightning_accel.PerStepLRR`` -> ``'lightning_accel.PerStepLR'``), without the config dump
    jsonargparse appends; any other message as it is."""
    found = compat.missing_module_attribute(message)
    if found is None:
        return message
    module, name = found
    try:
        names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
    except Exception:  # noqa: BLE001 - only the suggestion depends on it
        names = []
    close = difflib.get_close_matches(name, names, n=1)
    if not close:  # a case slip (GPUAugment) is below difflib's cutoff: compare without case
        close = [n for n in names if n.lower() == name.lower()][:1]
    fix = f"did you mean '{module}.{close[0]}'?" if close else f"check the class name and the module {module!r}."
    return f"class_path '{module}.{name}' does not exist: module {module!r} has no attribute {name!r}; {fix}"


def _required_error(text: str) -> ConfigError | None:
    """``model, data: required; ...`` for the classes a subcommand needs and nobody gave (argparse's line names them
    ``fit.data, fit.model``, with the subcommand as a prefix no config or option uses), else None."""
    required = compat.argparse_required_keys(text)
    if required is None:
        return None
    keys = [k.split(".", 1)[-1] for k in required]
    keys = sorted(keys, key=lambda k: (k != "model", k))  # the model first, as the options list it
    example = " ".join(f"`--{k}=package.module.Class`" for k in keys)
    return ConfigError(
        ", ".join(keys),
        f"required; give a config that sets {' and '.join(f'`{k}:`' for k in keys)} (e.g. `--config "
        f"examples/configs/quickstart.yaml`) or the {'class' if len(keys) == 1 else 'classes'} on the command line: "
        f"{example}.",
        text,
    )


# The config groups that are one fixed class rather than a `class_path:` (AccelCLI always builds Lightning's Trainer).
_GROUP_CLASSES: dict[str, type] = {"trainer": Trainer}

# The keys of a `class_path:` config itself (jsonargparse's subclass spec), told apart from the class's options.
_CLASS_CONFIG_KEYS = ("class_path", "init_args", "dict_kwargs")


def _top_level_key_error(text: str, subparsers: dict[str, Any], args: Any) -> ConfigError | None:
    """``trainner: not an option of `lightning-accel fit`; did you mean 'trainer'?`` for a top-level key no
    subcommand option starts with (a misspelled ``trainer:`` in YAML, ``--trainner.max_steps``, ``--ckpt_paht``);
    None for any other error (a misspelled option *inside* a known group is told by :func:`config_error`).

    Args:
        text: jsonargparse's error text (``Subcommand 'fit' does not accept option 'trainner.max_steps'`` for YAML,
            ``Option 'trainner.max_steps' is not accepted`` for YAML under ``--print_config``,
            ``unrecognized arguments: --trainner.max_steps 1`` for the command line).
        subparsers: the parser of each subcommand, by name (``{"": parser}`` without subcommands).
        args: the command line, to tell which subcommand an ``unrecognized arguments`` error is about.
    """
    found = compat.jsonargparse_top_level_option(text)
    if found is None:
        return None
    named, option = found
    words = [a for a in args if isinstance(a, str)] if isinstance(args, (list, tuple)) else []
    sub = named if named is not None else next((a for a in words if a in subparsers), "")
    chosen = [subparsers[sub]] if sub in subparsers else list(subparsers.values())
    keys = sorted(set().union(*(compat.parser_option_keys(p) for p in chosen)))
    head, _, rest = option.partition(".")
    if named is not None and head in _GROUP_CLASSES and rest and rest not in _class_options(_GROUP_CLASSES[head]):
        # `fit:` in a config given before the subcommand: jsonargparse refuses a misspelt Trainer option there with
        # the subcommand's line (`Subcommand 'fit' does not accept option 'trainer.max_epocs'`), never its class's
        return _unknown_option_error(head, "", rest, detail=text)
    if not keys or head in keys:
        return None
    if sub and (head in LightningCLI.subcommands() or head == "subcommand"):
        # a config written for the whole command (`fit:` sections) given after the subcommand
        return ConfigError(
            head,
            f"a config given after the subcommand holds {sub}'s settings at its top level (`trainer:`, `model:`, "
            f"`data:`); drop the `{head}:` level, or give this config before any subcommand "
            "(`lightning-accel --config job.yaml`, where its sections choose the subcommand).",
            text,
        )
    where = f"`lightning-accel {sub}`" if sub else "`lightning-accel`"
    close = _closest(head, keys)
    fix = f"did you mean {close!r}?" if close else f"{where[:-1]} --help` lists its options."
    return ConfigError(head, f"not an option of {where}; {fix}", text)


def _misspelled_class_key_error(key: str, text: str) -> ConfigError | None:
    """``<key>.clas_path: not a key of a class config; did you mean 'class_path'?`` when jsonargparse refused a
    ``class_path:`` config (``Not a valid subclass``, its dict dumped as ``Given value``) that has a key close to
    ``class_path`` / ``init_args`` / ``dict_kwargs``; None otherwise. jsonargparse's own line says ``expected None``
    or ``expected str``, which hides the typo.
    """
    # the innermost class refused: its key, its line
    key, at = compat.jsonargparse_nested_option_key(text, key, at="not a subclass")
    if at < 0:
        return None
    for name in compat.jsonargparse_given_dict_keys([ln.strip() for ln in text.splitlines()[at:]]):  # what it was given
        close = difflib.get_close_matches(name, _CLASS_CONFIG_KEYS, n=1, cutoff=0.8)
        if name not in _CLASS_CONFIG_KEYS and close:
            return ConfigError(f"{key}.{name}" if key else name, _class_key_message(close[0]), text)
    return None


def _class_key_message(close: str) -> str:
    """The message for a misspelled key of a ``class_path:`` config whose closest key is ``close``."""
    return (
        f"not a key of a class config; did you mean {close!r}? (a class is given as `class_path:` with its import "
        "path and `init_args:` with its arguments)"
    )


def _unknown_option_error(key: str, class_path: str, option: str, detail: str = "") -> ConfigError | None:
    """``<key>.<option>: not an option of <class>; did you mean '<closest>'?`` for an option the class does not take.

    Args:
        key: the config key of the class (``data``, ``trainer``, ``trainer.plugins``).
        class_path: the class given by ``class_path``; ``""`` for a group of a fixed class (``trainer``).
        option: the option that was refused.
        detail: jsonargparse's full text, kept in :attr:`ConfigError.detail`.

    Returns:
        None when the class cannot be named (an unknown top-level option, a class that does not import): the caller
        keeps jsonargparse's line.
    """
    cls = _import_class(class_path) if class_path else _GROUP_CLASSES.get(key)
    if cls is None:
        return None
    options = _class_options(cls)
    head = option.split(".")[0]  # `init_arg.width`: a misspelled `init_args:` holding the options
    if class_path and head not in options:
        structural = difflib.get_close_matches(head, _CLASS_CONFIG_KEYS, n=1, cutoff=0.8)
        if structural and head not in _CLASS_CONFIG_KEYS:
            return ConfigError(f"{key}.{head}" if key else head, _class_key_message(structural[0]), detail)
    close = _closest(option, options)
    if close:
        fix = f"did you mean {close!r}?"
    elif class_path:
        fix = f"`--{key}.help {class_path}` lists its options."
    else:
        fix = "`--help` lists its options."
    return ConfigError(f"{key}.{option}" if key else option, f"not an option of {cls.__name__}; {fix}", detail)


def _closest(name: str, choices: list[str]) -> str | None:
    """The accepted name ``name`` most likely meant: the only one it begins (a shortened option, ``max_ep``, which
    spelling alone would match to ``max_steps``), else the closest spelling; None when nothing is close."""
    starting = [c for c in choices if c.startswith(name)]
    if len(starting) == 1:
        return starting[0]
    close = difflib.get_close_matches(name, choices, n=1)
    return close[0] if close else None


def _class_options(cls: type) -> list[str]:
    """The options a config of ``cls`` accepts, in signature order, as jsonargparse reads them (it follows
    ``**kwargs`` into the parent class's signature, which ``inspect.signature`` alone does not)."""
    from jsonargparse import ArgumentParser

    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        keys = parser.get_defaults().keys()  # a jsonargparse Namespace: not iterable like a dict
        return list(dict.fromkeys(k.split(".")[0] for k in keys))
    except Exception:  # noqa: BLE001 - only an error message's suggestion depends on it: fall back to the signature
        params = inspect.signature(cls).parameters.values()
        return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _import_class(class_path: str) -> type | None:
    """The class ``class_path`` names, or None when it does not import or is not a class."""
    obj = import_object(class_path)
    return obj if isinstance(obj, type) else None


# the strategies this suite registers are told from Lightning's by the module of their class
_OWN_PACKAGE = __name__.split(".")[0]


def _strategy_name_error(name: str) -> ConfigError:
    """``trainer.strategy: '<name>' is not a strategy name; did you mean ...? Names: ...`` for a string Lightning's
    ``StrategyRegistry`` does not hold.

    The close matches come from every registered name; the names listed are only the base ones, this suite's first
    (``ddp_1bit``, not ``ddp_1bit_find_unused_parameters_true``; ``ddp``, not ``ddp_spawn``), so the line stays short.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    names = sorted({"auto", *StrategyRegistry.available_strategies()})  # sorted: registration order varies
    close = difflib.get_close_matches(name.lower(), names, n=1)
    # `StrategyRegistry.get` builds the strategy: read the registered class by item instead
    ours = [
        n
        for n in names
        if n in StrategyRegistry and StrategyRegistry[n]["strategy"].__module__.startswith(_OWN_PACKAGE)
    ]
    theirs = [n for n in names if n not in ours]

    def base(group: list[str]) -> list[str]:  # a variant is a registered name plus a suffix
        return [n for n in group if not any(n.startswith(f"{b}_") for b in group)]

    variants = sorted((n for n in theirs if n not in base(theirs)), key=lambda n: (len(n), n))  # shortest first
    guess = f"; did you mean {close[0]!r}?" if close else "."
    example = f", and variants such as {variants[0]!r}" if variants else ""
    return ConfigError(
        "trainer.strategy",
        f"{name!r} is not a strategy name{guess} Names: {', '.join(base(ours))} (lightning-accel); "
        f"{', '.join(base(theirs))} (Lightning){example}; or a Strategy `class_path:`.",
    )


def _precision_conflict_error(precision: Any, plugins: Any) -> ConfigError | None:
    """``trainer.precision: ... trainer.plugins ...`` when both set the precision (Lightning refuses that with the
    plugin object's repr), else None. The fix names the plugin's own ``precision`` argument when it has one."""
    from lightning.pytorch.plugins import Precision

    items = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    plugin = next((p for p in items if isinstance(p, Precision)), None)
    if precision is None or plugin is None:
        return None
    cls = type(plugin).__name__
    param = inspect.signature(type(plugin)).parameters.get("precision")
    if param is None:
        fix = f"drop `trainer.precision`, or {cls} from `trainer.plugins`."
    else:
        try:
            choices = typing.get_args(typing.get_type_hints(type(plugin).__init__).get("precision"))
        except Exception:  # noqa: BLE001 - a hint that does not resolve only costs the list of choices
            choices = ()
        takes = f" ({cls} takes {' or '.join(map(repr, choices))})" if choices else ""
        fix = (
            f"drop `trainer.precision` and give the precision to the plugin, `init_args: {{precision: {precision}}}` "
            f"under its `class_path:` in `trainer.plugins`{takes}."
        )
    return ConfigError(
        "trainer.precision",
        f"{str(precision)!r} is set and `trainer.plugins` holds {cls}, which sets the precision itself: {fix}",
    )


class SaveConfigBesideLogs(SaveConfigCallback):
    """Save the run's ``config.yaml`` beside its logs, never into the working directory.

    Lightning's callback writes to ``trainer.log_dir``, which without a logger is ``default_root_dir`` -- the working
    directory unless set -- so every ``logger: false`` run left a ``config.yaml`` there. Without a logger there is no
    run directory to keep the config beside, so it is not saved (the YAML the run was started with is the record).
    A log directory that already holds a config (a logger with a fixed ``version``) keeps it; this run's is saved as
    ``config_1.yaml`` (``_2``, ...) beside it.
    Every rank reads the same ``trainer.logger``, so all ranks take the same path through the parent's collectives.
    """

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is None:
            self.save_to_log_dir = False
        elif self.save_to_log_dir and not self.already_saved and not self.overwrite:
            self.config_filename = self._free_filename(trainer)
        super().setup(trainer, pl_module, stage)

    def _free_filename(self, trainer: Trainer) -> str:
        """``config.yaml``, or ``config_1.yaml``, ``config_2.yaml``, ... when the log directory already holds the
        config of an earlier run: a logger with a fixed ``version`` (resuming with ``--ckpt_path``, or ``validate``
        after ``fit``) writes into the same directory, where Lightning's callback refused to start with a traceback
        whose fixes (``LightningCLI(save_config_kwargs=...)``) the command cannot take. The earlier file is kept.
        Rank 0 picks the name; every rank takes it (a collective: all ranks reach it, see the class docstring)."""
        from lightning.fabric.utilities.cloud_io import get_filesystem

        log_dir = trainer.log_dir  # broadcast from rank 0
        name = self.config_filename
        if trainer.is_global_zero and log_dir is not None:
            fs = get_filesystem(log_dir)
            stem, ext = os.path.splitext(name)
            n = 0
            while fs.isfile(os.path.join(log_dir, name)):
                n += 1
                name = f"{stem}_{n}{ext}"
            if n:
                print(
                    f"lightning-accel: {log_dir} holds {self.config_filename} of an earlier run (kept); this run's "
                    f"config is saved as {name}",
                    file=sys.stderr,
                )
        return str(trainer.strategy.broadcast(name))


def int_first_hint(hint: Any) -> Any:
    """``hint`` with ``int`` tried before ``float`` when it is a Union holding both, else None.

    jsonargparse tries a Union's members in order, so under ``Union[float, int]`` the value ``1`` becomes ``1.0``.
    CPython's typing cache treats ``Union[float, int]`` and ``Union[int, float]`` as one key, so which order a
    signature gets is decided by whichever module spelled it first (Lightning 2.6 spells ``Union[float, int]`` in
    ``fabric.strategies.Strategy`` before ``Trainer.__init__`` spells ``Optional[Union[int, float]]``): the order
    cannot be trusted from the signature. The Union is rebuilt from a tuple, a cache key that keeps its order.
    """
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else ()
    if int not in args or float not in args:
        return None
    ordered = (int, float, *(a for a in args if a not in (int, float)))
    return Union[ordered]  # noqa: UP007 - built from a tuple on purpose (see above)


# The subcommands `main` hands to their own argparse tools before LightningCLI parses, with what each does.
_TOOLS = {
    "ckpt": "checks, exports or cleans DeltaCheckpointIO checkpoints (`ckpt {verify,export,gc}`)",
    "data": "packs an origin into shards for CachedDataModule (`data pack`), removes unused RAM tiers (`data clean`)",
    "tune": "measures each lever on a job and writes the tuned config (`tune --config job.yaml`)",
}


def _subcommand_names() -> list[str]:
    """Every subcommand of ``lightning-accel``: LightningCLI's (``fit``, ``validate``, ``test``, ``predict``), then
    the tools :func:`main` runs itself (:data:`_TOOLS`)."""
    return [*LightningCLI.subcommands(), *_TOOLS]


class AccelArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` that keeps an integer an integer for every Trainer argument typed int-or-float.

    ``limit_train_batches: 1`` means one batch and ``1.0`` the whole epoch (Lightning's documented meaning), for the
    ``limit_*_batches``, ``val_check_interval`` and ``overfit_batches`` family, whatever order the signature's Union
    resolved to (see :func:`int_first_hint`). A config it writes (``--print_config``, the run's ``config.yaml``)
    names every class by its current import path, never a deprecated alias (see :func:`_current_class_paths`).
    """

    @override
    def dump(self, namespace: Any, *args: Any, **kwargs: Any) -> str:
        # `--print_config` dumps straight from the parse, before AccelCLI.parse_arguments can rewrite the config
        namespace = namespace.clone()
        _current_class_paths(namespace)
        with _quiet_alias_lookups():
            return str(super().dump(namespace, *args, **kwargs))

    @override
    def add_subcommands(self, required: bool = True, dest: str = "subcommand", **kwargs: Any) -> Any:
        """The subcommands, with ``ckpt``, ``data`` and ``tune`` listed beside LightningCLI's in the usage line and
        the help: :func:`main` runs those three before this parser sees the command line, so argparse never knew them.
        """
        names = _subcommand_names()
        kwargs.setdefault("metavar", "{" + ",".join(names) + "}")
        kwargs.setdefault(
            "description",
            "For more details of each subcommand, add it as an argument followed by --help. Besides "
            f"{', '.join(LightningCLI.subcommands())}: "
            + "; ".join(f"{name} {what}" for name, what in _TOOLS.items())
            + " (each takes --help).",
        )
        return super().add_subcommands(required, dest, **kwargs)

    @override
    def add_lightning_class_args(
        self, lightning_class: Any, nested_key: str, subclass_mode: bool = False, required: bool = True
    ) -> list[str]:
        if subclass_mode or not (isinstance(lightning_class, type) and issubclass(lightning_class, Trainer)):
            return super().add_lightning_class_args(lightning_class, nested_key, subclass_mode, required)
        hints = typing.get_type_hints(lightning_class.__init__)
        fixed = {name: h for name, hint in hints.items() if (h := int_first_hint(hint)) is not None}
        added = self.add_class_arguments(
            lightning_class, nested_key, fail_untyped=False, instantiate=False, sub_configs=True, skip=set(fixed)
        )
        docs = _param_docs(lightning_class.__init__)
        params = inspect.signature(lightning_class.__init__).parameters
        group = self.groups.get(nested_key, self) if self.groups else self
        for name, hint in fixed.items():
            group.add_argument(f"--{nested_key}.{name}", type=hint, default=params[name].default, help=docs.get(name))
            added.append(f"{nested_key}.{name}")
        return added


def _param_docs(fn: Any) -> dict[str, str]:
    """Argument name -> its description in ``fn``'s Google-style docstring (what jsonargparse shows in ``--help``)."""
    import docstring_parser

    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    return {p.arg_name: " ".join((p.description or "").split()) for p in doc.params}


class AccelCLI(LightningCLI):
    """LightningCLI with lightning-accel's defaults.

    Subclass mode for model and data; CSV logging when the config sets no logger; ``DeltaCheckpointIO`` manifests
    accepted as ``ckpt_path``; a ``trainer.strategy`` of class ``AutoStrategy`` resolved for the model before the
    Trainer is built (:func:`~lightning_accel.parallel.strategies.resolve_trainer_kwargs`).
    """

    def __init__(self, args: ArgsType = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveConfigBesideLogs,
            parser_class=AccelArgumentParser,
            # allow_abbrev=False: argparse would take `--trainer.max_ep` for `--trainer.max_epochs` and a typo for
            # whichever option it prefixes; an option is spelt in full or refused with the closest name
            parser_kwargs={"prog": "lightning-accel", "exit_on_error": False, "allow_abbrev": False},
            args=args,
            run=run,
        )

    # LightningCLI (>= 2.6) reads the hyper-parameters of a local `ckpt_path` with its own `torch.load` right after
    # `parse_arguments`: it fails on a DeltaCheckpointIO manifest, and a text file or a truncated archive ends there
    # in a long traceback. So `parse_arguments` reads every local checkpoint through the project's reader (both
    # kinds, never unpickling code, every damage one named error), takes the hyper-parameters from it and hides the
    # path from that step; `before_instantiate_classes` puts it back.
    _hidden_ckpt_path: str | None = None

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse as LightningCLI does; every ``class_path`` that names a deprecated alias of this package is replaced by
        the class's current import path (see :func:`_current_class_paths`)."""
        with _quiet_alias_lookups():
            self._parse_arguments(parser, args)
        _current_class_paths(self.config)

    def _parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        from jsonargparse import ArgumentError

        try:
            super().parse_arguments(parser, args)
        except ArgumentError as e:
            subparsers = compat.cli_subcommand_parsers(self, parser)  # none when run=False
            err = _top_level_key_error(str(e), subparsers, sys.argv[1:] if args is None else args)
            if err is None:
                raise
            raise err from e
        sub = self.config.get("subcommand")
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if not isinstance(ckpt_path, str):
            return
        if _is_ckpt_keyword(ckpt_path):
            # a keyword is a keyword even when a file of that name sits in the cwd (`./last` names such a file):
            # hidden from LightningCLI too, which would `torch.load` that file; resolved when the Trainer exists
            if os.path.exists(ckpt_path):
                self._hidden_ckpt_path = ckpt_path
                self.config[sub]["ckpt_path"] = None
            return
        if os.path.isdir(ckpt_path):
            _check_ckpt_folder(ckpt_path)
            return  # a sharded checkpoint (a folder of shards): read by the strategy that wrote it
        if not os.path.isfile(ckpt_path):
            # a local path: refused before the model, the data and the Trainer are built (an empty one means no
            # checkpoint to Lightning, as `--ckpt_path=$CKPT` with CKPT unset gives: left to it)
            if ckpt_path and "://" not in ckpt_path:
                _check_ckpt_exists(ckpt_path)
            return  # a URL: resolved and read later, by the checkpoint plugin's reader
        model = compat.cli_model_config(read_ckpt_arg(ckpt_path).get("hyper_parameters", {}))
        if model is not None:
            self.config = parser.parse_object({sub: {"model": model}}, self.config)
        self._hidden_ckpt_path = ckpt_path
        self.config[sub]["ckpt_path"] = None

    @override
    def before_instantiate_classes(self) -> None:
        """Refuse a malformed Trainer value (:func:`check_trainer_values`) before the model, the data and the Trainer
        are built, and put back a ``ckpt_path`` hidden from LightningCLI's own read."""
        sub = self.config.get("subcommand")
        trainer = (self.config[sub] if sub else self.config).get("trainer")
        if trainer is not None:
            check_trainer_values(trainer.as_dict() if hasattr(trainer, "as_dict") else dict(trainer))
        if self._hidden_ckpt_path is not None:
            self.config[sub]["ckpt_path"] = self._hidden_ckpt_path

    @override
    def instantiate_classes(self) -> None:
        """Instantiate as LightningCLI does; a class refusing its arguments becomes one :class:`ConfigError` naming
        the config key (jsonargparse reports it inside a dump of every Union subtype it tried)."""
        try:
            with _quiet_alias_lookups():
                super().instantiate_classes()
        except (ValueError, TypeError) as e:
            if isinstance(e, ConfigError) or not compat.is_jsonargparse_union_error(e):
                raise
            sub = self.config.get(self.subcommand) if self.subcommand else self.config
            raise config_error(e, sub.as_dict() if hasattr(sub, "as_dict") else None) from e

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with CSV (+ TensorBoard) loggers when the config sets none, and an ``AutoStrategy`` resolved
        for the instantiated model before the Trainer is built (see :meth:`AutoStrategy.resolve`)."""
        sub = self.config_init.get(self.subcommand, self.config_init) if self.subcommand else self.config_init
        config = {**sub.get("trainer", {}), **kwargs}
        if config.get("logger") in (None, True):
            kwargs["logger"] = default_loggers(config.get("default_root_dir"))
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        bar = _default_progress_bar(config, callbacks)
        # a second run on a DeltaCheckpointIO directory is refused before its first step, not at its first save;
        # under torchrun a worker stopped for a restart exits at once (ElasticExit), not after the agent's 30 s
        elastic = [ElasticExit()] if not any(isinstance(c, ElasticExit) for c in callbacks) else []
        kwargs["callbacks"] = [*callbacks, *([bar] if bar is not None else []), CheckpointGuard(), *elastic]
        kwargs.update(resolve_trainer_kwargs({**config, "callbacks": kwargs["callbacks"]}, self.model))
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except ValueError as e:
            # Lightning's accelerator connector refuses these two with generic text (its own names only, an object
            # repr); told apart by the values, which keep their meaning whatever Lightning's wording becomes
            err = _trainer_flag_error({**config, **kwargs})
            if err is None:
                raise
            raise err from e
        # `--ckpt_path last`: resolved here (Lightning finds nothing on an object store: it drops the `s3://`) and
        # named, so a run never resumes another file than the user meant without saying which.
        if self.subcommand and sub.get("ckpt_path") == "last":
            from lightning_accel.checkpoint.callbacks import resolve_ckpt_path

            sub["ckpt_path"] = resolve_ckpt_path(trainer, "last")
            if sub["ckpt_path"] not in (None, "last") and trainer.is_global_zero:
                doing = _CKPT_USE.get(self.subcommand, "using")  # only `fit` resumes a run
                print(f"lightning-accel: {doing} {sub['ckpt_path']}", file=sys.stderr)
        if self.subcommand and isinstance(ckpt := sub.get("ckpt_path"), str):
            _check_manifest_reader(ckpt, trainer)
        return trainer


@contextlib.contextmanager
def _quiet_alias_lookups() -> Iterator[None]:
    """Silence the ``DeprecationWarning`` of this package's moved names (``lightning_accel.ImageClassifier``) when
    jsonargparse looks them up: to name a class by its shortest import path it tries ``getattr`` on every parent
    module, so ``class_path: lightning_accel.models.ImageClassifier`` warned about an alias the config never named."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`lightning_accel\.\w+` is deprecated",
            category=DeprecationWarning,
            module="jsonargparse",
        )
        yield


def _current_class_paths(config: Any) -> None:
    """Replace, in place, every ``class_path`` of ``config`` that names a deprecated alias of a moved class (a module's
    lazy ``__getattr__`` name, e.g. ``lightning_accel.ImageClassifier``) by the class's current import path
    (``lightning_accel.models.ImageClassifier``).

    jsonargparse resolves a bare class name (``--model=ImageClassifier``) to the shortest path that reaches the class,
    which is the alias: the run's saved ``config.yaml`` would name it, warn when reloaded and stop loading once the
    alias is removed. Paths that name a class where it is defined, or that do not import, are left as they are.
    """
    from jsonargparse import Namespace

    if isinstance(config, Namespace):
        path = config.get("class_path")
        if isinstance(path, str):
            config["class_path"] = _current_class_path(path)
        for value in vars(config).values():
            _current_class_paths(value)
    elif isinstance(config, (list, tuple)):
        for value in config:
            _current_class_paths(value)


def _current_class_path(class_path: str) -> str:
    """``class_path``, or the current import path of its class when ``class_path`` names a deprecated alias."""
    module_name, _, name = class_path.rpartition(".")
    module = sys.modules.get(module_name)  # the parse imported every class it resolved
    if module is None or name in vars(module):  # vars: a module's own names, never a lazy alias
        return class_path
    with warnings.catch_warnings():  # the alias warns; its target is what is read here
        warnings.simplefilter("ignore", DeprecationWarning)
        obj = getattr(module, name, None)
    return _public_path(obj) if isinstance(obj, type) else class_path


# what the run does with the checkpoint `--ckpt_path last` resolved to, in the line that names it
_CKPT_USE = {"fit": "resuming from", "validate": "validating", "test": "testing", "predict": "predicting with"}


def _check_manifest_reader(ckpt_path: str, trainer: Trainer) -> None:
    """Refuse, before any step, a local ``ckpt_path`` that is a DeltaCheckpointIO manifest when the Trainer's
    checkpoint IO is no DeltaCheckpointIO: Lightning's ``TorchCheckpointIO`` would ``torch.load`` the JSON manifest
    and end in a long ``WeightsUnpickler error: Unsupported operand 123`` traceback (a plain ``torch.save`` file needs
    nothing: DeltaCheckpointIO reads both kinds).

    Raises:
        ConfigError: naming the file and the two fixes (the plugin, or an exported plain file).
    """
    from lightning_accel.checkpoint import DeltaCheckpointIO
    from lightning_accel.checkpoint.manifest import is_manifest_bytes

    if not os.path.isfile(ckpt_path):
        return
    with open(ckpt_path, "rb") as f:
        if not is_manifest_bytes(f.read(128)):
            return
    io: Any = trainer.strategy.checkpoint_io
    while io is not None:  # a wrapper (AsyncCheckpointIO) holds the IO it wraps as `checkpoint_io`
        if isinstance(io, DeltaCheckpointIO):
            return
        io = getattr(io, "checkpoint_io", None)
    raise ConfigError(
        "ckpt_path",
        f"{ckpt_path!r} is a DeltaCheckpointIO manifest and `trainer.plugins` holds no DeltaCheckpointIO to read "
        "it: add `--trainer.plugins+=lightning_accel.DeltaCheckpointIO` (or its `class_path:` in the YAML), or pass "
        "a plain file made by `lightning-accel ckpt export`.",
    )


def _trainer_flag_error(config: dict[str, Any]) -> ConfigError | None:
    """The one-line error for a Trainer flag Lightning refused with a ``ValueError``, when the flags show which."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = config.get("strategy")
    if isinstance(strategy, str) and strategy.lower() != "auto" and strategy.lower() not in StrategyRegistry:
        return _strategy_name_error(strategy)
    return _precision_conflict_error(config.get("precision"), config.get("plugins"))


# the forms `devices` takes, shown in every refusal of it
_DEVICES_FORMS = (
    "a positive int (how many devices, or processes on CPU: `--trainer.devices=2`), a list of device indices "
    "(`--trainer.devices=[0,1]`), -1 for every device, or 'auto'"
)


def _parse_devices(value: Any) -> int | list[int] | None:
    """``value`` of ``trainer.devices`` as Lightning reads it (``"2"`` -> 2, ``"0,1"`` -> ``[0, 1]``, ``"-1"`` -> -1),
    or None when it is no form of a device count or list (``"abc"``, ``"1.5"``, ``-3``, ``0``, ``[]``, ``[0, 0]``)."""
    parsed: Any = value
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+", text):
            parsed = int(text)
        elif re.fullmatch(r"\d+(\s*,\s*\d+)*\s*,?", text):  # Lightning's `"0,1"` and `"1,"` (device index 1)
            parsed = [int(x) for x in text.split(",") if x.strip()]
        else:
            return None
    if isinstance(parsed, bool):
        return None
    if isinstance(parsed, int):
        return parsed if parsed > 0 or parsed == -1 else None
    if isinstance(parsed, (list, tuple)):
        ok = (
            parsed
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in parsed)
            and len(set(parsed)) == len(parsed)
        )
        return list(parsed) if ok else None
    return None


def _runs_on_cpu(accelerator: Any) -> bool:
    """True when ``trainer.accelerator`` is the CPU: ``cpu``, a ``CPUAccelerator`` class config, or ``auto`` on a
    machine where Lightning finds no other accelerator (its ``auto`` order: TPU, MPS, CUDA, then CPU)."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator, XLAAccelerator

    if isinstance(accelerator, CPUAccelerator):
        return True
    if isinstance(accelerator, dict) and isinstance(accelerator.get("class_path"), str):
        cls = _import_class(accelerator["class_path"])
        return cls is not None and issubclass(cls, CPUAccelerator)
    if not isinstance(accelerator, str):
        return False
    if accelerator.lower() == "cpu":
        return True
    return accelerator.lower() == "auto" and not any(
        a.is_available() for a in (XLAAccelerator, MPSAccelerator, CUDAAccelerator)
    )


def check_trainer_values(trainer: dict[str, Any]) -> None:
    """Refuse a ``trainer`` config value that Lightning would refuse late or not at all, naming the key, the value,
    what is expected and the fix.

    Lightning refused ``devices: abc`` (and ``1.5``, ``-3``, ``[0,x]``) only once the model and the data were built,
    with ``TypeError: `devices` selected with `CPUAccelerator` should be an int > 0.``, which names neither the key
    nor the value; ``num_nodes: 0`` without the key; and it took ``accumulate_grad_batches: 0``,
    ``val_check_interval: 0`` (an int: a count of batches) and ``check_val_every_n_epoch: 0`` (or below) and ended the
    first step (the first epoch) in a ``ZeroDivisionError`` traceback.

    Args:
        trainer: the ``trainer`` section of the parsed config, as a dict.

    Raises:
        ConfigError: for the first refused value, keyed ``trainer.<name>``.
    """
    devices = trainer.get("devices", "auto")
    if devices is not None and devices != "auto":
        parsed = _parse_devices(devices)
        if parsed is None:
            raise ConfigError(
                "trainer.devices",
                f"{devices!r} is not a number of devices or a list of them: expected {_DEVICES_FORMS}.",
            )
        if (parsed == -1 or isinstance(parsed, list)) and _runs_on_cpu(trainer.get("accelerator", "auto")):
            raise ConfigError(
                "trainer.devices",
                f"{devices!r} {'selects every device' if parsed == -1 else 'selects device indices'}, which the CPU "
                "accelerator does not take: on CPU `devices` is the number of processes, a positive int "
                "(`--trainer.devices=2`), or 'auto'.",
            )
    for name, fix in (("num_nodes", 1), ("accumulate_grad_batches", 1)):
        value = trainer.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"trainer.{name}",
                f"{value!r} is not a positive int: expected 1 or more (e.g. `--trainer.{name}={fix}`, the default).",
            )
    # both divide a counter at every batch: 0 ran into a ZeroDivisionError traceback at the first step (or the first
    # epoch's end), once the model and the data were built; None is Lightning's "validate by batch count"
    every = trainer.get("check_val_every_n_epoch", 1)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(
            "trainer.check_val_every_n_epoch",
            f"{every!r} is not a positive int: expected 1 or more (validate every N epochs, e.g. "
            "`--trainer.check_val_every_n_epoch=1`, the default), or null to validate every `val_check_interval` "
            "batches; to skip validation, set `--trainer.limit_val_batches=0`.",
        )
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval == 0:
        # an int counts batches (a float is a fraction of the epoch: 0.0 validates every batch, as Lightning reads it)
        raise ConfigError(
            "trainer.val_check_interval",
            "0 is no number of batches: expected an int of 1 or more (batches between validations), a float in "
            "(0.0, 1.0] (a fraction of the epoch, e.g. `--trainer.val_check_interval=0.25`) or a duration "
            "('DD:HH:MM:SS'); to skip validation, set `--trainer.limit_val_batches=0`.",
        )


class VersionRichProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` showing the logger version as ``v_num: 0``, not ``v_num: 0.000``."""

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if "v_num" in items and not isinstance(items["v_num"], str):
            items["v_num"] = str(items["v_num"])
        return items


def _default_progress_bar(config: dict[str, Any], callbacks: list[Any]) -> Any:
    """The progress bar the Trainer would add by itself, minus its ``v_num: 0.000`` (None: leave the Trainer's choice).

    Lightning's ``RichProgressBar`` (its default when ``rich`` is installed) formats every non-string item with
    ``.3f``, the integer logger version included. Added only when the config enables the bar and names none.
    """
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_accel._utils.imports import module_available

    if config.get("enable_progress_bar") is False or any(isinstance(c, ProgressBar) for c in callbacks):
        return None
    if not module_available("rich"):
        return None  # the TQDM bar prints integers as integers
    return VersionRichProgressBar()


def _is_ckpt_keyword(ckpt_path: str) -> bool:
    """True for the ``ckpt_path`` values Lightning resolves itself: ``last``, ``best``, ``hpc``, ``registry`` and
    ``registry:<name>`` (any case, as Lightning matches it)."""
    low = ckpt_path.lower()
    return ckpt_path in ("last", "best", "hpc") or low == "registry" or low.startswith("registry:")


def _check_ckpt_exists(path: str) -> None:
    """Refuse a local ``--ckpt_path`` that does not exist, naming the path and the ways out. Lightning found it missing
    only once the model, the data (rendered or listed) and the Trainer were built, with a line that said neither the
    working directory a relative path is read from nor the ``last`` keyword.

    Raises:
        ConfigError: naming the path, the working directory and the fixes.
    """
    if os.path.lexists(os.path.expanduser(path)):  # Lightning's fsspec reader expands `~` (`--ckpt_path=~/x.ckpt`)
        return  # something is there (a broken link, a special file): the reader names what is wrong with it
    raise ConfigError(
        "ckpt_path",
        f"{path!r} does not exist (cwd: {os.getcwd()}); pass a checkpoint file, `--ckpt_path last` for the last "
        "checkpoint the run's ModelCheckpoint saved, or start without `--ckpt_path`.",
    )


def _check_ckpt_folder(path: str) -> None:
    """Refuse a ``--ckpt_path`` folder that holds ``.ckpt`` files (a ``checkpoints/`` or ``lightning_logs/`` folder):
    it is not a checkpoint but a place of them, and Lightning's reader opened it as a file and ended in an
    ``IsADirectoryError`` traceback once the model was built. A folder without ``.ckpt`` files may be a sharded
    checkpoint (distributed checkpoint shards, DeepSpeed), which its strategy reads: it is let through.

    Raises:
        ConfigError: naming the folder, its newest checkpoint as the example and the ``last`` keyword.
    """
    found = glob.glob(os.path.join(glob.escape(path), "**", "*.ckpt"), recursive=True)
    files = [f for f in found if os.path.isfile(f)]
    if not files:
        return
    newest = max(files, key=os.path.getmtime)
    which = (
        f"{len(files)} checkpoints: pass one of them, e.g. the newest," if len(files) > 1 else "1 checkpoint: pass it,"
    )
    raise ConfigError(
        "ckpt_path",
        f"{path!r} is a folder, not a checkpoint file; it holds {which} `--ckpt_path={newest}`, or `--ckpt_path last` "
        "for the last checkpoint the run's ModelCheckpoint saved.",
    )


def read_ckpt_arg(path: str) -> dict[str, Any]:
    """The checkpoint at ``--ckpt_path``, read by the project's reader; any damage is one :class:`ConfigError`.

    A file that is no checkpoint, a truncated or corrupt one (delta or ``torch.save``), or one holding objects only
    unpickling could restore all end in one ``ckpt_path: ...`` line: the reader's message (the file, what was
    expected, the fix) and the way out.
    """
    from lightning_accel.checkpoint.reader import read_checkpoint
    from lightning_accel.checkpoint.store import CheckpointCorruptError

    try:
        return read_checkpoint(path)
    except (ValueError, CheckpointCorruptError, pickle.UnpicklingError) as e:
        damaged = isinstance(e, CheckpointCorruptError)
        hint = "`lightning-accel ckpt verify` names every damaged part; " if damaged else ""
        raise ConfigError("ckpt_path", f"{one_line(e)} ({hint}or start without `--ckpt_path`).") from e


def default_loggers(root: str | None) -> list[Any]:
    """``CSVLogger`` under ``root`` (cwd when None), plus ``TensorBoardLogger`` if tensorboard is installed."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_accel._utils.imports import module_available

    save_dir = os.fspath(root) if root else os.getcwd()
    loggers: list[Any] = [CSVLogger(save_dir=save_dir, name="lightning_logs")]
    if module_available("tensorboard") or module_available("tensorboardX"):
        loggers.append(TensorBoardLogger(save_dir=save_dir, name="lightning_logs", default_hp_metric=False))
    return loggers


def _check_config_paths(argv: list[str]) -> None:
    """Fail early, in plain words naming the file, on ``--config`` files that do not exist, are not valid YAML, are
    empty or hold something else than a mapping of settings (jsonargparse's messages say ``<unicode string>`` and
    ``Unexpected config:``, never which file), and on inline config strings that are no YAML mapping
    (:func:`_check_inline_config`).

    Raises:
        FileNotFoundError: a path that does not exist.
        ConfigError: a folder (its YAML files suggested), or a file whose content cannot be a config.
    """
    for i, a in enumerate(argv):
        path = None
        if a in ("-c", "--config") and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        if path is None:
            continue
        if path.lstrip().startswith(("{", "[")):
            _check_inline_config(path)  # an inline config string: jsonargparse reads it, once it is known to be YAML
            continue
        if os.path.isdir(path):
            raise ConfigError("", _config_folder_message(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"`--config` {path!r} does not exist (cwd: {os.getcwd()}). "
                "Pass the path of a YAML file, e.g. `--config examples/configs/quickstart.yaml`."
            )
        _check_config_file(path)


def _check_inline_config(text: str) -> None:
    """Refuse an inline ``--config`` string that is not a YAML mapping, or whose flow mapping lacks the space after a
    colon (``{trainer:{max_epochs:1}}`` reads as one key ``'max_epochs:1'``): jsonargparse said only ``config: in
    "<unicode string>", line 1, column 2``.

    Raises:
        ConfigError: naming the string, what is wrong and the spelling that works.
    """
    import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

    example = "e.g. `--config '{trainer: {max_epochs: 1}}'`"
    try:
        content = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or one_line(e)
        raise ConfigError(
            "", f"`--config` {text!r} is not valid YAML ({problem}); an inline config is a YAML mapping, {example}."
        ) from e
    except _DuplicateKeyError as e:
        raise ConfigError("", f"`--config` {text!r} sets {e.key!r} twice; keep one, {example}.") from e
    if not isinstance(content, dict):
        raise ConfigError("", f"`--config` {text!r} must be a mapping of settings, {example}.")

    def glued(obj: Any) -> str | None:  # a `key:value` without the space YAML needs after the colon
        if isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(k, str) and ":" in k and v is None:
                    return k
                if (found := glued(v)) is not None:
                    return found
        return None

    if (key := glued(content)) is not None:
        name, _, value = key.partition(":")
        raise ConfigError(
            "",
            f"`--config` {text!r} holds the key {key!r}: YAML needs a space after the colon, `{name}: {value}` "
            f"({example}).",
        )


def _config_example(label: str, path: str) -> str:
    """How the caller passes ``path``: ``--config PATH`` on the command line, ``label='PATH'`` from Python."""
    return f"`{label} {path}`" if label.startswith("-") else f"`{label}={path!r}`"


def _config_folder_message(path: str, label: str = "--config") -> str:
    """Why a ``--config`` folder is refused, with the YAML files in it to pick from; ``label``: the name the caller
    gave the path by (the flag, or a Python function's keyword argument)."""
    names = sorted(
        n for n in os.listdir(path) if n.endswith((".yaml", ".yml")) and os.path.isfile(os.path.join(path, n))
    )
    if not names:
        return (
            f"`{label}` {path!r} is a folder, not a YAML file, and holds no .yaml file. Pass the path of a YAML file, "
            f"e.g. {_config_example(label, 'examples/configs/quickstart.yaml')}."
        )
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    return (
        f"`{label}` {path!r} is a folder, not a YAML file. Pass one of its YAML files ({shown}), e.g. "
        f"{_config_example(label, os.path.join(path, names[0]))}."
    )


def _check_config_file(path: str, label: str = "--config", overrides: bool = True) -> dict[str, Any]:
    """Refuse a ``--config`` file that is not valid YAML, sets a key twice in one mapping, is empty or is not a
    mapping, naming the file as the caller gave it (``label``: the flag, or a Python function's keyword argument);
    else its content. ``overrides``: the command also takes each setting as a flag (``--trainer.max_epochs``), which
    a refusal may suggest."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            content = yaml.load(f, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKeyError as e:
        raise ConfigError(
            "",
            f"`{label}` {path!r} sets {e.key!r} twice in one mapping (lines {e.first} and {e.second}): YAML keeps "
            f"only the second, so everything set by the first was dropped. Keep one {e.key!r} and merge the two.",
        ) from e
    except UnicodeDecodeError as e:
        raise ConfigError("", f"`{label}` {path!r} is not a text file ({e.reason}). Pass a YAML file.") from e
    except yaml.YAMLError as e:
        # PyYAML's parts: what it was reading and where that began (an open bracket), what went wrong and where
        parts = []
        for part in ("context", "problem"):
            text, mark = getattr(e, part, None), getattr(e, f"{part}_mark", None)
            if text:
                parts.append(f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else text)
        raise ConfigError(
            "",
            f"`{label}` {path!r} is not valid YAML: {', '.join(parts) or one_line(e)}. "
            "Fix the syntax (brackets, quotes, indentation).",
        ) from e
    if content is None:
        raise ConfigError(
            "", f"`{label}` {path!r} is empty. Put settings in it (e.g. `trainer:` then `  max_epochs: 5`) or drop it."
        )
    if not isinstance(content, dict):
        raise ConfigError(
            "",
            f"`{label}` {path!r} must hold a mapping of settings (`key: value` lines), got a "
            f"{type(content).__name__}. E.g. `trainer:` then `  max_epochs: 5`.",
        )
    _refuse_variables(path, content, label=label, overrides=overrides)
    return content


class _DuplicateKeyError(ValueError):
    """A key set twice in one YAML mapping, with the 1-based lines of both."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"{key!r} set twice (lines {first} and {second})")
        self.key = key
        self.first = first
        self.second = second


def _unique_key_loader() -> type:
    """PyYAML's ``SafeLoader``, refusing a mapping that holds a key twice (:class:`_DuplicateKeyError`).

    PyYAML (and so jsonargparse) keeps the last value of a repeated key without a word: a second ``trainer:`` block
    dropped every setting of the first (``max_epochs: 1`` became the default of 1000 epochs).
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base`: keys set beside a merge override it, as YAML means
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:
                    continue  # an unhashable key: SafeLoader refuses it itself
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKeyError(key, first, key_node.start_mark.line + 1)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


# What a user writes expecting it expanded: `${NAME}` anywhere (shell, docker-compose, OmegaConf), or a value that
# starts with `$NAME` as a whole path part (`$HOME/runs`, `$CKPT`). A `$` elsewhere (a password, `price$usd`) is a
# literal character that a refusal would leave no way to write.
_VARIABLE = re.compile(r"\$\{[^}]*\}|^\$[A-Za-z_][A-Za-z0-9_]*(?=/|$)")


def _refuse_variables(path: str, content: Any, key: str = "", label: str = "--config", overrides: bool = True) -> None:
    """Refuse a ``--config`` value holding ``${NAME}``, or starting with ``$NAME`` as a whole path part (``$HOME/x``):
    configs are read as plain YAML, nothing in them
    is expanded, so ``default_root_dir: ${RUNS}/x`` would make a folder literally named ``${RUNS}`` in the working
    directory. The shell expands the same value given on the command line, which the message suggests.

    Raises:
        ConfigError: naming the key, the value, the file and the two fixes.
    """
    if isinstance(content, dict):
        for k, v in content.items():
            _refuse_variables(path, v, f"{key}.{k}" if key else str(k), label, overrides)
    elif isinstance(content, list):
        for i, v in enumerate(content):
            _refuse_variables(path, v, f"{key}[{i}]", label, overrides)
    elif isinstance(content, str) and (found := _VARIABLE.search(content)) is not None:
        # a list item has no command-line flag of its own: the example is given for plain keys only
        example = f': `--{key}="{content}"`' if "[" not in key else ""
        # a command without per-setting flags (`tune`) and a Python caller (``label`` a keyword argument) have no
        # command line to give the value on: a flag they would refuse is no fix
        if overrides:
            fix = f"write the value itself, or give it on the command line, where the shell expands it{example}"
        elif label.startswith("-"):
            fix = "write the value itself"
        else:
            fix = "write the value itself, or set it in the loaded job from `os.environ`"
        raise ConfigError(
            key,
            f"{content!r} in `{label}` {path!r} holds {found.group()!r}, which is not expanded (config values are "
            f"taken as written, not read from the environment); {fix}.",
        )


def _subcommand_error(argv: list[str]) -> ConfigError | None:
    """The one line for a command line whose subcommand is misspelt or missing, decided from ``argv``; None when the
    subcommand is fine (the parse failed on something else) or cannot be told.

    argparse says ``invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'predict')``, which neither guesses
    the subcommand meant nor names ``ckpt``, ``data`` and ``tune`` (run by :func:`main` before the parser).
    """
    names = _subcommand_names()
    configs: list[str | None] = []
    word = None
    i = 0
    while i < len(argv):  # the options the top-level parser takes before a subcommand
        a = argv[i]
        if a in ("-c", "--config"):
            configs.append(argv[i + 1] if i + 1 < len(argv) else None)
            i += 2
        elif a.startswith("--config="):
            configs.append(a.split("=", 1)[1])
            i += 1
        elif a == "--print_config" or a.startswith("--print_config="):
            i += 1
        elif a.startswith("-"):
            return None  # an option the scan does not know (it may take a value): the parser's own line stays
        else:
            word = a
            break
    listing = f"{', '.join(names[:-1])} or {names[-1]}"
    if word is not None:
        if word in _TOOLS:  # `lightning-accel -c job.yaml tune`: main runs a tool only when it comes first
            return ConfigError(
                "", f"{word!r} must come first, before any option: `lightning-accel {word} ...` (its options after it)."
            )
        if word in names:
            return _config_before_subcommand_error(word, configs)
        close = difflib.get_close_matches(word, names, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else "."
        return ConfigError("", f"{word!r} is not a subcommand{guess} The subcommands are {listing}.")
    for path in configs:  # a config may choose the subcommand itself (`subcommand: fit`, or a top-level `fit:`)
        if path is None or not os.path.isfile(path):
            return None  # an inline config string: not read here
        content = _check_config_file(path)
        if "subcommand" in content or any(n in content for n in LightningCLI.subcommands()):
            return None
    example = next((p for p in configs if p), "job.yaml")  # the user's own config, placed after the subcommand
    return ConfigError(
        "",
        f"a subcommand is required: {listing}, e.g. `lightning-accel fit --config {example}` "
        "(`lightning-accel --help` says what each does).",
    )


def _config_before_subcommand_error(word: str, configs: list[str | None]) -> ConfigError | None:
    """The fix for a subcommand's config given before the subcommand (``lightning-accel --config job.yaml fit``), else
    None. There it is read as the config of the whole command, whose keys are the subcommands (``fit:``, ...), so
    jsonargparse refused its first key (``Option 'model.init_args.num_classes' is not accepted before subcommand
    'fit'``) without saying that the order is the mistake."""
    for path in configs:
        if path is None or not os.path.isfile(path):
            continue  # an inline config string: not read here
        content = _check_config_file(path)
        if "subcommand" in content or any(n in content for n in LightningCLI.subcommands()):
            continue  # a config of the whole command, as it should be there
        return ConfigError(
            "",
            f"`--config` {path!r} comes before the subcommand {word!r}, where a config holds one section per "
            f"subcommand (`{word}:`), and it holds {word}'s own settings; give it after the subcommand: "
            f"`lightning-accel {word} --config {path}`.",
        )
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-accel`` console script."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["ckpt"]:  # `lightning-accel ckpt verify|export|gc ...`: the delta checkpoint tool
        from lightning_accel.checkpoint.cli import main as ckpt_main

        raise SystemExit(ckpt_main(raw[1:], prog="lightning-accel ckpt"))
    if raw[:1] == ["data"]:  # `lightning-accel data pack ...`: pack an origin into shards
        from lightning_accel.data.cli import main as data_main

        raise SystemExit(data_main(raw[1:], prog="lightning-accel data"))
    if raw[:1] == ["tune"]:  # `lightning-accel tune --config job.yaml`: measure the levers, write tuned.yaml
        from lightning_accel.tune.cli import main as tune_main

        raise SystemExit(tune_main(raw[1:], prog="lightning-accel tune"))
    from jsonargparse import ArgumentError

    debug = os.environ.get("LIGHTNING_ACCEL_DEBUG", "") not in ("", "0")
    try:
        _check_config_paths(raw)
        # None: LightningCLI reads sys.argv itself (passing both makes it warn)
        AccelCLI(args=None if argv is None else raw)
    except ArgumentError as e:
        if debug:
            raise
        err = _subcommand_error(raw)
        if err is None:
            err = config_error(e)
        # a message of config_error without a key: jsonargparse's own line; ours have no detail to fall back on
        msg = str(err) if err.key or not err.detail else one_line(e)
        print(f"lightning-accel: error: {msg}", file=sys.stderr)
        print("(run with --help for the options; LIGHTNING_ACCEL_DEBUG=1 for the full text)", file=sys.stderr)
        raise SystemExit(2) from None
    except ConfigError as e:
        if debug:
            print(e.detail, file=sys.stderr)
            raise
        print(f"lightning-accel: error: {e}", file=sys.stderr)
        print("(set LIGHTNING_ACCEL_DEBUG=1 for the full text and traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    except CheckpointDirectoryLockedError as e:  # a second run writing the same checkpoint directory
        if debug:
            raise
        print(f"lightning-accel: error: checkpoint: {one_line(e)}", file=sys.stderr)
        print("(set LIGHTNING_ACCEL_DEBUG=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    except (OriginError, StorageUnavailableError) as e:  # a store: unreachable, no credentials, refused
        if debug:
            raise
        # an OriginError is the data's origin; a bare StorageUnavailableError may be any store (a `--ckpt_path` URL,
        # a checkpoint directory), named by the URL in its message: "data" would send the user to the wrong key
        where = "data" if isinstance(e, OriginError) else "storage"
        print(f"lightning-accel: error: {where}: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        print("(set LIGHTNING_ACCEL_DEBUG=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    except _USER_ERRORS as e:
        if debug:
            raise
        print(f"lightning-accel: error: {_user_line(e)}", file=sys.stderr)
        print("(set LIGHTNING_ACCEL_DEBUG=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    except MisconfigurationException as e:  # Lightning's word for a Trainer/config mistake
        if debug:
            raise
        line = one_line(e)
        if compat.is_resume_past_max_epochs(e):
            line += (
                " Resume with `--trainer.max_epochs` above the checkpoint's epoch (the value the run was extended to),"
                " or start a new run without `--ckpt_path`."
            )
        print(f"lightning-accel: error: {line}", file=sys.stderr)
        print("(set LIGHTNING_ACCEL_DEBUG=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def _user_line(e: BaseException) -> str:
    """``Type: message`` of a user error; for one re-raised from a DataLoader worker, the worker's own line."""
    return compat.dataloader_worker_error_line(e) or f"{type(e).__name__}: {one_line(e)}"


if __name__ == "__main__":  # pragma: no cover
    main()
