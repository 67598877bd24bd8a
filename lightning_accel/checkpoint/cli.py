"""The checkpoint command: ``python -m lightning_accel.checkpoint verify|export`` (``lightning-accel ckpt ...``).

- ``verify PATH [PATH ...] [--repair] [--storage-options JSON]``: restore every tensor with all checksums; print a
  JSON summary per checkpoint (``{"ok": false, "error": ...}`` for a damaged one, never a traceback); exit 1 if any
  checkpoint is damaged (the message names the checkpoint and the tensor). ``--repair`` rewrites damaged base blobs
  from their second copy (``redundancy=2``). A plain ``torch.save`` file is verified by reading it safely
  (``weights_only=True``).
- ``export PATH OUT [--storage-options JSON]``: write a plain ``torch.save`` checkpoint that ``torch.load`` and
  Lightning's ``TorchCheckpointIO`` open.

Both take either kind of checkpoint: ``export`` reads through :func:`~lightning_accel.checkpoint.read_checkpoint`,
``verify`` checks a delta checkpoint with ``DeltaStore.verify`` and reads a plain file through the same reader.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import sys
from typing import Any

import torch

from lightning_accel._utils.cliargs import json_object_arg
from lightning_accel._utils.errors import one_line
from lightning_accel.checkpoint.manifest import CheckpointCorruptError, NotADeltaCheckpointError
from lightning_accel.checkpoint.reader import read_checkpoint_with
from lightning_accel.checkpoint.store import DeltaStore

__all__ = ["main"]

# What a damaged, foreign or missing checkpoint raises: reported in one line, exit code 1.
_CHECKPOINT_ERRORS = (CheckpointCorruptError, NotADeltaCheckpointError, OSError, pickle.UnpicklingError)


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Verify or export delta checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="restore every tensor with all checksums")
    v.add_argument("paths", nargs="+", help="checkpoint paths or URLs (delta manifests or torch.save files)")
    v.add_argument(
        "--repair", action="store_true", help="rewrite damaged base blobs from their second copy (redundancy=2)"
    )
    e = sub.add_parser("export", help="write a plain torch.save checkpoint")
    e.add_argument("path", help="checkpoint path or URL (a delta manifest or a torch.save file)")
    e.add_argument("out", help="output file (path or URL)")
    for s in (v, e):
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
    store = DeltaStore(storage_options=opts)
    failed = False
    if args.command == "verify":
        for path in args.paths:
            try:
                print(json.dumps(_verify(store, path, args.repair)))
            except Exception as e:  # noqa: BLE001 - verify reports every failure as its JSON line, never a traceback
                failed = True
                print(json.dumps({"path": path, "ok": False, "error": one_line(e, expected=_CHECKPOINT_ERRORS)}))
        return 1 if failed else 0
    try:
        ckpt = read_checkpoint_with(store, args.path)
    except Exception as e:  # noqa: BLE001 - one line, exit code 1
        print(f"{prog}: error: {one_line(e, expected=_CHECKPOINT_ERRORS)}", file=sys.stderr)
        return 1
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    store.fs.write(args.out, buf.getvalue())
    print(json.dumps({"path": args.path, "exported": args.out}))
    return 0


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
