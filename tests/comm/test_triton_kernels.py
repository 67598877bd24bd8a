"""The fused Triton compressor against the torch reference, on CPU through ``TRITON_INTERPRET=1``.

The interpreter must be switched on before ``triton`` is imported, and Lightning (imported by other tests in this
session) imports triton, so the comparison runs in a fresh subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_accel._utils.triton import triton_available

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import torch
    from lightning_accel.comm.compress import GroupLayout, compress_reference
    from lightning_accel.comm.triton_kernels import compress_triton

    torch.manual_seed(0)
    checked = 0
    for numels, world, block in [([10, 300, 5], 2, 64), ([129], 3, 32), ([8, 8], 1, 8)]:
        lay = GroupLayout(numels, world, block, torch.device("cpu"))
        for ef, ls in [(False, None), (True, None), (True, torch.tensor(512.0))]:
            g = torch.randn(lay.padded_numel) * lay.table.mask
            g[5] = 0.0
            e = torch.randn(lay.padded_numel) * lay.table.mask * 0.01 if ef else None
            ref = compress_reference(g, e, lay.table, ls)
            got = compress_triton(g, e, lay.table, ls)
            assert torch.equal(ref[0], got[0]), "packed bits differ"
            torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-7)
            if ef:
                torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
            else:
                assert got[2] is None
            # into caller-owned buffers: the same values, the buffers returned
            bufs = (torch.empty_like(got[0]), torch.empty_like(got[1]), torch.empty_like(g) if ef else None)
            into = compress_triton(g, e, lay.table, ls, out=bufs)
            assert into[0] is bufs[0] and into[1] is bufs[1] and into[2] is bufs[2]
            assert torch.equal(into[0], got[0]) and torch.equal(into[1], got[1])
            assert not ef or torch.equal(into[2], got[2])
            # one rank's chunk table (chunk-relative starts)
            c = lay.chunks[-1]
            gc = g[-lay.chunk_numel :].contiguous()
            ref_c, got_c = compress_reference(gc, None, c), compress_triton(gc, None, c)
            assert torch.equal(ref_c[0], got_c[0])
            torch.testing.assert_close(got_c[1], ref_c[1], rtol=1e-6, atol=1e-7)
            checked += 1
    g = torch.randn(lay.padded_numel)
    g[1] = float("nan")
    assert torch.isnan(compress_triton(g, None, lay.table)[1][0])
    # the hook's switch: `compressor_backend="triton"` runs the kernel on CPU gradients under the interpreter
    from lightning_accel.comm import OneBitState
    assert OneBitState(compressor_backend="triton").compressor(torch.device("cpu")) is compress_triton
    try:
        compress_triton(g, g.clone(), lay.table, out=(torch.empty(lay.padded_numel // 8, dtype=torch.uint8),
                                                      torch.empty(lay.num_blocks), None))
    except ValueError as err:
        assert "`out`" in str(err)
    else:
        raise AssertionError("a missing new-error buffer was accepted")
    print("checked", checked)
    """
)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_compressor_matches_reference_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked 9" in proc.stdout
