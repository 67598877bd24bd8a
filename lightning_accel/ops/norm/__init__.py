"""LayerNorm / RMSNorm over the last dimension: ``reference`` (oracle, CPU path), ``triton`` (kernels), ``function``."""

from lightning_accel.ops.norm.function import NormFunction, layer_norm, rms_norm

__all__ = ["NormFunction", "layer_norm", "rms_norm"]
