"""RMSNorm ops: typed functional API over torch.ops.fastlayers.rms_norm_fwd/_bwd, their fake
kernels, and each form's native composite (what the model computes, op for op). Autograd and
argument checks live in C++ (csrc/rms_norm/rms_norm.cpp, whose header says what each form
computes)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastlayers import config
from fastlayers._extension import _C
from fastlayers.ops._checks import check_same_device
from fastlayers.ops._native import fused_entry

rms_norm_fwd = torch.ops.fastlayers.rms_norm_fwd.default
rms_norm_bwd = torch.ops.fastlayers.rms_norm_bwd.default

# The forms (csrc/rms_norm/rms_norm.h RmsNormForm): which model's rounding order a call keeps.
FORMS = {"torch": 0, "cast_first": 1, "t5": 2, "gemma": 3, "float32": 4}
FORM_NAMES = {code: name for name, code in FORMS.items()}
_HALF = (torch.float16, torch.bfloat16)


def rms_norm_out_dtype(form: int, input: torch.dtype, weight: torch.dtype | None) -> torch.dtype:
    """The output dtype of a call (csrc/rms_norm/rms_norm.cpp rms_norm_out_dtype)."""
    if form == FORMS["cast_first"]:
        return input if weight is None else torch.promote_types(input, weight)
    if form == FORMS["t5"]:
        hidden = torch.promote_types(input, torch.float32)
        if weight is None:
            return hidden
        return weight if weight in _HALF else torch.promote_types(hidden, weight)
    return input


def _eps(eps: float | None, dtype: torch.dtype) -> float:
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def native_rms_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    eps: float | None,
    form: int,
) -> torch.Tensor:
    """What the model of ``form`` computes, op for op (the fused op's reference, and what runs
    under torch.func transforms, ONNX export and, by default, torch.compile)."""
    dims = [input.dim() - 1 - i for i in range(len(normalized_shape))]
    e = _eps(eps, input.dtype)

    def normalised(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + e)

    if form in (FORMS["torch"], FORMS["float32"]):
        wide = form == FORMS["torch"] and input.dtype == torch.float64
        y = normalised(input.to(torch.float64 if wide else torch.float32))
        return (y if weight is None else y * weight).to(input.dtype)
    if form == FORMS["cast_first"]:
        return weight * normalised(input.to(torch.float32)).to(input.dtype)
    if form == FORMS["t5"]:
        variance = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
        hidden = input * torch.rsqrt(variance + e)
        if weight.dtype in _HALF:
            hidden = hidden.to(weight.dtype)
        return weight * hidden
    x = input.float()  # gemma
    return (normalised(x) * (1.0 + weight.float())).type_as(input)


def _rms_norm_op_path(input, normalized_shape, weight, eps, form):
    """The torch.ops call, or the model's composite where dynamo traces and Inductor takes it."""
    if torch.compiler.is_compiling() and config.compile_rms_norm == "inductor":
        if torch.is_autocast_enabled(input.device.type) and form == FORMS["torch"]:
            return torch.nn.functional.rms_norm(input, list(normalized_shape), weight, eps)
        return native_rms_norm(input, normalized_shape, weight, eps, form)
    return rms_norm_fwd(input, list(normalized_shape), weight, eps, form)[0]


# What dynamo traces in place of _C.rms_norm (eager calls of this name run _C.rms_norm).
torch.compiler.substitute_in_graph(_C.rms_norm, skip_signature_check=True)(_rms_norm_op_path)


def _native_entry(input, normalized_shape, weight, eps, form):
    if torch.is_autocast_enabled(input.device.type) and form == FORMS["torch"]:
        return torch.nn.functional.rms_norm(input, list(normalized_shape), weight, eps)
    return native_rms_norm(input, normalized_shape, weight, eps, form)


rms_norm_forward = fused_entry(
    "rms_norm_forward",
    "rms_norm",
    _rms_norm_op_path,
    _native_entry,
    """``rms_norm_forward(input, normalized_shape, weight, eps, form)``: the output of
    rms_norm_fwd, by fastlayers.ops._native.fused_entry's call path. Under torch.compile with
    ``fastlayers.config.compile_rms_norm == "inductor"`` (the default) it traces as the form's
    native composite; under torch.func transforms, forward-mode AD and ONNX export, and on a GPU
    this build has no kernels for, it computes that composite.""",
)


def _stat(input: torch.Tensor, normalized_shape: Sequence[int], form: int) -> torch.Tensor:
    wide = form == FORMS["torch"] and input.dtype == torch.float64
    shape = input.shape[: input.dim() - len(normalized_shape)]
    return input.new_empty(shape, dtype=torch.float64 if wide else torch.float32)


@torch.library.register_fake("fastlayers::rms_norm_fwd")
def _rms_norm_fwd_fake(input, normalized_shape, weight, eps, form, out_dtype=None):
    check_same_device("rms_norm", input, weight=weight)
    torch._check(
        tuple(input.shape[input.dim() - len(normalized_shape) :]) == tuple(normalized_shape),
        lambda: (
            f"fastlayers.rms_norm: input of shape {list(input.shape)} does not end with "
            f"normalized_shape {list(normalized_shape)}"
        ),
    )
    torch._check(form in FORM_NAMES, lambda: f"fastlayers.rms_norm: form must be 0-4, got {form}")
    dtype = out_dtype or rms_norm_out_dtype(
        form, input.dtype, None if weight is None else weight.dtype
    )
    return input.new_empty(input.shape, dtype=dtype), _stat(input, normalized_shape, form)


