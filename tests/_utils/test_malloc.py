from __future__ import annotations

import multiprocessing as mp
import os
import platform

import pytest

from lightning_accel._utils import malloc


def _child(q: mp.Queue) -> None:  # type: ignore[type-arg]
    # a forked child applies it again (its own pid), and only once
    q.put((malloc._done_in, malloc.keep_freed_memory(), malloc._done_in == os.getpid()))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning applies to glibc only")
def test_keep_freed_memory_applies_once_per_process() -> None:
    assert malloc.keep_freed_memory() is True
    assert malloc._done_in == os.getpid()
    assert malloc.keep_freed_memory() is True  # already applied: no second mallopt
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    inherited, ok, own = q.get(timeout=30)
    p.join(30)
    assert inherited == os.getpid() and ok and own


def test_without_glibc_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "_done_in", None)
    monkeypatch.setattr(malloc, "_mallopt", lambda: None)
    assert malloc.keep_freed_memory() is False
    assert malloc._done_in is None
