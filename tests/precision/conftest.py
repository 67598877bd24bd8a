"""One intra-op thread for this room's tests (the ops are tiny; see ``one_torch_thread`` in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Applies the shared fixture to every test of this room."""
