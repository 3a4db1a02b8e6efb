"""dropout + residual add + LayerNorm in one op: typed functional API over
torch.ops.fastlayers.dropout_add_layer_norm_fwd/_bwd, and their fake (meta) kernels. Autograd,
autocast and the argument checks live in C++
(csrc/dropout_add_layer_norm/dropout_add_layer_norm.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastlayers import config
from fastlayers._extension import _C
from fastlayers.ops._checks import SUPPORTED_DTYPES, check_same_device, stat_dtype
from fastlayers.ops._native import computes_natively, fused_entry
from fastlayers.ops.layer_norm import _as_shape

dropout_add_layer_norm_fwd = torch.ops.fastlayers.dropout_add_layer_norm_fwd.default
dropout_add_layer_norm_bwd = torch.ops.fastlayers.dropout_add_layer_norm_bwd.default

_OP = "fastlayers.dropout_add_layer_norm"


def _sum_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype S of s = dropout(x) + residual (csrc: dropout_add_sum_dtype)."""
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _native_sequence(x, residual, normalized_shape, weight, bias, eps, p, training, store_sum):
    """(y, s) computed by torch's own ops: the sequence that the fused op replaces."""
    s = F.dropout(x, p, training)
    if residual is not None:
        s = s + residual
    return F.layer_norm(s, tuple(normalized_shape), weight, bias, eps), s


def _op_path(x, residual, normalized_shape, weight, bias, eps, p, training, store_sum):
    """The torch.ops call, or the native sequence where dynamo traces and Inductor should take
    it (fastlayers.config.compile_residual_layer_norm)."""
    if torch.compiler.is_compiling() and _inductor_takes(x, residual, weight, bias, p):
        return _native_sequence(
            x, residual, normalized_shape, weight, bias, eps, p, training, store_sum
        )
    out = dropout_add_layer_norm_fwd(
        x, residual, list(normalized_shape), weight, bias, eps, p, training, store_sum
    )
    return out[0], out[1]


# What dynamo traces in place of _C.dropout_add_layer_norm (eager calls run the C++ entry).
torch.compiler.substitute_in_graph(_C.dropout_add_layer_norm, skip_signature_check=True)(_op_path)

dropout_add_layer_norm_forward = fused_entry(
    "dropout_add_layer_norm_forward",
    "dropout_add_layer_norm",
    _op_path,
    _native_sequence,
    """``dropout_add_layer_norm_forward(x, residual, normalized_shape, weight, bias, eps, p,
    training, store_sum)``: (y, sum) of dropout_add_layer_norm_fwd by
    fastlayers.ops._native.fused_entry's call path, for callers that checked p and pass a plain
    tensor (or None) as the residual; without store_sum the sum is an empty tensor, or s on
    the native path.""",
)


def _inductor_takes(x, residual, weight, bias, p) -> bool:
    """Whether a traced call becomes the native sequence: by the setting, and only where that
    computes what our op computes. Other calls keep our op, which raises what eager raises (a
    residual of another shape, which native would broadcast; p outside [0, 1]; a dtype we do not
    take) or takes what native CUDA refuses (a half sum with float32 parameters, no autocast)."""
    if config.compile_residual_layer_norm != "inductor" or x.dtype not in SUPPORTED_DTYPES:
        return False
    if not 0.0 <= p <= 1.0:
        return False
    if residual is not None and (
        residual.dtype not in SUPPORTED_DTYPES
        or residual.device != x.device
        or residual.shape != x.shape
    ):
        return False
    if torch.is_autocast_enabled(x.device.type):
        return True  # autocast decides layer_norm's dtypes for native and for us alike
    s_dtype = _sum_dtype(x, residual)
    return all(t is None or t.dtype == s_dtype for t in (weight, bias))


@torch.library.register_fake("fastlayers::dropout_add_layer_norm_fwd")
def _fwd_fake(
    x, residual, normalized_shape, weight, bias, eps, p, training, store_sum, out_dtype=None
):
    check_same_device(
        "dropout_add_layer_norm", x, input_name="x", residual=residual, weight=weight, bias=bias
    )
    if residual is not None:
        torch._check(
            tuple(residual.shape) == tuple(x.shape),
            lambda: (
                f"{_OP}: residual has shape {list(residual.shape)} but x has shape "
                f"{list(x.shape)}; they must be equal (no broadcasting)"
            ),
        )
    k = len(normalized_shape)
    torch._check(
        tuple(x.shape[x.dim() - k :]) == tuple(normalized_shape),
        lambda: (
            f"{_OP}: x of shape {list(x.shape)} does not end with normalized_shape "
            f"{list(normalized_shape)}"
        ),
    )
    s_dtype = _sum_dtype(x, residual)
    stat = list(x.shape[: x.dim() - k])
    y = x.new_empty(x.shape, dtype=out_dtype or s_dtype)
    s = x.new_empty(x.shape if store_sum else (0,), dtype=s_dtype)
    mean = x.new_empty(stat, dtype=stat_dtype(s_dtype))
    rstd = x.new_empty(stat, dtype=stat_dtype(s_dtype))
    return y, s, mean, rstd, x.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("fastlayers::dropout_add_layer_norm_bwd")
