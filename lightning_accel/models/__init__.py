"""Reference models used by the quickstart, the tests and the benchmarks.

``SmallResNet`` and ``GPT``/``GPTBlock`` are plain ``nn.Module``s; ``ImageClassifier`` and ``TinyGPT`` are the
LightningModules around them (imported lazily: they need Lightning).
"""

from __future__ import annotations

from typing import Any

from lightning_accel.models.resnet import BasicBlock, SmallResNet
from lightning_accel.models.transformer import GPT, CausalSelfAttention, GPTBlock

__all__ = ["GPT", "BasicBlock", "CausalSelfAttention", "GPTBlock", "ImageClassifier", "SmallResNet", "TinyGPT"]


def __getattr__(name: str) -> Any:
    if name in ("ImageClassifier", "TinyGPT"):
        from lightning_accel.models import lit

        return getattr(lit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
