"""Functional forms of the fused layers, mirroring torch.nn.functional."""

from fastlayers.ops import (
    dropout_add_layer_norm,
    layer_norm,
    linear_act_linear,
    linear_act_path,
    linear_gelu,
    linear_gelu_path,
    linear_relu,
    relu_scale,
)

__all__ = [
    "dropout_add_layer_norm",
    "layer_norm",
    "linear_act_linear",
    "linear_act_path",
    "linear_gelu",
    "linear_gelu_path",
    "linear_relu",
    "relu_scale",
]
