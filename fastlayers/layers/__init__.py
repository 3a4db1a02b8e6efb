"""The fused nn.Modules."""

from fastlayers.layers.layer_norm import LayerNorm
from fastlayers.layers.relu_scale import ReLUScale

__all__ = ["LayerNorm", "ReLUScale"]
