"""The fused nn.Modules."""

from fastlayers.layers.layer_norm import LayerNorm
from fastlayers.layers.linear_act import FusedLinearAct
from fastlayers.layers.linear_gelu import FusedLinearGELU
from fastlayers.layers.linear_relu import FusedLinearReLU
from fastlayers.layers.recognise import (
    gelu_approximation,
    linear_layout,
    recognise_activation,
    recognise_rms_norm,
)
from fastlayers.layers.relu_scale import ReLUScale
from fastlayers.layers.rms_norm import RMSNorm
from fastlayers.layers.shared_input_linear import SharedInputLinear

__all__ = [
    "FusedLinearAct",
    "FusedLinearGELU",
    "FusedLinearReLU",
    "LayerNorm",
    "RMSNorm",
    "ReLUScale",
    "SharedInputLinear",
    "gelu_approximation",
    "linear_layout",
    "recognise_activation",
    "recognise_rms_norm",
]
