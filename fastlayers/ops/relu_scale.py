"""ReLUScale ops: relu(x) * alpha in one pass, over torch.ops.fastlayers.relu_scale*, with fake
kernels. Autograd and argument checks live in C++ (csrc/relu_scale/relu_scale.cpp)."""

from __future__ import annotations

import numbers

import torch

from fastlayers._extension import _C
from fastlayers.ops._checks import check_same_device
from fastlayers.ops._native import computes_natively, fused_entry, retry_natively

relu_scale_op = torch.ops.fastlayers.relu_scale.default
relu_scale_inplace_op = torch.ops.fastlayers.relu_scale_.default
relu_scale_backward_op = torch.ops.fastlayers.relu_scale_backward.default


@torch.library.register_fake("fastlayers::relu_scale")
def _relu_scale_fake(input, alpha):
    return input.new_empty(input.shape)


@torch.library.register_fake("fastlayers::relu_scale_")
def _relu_scale_inplace_fake(input, alpha):
    return None


@torch.library.register_fake("fastlayers::relu_scale_backward")
def _relu_scale_backward_fake(grad_out, result, alpha):
    check_same_device("relu_scale", result, grad_out=grad_out)
    return grad_out.new_empty(grad_out.shape)


def as_alpha(alpha: object) -> float:
    """``alpha`` as a Python float: a real number (int, float, bool, NumPy scalar) or a
    one-element real tensor that needs no gradient (its value is read once, on the host);
    anything else (a string, a complex number, None, a list, a tensor requiring grad, whose
    gradient would be lost) is refused with a TypeError naming ``alpha``."""
    if type(alpha) is float:
        return alpha
    if isinstance(alpha, torch.Tensor):
        ok = alpha.numel() == 1 and not alpha.is_complex() and not alpha.requires_grad
    else:
        ok = isinstance(alpha, numbers.Real)
    if not ok:
        raise TypeError(
            f"fastlayers.relu_scale: alpha must be a real number, got {type(alpha).__name__} "
            f"{alpha!r}"
        )
    return float(alpha)


def relu_scale(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False) -> torch.Tensor:
    """``torch.relu(input) * alpha`` in one pass (any alpha, negative and zero included).

    ``inplace=True`` overwrites ``input`` and returns it, as ``nn.ReLU(inplace=True)`` does.
    Where autograd tracks ``input`` the in-place form computes out of place and copies back
    (``copy_``), so autograd's in-place rules and errors apply unchanged. Under torch.func
    transforms, forward-mode AD and ONNX export, and on a GPU this build has no kernels for, it
    computes ``torch.relu(input) * alpha`` (fastlayers.ops._native).
    """
    alpha = as_alpha(alpha)
    if not inplace:
        return relu_scale_forward(input, alpha)
    if computes_natively(input):
        return _native_relu_scale(input, alpha, inplace)
    try:
        if torch.is_grad_enabled() and input.requires_grad:
            return input.copy_(relu_scale_op(input, alpha))
        relu_scale_inplace_op(input, alpha)
        return input
    except RuntimeError:
        if not retry_natively(input):
            raise
        return _native_relu_scale(input, alpha, inplace)


def _relu_scale_op_path(input: torch.Tensor, alpha: float) -> torch.Tensor:
    return relu_scale_op(input, alpha)


# What dynamo traces in place of _C.relu_scale (eager calls run the C++ entry).
torch.compiler.substitute_in_graph(_C.relu_scale, skip_signature_check=True)(_relu_scale_op_path)

relu_scale_forward = fused_entry(
    "relu_scale_forward",
    "relu_scale",
    _relu_scale_op_path,
    lambda input, alpha: _native_relu_scale(input, alpha, False),
    """``relu_scale_forward(input, alpha)``: ``torch.relu(input) * alpha`` out of place, alpha a
    float already (see as_alpha), by fastlayers.ops._native.fused_entry's call path.""",
)


def _native_relu_scale(input: torch.Tensor, alpha: float, inplace: bool) -> torch.Tensor:
    """``torch.relu(input) * alpha`` as native computes it (the fused op is bit-identical to
    this), in place as ``nn.ReLU(inplace=True)`` followed by ``mul_``."""
    if inplace:
        return torch.relu_(input).mul_(alpha)
    return torch.relu(input) * alpha
