"""Every fused-op kernel indexes memory in int64 (:mod:`lightning_accel.ops.indexing_triton`).

The kernels themselves run under the interpreter in ``interp_kernels.py`` (a program whose block starts past 2**31
elements must touch nothing of a small tensor); this checks, without Triton, that no kernel takes a bare int32
``tl.program_id`` to compute offsets from, the norm kernels' ``row * stride`` included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_accel.ops as ops

OPS = Path(ops.__file__).resolve().parent


def test_kernels_start_their_offsets_from_the_int64_program_start() -> None:
    kernels = sorted(p for p in OPS.rglob("*.py") if "@triton.jit" in p.read_text())
    assert {p.relative_to(OPS).as_posix() for p in kernels} >= {
        "conv_bn_relu/triton.py",
        "linear_dropout/triton.py",
        "norm/triton.py",
    }
    bare = []
    for path in kernels:
        if path.name == "indexing_triton.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("program_id", "num_programs"):
                bare.append(f"{path.relative_to(OPS)}:{node.lineno}")
    assert not bare, f"int32 program ids (use indexing_triton.program_start): {bare}"
