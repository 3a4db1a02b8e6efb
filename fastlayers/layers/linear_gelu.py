"""fastlayers.FusedLinearGELU: ``nn.Linear`` followed by ``nn.GELU`` in one op, the GELU computed in
the GEMM's epilogue on Hopper GPUs."""

from __future__ import annotations

import torch
from torch import nn

from fastlayers.layers.linear_act import FusedLinearAct
from fastlayers.layers.recognise import gelu_approximation
from fastlayers.ops.linear_act import GELU_ACTIVATION, _check_approximate


class FusedLinearGELU(FusedLinearAct):
    """``gelu(linear(input))`` in one op. Same constructor, defaults, parameters, initialisation
    and ``state_dict`` as :class:`torch.nn.Linear` (plus ``approximate`` as for
    :class:`torch.nn.GELU`), so a ``Linear`` checkpoint loads as is.

    It can also wrap a weight stored ``[in_features, out_features]`` (HuggingFace ``Conv1D``,
    via :meth:`from_native`) without copying or transposing it. It is not an ``nn.Linear``
    subclass on purpose: code that finds and rewrites Linears must not drop its GELU.
    """

    __constants__ = ("in_features", "out_features", "approximate", "weight_transposed")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        approximate: str = "none",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_approximate(approximate)
        self.approximate = approximate
        self._init_linear(in_features, out_features, bias, device, dtype)

    @property
    def activation(self) -> str:
        """The op's activation name: ``'gelu'`` (erf) or ``'gelu_tanh'``."""
        return GELU_ACTIVATION[self.approximate]

    @classmethod
    def from_native(cls, linear: nn.Module, gelu: nn.Module | str = "none") -> FusedLinearGELU:
        """The fused layer for ``linear`` followed by ``gelu``, around ``linear``'s own Parameter
        objects (no copy): optimizer state, tied weights, ``requires_grad`` and device placement
        stay valid.

        ``linear`` is an ``nn.Linear`` (or a subclass computing ``F.linear``) or HuggingFace
        ``Conv1D`` (weight [in, out], read in place). ``gelu`` is an ``nn.GELU``, a HuggingFace
        GELU activation module, or the form itself, ``'none'`` (erf) or ``'tanh'``.
        """
        if isinstance(gelu, str):
            _check_approximate(gelu)
            approximate = gelu
        else:
            approximate = gelu_approximation(gelu)
            if approximate is None:
                raise TypeError(
                    f"FusedLinearGELU.from_native: gelu must be an nn.GELU, a module computing "
                    f"GELU (erf or tanh form), or 'none'/'tanh'; {type(gelu).__name__} computes "
                    "something else"
                )
        layer = cls._around(linear, "FusedLinearGELU.from_native")
        layer.approximate = approximate
        return layer

    def to_native(self) -> tuple[nn.Module, nn.GELU]:
        """``(linear, nn.GELU(approximate))`` sharing this layer's Parameter objects; ``linear``
        is an ``nn.Linear``, or a HuggingFace ``Conv1D`` when the weight is stored transposed."""
        gelu = nn.GELU(approximate=self.approximate)
        gelu.train(self.training)
        return self.native_linear(), gelu

    def extra_repr(self) -> str:
        return (
            f"{self._linear_repr()}, approximate={self.approximate!r}{self._layout_repr()}, "
            "fused=fastlayers.linear_gelu"
        )
