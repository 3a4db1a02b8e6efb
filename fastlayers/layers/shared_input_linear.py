"""fastlayers.SharedInputLinear: an ``nn.Linear`` whose input, under autocast, is converted once
for every Linear that reads the same tensor (an attention's q, k and v projections)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlayers.layers._around import linear_around
from fastlayers.layers._script import refuse_script
from fastlayers.ops.shared_cast import shared_use

_any_autocast = torch._C._is_any_autocast_enabled


class SharedInputLinear(nn.Linear):
    """``nn.Linear`` (same constructor, Parameters, ``state_dict`` and results, bit for bit).
    Under ``torch.autocast`` with a float32 input, each ``nn.Linear`` converts the input to the
    autocast dtype itself and keeps its own copy for the weight's gradient; this layer takes the
    conversion its sibling made of the very same tensor (fastlayers.ops.shared_cast.shared_use):
    one conversion and one kept copy for q, k and v, each use with autocast's own backward node
    so the gradients add as natively. Without autocast it is ``F.linear``."""

    __prepare_scriptable__ = refuse_script

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # nn.Linear's own forward, read for read: dynamo guards each read on every compiled
            # call (Inductor fuses the autocast conversions itself)
            return F.linear(input, self.weight, self.bias)
        # Parameters straight from _parameters where they are there (a parametrization or
        # pruning takes them out: then the way nn.Module reads them)
        p = self._parameters
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        if _any_autocast():
            input = shared_use(input)
        return F.linear(input, weight, bias)

    @classmethod
    def from_native(cls, linear: nn.Linear) -> SharedInputLinear:
        """The layer holding ``linear``'s own Parameter objects (no copy)."""
        if type(linear) is not nn.Linear:
            raise TypeError(
                "SharedInputLinear.from_native: linear must be a torch.nn.Linear (not a "
                f"subclass), got {type(linear).__name__}"
            )
        return linear_around(cls, linear)

    def to_native(self) -> nn.Linear:
        """An ``nn.Linear`` holding this layer's Parameter objects."""
        return linear_around(nn.Linear, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fused=fastlayers.shared_autocast_input"
