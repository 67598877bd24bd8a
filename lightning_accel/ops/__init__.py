"""Fused operators: one folder per op, each a ladder of reference (pure torch) -> Triton kernels -> autograd.Function.

- :mod:`~lightning_accel.ops.norm`: LayerNorm and RMSNorm, forward and backward in one Triton kernel each.
- :mod:`~lightning_accel.ops.linear_dropout`: ``dropout(x @ W.T + b) (+ residual)``, mask regenerated from a seed.
- :mod:`~lightning_accel.ops.conv_bn_relu`: Conv2d -> BatchNorm2d (-> ReLU) that recomputes instead of storing.

Every op runs its Triton kernels on CUDA tensors and plain torch ops elsewhere (``backend="auto"``; the switch and its
other values are :mod:`lightning_accel._utils.triton`). Nothing in this package imports ``lightning``; Triton is
imported only when a kernel is first launched.
"""

from lightning_accel.ops.conv_bn_relu.function import conv_bn_relu, fold_bn_into_conv
from lightning_accel.ops.linear_dropout.function import linear_dropout
from lightning_accel.ops.norm.function import layer_norm, rms_norm

__all__ = ["conv_bn_relu", "fold_bn_into_conv", "layer_norm", "linear_dropout", "rms_norm"]
