"""Shared fixtures: temporary cache dirs, a real S3 endpoint (moto), digits data, GPU skipping."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

# Tests must not pick up a developer's AWS profile or hit a real endpoint.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    """Destroy torch's default process group after each test that left one up.

    A Trainer with a DDP-family strategy in this process initialises a (1-process gloo) group that Lightning's
    teardown keeps; every later test of the session would then see a distributed process (ranks from the group, not
    the environment), so the outcome of a test would depend on the order tests run in.
    """
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Put ``os.environ`` back as it was before each test.

    Lightning's launcher and ``seed_everything`` write ``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_PORT``,
    ``PL_GLOBAL_SEED`` ... into this process's environment. A later test that starts ``lightning-accel`` with a copy
    of it would then run as an externally launched rank 0 (``LOCAL_RANK`` set): it never starts its second process
    and waits for it forever.
    """
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def _ram_tiers_in_a_session_dir() -> Iterator[None]:
    """Default RAM tiers of this session go under one directory on tmpfs, removed at the end: no test leaves
    anything in /dev/shm (sessions running side by side never see each other's tiers either)."""
    import shutil

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        yield
        return
    root = os.path.join(base, f"lightning_accel-tests-{uuid.uuid4().hex[:8]}")
    old = os.environ.get("LIGHTNING_ACCEL_RAM_ROOT")
    os.environ["LIGHTNING_ACCEL_RAM_ROOT"] = root
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIGHTNING_ACCEL_RAM_ROOT", None)
        else:
            os.environ["LIGHTNING_ACCEL_RAM_ROOT"] = old
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def tmp_cache_dir(tmp_path: Path) -> Path:
    """An empty, writable directory for a cache or checkpoint store."""
    d = tmp_path / "cache"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 HTTP endpoint: moto's ``ThreadedMotoServer`` on 127.0.0.1 and a free port, for the whole session."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs ``storage_options`` for the moto endpoint (listing cache off so tests see their own writes)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "use_listings_cache": False,
    }


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket: yields ``(bucket_name, storage_options)``; use URLs like ``s3://{bucket}/key``."""
    import fsspec

    opts = s3_storage_options(s3_endpoint)
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    fs.mkdir(name)
    yield name, opts


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits as 32 px JPEGs (1,797 files), made once per test session. Treat as read-only."""
    from lightning_accel.datasets import materialize_digits

    root = tmp_path_factory.mktemp("digits32")
    materialize_digits(root, size=32)
    return root


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the test, restored afterwards.

    For rooms of tiny ops (request it from an autouse fixture in their conftest): on a shared 2-core machine a second
    OpenMP thread spin-waiting made a 30-step tiny-GPT fit 30x slower (12 s instead of 0.4 s of compute).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
