"""The data command: ``lightning-accel data pack SOURCE DEST`` writes a packed origin, ``lightning-accel data clean``
removes stale RAM tiers (see ``docs/data.md``).

``pack SOURCE DEST [--shard-bytes 16MiB] [--shuffle-seed N] [--manifest FILE] [--storage-options JSON]
[--dest-storage-options JSON] [--overwrite]``: copy an ImageFolder tree (or a manifest's keys) into shards plus an
index, so a cold epoch from an object store costs one GET per shard instead of one per image. ``DEST`` must be missing,
empty or hold a pack (replaced with ``--overwrite``, which touches only that pack's files): a ``DEST`` holding any
other file is refused, and so is a local ``DEST`` that a running process reads or writes (its pid is named). Prints a
JSON summary; exit 2 on bad arguments, 1 when the source or destination fails, 130 when interrupted (Ctrl-C).

``clean [--older-than 0s] [--root DIR] [--tier NAME ...] [--dry-run]``: remove the RAM tiers under ``DIR`` (default
``/dev/shm/lightning_accel``) that no process uses and that were last used longer ago than ``--older-than``; prints a
JSON summary (removed and kept tiers, bytes freed). A RAM tier is a directory carrying the marker the package writes
when it creates one; nothing else is ever removed. A ``DIR`` that holds anything besides tiers is refused (exit 2)
unless ``--tier`` names the tiers to remove, and so is a ``--tier`` naming anything but a tier (exit 2); a ``DIR`` that
does not exist, or a ``--tier`` that is not there (under the default root too), is an error that removes nothing (exit
1, as a missing SOURCE of ``pack``), and so is a ``--tier`` that a running process has open (its pid is named).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from lightning_accel._utils.checks import check_bytes
from lightning_accel._utils.cliargs import json_object_arg
from lightning_accel._utils.errors import one_line
from lightning_accel.data.lifecycle import find_tiers, other_entries, parse_duration, ram_root, sweep
from lightning_accel.data.origin import OriginError
from lightning_accel.data.pack import DEFAULT_SHARD_BYTES, MAX_SHARD_BYTES, pack_origin
from lightning_accel.data.tiers import read_marker

__all__ = ["main"]


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description="Prepare data for CachedDataModule.")
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser(
        "pack", allow_abbrev=False, help="pack an origin into shards + index (one GET per shard when read)"
    )
    k.add_argument("source", help="ImageFolder tree (or manifest root): path or fsspec URL")
    k.add_argument("dest", help="where to write the packed origin: path or fsspec URL")
    k.add_argument("--shard-bytes", default=str(DEFAULT_SHARD_BYTES), help="target shard size, e.g. 16MiB")
    k.add_argument("--manifest", default=None, help="JSONL manifest under SOURCE instead of a tree")
    k.add_argument("--storage-options", default=None, help="fsspec options of SOURCE as JSON")
    k.add_argument("--dest-storage-options", default=None, help="fsspec options of DEST as JSON (default: SOURCE's)")
    k.add_argument("--overwrite", action="store_true", help="replace a pack already at DEST (only its own files)")
    k.add_argument("--shuffle-seed", type=int, default=None, help="write samples in a seeded random order")
    c = sub.add_parser("clean", allow_abbrev=False, help="remove RAM tiers no process uses (on /dev/shm by default)")
    c.add_argument("--older-than", default="0s", help="only tiers last used longer ago than this, e.g. 12h, 7d")
    c.add_argument("--root", default=None, help="where the tiers are (default: /dev/shm/lightning_accel)")
    c.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    c.add_argument(
        "--tier",
        action="append",
        default=None,
        metavar="NAME",
        help="only this tier under --root (repeatable); needed when --root also holds other files",
    )
    return p


def _check_clean_target(root: str, explicit: bool, tiers: list[str] | None) -> None:
    """Refuse a root that is not a directory, a ``--tier`` that is not a tier, and a root holding anything besides
    tiers unless ``--tier`` names what to remove (a mistyped ``--root`` must never reach a user's own files).

    Raises:
        FileNotFoundError: the target is missing (exit 1, as ``pack``'s missing SOURCE): an explicit ``--root`` that
            does not exist, or a ``--tier`` found under no root (a mistyped name must not read as space freed).
        ValueError: the target would reach what is not a tier (exit 2): a ``--tier`` naming another entry or no
            single name, a root holding other entries without ``--tier``.
    """
    if not os.path.isdir(root):
        if explicit:
            raise FileNotFoundError(
                f"`--root` {root!r} is not an existing directory. Pass the directory that holds the RAM tiers "
                f"(default {ram_root()!r})."
            )
        if tiers:
            raise FileNotFoundError(
                f"`--tier` {tiers[0]!r} is not a RAM tier under {root!r} (the default root, which does not exist): "
                "nothing was removed. Pass the directory that holds it with `--root DIR`."
            )
        return  # no tier was ever made here: nothing to clean
    if read_marker(root) is not None:
        # the tier's own files are no tiers: the refusal below would offer `--tier NAME` with no name to give
        parent, name = os.path.split(os.path.abspath(root))
        raise ValueError(
            f"`--root` {root!r} is a RAM tier itself, not the directory holding tiers. Pass `--root {parent}` "
            f"`--tier {name}` to remove it."
        )
    marked = {os.path.basename(t.path) for t in find_tiers(root)}
    for name in tiers or ():
        if name in marked:
            continue
        shown = sorted(marked)[:5] or "none"
        if os.sep in name.rstrip(os.sep):
            # a path where a name is expected (a tier's full path, as `kept` lists them)
            head, tail = os.path.split(name.rstrip(os.sep))
            raise ValueError(
                f"`--tier` takes the name of a tier under `--root`, got the path {name!r}. Pass `--tier {tail}` with "
                f"`--root {head}`."
            )
        if name in ("", ".", "..") or os.sep in name or os.path.lexists(os.path.join(root, name)):
            raise ValueError(
                f"`--tier` {name!r} is not a RAM tier under {root!r} (a directory carrying the package's tier "
                f"marker). Tiers there: {shown}."
            )
        where = "`--root`" if explicit else "the default root"
        fix = f"Tiers there: {shown}; pass one of them, or" if marked else "No tier is there; pass"
        raise FileNotFoundError(
            f"`--tier` {name!r} is not a RAM tier under {root!r} ({where}; no entry of that name): nothing was "
            f"removed. {fix} `--root DIR` where the tier is."
        )
    others = other_entries(root)
    if others and not tiers:
        shown_others = ", ".join(repr(os.path.basename(o)) for o in others[:3]) + (", ..." if len(others) > 3 else "")
        raise ValueError(
            f"`--root` {root!r} holds {len(others)} entries that are not RAM tiers ({shown_others}); "
            "refusing to clean it. Name the tiers to remove with `--tier NAME`, or point `--root` at the tiers' "
            "own directory."
        )


def _named_tiers_in_use(root: str, names: list[str] | None) -> str | None:
    """The refusal, in one line, when a tier named by ``--tier`` is open in a running process, else None.

    A tier the user names is expected to go: keeping it silently (exit 0) read as done while the job still holds the
    RAM. Refused before anything is removed, the other named tiers included, so a rerun after the job ends does it all.
    """
    if not names:
        return None
    busy = [t for t in find_tiers(root) if os.path.basename(t.path) in names and t.in_use]
    if not busy:
        return None
    first = busy[0]
    known = [p for p in first.pids if p > 0]
    by = f"pid {', '.join(map(str, known[:3]))}" if known else "a process whose pid this system does not show"
    more = f" (and {len(busy) - 1} more named tier(s) in use)" if len(busy) > 1 else ""
    return (
        f"`--tier` {os.path.basename(first.path)!r} under {root!r} is in use by {by}, which has its LMDB files "
        f"open{more}: nothing was removed. Stop that process first, or leave the tier out of `--tier`."
    )


def _clean(args: argparse.Namespace, prog: str) -> int:
    root = args.root if args.root is not None else ram_root()
    try:
        older = parse_duration(args.older_than, name="--older-than")
        _check_clean_target(root, args.root is not None, args.tier)
    except FileNotFoundError as e:  # a missing target: exit 1, as a missing SOURCE of `pack`
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    busy = _named_tiers_in_use(root, args.tier)
    if busy:
        print(f"{prog}: error: {busy}", file=sys.stderr)
        return 1
    removed = sweep(args.root, older_than_s=older or 0.0, dry_run=args.dry_run, only=args.tier)
    gone = {r.path for r in removed}
    kept = [t for t in find_tiers(root) if t.path not in gone]
    summary = {
        "root": root,
        "dry_run": args.dry_run,
        "removed": [r.path for r in removed],
        "bytes_freed": sum(r.bytes for r in removed),
        "kept": [{"path": t.path, "in_use": t.in_use, "bytes": t.bytes, "note": t.note} for t in kept],
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None, prog: str = "lightning-accel data") -> int:
    """Run the command; returns the exit code (0 ok, 1 failed, 2 usage error)."""
    args = _parser(prog).parse_args(argv)
    if args.command == "clean":
        return _clean(args, prog)
    try:
        src_opts = json_object_arg("--storage-options", args.storage_options)
        dst_opts = json_object_arg("--dest-storage-options", args.dest_storage_options)
        shard_bytes = check_bytes("--shard-bytes", args.shard_bytes, low=1, fix="Pass a size such as 16MiB.")
        # pack_origin's own bound would fail later, as a source/destination failure (exit 1) naming `shard_bytes`
        if shard_bytes > MAX_SHARD_BYTES:
            raise ValueError(
                f"`--shard-bytes` must be at most {MAX_SHARD_BYTES} bytes (4GiB: a shard is built in memory), got "
                f"{args.shard_bytes!r}. Pass a size such as 16MiB."
            )
    except ValueError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2

    # the progress line is rewritten in place (`\r`): it is ended before the next line, and only if it was started,
    # so an error before the first sample is the only line printed
    started = False

    def progress(done: int, total: int) -> None:
        nonlocal started
        started = True
        print(f"\rpacked {done}/{total} samples", end="", file=sys.stderr, flush=True)

    def end_progress() -> None:
        if started:
            print(file=sys.stderr)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            listing = pack_origin(
                args.source,
                args.dest,
                storage_options=src_opts,
                dest_storage_options=dst_opts,
                manifest=args.manifest,
                shard_bytes=shard_bytes,
                overwrite=args.overwrite,
                progress=progress,
                shuffle_seed=args.shuffle_seed,
            )
    except (OriginError, FileNotFoundError, FileExistsError, ValueError, OSError) as e:
        end_progress()
        print(f"{prog}: error: {type(e).__name__}: {_command_line_names(one_line(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: one line saying what is left, not a traceback (the pack's journal lets the rerun take DEST over)
        end_progress()
        print(
            f"{prog}: interrupted: DEST {args.dest!r} may be incomplete (a pack without its index is refused when "
            "read, never read as complete). Run the same command again to complete it.",
            file=sys.stderr,
        )
        return 130
    end_progress()
    for w in caught:  # one line each (files left out of the pack), not Python's two-line warning format
        print(f"{prog}: warning: {one_line(str(w.message))}", file=sys.stderr)
    assert listing.pack is not None
    summary = {
        "dest": listing.origin,
        "samples": len(listing),
        "classes": len(listing.classes),
        "shards": len(listing.pack.shards),
        "bytes": sum(listing.pack.shard_sizes),
    }
    print(json.dumps(summary))
    return 0


#: `pack_origin`'s argument names as its errors spell them -> what this command calls them (whole phrases first: a
#: message that already gives the option beside the argument would name it twice, and `manifest=None` has no option)
_PACK_ARGUMENTS = {
    "`overwrite=True` (`--overwrite`)": "`--overwrite`",
    "pass `manifest=None`": "leave out `--manifest`",
    "`origin`": "SOURCE",
    "`source`": "SOURCE",
    "`dest`": "DEST",
    "`manifest=`": "`--manifest`",
    "`manifest`": "`--manifest`",
    "`storage_options`": "`--storage-options`",
    "`dest_storage_options`": "`--dest-storage-options`",
    "`shard_bytes`": "`--shard-bytes`",
    "`shuffle_seed`": "`--shuffle-seed`",
    "`overwrite=True`": "`--overwrite`",
    "`overwrite`": "`--overwrite`",
}


def _command_line_names(message: str) -> str:
    """``message`` (an error of ``pack_origin``) with its Python argument names spelt as this command's: the user typed
    SOURCE and ``--manifest``, not ``origin`` and ``manifest=``."""
    for python_name, cli_name in _PACK_ARGUMENTS.items():
        message = message.replace(python_name, cli_name)
    return message
