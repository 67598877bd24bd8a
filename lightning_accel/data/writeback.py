"""Write-behind: one background thread per process that commits a reader's batch writes in order.

A DataLoader worker hands the misses of a batch to :class:`WriteBehind` and decodes its next batch while the thread
waits for the tier's writer lock and the page cache. At most :data:`WRITE_QUEUE` batches wait; a full queue blocks
the reader (bounded memory). The error of a failed background commit is raised in the reading thread.
"""

from __future__ import annotations

import multiprocessing.util
import queue
import threading
from collections.abc import Callable

__all__ = ["WRITE_QUEUE", "WriteBehind", "Writes"]

WRITE_QUEUE = 4  # batches waiting for the writer thread (~9.6 MB each at 224 px); a full queue blocks the reader

Writes = list[tuple[bytes, bytes | bytearray]]  # (tier key, entry) pairs of one batch


class WriteBehind:
    """This process's writer thread for :class:`~lightning_accel.data.cache.SampleCache` misses (see its
    ``write_behind``).

    Runs each submitted ``commit(writes)`` in submission order; the error of a failed commit is raised by the next
    :meth:`submit` or :meth:`flush`, in the reading thread. Made on first use in each process (a
    :class:`~lightning_accel._utils.forksafe.PerProcess`): a forked child has none of its parent's thread or queue.
    """

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[Callable[[Writes], None], Writes]] = queue.Queue(maxsize=WRITE_QUEUE)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="la-cache-writer", daemon=True)
        self._thread.start()
        # DataLoader workers leave through multiprocessing's exit path, which runs these finalisers (not atexit):
        # commit what is queued so the next epoch finds it.
        multiprocessing.util.Finalize(self, self.flush, kwargs={"raise_errors": False}, exitpriority=10)

    def submit(self, commit: Callable[[Writes], None], writes: Writes) -> None:
        """Queue ``commit(writes)``; raises the error of an earlier background commit (e.g. BudgetTooSmallError)."""
        self._raise_error()
        self._q.put((commit, writes))

    def flush(self, raise_errors: bool = True) -> None:
        """Wait until every queued commit ran; then raise the error of a failed one (``raise_errors``)."""
        if self._thread.is_alive():
            self._q.join()
        if raise_errors:
            self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _run(self) -> None:
        while True:
            commit, writes = self._q.get()
            try:
                commit(writes)
            except Exception as e:  # disk errors disable the tier inside put_many; this is bad input (budget)
                self.error = e  # raised by the next submit, in the reading thread
            finally:
                self._q.task_done()
