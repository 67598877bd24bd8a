"""Rank helpers that work before, during and without ``torch.distributed`` initialisation.

Order: an initialised default process group wins; otherwise the launchers' environment variables
(torchrun: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``; SLURM: ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "ErrorDescription",
    "describe_error",
    "distributed_ready",
    "global_rank",
    "is_global_zero",
    "local_rank",
    "node_rank",
    "raise_if_any_rank_failed",
    "rebuild_error",
    "world_size",
]

#: ``(module, qualname, args, message)`` of an exception: plain data that any rank can unpickle
ErrorDescription = tuple[str, str, tuple[Any, ...], str]


def distributed_ready() -> bool:
    """True when ``torch.distributed`` is built in and its default process group is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _env_int(*names: str, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return default


def global_rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if distributed_ready():
        import torch.distributed as dist

        return dist.get_rank()
    return _env_int("RANK", "SLURM_PROCID", default=0)


def local_rank() -> int:
    """This process's rank within its node (0 when not distributed)."""
    return _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)


def node_rank() -> int:
    """This node's index from the launcher's environment: ``NODE_RANK`` (Lightning, SLURM through Lightning),
    ``GROUP_RANK`` (torchrun), ``SLURM_NODEID``; 0 when none is set (a negative value is not an index: skipped)."""
    for var in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    if distributed_ready():
        import torch.distributed as dist

        return dist.get_world_size()
    return _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)


def is_global_zero() -> bool:
    """True on global rank 0.

    Before a process group exists and without ``RANK`` / ``SLURM_PROCID``: local rank 0 of node 0 (``LOCAL_RANK``,
    ``NODE_RANK`` and their kin). Lightning's own launcher sets only ``LOCAL_RANK`` and ``NODE_RANK`` in the processes
    it starts for ``python train.py`` with ``devices=2``, so code running there before ``fit`` (a model converted by
    hand) took every process for rank 0 and warned once per process."""
    if distributed_ready() or any(_env_int(n, default=-1) >= 0 for n in ("RANK", "SLURM_PROCID")):
        return global_rank() == 0
    return local_rank() == 0 and node_rank() == 0


def describe_error(e: BaseException) -> ErrorDescription:
    """``e`` as plain data to broadcast, so that the other ranks raise it too (:func:`rebuild_error`); ``args`` are kept
    only when they are plain values. An exception object (or its class) may not unpickle on another rank."""
    plain = all(isinstance(a, (str, int, float, bool, type(None))) for a in e.args)
    return type(e).__module__, type(e).__qualname__, tuple(e.args) if plain else (), str(e)


def rebuild_error(described: ErrorDescription, where: str = "") -> Exception:
    """The error another rank described (:func:`describe_error`): the same type and message where the type can be
    imported and built from its arguments, else a ``RuntimeError`` naming the type after ``where``."""
    module, qualname, args, message = described
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, Exception):
            err = cls(*args)
            if str(err) == message:
                return err
    except Exception:  # noqa: BLE001 - not importable or not built from its args: the fallback below says it all
        pass
    return RuntimeError(f"{where}{qualname}: {message}")


def raise_if_any_rank_failed(
    error: BaseException | None,
    what: Callable[[int, str], str],
    *,
    device: Any = "cpu",
    group: Any = None,
) -> None:
    """Learn from every rank of ``group`` whether a step that may fail on some ranks only succeeded there (``error``:
    this rank's failure, None if it succeeded), and raise on every rank when one failed: nothing where it happened
    (the caller re-raises its own error), elsewhere a ``RuntimeError`` in one line, ``what(failed_rank, more)``
    (the first failing rank's global rank; ``more``: how many other ranks failed, or "") followed by that rank's
    error.

    Without it a rank that raised alone leaves the others in their next collective until the process group's timeout.
    Collective: one one-integer ``all_reduce`` (MAX) over ``group`` (default: the world) on ``device`` (this rank's:
    NCCL reduces CUDA tensors only), every rank failed or not; the failures' texts travel (``all_gather_object``)
    only when there is one. Nothing without an initialised process group of 2 ranks or more.
    """
    if not distributed_ready():
        return
    import torch
    import torch.distributed as dist

    if dist.get_world_size(group) < 2:
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    from lightning_accel._utils.errors import one_line

    mine = None if error is None else f"{type(error).__name__}: {one_line(error)}"
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (dist.get_rank(), mine), group=group)
    failed = [(rank, text) for rank, text in every if text is not None]
    if error is None and failed:
        first, text = failed[0]
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise RuntimeError(f"{what(first, more)}: {text}")
