"""Typed functional API over the registered torch.ops.fastlayers.* ops."""

from fastlayers.ops.dropout_add_layer_norm import dropout_add_layer_norm
from fastlayers.ops.layer_norm import layer_norm
from fastlayers.ops.linear_gelu import linear_gelu, linear_gelu_path
from fastlayers.ops.relu_scale import relu_scale

__all__ = [
    "dropout_add_layer_norm",
    "layer_norm",
    "linear_gelu",
    "linear_gelu_path",
    "relu_scale",
]
