"""Reference models used by the quickstart, the tests and the benchmarks.

``SmallResNet`` and ``GPT``/``GPTBlock`` are plain ``nn.Module``s; ``ImageClassifier`` and ``TinyGPT`` are the
LightningModules around them (imported lazily: they need Lightning).
"""

from __future__ import annotations

from lightning_accel._utils.lazy import lazy_getattr
from lightning_accel.models.resnet import BasicBlock, SmallResNet
from lightning_accel.models.transformer import GPT, CausalSelfAttention, GPTBlock

__all__ = ["GPT", "BasicBlock", "CausalSelfAttention", "GPTBlock", "ImageClassifier", "SmallResNet", "TinyGPT"]


# Lightning adapters, imported on first access so the core stays importable without Lightning's import cost
__getattr__ = lazy_getattr(
    __name__,
    {
        "ImageClassifier": "lightning_accel.models.lit",
        "TinyGPT": "lightning_accel.models.lit",
    },
)
