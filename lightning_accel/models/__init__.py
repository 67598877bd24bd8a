"""Reference models used by the quickstart, the tests and the benchmarks.

``SmallResNet`` and ``GPT``/``GPTBlock`` are plain ``nn.Module``s; ``ImageClassifier`` and ``TinyGPT`` are the
LightningModules around them.
"""

from __future__ import annotations

from lightning_accel.models.lit import ImageClassifier, TinyGPT
from lightning_accel.models.resnet import BasicBlock, SmallResNet
from lightning_accel.models.transformer import GPT, CausalSelfAttention, GPTBlock

__all__ = ["GPT", "BasicBlock", "CausalSelfAttention", "GPTBlock", "ImageClassifier", "SmallResNet", "TinyGPT"]