@torch.library.register_fake("fastlayers::rms_norm_bwd")
def _rms_norm_bwd_fake(grad_out, input, rstd, normalized_shape, weight, form, output_mask):
    check_same_device("rms_norm", input, grad_out=grad_out, rstd=rstd, weight=weight)
    dx = input.new_empty(input.shape) if output_mask[0] else input.new_empty((0,))
    if output_mask[1] and weight is not None:
        return dx, weight.new_empty(weight.shape)
    return dx, input.new_empty((0,))


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    form: str = "torch",
) -> torch.Tensor:
    """Root-mean-square normalization over the trailing ``normalized_shape`` dimensions,
    computed by fastlayers' fused kernels, in the rounding order of ``form``:

    - ``"torch"``: :func:`torch.nn.functional.rms_norm` (``eps=None``: float32's epsilon, as
      torch's implementation uses);
    - ``"cast_first"``: LLaMA, Mistral, Qwen, Phi-3: the normalised input cast to its dtype,
      then times the weight;
    - ``"t5"``: T5LayerNorm: cast to the weight's dtype when that is half, then times it;
    - ``"gemma"``: Gemma: times ``1 + weight`` in float32, cast to the input's dtype;
    - ``"float32"``: OLMo2: ``"torch"`` computed in float32 even for float64 inputs.

    On CPU it computes what the model computes, op for op (bit-identical); on CUDA the
    statistics are accumulated in float32 and each form's roundings are kept.
    """
    if form not in FORMS:
        raise ValueError(f"fastlayers.rms_norm: form must be one of {tuple(FORMS)}, got {form!r}")
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    return rms_norm_forward(input, shape, weight, eps, FORMS[form])


# ---------------------------------------------------------------- residual add + RMSNorm

add_rms_norm_fwd = torch.ops.fastlayers.add_rms_norm_fwd.default
add_rms_norm_bwd = torch.ops.fastlayers.add_rms_norm_bwd.default


def native_add_rms_norm(x, residual, normalized_shape, weight, eps, form):
    """``(norm(residual + x), residual + x)`` as the decoder layers compute them."""
    s = residual + x
    return native_rms_norm(s, normalized_shape, weight, eps, form), s


def _add_rms_norm_op_path(x, residual, normalized_shape, weight, eps, form):
    if torch.compiler.is_compiling() and config.compile_rms_norm == "inductor":
        return native_add_rms_norm(x, residual, normalized_shape, weight, eps, form)
    y, s, _ = add_rms_norm_fwd(x, residual, list(normalized_shape), weight, eps, form)
    return y, s


torch.compiler.substitute_in_graph(_C.add_rms_norm, skip_signature_check=True)(
    _add_rms_norm_op_path
)

add_rms_norm_forward = fused_entry(
    "add_rms_norm_forward",
    "add_rms_norm",
    _add_rms_norm_op_path,
    native_add_rms_norm,
    """``add_rms_norm_forward(x, residual, normalized_shape, weight, eps, form)``:
    ``(y, sum)`` of add_rms_norm_fwd, by fastlayers.ops._native.fused_entry's call path.""",
)


@torch.library.register_fake("fastlayers::add_rms_norm_fwd")
def _add_rms_norm_fwd_fake(x, residual, normalized_shape, weight, eps, form):
    check_same_device("add_rms_norm", x, input_name="x", residual=residual, weight=weight)
    torch._check(
        residual.shape == x.shape,
        lambda: (
            f"fastlayers.add_rms_norm: residual has shape {list(residual.shape)} but x has shape "
            f"{list(x.shape)}"
        ),
    )
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    y, rstd = _rms_norm_fwd_fake(s, normalized_shape, weight, eps, form)
    return y, s, rstd


@torch.library.register_fake("fastlayers::add_rms_norm_bwd")
def _add_rms_norm_bwd_fake(grad_y, grad_sum, sum, rstd, normalized_shape, weight, form, mask):
    check_same_device("add_rms_norm", sum, input_name="sum", grad_y=grad_y, grad_sum=grad_sum)
    ds = sum.new_empty(sum.shape) if mask[0] or mask[1] else sum.new_empty((0,))
    dw = weight.new_empty(weight.shape) if mask[2] and weight is not None else sum.new_empty((0,))
    return (ds if mask[0] else sum.new_empty((0,))), (ds if mask[1] else sum.new_empty((0,))), dw


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    form: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one pass (a decoder layer's residual add
    and the RMSNorm after it; the sum is the next residual): x and residual read once, the
    output and the sum written once, nothing written in place. ``form`` as for
    :func:`rms_norm`. On CPU, and for operands of different dtypes, the native ops' results
    bit for bit."""
    if form not in FORMS:
        raise ValueError(
            f"fastlayers.add_rms_norm: form must be one of {tuple(FORMS)}, got {form!r}"
        )
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    return add_rms_norm_forward(x, residual, shape, weight, eps, FORMS[form])
