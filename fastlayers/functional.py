"""Functional forms of the fused layers, mirroring torch.nn.functional."""

from fastlayers.ops import layer_norm, linear_gelu, linear_gelu_path, relu_scale

__all__ = ["layer_norm", "linear_gelu", "linear_gelu_path", "relu_scale"]
