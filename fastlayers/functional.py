"""Functional forms of the fused layers, mirroring torch.nn.functional."""

from fastlayers.ops.dropout_add_layer_norm import dropout_add_layer_norm
from fastlayers.ops.gated_act import gated_act, gated_act_down
from fastlayers.ops.layer_norm import layer_norm
from fastlayers.ops.linear_act import (
    linear_act_linear,
    linear_act_path,
    linear_gelu,
    linear_gelu_path,
    linear_relu,
)
from fastlayers.ops.linear_cross_entropy import linear_cross_entropy
from fastlayers.ops.relu_scale import relu_scale
from fastlayers.ops.rms_norm import add_rms_norm, rms_norm
from fastlayers.ops.rotary import rotary_embedding

__all__ = [
    "add_rms_norm",
    "dropout_add_layer_norm",
    "gated_act",
    "gated_act_down",
    "layer_norm",
    "linear_act_linear",
    "linear_act_path",
    "linear_cross_entropy",
    "linear_gelu",
    "linear_gelu_path",
    "linear_relu",
    "relu_scale",
    "rms_norm",
    "rotary_embedding",
]
