"""What a patch puts in a model, and how to recognise it: the fused layer types, FusedAway (the
stand-in for an activation fused into the layer before it), where a fused module keeps the native
module it replaced, and where a rewritten block keeps its forward. The lowest floor of the
patcher: every other module may use these."""

from __future__ import annotations

import inspect
import types
from typing import Any

from torch import nn

from fastlayers.layers import FusedLinearAct, LayerNorm, ReLUScale, RMSNorm, SharedInputLinear

# Where a fused module (or FusedAway) keeps the native module it replaced (not a submodule).
NATIVE_ATTR = "_fastlayers_native"

FUSED_TYPES = (LayerNorm, RMSNorm, FusedLinearAct, ReLUScale, SharedInputLinear)


class FusedAway(nn.Identity):
    """Stands where an activation was after it was fused into the preceding layer (the
    activation now runs inside that layer). :func:`fastlayers.unpatch` puts the original back.
    ``into`` is the fused layer itself (held by reference, not as a submodule). While the pair
    is broken (see records.Pairing: a module replaced, hooked or changed since the patch) it
    runs the original activation, and the fused layer computes the Linear alone.

    The original activation's own attributes read and write through (``act.approximate =
    'tanh'`` on the model's slot changes the original, as it would natively; the pair then
    computes apart)."""

    pairing: Any = None  # set by the patch (records.Pairing); None: an identity

    def __init__(self, original: nn.Module, into: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, NATIVE_ATTR, original)
        object.__setattr__(self, "into", into)
        self.train(original.training)

    def forward(self, input: Any) -> Any:
        pairing = self.pairing
        if pairing is not None and pairing.activation_applies():
            return self.__dict__[NATIVE_ATTR](input)
        return input

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get(NATIVE_ATTR)
            if original is None or name.startswith("__"):
                raise
            return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        original = self.__dict__.get(NATIVE_ATTR)
        if (
            original is not None
            and name not in self.__dict__
            and name not in _OWN_STATE
            and name in original.__dict__
        ):
            setattr(original, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        original = self.__dict__.get(NATIVE_ATTR)
        if original is not None and name not in self.__dict__ and name in original.__dict__:
            delattr(original, name)
        else:
            super().__delattr__(name)

    def extra_repr(self) -> str:
        return f"{type(self.__dict__[NATIVE_ATTR]).__name__} fused into {type(self.into).__name__}"


# nn.Module's bookkeeping: FusedAway's own, never the original's
_OWN_STATE = frozenset(nn.Module().__dict__) | {"forward", "pairing", "into", NATIVE_ATTR}


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
    value = _under(block.__dict__.get(forward_attr(block)), "is_fastlayers_rewrite")
    return value if getattr(value, "is_fastlayers_rewrite", False) else None


# The call-time paths a patch puts on an instance's forward, outermost first: each wraps the
# forward it replaced (``previous``).
_CALL_PATHS = ("is_fastlayers_replay", "is_fastlayers_loss", "is_fastlayers_unpad")


def _under(value: Any, marker: str) -> Any:
    """``value``, or the first forward with ``marker`` under the call-time paths wrapping it."""
    while not getattr(value, marker, False) and any(getattr(value, m, False) for m in _CALL_PATHS):
        value = value.previous
    return value


def fused_loss_forward(model: nn.Module) -> Any:
    """The fused head + loss forward (runtime.fused_loss.FusedLossForward) a patch put on
    ``model`` (a causal LM), or None."""
    value = _under(model.__dict__.get("forward"), "is_fastlayers_loss")
    return value if getattr(value, "is_fastlayers_loss", False) else None


def unpad_forward(model: nn.Module) -> Any:
    """The padding-free forward (runtime.unpad.UnpadForward) a patch with ``unpad=True`` put on
    ``model`` (a base model), or None; looked for under replay's, which may wrap it."""
    value = _under(model.__dict__.get("forward"), "is_fastlayers_unpad")
    return value if getattr(value, "is_fastlayers_unpad", False) else None


def replay_forward(model: nn.Module) -> Any:
    """The replay forward (replay.ReplayForward) a patch with ``replay=`` put on ``model``, or
    None."""
    value = model.__dict__.get("forward")
    return value if getattr(value, "is_fastlayers_replay", False) else None


def forward_signature(module: nn.Module) -> inspect.Signature | None:
    """The signature ``inspect.signature(module.forward)`` gives natively: its class forward's,
    bound (no ``self``). A forward a patch puts on an instance (a rewritten block's, a routed
    attention's, replay's) shows it, so tools that read a model's arguments by signature (HF
    Trainer's column filter, accelerate, PEFT) see the model's own; None where it has none."""
    try:
        return inspect.signature(types.MethodType(type(module).forward, module))
    except (TypeError, ValueError):
        return None


def wrapped_signature(previous: Any, module: nn.Module) -> inspect.Signature | None:
    """The signature of a forward a call-time path (replay, unpad) wraps: the wrapped one's
    (``previous``, a rewritten block's) or, where it wraps the class's, the class forward's."""
    if previous is not None:
        signature = getattr(previous, "__signature__", None)
        if signature is None and callable(previous):  # a plain function or bound method
            try:
                signature = inspect.signature(previous)
            except (TypeError, ValueError):
                return None
        return signature
    return forward_signature(module)
