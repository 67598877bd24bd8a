"""The checkpoint command: ``python -m lightning_accel.checkpoint verify|export|gc`` (``lightning-accel ckpt ...``).

- ``verify PATH [PATH ...] [--repair] [--storage-options JSON]``: restore every tensor with all checksums and check
  every second copy (``redundancy=2``); print a JSON summary per checkpoint (``{"ok": false, "error": ...}`` for a
  damaged one, never a traceback); exit 1 if any checkpoint is damaged (the message names the checkpoint and the
  tensor or file). ``--repair`` rewrites a damaged blob from its good copy and a damaged copy from its good blob. A
  plain ``torch.save`` file is verified by reading it safely (``weights_only=True``).
- ``gc DIR [--dry-run] [--grace-s S] [--storage-options JSON]``: remove the delta checkpoints of ``DIR`` that the
  ``ModelCheckpoint`` state of its newest ``last*.ckpt`` does not track (a killed run's leftovers; only ``*.ckpt``
  manifests this plugin wrote, never another file), then the blobs nothing references for ``S`` seconds (a finite
  number >= 0; default: the store's ``gc_grace_s``). Subdirectories of ``DIR`` with a blob store of their own
  (checkpoints saved by a ``filename`` with a ``/``) are treated the same way; one left with nothing but the store's
  own files is removed. ``--dry-run`` lists what would go and removes nothing. Takes the writer lock of each directory
  it collects: refused while a run writes there. Prints one JSON object.
- ``export PATH OUT [--overwrite] [--storage-options JSON]``: write a plain ``torch.save`` checkpoint that
  ``torch.load`` and Lightning's ``TorchCheckpointIO`` open; an existing ``OUT`` is refused unless ``--overwrite``,
  and ``OUT`` = ``PATH`` always, as is an ``OUT`` that names no file (empty, or ending with ``/``).

Both take either kind of checkpoint: ``export`` reads through :func:`~lightning_accel.checkpoint.read_checkpoint`,
``verify`` checks a delta checkpoint with ``DeltaStore.verify`` and reads a plain file through the same reader.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import math
import os
import pickle
import posixpath
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch

from lightning_accel._utils import compat
from lightning_accel._utils.atomic import is_local_url, strip_file_scheme
from lightning_accel._utils.cliargs import json_object_arg
from lightning_accel._utils.errors import one_line
from lightning_accel.checkpoint.manifest import CheckpointCorruptError, NotADeltaCheckpointError
from lightning_accel.checkpoint.reader import read_checkpoint_with, resolve_last
from lightning_accel.checkpoint.store import (
    BLOB_DIR,
    GC_GRACE_S,
    DeltaStore,
    check_export_target,
    relative_to,
    split_path,
    store_dir,
)

__all__ = ["collect", "main"]

# What a damaged, foreign or missing checkpoint raises: reported in one line, exit code 1.
_CHECKPOINT_ERRORS = (CheckpointCorruptError, NotADeltaCheckpointError, OSError, pickle.UnpicklingError)
_ERRNO_PREFIX = re.compile(r"^\[Errno -?\d+\] ")


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, description="Verify, export or clean up delta checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", allow_abbrev=False, help="restore every tensor with all checksums")
    v.add_argument(
        "paths",
        nargs="+",
        help="checkpoint paths or URLs (delta manifests or torch.save files), or directories: their *.ckpt files",
    )
    v.add_argument(
        "--repair", action="store_true", help="rewrite a damaged blob or second copy from its good twin (redundancy=2)"
    )
    e = sub.add_parser("export", allow_abbrev=False, help="write a plain torch.save checkpoint")
    e.add_argument("path", help="checkpoint path or URL (a delta manifest or a torch.save file)")
    e.add_argument("out", help="output file (path or URL); an existing file is refused unless --overwrite")
    e.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    g = sub.add_parser(
        "gc", allow_abbrev=False, help="remove checkpoints ModelCheckpoint no longer tracks, then unreferenced blobs"
    )
    g.add_argument("path", help="checkpoint directory (path or URL)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    g.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help=f"keep unreferenced blobs this many seconds (default: {GC_GRACE_S:g}; 0: now)",
    )
    for s in (v, e, g):
        s.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. '{\"anon\": true}'")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m lightning_accel.checkpoint") -> int:
    """Run the command; returns the exit code (0 ok, 1 damaged/not found, 2 usage error)."""
    args = _parser(prog).parse_args(argv)
    try:
        opts = json_object_arg("--storage-options", args.storage_options or None)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.command == "gc":
        grace = args.grace_s
        # NaN fails `>= 0` too. An infinite grace period (the store's "never collect") is refused here: `gc` would
        # remove the untracked checkpoints and then delete none of their blobs, which is never what `gc` is run for.
        if grace is not None and not (grace >= 0 and math.isfinite(grace)):
            # Named as the user typed it; the store would name its own keyword (`gc_grace_s`).
            print(
                f"{prog}: error: `--grace-s` must be a finite number of seconds >= 0, got {grace:g}. Use "
                f"0 to delete unreferenced blobs at once, leave it out for the default ({GC_GRACE_S:g}), or pass "
                "`--dry-run` to list what would go without removing anything.",
                file=sys.stderr,
            )
            return 2
        try:
            store = DeltaStore(storage_options=opts, **({} if args.grace_s is None else {"gc_grace_s": args.grace_s}))
            out = collect(store, args.path, dry_run=args.dry_run)
            print(json.dumps(out))
        except Exception as e:  # noqa: BLE001 - one line, exit code 1
            print(f"{prog}: error: {_error_line(e, (*_CHECKPOINT_ERRORS, ValueError, RuntimeError))}", file=sys.stderr)
            return 1
        if out.get("undeletable"):
            # every checkpoint is intact, but the space is not back: a script running gc must hear it
            print(
                f"{prog}: error: {out['undeletable']} unreferenced file(s) under {args.path!r} could not be deleted "
                "(the warning above names the first and why); they stay listed for the next `gc`. Fix the "
                "permission and run `gc` again.",
                file=sys.stderr,
            )
            return 1
        return 0
    store = DeltaStore(storage_options=opts)
    failed = False
    if args.command == "verify":
        for path in _verify_targets(store, args.paths):
            try:
                print(json.dumps(_verify(store, path, args.repair)))
            except Exception as e:  # noqa: BLE001 - verify reports every failure as its JSON line, never a traceback
                failed = True
                print(json.dumps({"path": path, "ok": False, "error": _error_line(e, _CHECKPOINT_ERRORS)}))
        return 1 if failed else 0
    try:
        # checked before the (possibly long) read; the rename would fail only at the end
        check_export_target(store.fs, args.path, args.out, overwrite=args.overwrite)
        ckpt = read_checkpoint_with(store, args.path)
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        store.fs.write(args.out, buf.getvalue())
    except Exception as e:  # noqa: BLE001 - one line, exit code 1
        # ValueError: an `OUT` that names no file (empty, or ending with '/'), refused by `check_export_target`.
        print(f"{prog}: error: {_error_line(e, (*_CHECKPOINT_ERRORS, ValueError))}", file=sys.stderr)
        return 1
    print(json.dumps({"path": args.path, "exported": args.out}))
    return 0


def _verify_targets(store: DeltaStore, paths: list[str]) -> list[str]:
    """``paths`` with each directory replaced by the ``*.ckpt`` files directly inside it, by name (what
    ``ModelCheckpoint`` writes there; the blob store beside them is checked through their manifests). A directory
    without any stays in the list, so its line says so."""
    out: list[str] = []
    for path in paths:
        try:
            is_dir = store.fs.isdir(path)
        except Exception:  # noqa: BLE001 - the verify of the path itself reports what is wrong with it
            is_dir = False
        names = sorted(n for n in store.fs.list_files(path) if n.endswith(".ckpt")) if is_dir else []
        out += [posixpath.join(path.rstrip("/"), n) for n in names] if names else [path]
    return out


def _error_line(error: BaseException, expected: tuple[type[BaseException], ...]) -> str:
    """``error`` as the one line the command prints: without the ``[Errno 2]`` that ``str()`` puts before an
    ``OSError`` raised with an errno (the message says what happened; the number tells the user nothing)."""
    return _ERRNO_PREFIX.sub("", one_line(error, expected=expected), count=1)


def collect(store: DeltaStore, directory: str, *, dry_run: bool = False) -> dict[str, Any]:
    """``ckpt gc``: remove the delta checkpoints (``*.ckpt`` manifests) of ``directory`` that the ``ModelCheckpoint``
    state of its newest ``last*.ckpt`` does not track, then collect unreferenced blobs (after ``store.gc_grace_s``).

    Without a ``last*.ckpt`` holding a ``ModelCheckpoint`` state for this directory nothing tells which checkpoints
    are tracked: no checkpoint is removed (the summary's ``note`` says why), only unreferenced blobs. A directory
    without a blob store (``.delta_blobs``) is left exactly as it is: not even the writer lock is created there. A
    checkpoint saved after that ``last*.ckpt`` at the same ``global_step`` is kept too: another ``ModelCheckpoint`` on
    the directory saved it in the same step, after ``last.ckpt`` recorded the callbacks' state.

    Subdirectories of ``directory`` (at any depth, not through symlinks) that hold a blob store of their own (a
    ``filename`` with a ``/`` saves into one) are treated the same way: their untracked checkpoints are removed and
    their unreferenced blobs collected, after the same grace period and under their own writer lock. A subdirectory
    left with nothing but the store's own files (``.delta_blobs`` with its lock, no blob) is removed, then the empty
    folders that led to it; one that holds anything else (a user's file, a blob in its grace period) is kept whole.

    Every directory it writes is locked before anything is removed: one that a live run holds refuses the whole
    collection, which then removes nothing.

    Returns:
        ``{"path", "dry_run", "last", "tracked", "untracked", "removed", "blobs_deleted", "subdirectories",
        "emptied", "pending", "undeletable", "note"?}`` (checkpoints and ``subdirectories``, those collected,
        relative to ``directory``; ``emptied``: the subdirectories removed; ``blobs_deleted``, ``pending`` and
        ``undeletable`` (files the collection could not delete) count them in; ``emptied``, ``pending`` and
        ``undeletable`` only without ``dry_run``).

    Raises:
        FileNotFoundError: ``directory`` does not exist (nothing is created: a mistyped path is not a clean one).
        NotADirectoryError: ``directory`` is a file.
        CheckpointDirectoryLockedError: a live writer holds ``directory`` or one of the subdirectories.
    """
    root = store_dir(directory)
    # Checked before anything resolves or locks it: taking the writer lock would create a mistyped directory and
    # report it collected.
    if not store.fs.isdir(root):
        if store.fs.exists(root):
            raise NotADirectoryError(
                errno.ENOTDIR, f"{root!r} is a file, not a checkpoint directory. Pass the directory that holds it."
            )
        raise FileNotFoundError(
            errno.ENOENT, f"Checkpoint directory {root!r} does not exist (nothing collected). Check the path."
        )
    last = resolve_last(root, storage_options=store.fs.storage_options)
    tracked: set[str] = set()
    note = ""
    last_step: object = None
    if last is None:
        note = "no last*.ckpt in the directory, so nothing says which checkpoints are tracked: none removed"
    else:
        skeleton = store.read_skeleton(last)
        last_step = skeleton.get("global_step")
        callbacks = skeleton.get("callbacks")
        states = [
            s
            for s in compat.model_checkpoint_states(callbacks if isinstance(callbacks, dict) else {})
            if isinstance(s.get("dirpath"), str) and _same_dir(s["dirpath"], root)
        ]
        if not states:
            note = f"{last} holds no ModelCheckpoint state for this directory: no checkpoint removed"
        elif keeps := [s for s in states if _keeps_all(s)]:
            note = (
                f"{last}'s ModelCheckpoint "
                + (
                    "keeps every checkpoint (save_top_k=-1)"
                    if keeps[0].get("save_top_k") == -1
                    else "has no monitor (with save_top_k=-1 it keeps every checkpoint)"
                )
                + " and its state lists only the newest: no checkpoint removed"
            )
        for s in states:
            tracked |= compat.model_checkpoint_tracked(s)
        tracked.add(last)
    found = [] if note else store.untracked_manifests(root, tracked, subdirectories=True)
    if found and last is not None:
        # Another ModelCheckpoint on this directory that saves after the one writing `last.ckpt` (callbacks save in
        # order) wrote its newest checkpoint at the same step, after `last.ckpt` took the callbacks' state: a kept
        # checkpoint of a finished run, not a killed run's leftover (those are of later steps).
        last_created = store.open_manifest(last).created
        found = [(u, c) for u, c in found if not (c >= last_created and store.saved_at_step(u, last_step))]
    untracked = [url for url, _ in found if url.endswith(".ckpt")]  # only checkpoint names: never `x.ckpt.bak`
    out: dict[str, Any] = {
        "path": root,
        "dry_run": dry_run,
        "last": last,
        "tracked": sorted(relative_to(t, root) for t in tracked),
        "untracked": [relative_to(u, root) for u in untracked],
        "removed": [],
        "blobs_deleted": 0,
    }
    # A directory without a blob store holds nothing of this plugin's to collect: taking the writer lock there (the
    # run's root given instead of its checkpoint directory) would leave a `.delta_blobs/.lock` in the user's folder.
    has_store = store.fs.isdir(posixpath.join(root, BLOB_DIR))
    # Checkpoints saved under a `filename` with a `/` (`{epoch}-{val/loss:.2f}`) live in subdirectories, each with its
    # own blob store beside them: the blobs of those `save_top_k` removed wait there for a collection too.
    below = store.blob_stores_below(root)
    out["subdirectories"] = [relative_to(d, root) for d in below]
    if not dry_run:  # which subdirectories end up empty depends on the blobs the collection deletes: not foretold
        out["emptied"] = []
    in_root = [u for u in untracked if split_path(u)[0] == root]
    if not dry_run and (untracked or has_store or below):
        try:
            # every directory this collection writes, locked first: one a live run holds refuses it before any removal
            for d in [*([root] if in_root or has_store else []), *below]:
                store.claim(d)
            deleted = store.remove_checkpoints(untracked) if untracked else 0
            if has_store and not in_root:
                deleted += store.collect_garbage(root)
            out["removed"] = out["untracked"]
            pending = len(store.pending_deletions(root)) if has_store else 0
            undeletable = store.undeletable(root) if has_store else 0
            for sub in below:
                deleted += store.collect_garbage(sub)
                pending += len(store.pending_deletions(sub))
                undeletable += store.undeletable(sub)
            # the deepest first: a subdirectory's own subdirectory may be all that keeps it
            for sub in sorted(below, reverse=True):
                if store.remove_if_emptied(sub):
                    out["emptied"].append(relative_to(sub, root))
                    _remove_empty_parents(sub, root)
            out["emptied"].sort()
            out["blobs_deleted"] = deleted
            out["pending"] = pending
            out["undeletable"] = undeletable
        finally:
            store.close()
    elif not dry_run:
        out["pending"] = 0
        out["undeletable"] = 0
    if note:
        out["note"] = note
    return out


def _remove_empty_parents(sub: str, root: str) -> None:
    """Remove the folders between ``root`` and the removed ``sub`` that are left empty (made for ``sub`` by a
    ``filename`` with more than one ``/``); an object store has no folders to remove."""
    if not is_local_url(root):
        return
    top = os.path.realpath(strip_file_scheme(root))
    d = os.path.dirname(strip_file_scheme(sub))
    while os.path.realpath(d) != top and os.path.realpath(d).startswith(top + os.sep):
        try:
            os.rmdir(d)  # only an empty folder: anything in it keeps it
        except OSError:
            return
        d = os.path.dirname(d)


def _keeps_all(state: Mapping[str, Any]) -> bool:
    """Whether a ``ModelCheckpoint`` state may keep checkpoints it does not list: ``save_top_k=-1`` (recorded by
    ``DeltaModelCheckpoint``), or no ``monitor`` and no recorded ``save_top_k`` (Lightning then lists only the newest
    checkpoint, for ``save_top_k=-1`` as for 1)."""
    top_k = state.get("save_top_k")
    return top_k == -1 or (top_k is None and state.get("monitor") is None)


def _same_dir(a: str, b: str) -> bool:
    if is_local_url(a) and is_local_url(b):
        return os.path.realpath(strip_file_scheme(a)) == os.path.realpath(strip_file_scheme(b))
    return a.rstrip("/") == b.rstrip("/")


def _verify(store: DeltaStore, path: str, repair: bool = False) -> dict[str, Any]:
    """A delta checkpoint: every blob re-hashed and every tensor restored (``DeltaStore.verify``). A plain file:
    read with ``weights_only=True`` and summarised."""
    try:
        return store.verify(path, repair=repair)
    except NotADeltaCheckpointError:
        ckpt = read_checkpoint_with(store, path)  # raises the reader's one-line error when it is neither kind
    tensors = 0

    def count(obj: Any) -> None:
        nonlocal tensors
        if isinstance(obj, torch.Tensor):
            tensors += 1
        elif isinstance(obj, dict):
            for v in obj.values():
                count(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                count(v)

    count(ckpt)
    return {
        "path": path,
        "ok": True,
        "format": "torch.save",
        "tensors": tensors,
        "top_level_keys": sorted(map(str, ckpt)),
    }


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
