"""One intra-op thread for this room's tests (restored afterwards): the ops are tiny, and on a shared 2-core machine
a second OpenMP thread spin-waiting made a 30-step tiny-GPT fit 30x slower (12 s instead of 0.4 s of compute)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
