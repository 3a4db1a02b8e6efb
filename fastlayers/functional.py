"""Functional forms of the fused layers, mirroring torch.nn.functional."""

from fastlayers.ops import layer_norm, relu_scale

__all__ = ["layer_norm", "relu_scale"]
