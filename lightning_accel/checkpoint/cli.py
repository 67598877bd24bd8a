"""The checkpoint command: ``python -m lightning_accel.checkpoint verify|export`` (``lightning-accel ckpt ...``).

- ``verify PATH [PATH ...] [--storage-options JSON]``: restore every tensor with all checksums; print a JSON summary
  per checkpoint; exit 1 if any checkpoint is damaged (the message names the checkpoint and the tensor).
- ``export PATH OUT [--storage-options JSON]``: write a plain ``torch.save`` checkpoint that ``torch.load`` and
  Lightning's ``TorchCheckpointIO`` open.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_accel._utils.cliargs import json_object_arg
from lightning_accel.checkpoint.store import CheckpointCorruptError, DeltaStore, NotADeltaCheckpointError

__all__ = ["main"]


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Verify or export delta checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="restore every tensor with all checksums")
    v.add_argument("paths", nargs="+", help="checkpoint manifest paths or URLs")
    e = sub.add_parser("export", help="write a plain torch.save checkpoint")
    e.add_argument("path", help="checkpoint manifest path or URL")
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
                print(json.dumps(store.verify(path)))
            except (CheckpointCorruptError, NotADeltaCheckpointError, FileNotFoundError) as e:
                failed = True
                print(json.dumps({"path": path, "ok": False, "error": str(e)}))
        return 1 if failed else 0
    try:
        out = store.export(args.path, args.out)
    except (CheckpointCorruptError, NotADeltaCheckpointError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"path": args.path, "exported": out}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
