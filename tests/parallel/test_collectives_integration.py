"""What the sharded and pipeline strategies send between ranks (2 gloo processes): a batch gathered over a
tensor-parallel group or a pipeline (``batch_split="world"``) and the buffers copied from rank 0 keep every dtype,
including those gloo carries no collective of (16-bit and unsigned integers, float8: a uint16 token batch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import run_in_processes

DTYPES = [torch.uint16, torch.int16, torch.uint32, torch.float8_e4m3fn, torch.bool, torch.int64, torch.bfloat16]


def _rows(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``r``'s batch: ``2 + r`` rows of 3 tokens (unequal counts, as a loader's last batches)."""
    return (torch.arange(3 * (2 + rank)).reshape(2 + rank, 3) % 2 + rank).to(dtype)


def _send(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    from lightning_accel.parallel.strategies._helpers import broadcast_buffers, gather_batch

    out: dict[str, Any] = {}
    for name in names:
        dtype = getattr(torch, name)
        gathered = gather_batch({"tokens": _rows(rank, dtype), "first": _rows(rank, dtype)[:, 0]}, None)
        module = torch.nn.Module()
        module.register_buffer("table", torch.full((4,), rank + 1).to(dtype))
        module.register_buffer("stats", torch.full((2,), float(rank)))
        broadcast_buffers(module, src=0)
        out[name] = {
            # as int64 (and the dtype's name): every dtype here converts exactly, and numpy has no uint16 / float8
            "tokens": gathered["tokens"].to(torch.int64).tolist(),
            "first": gathered["first"].to(torch.int64).tolist(),
            "dtypes": {str(gathered["tokens"].dtype), str(module.table.dtype)},
            "table": module.table.to(torch.int64).tolist(),
            "stats": module.stats.tolist(),
        }
    return out


@pytest.fixture(scope="module")
def sent() -> list[dict[str, Any]]:
    names = [str(d).removeprefix("torch.") for d in DTYPES]
    return run_in_processes(_send, 2, (names,), timeout=120)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_batch_and_buffers_of_any_dtype_cross_the_ranks(sent: list[dict[str, Any]], dtype: torch.dtype) -> None:
    want = torch.cat([_rows(0, dtype), _rows(1, dtype)]).to(torch.int64)
    for rank in sent:
        got = rank[str(dtype).removeprefix("torch.")]
        assert got["tokens"] == want.tolist() and got["first"] == want[:, 0].tolist()
        assert got["dtypes"] == {str(dtype)}
        assert got["table"] == [1, 1, 1, 1] and got["stats"] == [0.0, 0.0]  # rank 0's, on every rank
