"""LayerNorm ops: typed functional API over torch.ops.fastlayers.layer_norm_fwd/_bwd, and their
fake (meta) kernels. Autograd and argument checks live in C++ (csrc/layer_norm/layer_norm.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastlayers import config
from fastlayers._extension import _C
from fastlayers.ops._checks import SUPPORTED_DTYPES, check_same_device, stat_dtype
from fastlayers.ops._native import fused_entry

layer_norm_fwd = torch.ops.fastlayers.layer_norm_fwd.default
layer_norm_bwd = torch.ops.fastlayers.layer_norm_bwd.default


def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)


def _layer_norm_op_path(input, normalized_shape, weight, bias, eps):
    """The torch.ops call, or aten.layer_norm where dynamo traces and Inductor should take it."""
    if torch.compiler.is_compiling() and _inductor_takes(input, weight, bias):
        return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)
    return layer_norm_fwd(input, list(normalized_shape), weight, bias, eps)[0]


# What dynamo traces in place of _C.layer_norm (eager calls of this name run _C.layer_norm).
torch.compiler.substitute_in_graph(_C.layer_norm, skip_signature_check=True)(_layer_norm_op_path)

layer_norm_forward = fused_entry(
    "layer_norm_forward",
    "layer_norm",
    _layer_norm_op_path,
    _native_layer_norm,
    """``layer_norm_forward(input, normalized_shape, weight, bias, eps)``: the output of
    layer_norm_fwd, by fastlayers.ops._native.fused_entry's call path.

    Under torch.compile (and torch.export) with ``fastlayers.config.compile_layer_norm ==
    "inductor"`` (the default) it traces as ``torch.nn.functional.layer_norm``, so Inductor can
    fuse the normalisation with its neighbours (see fastlayers/config.py). Eager calls pay
    nothing for that choice: it is made where dynamo traces (the substitute of _C.layer_norm).
    Under torch.func transforms, forward-mode AD and ONNX export, and on a GPU this build has no
    kernels for, it computes ``F.layer_norm``.""",
)


def _inductor_takes(input, weight, bias) -> bool:
    """Whether a traced call becomes aten.layer_norm: by the setting, and only where that computes
    what our op computes. Other calls keep our op, which raises what eager raises (a dtype
    fastlayers does not take) or takes what native CUDA refuses (half input, float32 parameters,
    no autocast)."""
    if config.compile_layer_norm != "inductor" or input.dtype not in SUPPORTED_DTYPES:
        return False
    if torch.is_autocast_enabled(input.device.type):
        return True  # autocast runs layer_norm in float32, parameters float32 or not
    return all(p is None or p.dtype == input.dtype for p in (weight, bias))


def _stat_shape(input: torch.Tensor, normalized_shape: Sequence[int]) -> list:
    return list(input.shape[: input.dim() - len(normalized_shape)])


@torch.library.register_fake("fastlayers::layer_norm_fwd")
def _layer_norm_fwd_fake(input, normalized_shape, weight, bias, eps, out_dtype=None):
    check_same_device("layer_norm", input, weight=weight, bias=bias)
    torch._check(
        tuple(input.shape[input.dim() - len(normalized_shape) :]) == tuple(normalized_shape),
        lambda: (
            f"fastlayers.layer_norm: input of shape {list(input.shape)} does not end with "
            f"normalized_shape {list(normalized_shape)}"
        ),
    )
    stat = _stat_shape(input, normalized_shape)
    y = input.new_empty(input.shape, dtype=out_dtype or input.dtype)
    mean = input.new_empty(stat, dtype=stat_dtype(input.dtype))
    return y, mean, input.new_empty(stat, dtype=stat_dtype(input.dtype))


@torch.library.register_fake("fastlayers::layer_norm_bwd")
def _layer_norm_bwd_fake(grad_out, input, mean, rstd, normalized_shape, weight, bias, output_mask):
    check_same_device("layer_norm", input, grad_out=grad_out, weight=weight, bias=bias)

    def grad_like(want, p):
        return p.new_empty(p.shape) if want and p is not None else input.new_empty((0,))

    dx = input.new_empty(input.shape) if output_mask[0] else input.new_empty((0,))
    return dx, grad_like(output_mask[1], weight), grad_like(output_mask[2], bias)


def _as_shape(normalized_shape: int | Sequence[int]) -> list[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return list(normalized_shape)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Layer normalization over the trailing ``normalized_shape`` dimensions, as
    :func:`torch.nn.functional.layer_norm`, computed by fastlayers' fused kernels.

    Inputs may be float32, float64, float16 or bfloat16; ``weight``/``bias`` the input's dtype
    or float32 (float64 inputs: float64 parameters, as native). On CPU it computes what
    torch.nn.functional.layer_norm computes (ATen's kernel); on CUDA statistics are accumulated in
    float32 (float64 for float64 inputs).
    """
    return layer_norm_forward(input, _as_shape(normalized_shape), weight, bias, eps)
