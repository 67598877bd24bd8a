"""The ``lightning-accel`` command: LightningCLI with subcommands ``fit | validate | test | predict``.

Models and data modules are chosen by ``class_path`` in YAML (``--config FILE``) or on the command line, so any
LightningModule / LightningDataModule works, not only ours. When the config sets no logger, runs log with
``CSVLogger`` (``metrics.csv`` under ``trainer.default_root_dir``) and TensorBoard when it is installed.

User mistakes (a missing config, an unknown class path, a bad argument, an unwritable data directory, a missing
optional package) end with one ``lightning-accel: error: ...`` line and exit code 2; set ``LIGHTNING_ACCEL_DEBUG=1``
to see the full traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from typing_extensions import override

import lightning_accel  # noqa: F401 - registers the strategy aliases on import
from lightning_accel._utils import compat
from lightning_accel.parallel.strategy import resolve_trainer_kwargs

__all__ = ["AccelCLI", "SaveConfigBesideLogs", "main"]

# Errors our code raises for bad input carry the argument, the value and the fix; show them without a traceback.
_USER_ERRORS = (ValueError, TypeError, PermissionError, FileNotFoundError, ModuleNotFoundError, NotADirectoryError)


class SaveConfigBesideLogs(SaveConfigCallback):
    """Save the run's ``config.yaml`` beside its logs, never into the working directory.

    Lightning's callback writes to ``trainer.log_dir``, which without a logger is ``default_root_dir`` -- the working
    directory unless set -- so every ``logger: false`` run left a ``config.yaml`` there. Without a logger there is no
    run directory to keep the config beside, so it is not saved (the YAML the run was started with is the record).
    Every rank reads the same ``trainer.logger``, so all ranks take the same path through the parent's collectives.
    """

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is None:
            self.save_to_log_dir = False
        super().setup(trainer, pl_module, stage)


class AccelCLI(LightningCLI):
    """LightningCLI with lightning-accel's defaults.

    Subclass mode for model and data; CSV logging when the config sets no logger; ``DeltaCheckpointIO`` manifests
    accepted as ``ckpt_path``; a ``trainer.strategy`` of class ``AutoStrategy`` resolved for the model before the
    Trainer is built (:func:`~lightning_accel.parallel.strategy.resolve_trainer_kwargs`).
    """

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveConfigBesideLogs,
            parser_kwargs={"prog": "lightning-accel", "exit_on_error": False},
            args=args,
            run=run,
        )

    # A ckpt_path written by DeltaCheckpointIO is a JSON manifest; LightningCLI (>= 2.6) reads the hyper-parameters of
    # `ckpt_path` with `torch.load` right after `parse_arguments`, which fails on it. So `parse_arguments` reads them
    # through the delta store and hides the path from that step; `before_instantiate_classes` puts it back.
    _delta_ckpt_path: str | None = None

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        sub = self.config.get("subcommand")
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if not (ckpt_path and _is_delta_manifest(ckpt_path)):
            return
        from lightning_accel.checkpoint.reader import read_checkpoint

        model = compat.cli_model_config(read_checkpoint(ckpt_path).get("hyper_parameters", {}))
        if model is not None:
            self.config = parser.parse_object({sub: {"model": model}}, self.config)
        self._delta_ckpt_path = ckpt_path
        self.config[sub]["ckpt_path"] = None

    @override
    def before_instantiate_classes(self) -> None:
        if self._delta_ckpt_path is not None:
            self.config[self.config["subcommand"]]["ckpt_path"] = self._delta_ckpt_path

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with CSV (+ TensorBoard) loggers when the config sets none, and an ``AutoStrategy`` resolved
        for the instantiated model before the Trainer is built (see :meth:`AutoStrategy.resolve`)."""
        sub = self.config_init.get(self.subcommand, self.config_init) if self.subcommand else self.config_init
        config = {**sub.get("trainer", {}), **kwargs}
        if config.get("logger") in (None, True):
            kwargs["logger"] = default_loggers(config.get("default_root_dir"))
        kwargs.update(resolve_trainer_kwargs(config, self.model))
        trainer = super().instantiate_trainer(**kwargs)
        # `--ckpt_path last` on an object store: Lightning does not find it (it drops the `s3://`); resolved here.
        if self.subcommand and sub.get("ckpt_path") == "last":
            from lightning_accel.checkpoint.callbacks import resolve_ckpt_path

            sub["ckpt_path"] = resolve_ckpt_path(trainer, "last")
        return trainer


def _is_delta_manifest(path: str) -> bool:
    """True for a local file written by DeltaCheckpointIO (a JSON manifest, not a torch zip)."""
    from lightning_accel.checkpoint.store import is_manifest_bytes

    try:
        with open(path, "rb") as f:
            return is_manifest_bytes(f.read(64))
    except OSError:
        return False


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
    """Fail early, in plain words, on ``--config`` paths that do not exist (jsonargparse's message is cryptic)."""
    for i, a in enumerate(argv):
        path = None
        if a in ("-c", "--config") and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        if path is not None and not path.lstrip().startswith(("{", "[")) and not os.path.isfile(path):
            raise FileNotFoundError(
                f"`--config` {path!r} does not exist (cwd: {os.getcwd()}). "
                "Pass the path of a YAML file, e.g. `--config examples/configs/quickstart.yaml`."
            )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-accel`` console script."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["ckpt"]:  # `lightning-accel ckpt verify|export ...`: the delta checkpoint tool
        from lightning_accel.checkpoint.cli import main as ckpt_main

        raise SystemExit(ckpt_main(raw[1:], prog="lightning-accel ckpt"))
    if raw[:1] == ["data"]:  # `lightning-accel data pack ...`: pack an origin into shards
        from lightning_accel.data.cli import main as data_main

        raise SystemExit(data_main(raw[1:], prog="lightning-accel data"))
    from jsonargparse import ArgumentError

    debug = os.environ.get("LIGHTNING_ACCEL_DEBUG", "") not in ("", "0")
    try:
        _check_config_paths(raw)
        # None: LightningCLI reads sys.argv itself (passing both makes it warn)
        AccelCLI(args=None if argv is None else raw)
    except ArgumentError as e:
        if debug:
            raise
        msg = " ".join(str(e).split())  # jsonargparse's message spans lines; one line reads better in a terminal
        print(f"lightning-accel: error: {msg}", file=sys.stderr)
        print("(run with --help for the options; LIGHTNING_ACCEL_DEBUG=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    except _USER_ERRORS as e:
        if debug:
            raise
        print(f"lightning-accel: error: {type(e).__name__}: {e}", file=sys.stderr)
        print("(set LIGHTNING_ACCEL_DEBUG=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()
