"""fastlayers.ReLUScale: relu(x) * alpha in one pass; replaces nn.ReLU (alpha 1) and "ReLU, then
multiply by a constant"."""

from __future__ import annotations

import torch
from torch import nn

from fastlayers.layers._script import refuse_script
from fastlayers.ops.relu_scale import as_alpha, relu_scale, relu_scale_forward


class ReLUScale(nn.Module):
    """``relu(input) * alpha``. Like ``nn.ReLU`` it has no parameters or buffers (an empty
    ``state_dict``); ``alpha`` is a constructor argument shown in ``extra_repr``.
    ``inplace=True`` behaves as ``nn.ReLU(inplace=True)``."""

    __constants__ = ("alpha", "inplace")

    __prepare_scriptable__ = refuse_script

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        super().__init__()
        self.alpha = as_alpha(alpha)
        self.inplace = bool(inplace)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return relu_scale(input, self.alpha, True)
        return relu_scale_forward(input, self.alpha)  # alpha is a float since __init__

    @classmethod
    def from_native(cls, relu: nn.ReLU, alpha: float = 1.0) -> ReLUScale:
        """The fused layer for ``relu`` (followed by a multiplication by ``alpha``)."""
        if not isinstance(relu, nn.ReLU):
            raise TypeError(
                f"ReLUScale.from_native: relu must be a torch.nn.ReLU, got {type(relu).__name__}"
            )
        fused = cls(alpha, inplace=relu.inplace)
        fused.train(relu.training)
        return fused

    def to_native(self) -> nn.ReLU:
        """``nn.ReLU`` with the same ``inplace``; only for ``alpha == 1`` (a scaled ReLU has no
        single native module)."""
        if self.alpha != 1.0:
            raise ValueError(
                f"ReLUScale.to_native: alpha={self.alpha} has no single native module "
                "(it is nn.ReLU followed by a multiplication by alpha)"
            )
        native = nn.ReLU(inplace=self.inplace)
        native.train(self.training)
        return native

    def extra_repr(self) -> str:
        inplace = ", inplace=True" if self.inplace else ""
        return f"alpha={self.alpha}{inplace}, fused=fastlayers.relu_scale"
