"""Test helpers: run a function in N processes with a gloo process group; free ports; Ctrl-C as it is by default."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["ctrl_c_by_default", "default_ctrl_c", "free_port", "run_in_processes"]

#: the environment the test session started with; the fork server starts from it, whichever test starts it
_SESSION_ENV = dict(os.environ)
#: imported once, in the fork server, before it forks the ranks: torch and Lightning cost ~4 s of CPU per process to
#: import, most of a short multi-process test on 2 cores
_PRELOAD = ["lightning"]
_server_started = False


def _context() -> Any:
    """The ``forkserver`` context, its server started from the session's environment with :data:`_PRELOAD` imported.

    A forked rank's environment is its fork server's, not its parent's: :func:`_worker` sets the parent's current
    one, as ``spawn`` would have passed it."""
    global _server_started
    ctx = mp.get_context("forkserver")
    if not _server_started:
        ctx.set_forkserver_preload(_PRELOAD)
        from multiprocessing import forkserver

        current = dict(os.environ)
        os.environ.clear()
        os.environ.update(_SESSION_ENV)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(current)
        _server_started = True
    return ctx


def default_ctrl_c() -> None:
    """``preexec_fn`` of a child that a test sends SIGINT (Ctrl-C): SIGINT as it is by default there.

    Why: a shell runs a background job (``.ci/run &``, ``nohup ... &``) with SIGINT ignored, every process it starts
    inherits that, and Python then installs no ``KeyboardInterrupt`` handler: the Ctrl-C the test sends did nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def ctrl_c_by_default() -> Iterator[None]:
    """Within it, a SIGINT to this process raises ``KeyboardInterrupt`` as Python's default handler does, however the
    test session was started (see :func:`default_ctrl_c`); the handler before is restored after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    init_process_group: bool,
    env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    import torch

    torch.set_num_threads(1)  # 2 processes on 2 cores: oversubscription makes gloo tests crawl
    try:
        if init_process_group:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including SystemExit from Lightning
        queue.put((rank, "err", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # A forked rank ends in os._exit, which skips interpreter exit: join the threads and run the atexit hooks a
        # spawned rank's exit would have run (writers that flush, producers that stop).
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()


def run_in_processes(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: tuple = (),
    *,
    timeout: float = 300.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` fresh processes and return their results by rank.

    The processes are forked from a server that has imported Lightning once (:func:`_context`); each gets this
    process's current environment plus ``env``, as a spawned process would.

    With ``init_process_group=True`` a gloo default group is ready when ``fn`` starts; with ``False`` only the
    torchrun-style environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``) is set, which is what
    ``Trainer(strategy="ddp", accelerator="cpu", devices=N)`` needs to join instead of launching its own processes.
    ``fn`` and its results must be picklable (define ``fn`` at module level). A failure in any rank raises
    ``RuntimeError`` with that rank's traceback.
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    environ = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, queue, init_process_group, environ), daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: list[str] = []
    while len(results) + len(errors) < nprocs:
        if time.monotonic() > deadline:
            break
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
        elif all(not p.is_alive() for p in procs) and queue.empty():
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if errors else max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    if len(results) < nprocs:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"ranks did not all report within {timeout}s (exit codes {codes}, got {sorted(results)})")
    return [results[r] for r in range(nprocs)]


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``"8m"``) mounted at ``path`` (made) for the block, lazily unmounted after: a real
    full filesystem. Skips the test without root or where mounting fails, with the reason."""
    import pytest

    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    r = subprocess.run(mount, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
