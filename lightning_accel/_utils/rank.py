"""Rank helpers that work before, during and without ``torch.distributed`` initialisation.

Order: an initialised default process group wins; otherwise the launchers' environment variables
(torchrun: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``; SLURM: ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``).
"""

from __future__ import annotations

import os

__all__ = ["distributed_ready", "global_rank", "is_global_zero", "local_rank", "node_rank", "world_size"]


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
    """True on global rank 0."""
    return global_rank() == 0
