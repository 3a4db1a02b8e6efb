"""One autocast conversion of an activation that several Linears read.

Under ``torch.autocast`` each ``F.linear`` converts a float32 input to the autocast dtype itself:
an activation read by two projections (a gated MLP's gate and up) is converted twice and both
copies are kept for the weights' gradients. :func:`autocast_conversion` converts once;
:func:`converted_use`, called where each projection reads its input, hands it that one copy as
the output of a node of its own whose backward is autocast's (the gradient converted back to
x's dtype). The nodes are made in native's order, so the autograd engine adds the projections'
gradients (and those of x's other readers) exactly as it adds native's: values and gradients
bit for bit, one conversion and one kept copy."""

from __future__ import annotations

import torch

from fastlayers._extension import _C
from fastlayers.ops._native import computes_natively

_Tensor = torch.Tensor
_is_autocast_available = torch.amp.is_autocast_available


def autocast_dtype_for(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast converts ``x`` to when an op of its lower-precision list (F.linear)
    reads it, or None where it leaves ``x`` as it is (no autocast for x's device type, x not
    floating point, float64, or already in that dtype)."""
    device_type = x.device.type
    if not _is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if not x.is_floating_point() or x.dtype in (torch.float64, dtype):
        return None
    return dtype


def autocast_conversion(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` converted once to the dtype autocast gives the Linears that read it (outside
    autograd: each reader takes it through :func:`converted_use`), or None where each Linear
    should take ``x`` itself: autocast would not convert it, or converts it once already (a
    leaf that requires grad: autocast's cache), or this call is traced or transformed
    (torch.compile, whose Inductor fuses the conversions itself; torch.func; ONNX export), or
    ``x`` is a tensor subclass."""
    if type(x) is not _Tensor or torch.compiler.is_compiling():
        return None
    dtype = autocast_dtype_for(x)
    if dtype is None or (x.requires_grad and x.is_leaf) or computes_natively(x):
        return None
    return x.detach().to(dtype)


def converted_use(x: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """One reader's ``x``: ``converted`` (from :func:`autocast_conversion`) as the output of a
    node of its own, made here, where autocast would make its conversion node."""
    return _C.converted_use(x, converted)
