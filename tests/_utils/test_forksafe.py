from __future__ import annotations

import os
import pickle
import sys
import threading

import pytest

from lightning_accel._utils.forksafe import ForkSafeLock, PerProcess, ResetOnPickle


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs os.fork")
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_child_forked_while_a_thread_holds_the_lock_can_take_it(reentrant: bool) -> None:
    lock = ForkSafeLock(reentrant=reentrant)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: a plain threading.Lock copied here would stay locked forever
        ok = lock.acquire(timeout=5)
        os._exit(0 if ok else 1)
    release.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert lock.acquire(blocking=False)  # the parent's lock works as before
    lock.release()


def test_pickles_as_a_fresh_lock() -> None:
    lock = ForkSafeLock()
    with lock:
        copy = pickle.loads(pickle.dumps(lock))
        assert copy.acquire(blocking=False)
        copy.release()


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs os.fork")
def test_per_process_state_starts_fresh_in_a_forked_child_and_when_unpickled() -> None:
    from lightning_accel._utils.forksafe import PerProcess

    state: PerProcess[dict[str, int]] = PerProcess(dict)
    state.get()["parent"] = 1
    pid = os.fork()
    if pid == 0:
        os._exit(0 if state.get() == {} else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert state.get() == {"parent": 1}
    assert pickle.loads(pickle.dumps(state)).get() == {}


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs os.fork")
def test_peek_sees_only_this_process_value_and_never_makes_one() -> None:
    from lightning_accel._utils.forksafe import PerProcess

    state: PerProcess[list[int]] = PerProcess(list)
    assert state.peek() is None and state.peek() is None  # peeking made nothing
    state.get().append(1)
    assert state.peek() == [1]
    pid = os.fork()
    if pid == 0:  # the parent's value is not this process's
        os._exit(0 if state.peek() is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert state.peek() == [1]
    assert pickle.loads(pickle.dumps(state)).peek() is None


class _Counted(ResetOnPickle):
    _reset_on_pickle = {"reads": 0, "seen": (0, 0)}

    def __init__(self) -> None:
        self.name = "a"
        self.reads = 5
        self.seen = (3, 4)


def test_reset_on_pickle_resets_the_named_fields_only() -> None:
    obj = _Counted()
    copy = pickle.loads(pickle.dumps(obj))
    assert (copy.name, copy.reads, copy.seen) == ("a", 0, (0, 0))
    assert (obj.name, obj.reads, obj.seen) == ("a", 5, (3, 4))  # the original keeps its values


def test_first_get_from_racing_threads_makes_one_value() -> None:
    import time

    made: list[object] = []

    def slow_factory() -> object:
        time.sleep(0.05)  # long enough that every thread arrives while the first is still building
        made.append(object())
        return made[-1]

    pp = PerProcess(slow_factory)
    start = threading.Barrier(4)
    seen: list[object] = []

    def worker() -> None:
        start.wait()
        seen.append(pp.get())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(made) == 1 and all(v is made[0] for v in seen) and len(seen) == 4


def test_plugins_built_before_a_fork_ask_cuda_through_the_fork_safe_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import lightning_accel as la
    from lightning_accel._utils.forksafe import cuda_available

    def refuse() -> bool:  # the CUDA runtime's check: a process that ran it before a fork breaks its children
        raise AssertionError("torch.cuda.is_available() called while constructing")

    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    la.FusedPrecision("bf16-mixed")
    la.CudaMemoryManager()
    assert cuda_available() is (torch.cuda.device_count() > 0)
