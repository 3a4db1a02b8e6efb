"""What a patch puts in a model, and how to recognise it: the fused layer types, FusedAway (the
stand-in for an activation fused into the layer before it), where a fused module keeps the native
module it replaced, and where a rewritten block keeps its forward. The lowest floor of the
patcher: every other module may use these."""

from __future__ import annotations

from typing import Any

from torch import nn

from fastlayers.layers import FusedLinearAct, LayerNorm, ReLUScale

# Where a fused module (or FusedAway) keeps the native module it replaced (not a submodule).
NATIVE_ATTR = "_fastlayers_native"

FUSED_TYPES = (LayerNorm, FusedLinearAct, ReLUScale)


class FusedAway(nn.Identity):
    """Stands where an activation was after it was fused into the preceding layer (the
    activation now runs inside that layer). :func:`fastlayers.unpatch` puts the original back.
    ``into`` is the fused layer itself (held by reference, not as a submodule). While the pair
    is broken (see swap.Pairing: a module replaced or hooked since the patch) it runs the
    original activation, and the fused layer computes the Linear alone."""

    pairing: Any = None  # set by the patch (swap.Pairing); None: an identity

    def __init__(self, original: nn.Module, into: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, NATIVE_ATTR, original)
        object.__setattr__(self, "into", into)
        self.train(original.training)

    def forward(self, input: Any) -> Any:
        pairing = self.pairing
        if pairing is not None and pairing.broken():
            return self.__dict__[NATIVE_ATTR](input)
        return input

    def extra_repr(self) -> str:
        return f"{type(self.__dict__[NATIVE_ATTR]).__name__} fused into {type(self.into).__name__}"


def is_fused(module: nn.Module) -> bool:
    """Already one of ours (a second patch leaves it alone)."""
    return isinstance(module, (*FUSED_TYPES, FusedAway))


def native_of(fused: nn.Module) -> nn.Module | None:
    """The native module a patch swapped ``fused`` in for (None for one built directly)."""
    return fused.__dict__.get(NATIVE_ATTR)


def forward_attr(block: nn.Module) -> str:
    """Where a block's forward is replaced: accelerate's ``_old_forward`` under its hook."""
    return "_old_forward" if "_hf_hook" in block.__dict__ else "forward"


def rewritten_forward(block: nn.Module) -> Any:
    """The rewritten forward a block rewrite put on ``block`` (blocks.RewrittenForward), or
    None. Recognised by its marker, so that the floors below blocks.py can ask."""
    value = block.__dict__.get(forward_attr(block))
    return value if getattr(value, "is_fastlayers_rewrite", False) else None
