"""``dropout(x @ W.T + b) (+ residual)``: ``reference`` (oracle + CPU path), ``triton`` (kernels), ``function``."""

from lightning_accel.ops.linear_dropout.function import LinearDropoutFunction, linear_dropout

__all__ = ["LinearDropoutFunction", "linear_dropout"]
