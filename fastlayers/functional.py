"""Functional forms of the fused layers, mirroring torch.nn.functional."""

from fastlayers.ops import layer_norm

__all__ = ["layer_norm"]
