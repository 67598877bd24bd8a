"""Helpers shared by every room: atomic writes, rank helpers, optional-dependency flags, path safety.

Nothing here imports ``lightning``; rooms import these helpers, never each other.
"""

from lightning_accel._utils.atomic import atomic_write_bytes, atomic_write_text, fsync_dir
from lightning_accel._utils.imports import module_available, require
from lightning_accel._utils.paths import safe_join
from lightning_accel._utils.rank import global_rank, is_global_zero, local_rank, world_size

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "global_rank",
    "is_global_zero",
    "local_rank",
    "module_available",
    "require",
    "safe_join",
    "world_size",
]