def _bwd_fake(
    grad_y,
    grad_sum,
    sum,
    mean,
    rstd,
    rng_state,
    normalized_shape,
    weight,
    bias,
    p,
    dropout,
    x_dtype,
    output_mask,
):
    check_same_device(
        "dropout_add_layer_norm",
        sum,
        input_name="sum",
        grad_y=grad_y,
        grad_sum=grad_sum,
        rng_state=rng_state,
        weight=weight,
        bias=bias,
    )

    def grad(want, like, dtype=None):
        if want and like is not None:
            return like.new_empty(like.shape, dtype=dtype or like.dtype)
        return sum.new_empty((0,))  # not asked for (or no such parameter): empty, sum's dtype

    return (
        grad(output_mask[0], sum, x_dtype),
        grad(output_mask[1], sum),
        grad(output_mask[2], weight),
        grad(output_mask[3], bias),
    )


def dropout_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    p: float = 0.0,
    training: bool = False,
    prenorm: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``y = layer_norm(dropout(x, p, training) + residual)`` in one fused op: the
    post-LayerNorm residual block of BERT-like models (and, with ``prenorm=True``, the sum that a
    pre-LN block carries on).

    Computes ``d = dropout(x)`` (an element is kept with probability ``1 - p`` and then equals
    ``x / (1 - p)`` rounded to x's dtype, else 0; no dropout unless ``training`` and ``p > 0``),
    ``s = d + residual`` (``residual=None``: ``s = d``) and ``y`` = LayerNorm of ``s`` over the
    trailing ``normalized_shape`` dimensions with ``weight``, ``bias`` and ``eps``, statistics
    accumulated in float32 (float64 for float64 sums). Returns ``y``, or ``(y, s)`` when
    ``prenorm``; gradients flow to x, residual, weight and bias through both.

    Mask and random numbers: the mask of element e (its index in x flattened row-major) is a
    function of e and a (seed, offset) pair drawn once per call from the default generator of
    x's device (CPU: one 64-bit draw from torch's CPU generator; CUDA: the generator's Philox
    seed and offset, as torch's own dropout draws them), through Philox4x32-10
    (csrc/common/philox.h).
    ``torch.manual_seed`` therefore reproduces the masks bit for bit, the same (seed, offset)
    gives the same mask on CPU and CUDA, and the backward regenerates the mask instead of
    storing it. The masks are not those ``torch.nn.functional.dropout`` would draw. Without
    dropout (or with an empty x) no random number is drawn: the generator's state is unchanged.

    Dtypes: x and residual float32, float64, float16 or bfloat16, of the same shape (no
    broadcasting) and device; ``s`` has the promoted dtype S of the two (a bfloat16 x with a
    float32 residual sums in float32); ``weight``/``bias`` S or float32 (float64 sums: float64).
    ``y`` has dtype S, except under CUDA autocast, where it is float32 for half/bfloat16 sums,
    as the native sequence gives there (layer_norm runs in float32 under autocast; CPU autocast
    leaves layer_norm's dtype alone). Gradients come back in each input's dtype.

    Under ``torch.compile`` the traced op is fastlayers' op or the native sequence for Inductor
    to fuse, by ``fastlayers.config.compile_residual_layer_norm`` (default ``"inductor"``, whose
    masks are then Inductor's own random numbers).
    """
    if not 0.0 <= p <= 1.0:  # F.dropout's error (a NaN p too, which F.dropout lets through)
        raise ValueError(
            f"{_OP}: p (the dropout probability) has to be between 0 and 1, but got {p}"
        )
    args = (x, residual, _as_shape(normalized_shape), weight, bias, eps, p, training, prenorm)
    if residual is None or type(residual) is torch.Tensor:
        y, s = dropout_add_layer_norm_forward(*args)
    elif computes_natively(x):
        y, s = _native_sequence(*args)
    else:  # a tensor subclass as the residual: the torch.ops call, as for one as x
        y, s = _op_path(*args)
    return (y, s) if prenorm else y
