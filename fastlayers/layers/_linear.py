"""A Linear built around Parameters it does not own: the fused layers' from_native / to_native."""

from __future__ import annotations

from torch import nn


def linear_around(cls: type[nn.Linear], source: nn.Module) -> nn.Linear:
    """An instance of ``cls`` (``nn.Linear`` or a subclass) holding ``source``'s own weight and
    bias Parameter objects (no copy, no initialisation), its features and its training flag."""
    linear = cls.__new__(cls)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = source.in_features, source.out_features
    linear.register_parameter("weight", source.weight)
    linear.register_parameter("bias", source.bias)
    linear.train(source.training)
    return linear
