"""A small GPT-style decoder (pre-norm blocks with separate q, k, v projections, as in nanoGPT-style code)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel._utils.checks import check_bool, check_int, check_number
from lightning_accel.precision.modules import FusedAttentionMixin, FusedGPTBlockMixin, register_block

__all__ = ["GPT", "CausalSelfAttention", "GPTBlock", "GPTEmbedding", "GPTHead"]


def _check_heads(n_embd: object, n_head: object, *, width: str = "n_embd", heads: str = "n_head") -> None:
    """Check an attention layer's width and head count: integers >= 1, the width a multiple of the heads.

    A head count of 0 used to stop with a bare ``ZeroDivisionError``, and a negative one (it divides the width) built
    a layer that failed only in its first forward.

    Args:
        n_embd: the model width.
        n_head: the number of heads.
        width: the width's argument name in the message.
        heads: the head count's argument name in the message.

    Raises:
        TypeError: a value that is not an integer (a bool neither).
        ValueError: a value below 1, or a width that the head count does not divide.
    """
    c: int = check_int(width, n_embd, low=1)
    h: int = check_int(heads, n_head, low=1, fix="It is the number of attention heads.")
    if c % h:
        raise ValueError(
            f"`{width}` must be a multiple of `{heads}`, got {width}={c}, {heads}={h}. Each head takes "
            f"{width} / {heads} channels: e.g. {width}={h * max(1, round(c / h))}."
        )


def _check_length(s: int, block_size: int) -> None:
    """Refuse a sequence the model cannot embed: longer than ``block_size`` (the position embedding's bare
    ``IndexError``), or empty (the attention's "cannot reshape tensor of 0 elements")."""
    if not 1 <= s <= block_size:
        raise ValueError(
            f"Sequence length {s} is outside 1..{block_size}: the model embeds 1 to `block_size` tokens. Pass "
            f"sequences of that length, or a larger `block_size`."
        )


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate ``q_proj``/``k_proj``/``v_proj`` and an output ``proj`` + dropout.

    Raises:
        TypeError, ValueError: ``n_embd`` or ``n_head`` is not an integer >= 1, ``n_head`` does not divide
            ``n_embd``, ``dropout`` is not a probability in [0, 1), or ``bias`` is not a bool.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        _check_heads(n_embd, n_head)
        check_number("dropout", dropout, low=0, high=1, high_open=True, fix="It is a probability; 0 disables it.")
        # a string is truthy: bias="no" built the biases it asked to leave out
        check_bool("bias", bias)
        self.n_head = n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, c = t.shape
        return t.view(b, s, self.n_head, c // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0
        )
        # -1, not `c`: under a tensor-parallel plan this rank holds `n_head / tp` heads, i.e. `c / tp` features
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, s, -1)))


class GPTBlock(nn.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; the MLP is ``fc -> GELU -> proj -> Dropout``.

    Raises:
        TypeError, ValueError: as :class:`CausalSelfAttention`, or ``mlp_ratio`` is not an integer >= 1.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, mlp_ratio: int = 4, bias: bool = True) -> None:
        super().__init__()
        # before the first layer is built: `LayerNorm(-1)` stopped with torch's "negative dimension", naming no argument
        _check_heads(n_embd, n_head)
        check_int("mlp_ratio", mlp_ratio, low=1, fix="The MLP's hidden width is mlp_ratio * n_embd (4 in GPT-2).")
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, mlp_ratio * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(mlp_ratio * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# these forwards are the ones the mixins reimplement: let FusedPrecision pack QKV and fuse the residual epilogues
register_block(CausalSelfAttention, FusedAttentionMixin)
register_block(GPTBlock, FusedGPTBlockMixin)


class GPTEmbedding(nn.Module):
    """The first pipeline piece of :class:`GPT`: token + position embeddings and dropout (shares the GPT's modules)."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Dropout, block_size: int) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop, self.block_size = tok_emb, pos_emb, drop, block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        _check_length(s, self.block_size)
        return self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(s, device=idx.device)))


class GPTHead(nn.Module):
    """The last pipeline piece of :class:`GPT`: final LayerNorm and the (tied) LM head."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` ``GPTBlock``s, final LayerNorm, tied LM head.

    Args:
        vocab_size: number of tokens.
        block_size: maximum sequence length.
        n_layer: number of blocks.
        n_head: attention heads.
        n_embd: model width.
        dropout: dropout probability (embeddings, attention, residual).
    """

    def __init__(
        self,
        vocab_size: int = 27,
        block_size: int = 65,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "block_size": block_size,
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
        }
        for name, value in sizes.items():
            check_int(name, value, low=1)
        _check_heads(n_embd, n_head)
        check_number("dropout", dropout, low=0, high=1, high_open=True, fix="It is a probability; 0 disables it.")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def pipeline_modules(self) -> list[nn.Module]:
        """The forward as pieces for a pipeline split: embedding, each block, head (their composition is
        :meth:`forward`; the tied head weight is shared by the first and last piece)."""
        return [
            GPTEmbedding(self.tok_emb, self.pos_emb, self.drop, self.block_size),
            *self.blocks,
            GPTHead(self.ln_f, self.head),
        ]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        _check_length(s, self.block_size)
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
