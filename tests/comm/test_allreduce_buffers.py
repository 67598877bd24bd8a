"""``OneBitBuffers`` (kept compressor/decode buffers) against the allocating path, in a 1-process gloo group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_accel.comm.allreduce import OneBitAllreduce, OneBitBuffers
from lightning_accel.comm.compress import Compressor, GroupLayout, compress_fast


@pytest.fixture
def group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    if dist.is_initialized():  # another test of this process owns the default group
        pytest.skip("needs its own 1-process default group")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


def test_buffers_give_the_same_bits_and_the_same_finite_verdict(group: dist.ProcessGroup) -> None:
    numels = [37 * 29, 10, 300, 7 * 13]
    layout = GroupLayout(numels, 1, 64, "cpu")
    bufs = OneBitBuffers(layout, 0)
    g = torch.Generator().manual_seed(0)
    errs = {k: (torch.zeros(layout.padded_numel), torch.zeros(layout.chunk_numel)) for k in ("plain", "kept")}
    for step in range(4):
        x = torch.randn(layout.padded_numel, generator=g) * (1 + step)
        x[~layout.table.mask] = 0.0
        if step == 2:
            x[5] = float("nan")
        results = {}
        for k, b in (("plain", None), ("kept", bufs)):
            w, s = errs[k]
            op = OneBitAllreduce(x, layout, w, s, group=group, compress=compress_fast, buffers=b)
            res = op.start().serve().finish()
            # the verdict from the scales equals the verdict over the decoded real elements
            assert bool(res.finite) == bool(torch.isfinite(torch.where(layout.table.mask, res.out, 0.0)).all())
            assert bool(res.finite) == (step != 2)
            results[k] = (res.out.clone(), res.worker_error, res.server_error)
            if bool(res.finite):
                assert res.worker_error is not None and res.server_error is not None
                if b is None:
                    w.copy_(res.worker_error)
                    s.copy_(res.server_error)
                else:
                    errs[k] = (b.worker.exchange_error(w), b.server.exchange_error(s))
        mask = layout.table.mask
        # bit for bit (NaN included) on the real elements
        assert torch.equal(results["plain"][0][mask].view(torch.int32), results["kept"][0][mask].view(torch.int32))
        for a, b2 in zip(errs["plain"], errs["kept"], strict=True):
            assert torch.equal(a.view(torch.int32), b2.view(torch.int32))


def test_buffers_and_exchange_reject_mismatches(group: dist.ProcessGroup) -> None:
    layout = GroupLayout([16], 1, 8, "cpu")
    other = GroupLayout([16], 1, 8, "cpu")
    x = torch.zeros(layout.padded_numel)
    with pytest.raises(ValueError, match="`buffers`"):
        OneBitAllreduce(x, layout, None, None, group=group, buffers=OneBitBuffers(other, 0))
    comp = Compressor(layout.table)
    with pytest.raises(ValueError, match="`t` must be"):
        comp.exchange_error(torch.zeros(layout.padded_numel + 8))
