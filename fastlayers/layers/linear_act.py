"""The fused Linear + activation layers' shared base: ``nn.Linear``'s parameters, initialisation
and ``state_dict``, a weight optionally stored transposed (HuggingFace ``Conv1D``), and the one
op family ``fastlayers::linear_act`` with the subclass's activation."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fastlayers.layers._around import linear_around, module_around
from fastlayers.layers._script import refuse_script
from fastlayers.layers.recognise import linear_layout
from fastlayers.ops.linear_act import linear_act_forward


class FusedLinearAct(nn.Module):
    """``act(linear(input))`` in one op; subclasses name the activation (:attr:`activation`:
    ``'gelu'``, ``'gelu_tanh'`` or ``'relu'``). Not an ``nn.Linear`` subclass on purpose: code
    that finds and rewrites Linears must not drop the activation."""

    __constants__ = ("in_features", "out_features", "weight_transposed")

    __prepare_scriptable__ = refuse_script

    activation: str

    def _init_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight_transposed = False
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: weight and bias uniform in +-1/sqrt(in_features)."""
        if not self.weight_transposed:
            nn.Linear.reset_parameters(self)  # the same random draws as nn.Linear
            return
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    # Set by fastlayers.patch on a layer it fused with the activation module that followed the
    # Linear (fastlayers.patching.records.Pairing): while that pair is broken (either module
    # replaced or hooked since the patch), the layer computes the Linear alone.
    _pairing: Any = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        pairing = self._pairing
        if pairing is not None and pairing.broken():
            return pairing.linear_alone(input)
        # Parameters straight from _parameters (self.weight goes through Module.__getattr__, a
        # Python call, on every call); where a parametrization or pruning took them out of it,
        # the way nn.Module reads them
        p = self._parameters
        weight = p["weight"] if "weight" in p else self.weight
        bias = p["bias"] if "bias" in p else self.bias
        return linear_act_forward(input, weight, bias, self.activation, self.weight_transposed)

    @classmethod
    def _around(cls, linear: nn.Module, caller: str) -> FusedLinearAct:
        """An instance of ``cls`` holding ``linear``'s own Parameter objects (no copy)."""
        layout, why = linear_layout(linear)
        if layout is None:
            raise TypeError(
                f"{caller}: linear must be a torch.nn.Linear (or a subclass computing F.linear) "
                f"or a HuggingFace Conv1D; {why}"
            )
        if layout == "conv1d":
            in_features, out_features = linear.weight.shape
        else:
            in_features, out_features = linear.in_features, linear.out_features
        return module_around(
            cls,
            linear.training,
            {"weight": linear.weight, "bias": linear.bias},
            in_features=int(in_features),
            out_features=int(out_features),
            weight_transposed=layout == "conv1d",
        )

    def native_linear(self) -> nn.Module:
        """An ``nn.Linear`` (a HuggingFace ``Conv1D`` when the weight is stored transposed)
        sharing this layer's Parameter objects."""
        if not self.weight_transposed:
            return linear_around(nn.Linear, self)
        from transformers.pytorch_utils import Conv1D

        return module_around(
            Conv1D,
            self.training,
            {"weight": self.weight, "bias": self.bias},
            nf=self.out_features,
            nx=self.in_features,
        )

    def _linear_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )

    def _layout_repr(self) -> str:
        return ", weight_transposed=True" if self.weight_transposed else ""
