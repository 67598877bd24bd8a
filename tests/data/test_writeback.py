"""``WriteBehind``: commits run in submission order on one thread; a failed commit's error reaches the reader."""

from __future__ import annotations

import threading

import pytest

from lightning_accel.data.writeback import WRITE_QUEUE, WriteBehind, Writes


def test_commits_run_in_order_on_the_writer_thread() -> None:
    seen: list[tuple[str, bytes]] = []
    main = threading.get_ident()

    def commit(writes: Writes) -> None:
        assert threading.get_ident() != main
        seen.extend((threading.current_thread().name, k) for k, _ in writes)

    w = WriteBehind()
    for i in range(3 * WRITE_QUEUE):  # more than the queue holds: submit blocks, nothing is dropped
        w.submit(commit, [(f"k{i}".encode(), b"v")])
    w.flush()
    assert [k for _, k in seen] == [f"k{i}".encode() for i in range(3 * WRITE_QUEUE)]
    assert {name for name, _ in seen} == {"la-cache-writer"}


def test_a_failed_commit_is_raised_once_in_the_reader() -> None:
    def bad(writes: Writes) -> None:
        raise ValueError("budget too small")

    w = WriteBehind()
    w.submit(bad, [(b"k", b"v")])
    with pytest.raises(ValueError, match="budget too small"):
        w.flush()
    w.flush()  # reported once
    w.submit(bad, [(b"k", b"v")])
    w.flush(raise_errors=False)
    with pytest.raises(ValueError, match="budget too small"):
        w.submit(lambda writes: None, [])
