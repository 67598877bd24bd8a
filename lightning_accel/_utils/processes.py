"""Whether a process named by its pid still runs: the one check behind every "is the owner of this file alive?".

Several rooms leave a pid in a file another process may find later: the checkpoint writer lock, the packed origin's
read-ahead markers, a tune's trial folder. Each decides from it whether the owner is gone (its file may be taken over
or removed) with :func:`process_running`; :func:`process_start` tells a process from a later one given the same pid.
"""

from __future__ import annotations

import os

__all__ = ["process_running", "process_start"]


def process_running(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (signal 0: nothing is sent). One of another user's counts as
    running (the kernel refuses the signal, but the process is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), None where it cannot be read: with the
    pid it names one process, not a later one that was given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
