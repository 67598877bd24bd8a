"""Helpers shared by every room: argument checks, one-line errors, the patching handle, atomic writes, rank helpers,
optional-dependency flags, path safety.

Nothing here imports ``lightning`` (``compat.py`` only for type checking); rooms import these helpers, never each other.
"""

from lightning_accel._utils.atomic import atomic_publish_file, atomic_write_bytes, atomic_write_text, fsync_dir
from lightning_accel._utils.checks import (
    check_bool,
    check_bytes,
    check_choice,
    check_int,
    check_number,
    renamed_argument,
)
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.imports import module_available, require
from lightning_accel._utils.patching import Patch, patch, restore_all, swap_class
from lightning_accel._utils.paths import safe_join
from lightning_accel._utils.rank import global_rank, is_global_zero, local_rank, node_rank, world_size

__all__ = [
    "Patch",
    "atomic_publish_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_bool",
    "check_bytes",
    "check_choice",
    "check_int",
    "check_number",
    "fsync_dir",
    "global_rank",
    "is_global_zero",
    "local_rank",
    "module_available",
    "node_rank",
    "one_line",
    "patch",
    "renamed_argument",
    "require",
    "restore_all",
    "safe_join",
    "swap_class",
    "world_size",
]
