"""One pair of gloo processes for the plain-DDP scenarios of ``test_hook.py`` and ``test_momentum.py``.

Spawning a pair costs ~8 s of imports on the 2-core machine; both modules' scenarios run in the same launch.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import run_in_processes


def _both(rank: int, world: int) -> dict[str, Any]:
    from tests.comm import test_hook, test_momentum

    return {"hook": test_hook._run_all(rank, world), "momentum": test_momentum._run_all(rank, world)}


@pytest.fixture(scope="session")
def ddp_pair_results() -> list[dict[str, Any]]:
    """Per rank: ``{"hook": test_hook scenarios, "momentum": test_momentum scenarios}``."""
    return run_in_processes(_both, 2)
