"""Fault cases of delta checkpoints: readers racing the writer, and what a loop of SIGKILLs leaves on disk.

- :func:`reader_case`: a writer thread saves ``step=N.ckpt`` + ``last.ckpt`` and removes ``step=N-1.ckpt`` in a loop
  (``save_top_k=1``) while reader threads load ``last.ckpt`` without any lock, on a local directory and on moto's S3
  server. Every ``CheckpointCorruptError`` is a false one (nothing is damaged), and a reader that got tensors of one
  version with the non-tensor state of another would count as ``mixed``. Baseline, alternated with it in the same
  run: the writer with ``gc_grace_s=0`` (unreferenced blobs deleted at once; readers still retry once).
  ``ratios``: ``reader_false_errors`` (with the default grace period, summed over both backends).
- :func:`orphan_case`: start a training subprocess (Lightning, ``DeltaCheckpointIO`` + ``DeltaModelCheckpoint(
  save_top_k=2, save_last=True, every_n_train_steps=1)``), SIGKILL it after a random number of steps, resume with
  ``ckpt_path="last"``, again and again; then one clean round. Workers are forked from one process that imported
  Lightning once (a fresh interpreter per round would spend most of the time importing). At the end: bytes on disk of
  the directory (manifests and blobs, untracked ones included) against the bytes of the checkpoints the resumed
  ``ModelCheckpoint`` tracks (their manifests and every blob they reference); every remaining checkpoint must verify.
  ``ratios``: ``orphan_bytes_after_kills_vs_tracked`` (1.0: nothing but tracked checkpoints left).

``python benchmarks/_delta_faults.py --quick`` prints both cases as JSON (``--out FILE`` writes them);
``benchmarks/delta_checkpoint.py`` imports the two functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python benchmarks/_delta_faults.py`: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["orphan_case", "reader_case", "reader_race"]

REPO = Path(__file__).resolve().parent.parent
#: The grace period of the kill-loop workers: short, so the final measurement is not dominated by blobs that are
#: only waiting for it (the default keeps them for a minute, for readers).
WORKER_GRACE_S = 1.0


# ---------------------------------------------------------------------------------------------------- reader race
def _version(step: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "state_dict": {"w": torch.randn(4096, generator=g), "marker": torch.full((512,), float(step))},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(4096, generator=g)}}, "param_groups": [{}]}],
        "global_step": step,
    }


def reader_race(
    root: str,
    *,
    storage_options: dict[str, Any] | None = None,
    gc_grace_s: float | None = None,
    reads: int = 200,
    max_s: float = 30.0,
    readers: int = 1,
) -> dict[str, Any]:
    """Readers load ``<root>/last.ckpt`` while a writer replaces it (and a ``step=N.ckpt`` beside it) in a loop.

    Stops after ``reads`` loads in total or ``max_s`` seconds, whichever comes first.

    Returns:
        ``{"reads", "saves", "false_errors", "mixed", "other_errors", "first_error", "seconds"}``.
    """
    from lightning_accel.checkpoint.store import GC_GRACE_S, CheckpointCorruptError, DeltaStore

    writer = DeltaStore(storage_options=storage_options, gc_grace_s=GC_GRACE_S if gc_grace_s is None else gc_grace_s)
    last = f"{root}/last.ckpt"
    writer.save(_version(0), last)
    stop = threading.Event()
    counts = {"reads": 0, "saves": 0, "false_errors": 0, "mixed": 0, "other_errors": 0}
    first: list[str] = []
    lock = threading.Lock()

    def write() -> None:
        step = 0
        try:
            while not stop.is_set():
                step += 1
                state = _version(step)
                writer.save(state, f"{root}/step={step:06d}.ckpt")
                writer.save(state, last)
                if step > 1:
                    writer.remove(f"{root}/step={step - 1:06d}.ckpt")
                counts["saves"] += 1
        finally:
            writer.close()

    def read() -> None:
        reader = DeltaStore(storage_options=storage_options)
        while not stop.is_set():
            outcome = "reads"
            try:
                ckpt = reader.load(last)
                if float(ckpt["state_dict"]["marker"][0]) != ckpt["global_step"]:
                    outcome = "mixed"
            except CheckpointCorruptError as e:
                outcome = "false_errors"
                first.append(str(e))
            except Exception as e:  # noqa: BLE001 - counted and shown, the loop goes on
                outcome = "other_errors"
                first.append(f"{type(e).__name__}: {e}")
            with lock:
                counts["reads"] += 1
                if outcome != "reads":
                    counts[outcome] += 1
                if counts["reads"] >= reads:
                    stop.set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=write, daemon=True)]
    threads += [threading.Thread(target=read, daemon=True) for _ in range(readers)]
    for t in threads:
        t.start()
    threads[1].join(max_s)
    stop.set()
    for t in threads:
        t.join(60)
    return {**counts, "first_error": first[0][:300] if first else None, "seconds": round(time.perf_counter() - t0, 2)}


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    """A moto S3 server in its own process (in this one it would share the GIL with the readers and the writer)."""
    import socket

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (
        "from moto.server import ThreadedMotoServer; import time; "
        f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False); s.start(); time.sleep(10**6)"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "use_listings_cache": False,
    }


def reader_case(quick: bool, s3_endpoint: str | None) -> dict[str, Any]:
    """Case: :func:`reader_race` on a local directory and on S3 (``s3_endpoint``; a moto server is started here when
    it is None), with the default grace period and, alternated with it, the ``gc_grace_s=0`` baseline.

    Returns:
        ``{"results": {backend: {"grace": ..., "no_grace": ...}}, "ratios": {"reader_false_errors": N}}``.
    """
    import uuid

    import fsspec

    server = None
    if s3_endpoint is None:
        server, s3_endpoint = _moto()
    opts = _s3_options(s3_endpoint)
    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    fsspec.filesystem("s3", skip_instance_cache=True, **opts).mkdir(bucket)
    # Reads per backend and phase: the grace phase gets most of them, the baseline enough to show its errors.
    plan = {
        "local": (2000, 200, 30.0) if quick else (4000, 400, 90.0),
        "s3": (1000, 100, 30.0) if quick else (2000, 300, 180.0),
    }
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            for backend, (n, n_base, max_s) in plan.items():
                options = opts if backend == "s3" else None
                readers = 4 if backend == "s3" else 1  # overlap the round trips
                out: dict[str, Any] = {}
                # Alternated: half of each phase, then the other half.
                for half in range(2):
                    for phase, grace, count, limit in (("grace", None, n, max_s), ("no_grace", 0.0, n_base, 10.0)):
                        root = f"s3://{bucket}/{phase}{half}" if backend == "s3" else f"{d}/{phase}{half}"
                        got = reader_race(
                            root,
                            storage_options=options,
                            gc_grace_s=grace,
                            reads=count // 2,
                            max_s=limit / 2,
                            readers=readers,
                        )
                        prev = out.get(phase)
                        if prev is None:
                            out[phase] = got
                        else:
                            for k in ("reads", "saves", "false_errors", "mixed", "other_errors", "seconds"):
                                prev[k] = round(prev[k] + got[k], 2)
                            prev["first_error"] = prev["first_error"] or got["first_error"]
                results[backend] = out
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    false = sum(r["grace"]["false_errors"] + r["grace"]["mixed"] + r["grace"]["other_errors"] for r in results.values())
    results["reads_during_saves"] = sum(
        r["grace"]["reads"] for r in results.values() if isinstance(r, dict) and "grace" in r
    )
    return {"results": results, "ratios": {"reader_false_errors": false}}


# ---------------------------------------------------------------------------------------------------- kill loop
WIDTHS = (32, 64, 4)


def _worker(root: str, seed: int, async_save: bool, extra_steps: int, keep_orphans: bool) -> None:
    """One training run in a forked child: resume from ``last`` and save at every step until killed (or, when
    ``extra_steps`` > 0, stop normally that many steps after the resumed one)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks._harness import cpu_trainer
    from benchmarks._models import MLP
    from lightning_accel.checkpoint import DeltaCheckpointIO, DeltaModelCheckpoint, DeltaStore

    torch.manual_seed(seed)
    last = f"{root}/last.ckpt"
    max_steps = 10**6
    if extra_steps > 0:
        max_steps = extra_steps + (int(DeltaStore().read_skeleton(last)["global_step"]) if os.path.exists(last) else 0)

    class Report(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            print("STARTED " + json.dumps({"resumed_step": trainer.global_step}), flush=True)

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            print(f"STEP {trainer.global_step}", flush=True)

    io = DeltaCheckpointIO(async_save=async_save)
    io.store.gc_grace_s = WORKER_GRACE_S
    ckpt = DeltaModelCheckpoint(
        dirpath=root,
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=2,
        save_last=True,
        monitor="step",
        mode="max",
        keep_orphans=keep_orphans,
    )
    x = torch.randn(256, WIDTHS[0])
    data = DataLoader(TensorDataset(x, x[:, : WIDTHS[-1]].argmax(1)), batch_size=16, shuffle=True)
    trainer = cpu_trainer(plugins=[io], callbacks=[Report(), ckpt], max_steps=max_steps)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(MLP(*WIDTHS), data, ckpt_path="last" if os.path.exists(last) else None)
    print(f"DONE {trainer.global_step}", flush=True)


def _zygote() -> None:
    """Import Lightning once, then fork one worker per ``GO root seed async extra_steps keep_orphans`` line on stdin;
    report ``PID`` and ``EXIT`` lines on stdout (the worker's own lines come in between)."""
    import torch

    torch.set_num_threads(1)
    import lightning  # noqa: F401 - imported once here, inherited by every forked worker

    from benchmarks._models import MLP  # noqa: F401
    from lightning_accel.checkpoint import DeltaCheckpointIO  # noqa: F401

    print("READY", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "GO":
            break
        root, seed, async_save, extra, keep = parts[1], int(parts[2]), parts[3] == "1", int(parts[4]), parts[5] == "1"
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _worker(root, seed, async_save, extra, keep)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, then the child exits
                print(f"ERROR {type(e).__name__}: {e}", flush=True)
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {pid} {status}", flush=True)


def _dir_bytes(root: str) -> tuple[int, int]:
    """(bytes of every manifest and blob of ``root``, bytes of the tracked manifests and the blobs they need)."""
    from lightning_accel.checkpoint.cli import collect
    from lightning_accel.checkpoint.store import BLOB_DIR, COPY_SUFFIX, DeltaStore

    store = DeltaStore()
    summary = collect(store, root, dry_run=True)
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f not in (".lock", ".pending"):
                total += os.path.getsize(os.path.join(dirpath, f))
    tracked = 0
    keys: set[str] = set()
    for name in summary["tracked"]:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        tracked += os.path.getsize(path)
        keys |= store.open_manifest(path).keys()
    for key in keys:
        for suffix in ("", COPY_SUFFIX):
            p = os.path.join(root, BLOB_DIR, key[:2], key + suffix)
            if os.path.exists(p):
                tracked += os.path.getsize(p)
    return total, tracked


def orphan_case(quick: bool, kills: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Case: ``kills`` rounds (>= 20) of start / resume from ``last`` / SIGKILL, then one clean round; bytes left on
    disk against the tracked checkpoints' bytes, every remaining checkpoint verified. Baseline, alternated round by
    round in a second directory (half as many kills): the same with ``DeltaModelCheckpoint(keep_orphans=True)``, i.e.
    nothing reconciled.

    Returns:
        ``{"results": {"reconciled": {...}, "keep_orphans": {...}}, "ratios":
        {"orphan_bytes_after_kills_vs_tracked": x}}``.
    """
    kills = kills if kills is not None else (20 if quick else 40)
    runs = {"reconciled": (kills, False), "keep_orphans": (max(kills // 2, 1), True)}
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        zygote = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert zygote.stdin is not None and zygote.stdout is not None
        lines, commands = zygote.stdout, zygote.stdin

        def expect(prefix: str, deadline: float) -> str:
            while True:
                line = lines.readline()
                if not line:
                    raise AssertionError(f"the worker process ended while waiting for {prefix!r}")
                if line.startswith("ERROR "):
                    raise AssertionError(f"worker failed: {line.strip()}")
                if line.startswith(prefix):
                    return line.strip()
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {prefix!r} in time")

        def round_(root: str, k: int, final: bool, keep: bool) -> int:
            """One worker: resume, then SIGKILL after 1-3 steps (or, ``final``, two steps and a normal exit)."""
            deadline = time.monotonic() + 120
            commands.write(f"GO {root} {seed + k} {k % 2} {2 if final else 0} {int(keep)}\n")
            commands.flush()
            pid = int(expect("PID ", deadline).split()[1])
            resumed = int(json.loads(expect("STARTED ", deadline)[len("STARTED ") :])["resumed_step"])
            if final:
                expect("DONE ", deadline)
            else:
                target = resumed + rng.randint(1, 3)
                while int(expect("STEP ", deadline).split()[1]) < target:
                    pass
                time.sleep(rng.uniform(0.0, 0.15))  # inside the saves that follow the step
                os.kill(pid, signal.SIGKILL)
            expect(f"EXIT {pid}", deadline)
            return resumed

        per_run: dict[str, dict[str, Any]] = {
            name: {"root": f"{d}/{name}", "steps": [], "untracked_after_each_kill": []} for name in runs
        }
        try:
            expect("READY", time.monotonic() + 300)
            for k in range(kills + 1):  # alternated: a round of each run in turn
                for name, (n, keep) in runs.items():
                    if k > n:
                        continue
                    run = per_run[name]
                    run["steps"].append(round_(run["root"], k, k == n, keep))
                    if k < n:
                        run["untracked_after_each_kill"].append(len(_untracked(run["root"])))
        finally:
            commands.close()
            try:
                zygote.wait(timeout=60)
            except subprocess.TimeoutExpired:
                zygote.kill()
                zygote.wait()
        results: dict[str, Any] = {name: _measure(per_run[name], runs[name][0]) for name in runs}
    results["seconds"] = round(time.perf_counter() - t0, 1)
    ratio = results["reconciled"]["bytes_on_disk"] / max(results["reconciled"]["bytes_tracked"], 1)
    return {"results": results, "ratios": {"orphan_bytes_after_kills_vs_tracked": round(ratio, 4)}}


def _measure(run: dict[str, Any], kills: int) -> dict[str, Any]:
    """Bytes on disk against tracked bytes at the end of a run's rounds, and every remaining checkpoint verified."""
    from lightning_accel.checkpoint.store import DeltaStore, is_manifest_bytes

    root = run["root"]
    raw_total, _ = _dir_bytes(root)
    time.sleep(WORKER_GRACE_S)
    DeltaStore(gc_grace_s=WORKER_GRACE_S).collect_garbage(root)  # what the next save would do first
    total, tracked = _dir_bytes(root)
    store = DeltaStore()
    verified = 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isfile(path) and is_manifest_bytes(Path(path).read_bytes()[:64]):
            assert store.verify(path)["ok"], path
            verified += 1
    return {
        "kills": kills,
        "resumed_steps": run["steps"],
        "untracked_after_each_kill": run["untracked_after_each_kill"],
        "untracked_at_end": _untracked(root),
        "bytes_on_disk": total,
        "bytes_tracked": tracked,
        "bytes_on_disk_vs_tracked": round(total / max(tracked, 1), 4),
        "bytes_on_disk_before_final_collection": raw_total,
        "checkpoints_verified": verified,
    }


def _untracked(root: str) -> list[str]:
    from lightning_accel.checkpoint.cli import collect
    from lightning_accel.checkpoint.store import DeltaStore

    return list(collect(DeltaStore(), root, dry_run=True)["untracked"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--case", choices=("reader", "orphan", "both"), default="both")
    p.add_argument("--kills", type=int, default=None)
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zygote:
        _zygote()
        return
    out: dict[str, Any] = {"results": {}, "ratios": {}}
    if args.case in ("reader", "both"):
        r = reader_case(args.quick, None)
        out["results"]["reader"], _ = r["results"], out["ratios"].update(r["ratios"])
    if args.case in ("orphan", "both"):
        r = orphan_case(args.quick, args.kills)
        out["results"]["orphan"], _ = r["results"], out["ratios"].update(r["ratios"])
    text = json.dumps(out, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
