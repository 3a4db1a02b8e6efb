"""Typed functional API over the registered torch.ops.fastlayers.* ops."""

from fastlayers.ops.layer_norm import layer_norm

__all__ = ["layer_norm"]
