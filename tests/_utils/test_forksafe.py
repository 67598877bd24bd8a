from __future__ import annotations

import os
import pickle
import sys
import threading

import pytest

from lightning_accel._utils.forksafe import ForkSafeLock


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
