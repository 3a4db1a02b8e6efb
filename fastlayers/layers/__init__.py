"""The fused nn.Modules."""

from fastlayers.layers.layer_norm import LayerNorm
from fastlayers.layers.linear_gelu import FusedLinearGELU, gelu_approximation
from fastlayers.layers.relu_scale import ReLUScale

__all__ = ["FusedLinearGELU", "LayerNorm", "ReLUScale", "gelu_approximation"]
