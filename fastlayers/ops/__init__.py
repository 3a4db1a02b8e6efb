"""Typed functional API over the registered torch.ops.fastlayers.* ops."""

from fastlayers.ops.layer_norm import layer_norm
from fastlayers.ops.relu_scale import relu_scale

__all__ = ["layer_norm", "relu_scale"]
