"""Conv2d -> BatchNorm2d (-> ReLU): ``reference`` (oracle + math) and ``function`` (recomputing autograd.Function)."""

from lightning_accel.ops.conv_bn_relu.function import ConvBNReLUFunction, conv_bn_relu, fold_bn_into_conv

__all__ = ["ConvBNReLUFunction", "conv_bn_relu", "fold_bn_into_conv"]
