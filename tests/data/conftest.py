"""Fixtures of the data room: a small digits tree (fast to list, decode and cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def small_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 digits as 24 px JPEGs in an ImageFolder tree (about 20 per class). Treat as read-only."""
    from lightning_accel.datasets import materialize_digits

    root = tmp_path_factory.mktemp("digits24")
    materialize_digits(root, size=24, num_images=200)
    return root
