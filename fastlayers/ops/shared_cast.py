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


# The last conversion shared_use made: (weak reference to x, x's version, x converted, x's device
# type). The reference's callback drops it when x dies, so it keeps the copy no longer than x
# lives (and no longer than the next conversion: one copy at most).
_last: tuple[Any, int, torch.Tensor, str] | None = None
_tracing = torch._C._get_tracing_state


def _forget(ref: Any) -> None:
    global _last
    last = _last
    if last is not None and last[0] is ref:
        _last = None


def _unshareable(x: torch.Tensor) -> bool:
    """Calls whose conversion is autocast's own, per reader: tensors without a version counter
    (made under torch.inference_mode: a change in place could not be seen), a trace (torch.jit,
    ONNX export: a conversion from an earlier eager call would be baked in as a constant) and a
    CUDA graph capture (likewise: the graph would read a warm-up's copy). torch.compile is the
    caller's to rule out first (SharedInputLinear.forward: dynamo must not trace this)."""
    return (
        type(x) is not _Tensor
        or x.is_inference()
        or _tracing() is not None
        or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing())
    )


def shared_use(x: torch.Tensor) -> torch.Tensor:
    """``x`` as one Linear under autocast reads it: the conversion of this very tensor (same
    version, same autocast dtype) that the previous reader made, through a node of this use's
    own (:func:`converted_use`), or a new conversion remembered for the next reader; ``x``
    itself (autocast converts it for this reader) where :func:`autocast_conversion` gives None
    or the call is one of :func:`_unshareable`'s; never called under torch.compile. Values and
    gradients are those of each reader converting ``x`` itself. Changes that bypass the version
    counter (``x.data``, a NumPy view, the storage) are not seen, as autograd's own check of
    saved tensors does not see them."""
    global _last
    if _unshareable(x):
        return x
    last = _last
    if last is not None and last[0]() is x and last[1] == x._version:
        converted, device = last[2], last[3]
        if (
            torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == converted.dtype
            and not (x.requires_grad and x.is_leaf)  # made one since: autocast's cache's
            and not computes_natively(x)
        ):
            return converted_use(x, converted)
    converted = autocast_conversion(x)
    if converted is None:
        return x
    _last = (weakref.ref(x, _forget), x._version, converted, x.device.type)
    return converted_use(x, converted)
