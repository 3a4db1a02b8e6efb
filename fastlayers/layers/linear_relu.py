"""fastlayers.FusedLinearReLU: ``nn.Linear`` followed by ``nn.ReLU`` in one op, the ReLU computed
in the GEMM's epilogue (CUTLASS on Hopper, cuBLASLt's bias + ReLU epilogue elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from fastlayers.layers.linear_act import FusedLinearAct
from fastlayers.layers.recognise import recognise_activation


class FusedLinearReLU(FusedLinearAct):
    """``relu(linear(input))`` in one op. Same constructor, defaults, parameters, initialisation
    and ``state_dict`` as :class:`torch.nn.Linear`, so a ``Linear`` checkpoint loads as is.
    Backward reads the ReLU's mask from the output (no pre-activation is stored). It can also
    wrap a weight stored ``[in_features, out_features]`` (HuggingFace ``Conv1D``, via
    :meth:`from_native`) without copying or transposing it."""

    activation = "relu"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._init_linear(in_features, out_features, bias, device, dtype)

    @classmethod
    def from_native(cls, linear: nn.Module, relu: nn.Module | None = None) -> FusedLinearReLU:
        """The fused layer for ``linear`` followed by ``relu``, around ``linear``'s own Parameter
        objects (no copy): optimizer state, tied weights, ``requires_grad`` and device placement
        stay valid. ``linear`` is an ``nn.Linear`` (or a subclass computing ``F.linear``) or a
        HuggingFace ``Conv1D``; ``relu``, when given, an ``nn.ReLU`` (``inplace`` either way) or a
        module computing ReLU."""
        if relu is not None:
            name, why = recognise_activation(relu)
            if name != "relu":
                raise TypeError(
                    "FusedLinearReLU.from_native: relu must be an nn.ReLU or a module computing "
                    f"ReLU; {why or f'{type(relu).__name__} computes {name}'}"
                )
        return cls._around(linear, "FusedLinearReLU.from_native")

    def to_native(self) -> tuple[nn.Module, nn.ReLU]:
        """``(linear, nn.ReLU())`` sharing this layer's Parameter objects; ``linear`` is an
        ``nn.Linear``, or a HuggingFace ``Conv1D`` when the weight is stored transposed."""
        relu = nn.ReLU()
        relu.train(self.training)
        return self.native_linear(), relu

    def extra_repr(self) -> str:
        return f"{self._linear_repr()}{self._layout_repr()}, fused=fastlayers.linear_relu"
