"""One autocast conversion of an activation that several Linears read.

Under ``torch.autocast`` each ``F.linear`` converts a float32 input to the autocast dtype itself:
an activation read by two projections (a gated MLP's gate and up) is converted twice and both
copies are kept for the weights' gradients. :func:`autocast_conversion` converts once;
:func:`converted_use`, called where each projection reads its input, hands it that one copy as
the output of a node of its own whose backward is autocast's (the gradient converted back to
x's dtype). The nodes are made in native's order, so the autograd engine adds the projections'
gradients (and those of x's other readers) exactly as it adds native's: values and gradients
bit for bit, one conversion and one kept copy.

:func:`shared_use` does the same where the readers are separate modules (an attention's q, k and
v projections: fastlayers.SharedInputLinear): the last conversion is remembered, by the very
tensor converted (alive) and its version, and a reader of that tensor under the same autocast
takes it."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fastlayers._extension import _C
from fastlayers.ops._native import computes_natively

_Tensor = torch.Tensor
_any_autocast = torch._C._is_any_autocast_enabled


def autocast_conversion(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` converted once to the dtype autocast gives the Linears that read it (outside
    autograd: each reader takes it through :func:`converted_use`), or None where each Linear
    should take ``x`` itself: autocast would not convert it (off for x's device type, x not
    floating point, float64 or already that dtype), or converts it once already (a leaf that
    requires grad: autocast's cache), or this call is traced or transformed (torch.compile,
    whose Inductor fuses the conversions itself; torch.func; ONNX export), or ``x`` is a tensor
    subclass. The dtype decisions are C++'s (_C.autocast_conversion): this runs in every MLP
    call."""
    # the call without autocast (most calls of every MLP) decided by one flag read
    if not _any_autocast() or type(x) is not _Tensor or torch.compiler.is_compiling():
        return None
    return None if computes_natively(x) else _C.autocast_conversion(x)


def converted_use(x: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """One reader's ``x``: ``converted`` (from :func:`autocast_conversion`) as the output of a
    node of its own, made here, where autocast would make its conversion node."""
    return _C.converted_use(x, converted)


# The last conversion shared_use made: (weak reference to x, x's version, x converted). The
# reference's callback drops it when x dies, so it keeps the copy no longer than x lives (a
# module's call ends, its input goes, the copy with it; the graph keeps what backward needs).
_last: tuple[Any, int, torch.Tensor] | None = None


def _forget(ref: Any) -> None:
    global _last
    last = _last
    if last is not None and last[0] is ref:
        _last = None


def shared_use(x: torch.Tensor) -> torch.Tensor:
    """``x`` as one Linear under autocast reads it: the conversion of this very tensor (same
    version, same autocast dtype) that the previous reader made, through a node of this use's
    own (:func:`converted_use`), or a new conversion remembered for the next reader; ``x``
    itself where :func:`autocast_conversion` gives None. Values and gradients are those of
    each reader converting ``x`` itself."""
    global _last
    last = _last
    if last is not None and last[0]() is x and last[1] == x._version:
        converted = last[2]
        device = x.device.type
        if (
            _any_autocast()
            and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == converted.dtype
            and not torch.compiler.is_compiling()
            and not (x.requires_grad and x.is_leaf)  # made one since: autocast's cache's
        ):
            return converted_use(x, converted)
    converted = autocast_conversion(x)
    if converted is None:
        return x
    _last = (weakref.ref(x, _forget), x._version, converted)
    return converted_use(x, converted)
