"""A single-process, loop-by-loop simulation of the 1-bit two-phase allreduce (the test oracle), and the toy model
whose gradients the DDP tests choose.

Written from the algorithm's description, not from the package's vectorised code: it loops over blocks and ranks
and only shares the block table (which ``test_compress.py`` checks against its own definition).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from lightning_accel.comm.compress import GroupLayout


class Params(nn.Module):
    """Parameters of the given shapes (seeded); ``forward(coeffs)`` is ``sum(p * c)``, so ``d loss / d p = c``."""

    def __init__(self, sizes: Sequence[tuple[int, ...]]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(*s, generator=g)) for s in sizes])

    def forward(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.ps, coeffs, strict=True))


def _blocks(lengths: torch.Tensor, valid: torch.Tensor) -> list[tuple[int, int, int]]:
    out, pos = [], 0
    for length, v in zip(lengths.tolist(), valid.tolist(), strict=True):
        out.append((pos, int(length), int(v)))
        pos += int(length)
    return out


def _compress(x: torch.Tensor, mask: torch.Tensor, blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """Decoded ``±mean|x|`` per block on real elements (0 elsewhere)."""
    x = torch.where(mask, x, 0.0)
    dec = torch.zeros_like(x)
    for a, length, v in blocks:
        seg = x[a : a + length]
        s = seg.abs().sum() / v if v else torch.tensor(0.0)
        dec[a : a + length] = torch.where(seg >= 0, s, -s)
    return torch.where(mask, dec, 0.0)


class Simulation:
    """Carries every rank's worker/server error between steps for one group."""

    def __init__(self, numels: list[int], world_size: int, block_size: int, error_feedback: bool = True) -> None:
        self.layout = GroupLayout(numels, world_size, block_size, torch.device("cpu"))
        self.n = world_size
        self.ef = error_feedback
        lay = self.layout
        self.e_w = [torch.zeros(lay.padded_numel) for _ in range(world_size)]
        self.e_s = [torch.zeros(lay.chunk_numel) for _ in range(world_size)]

    def canon(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Per-parameter flat tensors (canonical order) -> padded canonical buffer."""
        x = torch.zeros(self.layout.padded_numel)
        for o, p in zip(self.layout.offsets, params, strict=True):
            x[o : o + p.numel()] = p.reshape(-1).float()
        return x

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x[o : o + n].clone() for o, n in zip(self.layout.offsets, self.layout.numels, strict=True)]

    def step(self, grads_per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """One compressed step; returns the averaged gradient per parameter (canonical order)."""
        lay = self.layout
        full_blocks = _blocks(lay.table.lengths, lay.table.valid)
        decoded, new_w = [], []
        for r in range(self.n):
            x = self.canon(grads_per_rank[r]) + (self.e_w[r] if self.ef else 0)
            d = _compress(x, lay.table.mask, full_blocks)
            decoded.append(d)
            new_w.append(torch.where(lay.table.mask, x - d, 0.0))
        out = torch.zeros(lay.padded_numel)
        new_s = []
        c = lay.chunk_numel
        for r in range(self.n):
            ch = lay.chunks[r]
            avg = torch.stack([decoded[j][r * c : (r + 1) * c] for j in range(self.n)]).mean(0)
            x = avg + (self.e_s[r] if self.ef else 0)
            d = _compress(x, ch.mask, _blocks(ch.lengths, ch.valid))
            out[r * c : (r + 1) * c] = d
            new_s.append(torch.where(ch.mask, x - d, 0.0))
        if bool(torch.isfinite(out).all()):
            self.e_w, self.e_s = new_w, new_s
        return self.split(out)
