"""The one checkpoint reader: a delta checkpoint manifest or a plain ``torch.save`` file, never unpickling code.

Everything in the package that opens a checkpoint comes here (``DeltaCheckpointIO.load_checkpoint``, the
``ckpt verify|export`` command, distillation's ``load_teacher``), so all of them accept both kinds:

1. A file that starts like a manifest (``{"format":"lightning-accel/delta-checkpoint"``) is rebuilt by
   :meth:`DeltaStore.load <lightning_accel.checkpoint.store.DeltaStore.load>` (blobs checksum-verified; the
   non-tensor state read with ``torch.load(weights_only=True)``).
2. A ZIP archive (``torch.save``'s format since torch 1.6) or a legacy pickle-based ``torch.save`` file is read with
   ``torch.load(weights_only=True)``: tensors and plain containers only, arbitrary classes are refused.
3. Anything else fails with one line naming the file.

Local paths and any fsspec URL work (``storage_options`` as everywhere in the package).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import warnings
from typing import Any, Literal, overload

import torch

from lightning_accel._utils.atomic import is_local_url, strip_file_scheme
from lightning_accel._utils.errors import one_line
from lightning_accel._utils.fs import FileStore
from lightning_accel._utils.paths import safe_join
from lightning_accel.checkpoint.manifest import (
    CheckpointCorruptError,
    NotADeltaCheckpointError,
    damaged_manifest_head,
    is_manifest_bytes,
    truncated_manifest_head,
)
from lightning_accel.checkpoint.store import TORCH_ZIP_MAGIC, DeltaStore

__all__ = ["read_checkpoint", "read_checkpoint_with", "resolve_last"]

# Legacy (pre-zip) `torch.save` files begin with a pickle of protocol >= 2 (opcode PROTO = 0x80).
_PICKLE_PROTO = b"\x80"


def read_checkpoint(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load the checkpoint at ``path``: a delta checkpoint manifest or a plain ``torch.save`` file.

    Never unpickles arbitrary objects: a plain file is read with ``torch.load(weights_only=True)``, a delta
    checkpoint's non-tensor state likewise.

    Args:
        path: a local path, ``file://`` URL or fsspec URL (``s3://bucket/run/last.ckpt``).
        map_location: where tensors go, as for ``torch.load`` (``"cpu"``, a device, a ``{"cuda:1": "cuda:0"}``
            mapping, a callable).
        storage_options: fsspec options for remote URLs (endpoint, credentials).

    Returns:
        The checkpoint dict.

    Raises:
        FileNotFoundError: nothing at ``path``.
        NotADeltaCheckpointError: ``path`` is a directory, or a file that is neither kind (a ``ValueError``).
        CheckpointCorruptError: a damaged delta checkpoint (missing or corrupt blob) or ``torch.save`` file.
        pickle.UnpicklingError: a plain file holding objects that ``weights_only=True`` refuses.
    """
    return read_checkpoint_with(DeltaStore(storage_options=storage_options), path, map_location=map_location)


