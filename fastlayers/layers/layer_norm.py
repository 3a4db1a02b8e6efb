"""fastlayers.LayerNorm: a drop-in torch.nn.LayerNorm whose forward and backward run fused
kernels."""

from __future__ import annotations

import torch
from torch import nn

from fastlayers.layers._around import module_around
from fastlayers.layers._script import refuse_script
from fastlayers.ops.layer_norm import layer_norm_forward


class LayerNorm(nn.LayerNorm):
    """Same constructor, defaults, parameters, initialisation and ``state_dict`` as
    :class:`torch.nn.LayerNorm` (it is a subclass, so ``isinstance(m, nn.LayerNorm)`` holds and
    code that groups LayerNorm parameters, e.g. for weight decay, keeps working).

    Forward and backward run fastlayers' fused kernels (CUDA or CPU). Under CUDA autocast the
    output is float32, as ``nn.LayerNorm``'s is, but the half-precision input is read directly.
    """

    __prepare_scriptable__ = refuse_script

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Parameters straight from _parameters (self.weight goes through Module.__getattr__, a
        # Python call, on every call); where a parametrization or pruning took them out of it,
        # the way nn.Module reads them
        p = self._parameters
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        return layer_norm_forward(input, self.normalized_shape, weight, bias, self.eps)

    @classmethod
    def from_native(cls, native: nn.LayerNorm) -> LayerNorm:
        """Wraps ``native``'s own Parameter objects (no copy): optimizer state, tied weights,
        ``requires_grad`` and device placement stay valid."""
        if not isinstance(native, nn.LayerNorm):
            raise TypeError(
                f"LayerNorm.from_native: native must be a torch.nn.LayerNorm, got "
                f"{type(native).__name__}"
            )
        return _sharing_parameters(cls, native)

    def to_native(self) -> nn.LayerNorm:
        """An ``nn.LayerNorm`` sharing this layer's Parameter objects."""
        return _sharing_parameters(nn.LayerNorm, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fused=fastlayers.layer_norm"


def _sharing_parameters(cls: type[nn.LayerNorm], src: nn.LayerNorm) -> nn.LayerNorm:
    """A ``cls`` with ``src``'s configuration and its very Parameter objects."""
    return module_around(
        cls,
        src.training,
        {"weight": src.weight, "bias": src.bias},
        normalized_shape=tuple(src.normalized_shape),
        eps=src.eps,
        elementwise_affine=src.elementwise_affine,
    )
