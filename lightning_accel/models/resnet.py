"""A small ResNet-style image classifier (torchvision's BasicBlock layout, narrower and shallower)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_accel._utils.checks import check_int
from lightning_accel.precision.modules import FusedBasicBlockMixin, register_block

__all__ = ["BasicBlock", "SmallResNet"]


def _check_blocks(blocks: object) -> tuple[int, ...]:
    """``blocks`` (blocks per stage) as a tuple of integers >= 1, or one line naming what is wrong.

    A stage of 0 (or a negative number of) blocks would be skipped silently, building a smaller network than asked.

    Raises:
        TypeError: ``blocks`` is not a sequence of integers (a string, a bare integer, a bool inside).
        ValueError: it is empty, or a stage has fewer than one block.
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
        raise TypeError(
            f"`blocks` must be a list of blocks per stage (integers >= 1), got {blocks!r} ({type(blocks).__name__}). "
            "E.g. `blocks=(1, 1, 1)` for three stages of one block."
        )
    if not blocks:
        raise ValueError(f"`blocks` must be a non-empty list of blocks per stage, got {blocks!r}.")
    for i, n in enumerate(blocks):
        check_int(f"blocks[{i}]", n, low=1, fix="Every stage needs a block: leave the stage out instead.")
    return tuple(blocks)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN (+ shortcut) -ReLU, attribute names as in ``torchvision.models.resnet``.

    Raises:
        TypeError, ValueError: ``in_ch``, ``out_ch`` or ``stride`` is not an integer >= 1 (a block of 0 channels, or
            of stride 0, was built and failed only in its first forward).
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        check_int("in_ch", in_ch, low=1, fix="It is the input's channels.")
        check_int("out_ch", out_ch, low=1, fix="It is the block's output channels.")
        check_int("stride", stride, low=1, fix="1 keeps the size, 2 halves it.")
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


# the forward above is the one FusedBasicBlockMixin reimplements: let FusedPrecision fuse it
register_block(BasicBlock, FusedBasicBlockMixin)


class SmallResNet(nn.Module):
    """Stem (conv-BN-ReLU as an ``nn.Sequential``) + stages of ``BasicBlock`` + global pool + linear head.

    Args:
        num_classes: output logits.
        width: channels of the first stage; each later stage doubles it.
        blocks: number of blocks per stage, each at least 1 (its length is the number of stages).
        in_channels: input channels.
    """

    def __init__(
        self, num_classes: int = 10, width: int = 32, blocks: Sequence[int] = (1, 1, 1), in_channels: int = 3
    ) -> None:
        super().__init__()
        check_int("num_classes", num_classes, low=2)
        check_int("width", width, low=1)
        check_int("in_channels", in_channels, low=1, fix="It is the images' channels: 3 for RGB, 1 for grey.")
        blocks = _check_blocks(blocks)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        layers: list[nn.Module] = []
        ch = width
        for i, n in enumerate(blocks):
            out = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(ch, out, stride=2 if (j == 0 and i > 0) or (i == 0 and j == 0) else 1))
                ch = out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))