def read_checkpoint_with(
    store: DeltaStore, path: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> dict[str, Any]:
    """:func:`read_checkpoint` through an existing ``store`` (its ``storage_options``, threads and filesystems)."""
    p = os.fspath(path)
    if not isinstance(p, str) or not p:  # a path check, worded as `_utils.checks` words theirs
        raise ValueError(f"`path` must be a non-empty path or URL of a checkpoint, got {path!r}.")
    try:
        return store.load(p, map_location=map_location)
    except NotADeltaCheckpointError:
        if store.fs.isdir(p):
            raise
        head = store.fs.head(p, len(TORCH_ZIP_MAGIC))
    except IsADirectoryError as e:  # a remote "directory" seen through a file operation
        raise NotADeltaCheckpointError(f"Checkpoint path {p!r} is a directory, not a checkpoint file.") from e
    if not (head.startswith(TORCH_ZIP_MAGIC) or head.startswith(_PICKLE_PROTO)):
        raise NotADeltaCheckpointError(
            f"Checkpoint {p!r} is neither a delta checkpoint manifest nor a `torch.save` file (it starts with "
            f"{head!r}). Pass a file written by `DeltaCheckpointIO`, `Trainer.save_checkpoint` or `torch.save`."
        ) from None
    return _torch_load(store, p, map_location)


# Lightning's names for "last" checkpoints: last.ckpt, last-v1.ckpt, ... (ModelCheckpoint.CHECKPOINT_NAME_LAST).
_LAST_RE = re.compile(r"^last(-v?\d+)?\.ckpt$")


@overload
def resolve_last(
    dirpath: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = ...,
    with_time: Literal[False] = ...,
) -> str | None: ...


@overload
def resolve_last(
    dirpath: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = ..., with_time: Literal[True]
) -> tuple[str, float] | None: ...


def resolve_last(
    dirpath: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, with_time: bool = False
) -> str | tuple[str, float] | None:
    """The newest ``last*.ckpt`` in ``dirpath`` (local or any fsspec URL), as a full path or URL; None when none.

    ``Trainer.fit(ckpt_path="last")`` does not find checkpoints on object stores (Lightning drops the ``s3://`` of the
    paths it lists); pass the result of this function as ``ckpt_path`` instead. Newest is the manifest's ``created``
    time for delta checkpoints, the file's modification time otherwise. A ``last*.ckpt`` that is a manifest cut short
    or damaged is skipped with a warning naming it (the resume goes on from the newest complete one).

    Args:
        dirpath: the ``ModelCheckpoint`` directory, e.g. ``"s3://bucket/run/ckpt"``.
        storage_options: fsspec options (endpoint, credentials).
        with_time: return ``(url, time)`` instead of the URL.
    """
    fs = FileStore(storage_options)
    root = os.fspath(dirpath).rstrip("/") or "/"
    best: tuple[float, str] | None = None
    damaged: list[str] = []
    for name in fs.list_files(root):
        if not _LAST_RE.match(name):
            continue
        url = safe_join(root, name)
        try:
            when = _created(fs, url)
        except _DamagedManifestError:
            damaged.append(url)
            continue
        if when is not None and (best is None or when > best[0]):
            best = (when, url)
    if damaged:
        # why: a damaged manifest's time is its file's, so a torn copy (a disk or sync tool, not our writes, which
        # publish whole) was taken for the newest and failed the resume that "last" should have made
        warnings.warn(
            f"`ckpt_path='last'` skipped {', '.join(repr(u) for u in damaged)}: a manifest cut short or damaged, "
            f"{'resuming from ' + repr(best[1]) if best else 'no other last checkpoint found'}. Remove or replace the "
            "damaged file; `lightning-accel ckpt verify PATH` checks a checkpoint whole.",
            UserWarning,
            stacklevel=2,
        )
    if best is None:
        return None
    return (best[1], best[0]) if with_time else best[1]


class _DamagedManifestError(Exception):
    """A ``last*.ckpt`` that is a delta manifest cut short or damaged (:func:`resolve_last` skips it)."""


def _created(fs: FileStore, url: str) -> float | None:
    """A delta manifest's ``created`` time, else the file's modification time; None if it vanished.

    Raises:
        _DamagedManifestError: the file is a manifest cut short or damaged.
    """
    try:
        head = fs.head(url, 64)
        if truncated_manifest_head(head) or (not is_manifest_bytes(head) and damaged_manifest_head(head)):
            raise _DamagedManifestError(url)
        if is_manifest_bytes(head):
            try:
                created = json.loads(fs.read(url)).get("created")
            except ValueError:
                raise _DamagedManifestError(url) from None
            if isinstance(created, (int, float)):
                return float(created)
        if "://" not in url or url.startswith("file://"):
            return os.path.getmtime(url.removeprefix("file://"))
        info = fs.call("check", url, lambda: fs.filesystem(url).info(fs.fs_path(url)))
        stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
        return float(stamp.timestamp()) if hasattr(stamp, "timestamp") else float(stamp or 0.0)
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def _torch_load(store: DeltaStore, path: str, map_location: Any) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a plain file; failures become one line naming the file."""
    # A local file is opened by torch itself (no copy in memory); a remote one is read whole, with retries.
    source: Any = strip_file_scheme(path) if is_local_url(path) else io.BytesIO(store.fs.read(path))
    try:
        ckpt = torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():  # not a refusal: a damaged pickle
            raise CheckpointCorruptError(
                f"Checkpoint {path!r} is a damaged `torch.save` file ({one_line(e, first=True)})."
            ) from e
        raise pickle.UnpicklingError(
            f"Checkpoint {path!r} was refused: it holds objects that only unpickling code could restore "
            f"({_refusal(e)}), and lightning-accel never unpickles untrusted bytes. Re-save it with plain data "
            "(tensors, dicts, lists, numbers, strings)."
        ) from e
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError) as e:  # a truncated or damaged archive
        raise CheckpointCorruptError(
            # torch's first sentence says what broke; the rest is general advice
            f"Checkpoint {path!r} is a damaged `torch.save` file "
            f"({type(e).__name__}: {one_line(e, first=True).split('. ')[0].rstrip('.')})."
        ) from e
    if not isinstance(ckpt, dict):
        raise NotADeltaCheckpointError(
            f"Checkpoint {path!r} holds a {type(ckpt).__name__}, not a checkpoint dict. Save a dict "
            '(`Trainer.save_checkpoint`, or `torch.save({"state_dict": ...})`).'
        )
    return ckpt


def _refusal(error: BaseException) -> str:
    """What torch's many-line weights-only refusal refused, e.g. ``Unsupported global: GLOBAL pkg.Cls was not an
    allowed global by default``."""
    for line in str(error).splitlines():
        _, marker, rest = line.partition("WeightsUnpickler error:")
        if marker:
            return rest.strip().split(". ", 1)[0].rstrip(".")
    return one_line(error, first=True)
