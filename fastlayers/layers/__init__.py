"""The fused nn.Modules."""

from fastlayers.layers.layer_norm import LayerNorm

__all__ = ["LayerNorm"]
