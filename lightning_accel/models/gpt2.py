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

from lightning_accel._utils.checks import check_int, check_number, check_seed
from lightning_accel.models.transformer import _check_heads
from lightning_accel.precision.modules import FusedGPT2BlockMixin, FusedPackedAttentionMixin, register_block

__all__ = ["GPT2Attention", "GPT2Block", "GPT2Embedding", "GPT2Head", "GPT2MLP", "gpt2_lm"]


class GPT2Attention(nn.Module):
    """Causal self-attention with a packed ``c_attn`` projection.

    Raises:
        TypeError, ValueError: ``n_embd`` or ``n_head`` is not an integer >= 1, ``n_head`` does not divide
            ``n_embd``, or ``dropout`` is not a probability in [0, 1).
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        _check_heads(n_embd, n_head)
        check_number("dropout", dropout, low=0, high=1, high_open=True, fix="It is a probability; 0 disables it.")
        # the q/k/v width is an attribute, not read from the input: tensor parallel divides it with `n_head`
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c, hd = self.n_embd, self.n_embd // self.n_head
        q, k, v = (t.view(b, s, self.n_head, hd).transpose(1, 2) for t in self.c_attn(x).split(c, 2))
        p = self.attn_dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, s, c)))


class GPT2MLP(nn.Module):
    """``dropout(c_proj(act(c_fc(x))))`` with ``act`` GELU (tanh approximation, as GPT-2); ``hidden`` is the inner
    width (``None``: ``4 * n_embd``).

    Raises:
        TypeError, ValueError: ``n_embd`` or ``hidden`` is not an integer >= 1, or ``dropout`` is not a probability in
            [0, 1).
    """

    def __init__(self, n_embd: int, dropout: float = 0.0, hidden: int | None = None) -> None:
        super().__init__()
        check_int("n_embd", n_embd, low=1)
        check_int("hidden", hidden, low=1, allow_none=True, fix="None uses 4 * n_embd.")
        check_number("dropout", dropout, low=0, high=1, high_open=True, fix="It is a probability; 0 disables it.")
        self.c_fc = nn.Linear(n_embd, hidden or 4 * n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden or 4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Raises:
        TypeError, ValueError: as :class:`GPT2Attention`.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        # before the first layer is built: `LayerNorm(-4)` stopped with torch's "negative dimension", naming no argument
        _check_heads(n_embd, n_head)
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = GPT2Attention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = GPT2MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


register_block(GPT2Attention, FusedPackedAttentionMixin)
register_block(GPT2Block, FusedGPT2BlockMixin)


class GPT2Embedding(nn.Module):
    """Token (``wte``) + position (``wpe``) embeddings.

    Raises:
        TypeError, ValueError: ``vocab``, ``seq`` or ``n_embd`` is not an integer >= 1 (an embedding of 0 tokens was
            built, and failed on the first token it was given).
    """

    def __init__(self, vocab: int, seq: int, n_embd: int) -> None:
        super().__init__()
        for name, value in (("vocab", vocab), ("seq", seq), ("n_embd", n_embd)):
            check_int(name, value, low=1)
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(seq, n_embd)
        self.seq = seq

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        if s > self.seq:  # else the position embedding's bare "IndexError: index out of range in self"
            raise ValueError(f"Sequence length {s} exceeds `seq` {self.seq}, the longest sequence this model embeds.")
        if s == 0:  # else the attention's "cannot reshape tensor of 0 elements"
            raise ValueError("Sequence length 0: the model embeds 1 to `seq` tokens. Pass at least one token.")
        return self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))


class GPT2Head(nn.Module):
    """Final LayerNorm and the LM ``head`` (its weight is the embedding's, tied by :func:`gpt2_lm`).

    Raises:
        TypeError, ValueError: ``vocab`` or ``n_embd`` is not an integer >= 1.
    """

    def __init__(self, vocab: int, n_embd: int) -> None:
        super().__init__()
        check_int("vocab", vocab, low=1)
        check_int("n_embd", n_embd, low=1)
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt2_lm(
    vocab: int = 64,
    seq: int = 16,
    layers: int = 2,
    heads: int = 4,
    width: int = 32,
    dropout: float = 0.0,
    seed: int = 0,
) -> nn.Sequential:
    """``nn.Sequential(GPT2Embedding, GPT2Block x layers, GPT2Head)`` with the head tied to the token embedding
    (``net[-1].head.weight is net[0].wte.weight``): the form a pipeline splits, with the packed attention and tied
    weights the parallel plans handle. GPT-2's initialisation (N(0, 0.02) weights, zero biases) is drawn from the CPU
    generator seeded with ``seed`` inside :func:`torch.random.fork_rng`: the same ``seed`` gives the same weights in
    every process, and the caller's global random state (``seed_everything``'s) is left as it was.

    Raises:
        TypeError: a size or ``seed`` that is not an integer, or a ``dropout`` that is not a number, naming it.
        ValueError: a size below 1, a ``seed`` outside ``seed_everything``'s range ``0 .. 2**32 - 1``, a ``dropout``
            outside [0, 1), or a ``width`` that ``heads`` does not divide.
    """
    for name, value in (("vocab", vocab), ("seq", seq), ("layers", layers), ("heads", heads), ("width", width)):
        check_int(name, value, low=1)
    check_number("dropout", dropout, low=0, high=1, high_open=True, fix="It is a probability; 0 disables it.")
    check_seed("seed", seed, what="the initial weights")
    _check_heads(width, heads, width="width", heads="heads")
    # A forked generator state: reseeding the global one here would make everything the caller draws afterwards
    # (dropout masks, shuffles) the same whatever seed they had set. The CPU generator alone is seeded, as
    # torch.manual_seed did on CPU (same weights as before), and no CUDA state is touched.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        embed, head = GPT2Embedding(vocab, seq, width), GPT2Head(vocab, width)
        head.head.weight = embed.wte.weight
        net = nn.Sequential(embed, *[GPT2Block(width, heads, dropout) for _ in range(layers)], head)
        for m in net.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
    return net
