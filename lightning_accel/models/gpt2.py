"""A GPT-2 style transformer block (the layout of Hugging Face's ``GPT2Block``, with ``nn.Linear`` projections).

``GPT2Block`` has ``ln_1``, ``attn`` (``c_attn``: one packed ``Linear(C, 3 * C)``, ``c_proj``, ``attn_dropout``,
``resid_dropout``), ``ln_2`` and ``mlp`` (``c_fc``, ``act``, ``c_proj``, ``dropout``). Its forward is its own, so module
surgery fuses it only because this module registers both classes with their fused forwards
(:class:`~lightning_accel.precision.modules.FusedPackedAttentionMixin`,
:class:`~lightning_accel.precision.modules.FusedGPT2BlockMixin`): a block of the same layout in your code registers
the same way (docs/fused.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.precision.modules import FusedGPT2BlockMixin, FusedPackedAttentionMixin, register_block

__all__ = ["GPT2MLP", "GPT2Attention", "GPT2Block"]


class GPT2Attention(nn.Module):
    """Causal self-attention with a packed ``c_attn`` projection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"`n_embd` must be a multiple of `n_head`, got {n_embd} and {n_head}. Change either.")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.n_head, c // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(c, 2))
        p = self.attn_dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, s, c)))


class GPT2MLP(nn.Module):
    """``dropout(c_proj(act(c_fc(x))))`` with ``act`` GELU (tanh approximation, as GPT-2)."""

    def __init__(self, n_embd: int, dropout: float = 0.0, hidden: int | None = None) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden or 4 * n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden or 4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = GPT2Attention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = GPT2MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


register_block(GPT2Attention, FusedPackedAttentionMixin)
register_block(GPT2Block, FusedGPT2BlockMixin)
