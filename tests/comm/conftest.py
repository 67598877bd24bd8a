"""One pair of gloo processes for the plain-DDP scenarios of ``test_hook.py`` and ``test_momentum.py``, and a gloo
group of the test process alone for state machines driven in one process.

Spawning a pair costs ~8 s of imports on the 2-core machine; both modules' scenarios run in the same launch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from tests.helpers import run_in_processes


def _both(rank: int, world: int) -> dict[str, Any]:
    from tests.comm import test_hook, test_momentum

    return {"hook": test_hook._run_all(rank, world), "momentum": test_momentum._run_all(rank, world)}


@pytest.fixture(scope="session")
def ddp_pair_results() -> list[dict[str, Any]]:
    """Per rank: ``{"hook": test_hook scenarios, "momentum": test_momentum scenarios}``."""
    return run_in_processes(_both, 2)


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A gloo default group of this process alone (world size 1), destroyed after the test: the compressed allreduce
    and ``LocalSteps`` need a group, and a one-rank group runs them in milliseconds without spawning ranks."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
