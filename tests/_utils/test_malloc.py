from __future__ import annotations

import multiprocessing as mp
import os
import platform

import pytest

from lightning_accel._utils import malloc


def _child(q: mp.Queue) -> None:  # type: ignore[type-arg]
    # a forked child applies it again (its own pid), and only once
    before = malloc._applied
    ok = malloc.keep_freed_memory()
    q.put((before, ok, malloc._applied))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning applies to glibc only")
def test_keep_freed_memory_applies_once_per_process() -> None:
    assert malloc.keep_freed_memory() is True
    assert malloc._applied == (os.getpid(), malloc.TRIM_BYTES)
    assert malloc.keep_freed_memory() is True  # already applied: no second mallopt
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    inherited, ok, own = q.get(timeout=30)
    p.join(30)
    assert inherited == (os.getpid(), malloc.TRIM_BYTES) and ok and own[0] == p.pid


def test_a_larger_setting_raises_it_and_a_smaller_one_leaves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.setattr(malloc, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    assert malloc.keep_freed_memory(64 << 20) is True
    assert malloc.keep_freed_memory(256 << 20) is True  # a training process asking to keep more than the cache
    assert malloc.keep_freed_memory(64 << 20) is True  # less: left at 256 MiB
    trims = [v for p, v in calls if p == malloc._M_TRIM_THRESHOLD]
    assert trims == [64 << 20, 256 << 20]
    assert malloc._applied == (os.getpid(), 256 << 20)


def test_without_glibc_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.setattr(malloc, "_mallopt", lambda: None)
    assert malloc.keep_freed_memory() is False
    assert malloc._applied is None
