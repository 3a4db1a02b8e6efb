"""One autocast conversion of an activation that several Linears read.

Under ``torch.autocast`` each ``F.linear`` converts a float32 input to the autocast dtype itself:
an activation read by two projections (a gated MLP's gate and up) is converted twice, both copies
are kept for the weights' gradients, and the backward converts each gradient back and adds the
two. :func:`autocast_shared_inputs` converts once and hands each consumer its own output of one
autograd node (``_C.shared_cast``): the same values, one copy kept, and a backward that converts
and adds the gradients as native's conversions and the autograd engine do, bit for bit."""

from __future__ import annotations

import torch

from fastlayers._extension import _C
from fastlayers.ops._native import computes_natively

_Tensor = torch.Tensor


def autocast_dtype_for(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast converts ``x`` to when an op of its lower-precision list (F.linear)
    reads it, or None where it leaves ``x`` as it is (autocast off for x's device type, x not
    floating point, float64, or already in that dtype)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if not x.is_floating_point() or x.dtype in (torch.float64, dtype):
        return None
    return dtype


def autocast_shared_inputs(x: torch.Tensor, uses: int) -> tuple[torch.Tensor, ...] | None:
    """``uses`` tensors to pass to ``uses`` Linears in place of ``x``, converted once to the
    autocast dtype, or None where each Linear should take ``x`` itself: autocast would not
    convert it, or this call is traced or transformed (torch.compile, whose Inductor fuses the
    conversions itself; torch.func; ONNX export) or ``x`` is a tensor subclass."""
    if type(x) is not _Tensor or torch.compiler.is_compiling():
        return None
    dtype = autocast_dtype_for(x)
    if dtype is None or computes_natively(x):
        return None
    return tuple(_C.shared_cast(x, dtype, uses))
