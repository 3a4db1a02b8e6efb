"""Rotary embedding ops: q and k rotated by (cos, sin) in one call, over
torch.ops.fastlayers.rotary_fwd/_bwd, with fake kernels and the forms' native composite.
Autograd and argument checks live in C++ (csrc/rotary/rotary.cpp; rotary.h states what each
form computes, rounding for rounding)."""

from __future__ import annotations

import torch

from fastlayers import config
from fastlayers._extension import _C
from fastlayers.ops._checks import check_same_device
from fastlayers.ops._native import fused_entry

rotary_fwd = torch.ops.fastlayers.rotary_fwd.default
rotary_bwd = torch.ops.fastlayers.rotary_bwd.default

# The form's flags (csrc/rotary/rotary.h kRotary*): which model's sequence a call computes.
INTERLEAVED = 1  # Cohere: pairs (x[2j], x[2j+1]) rotate; else transformers' rotate_half
UPCAST = 2  # x.float() first (Cohere, ModernBERT)
CAST_BACK = 4  # the result cast to x's dtype (OLMo2, Cohere, ModernBERT)
PARTIAL = 8  # the first cos.shape[-1] dims rotate, the rest pass through (Phi-3, GPT-NeoX)
UPCAST_EACH = 16  # with UPCAST: x.float() per use (ModernBERT), which only the backward shows
ALL_FLAGS = 31

_FLAG_NAMES = (
    (INTERLEAVED, "interleaved"),
    (UPCAST, "float32"),
    (UPCAST_EACH, "per use"),
    (PARTIAL, "partial"),
    (CAST_BACK, "cast back"),
)


def form_name(form: int) -> str:
    """``form`` in words, for reports: 'rotate_half', 'interleaved, float32, cast back' ..."""
    words = [name for flag, name in _FLAG_NAMES if form & flag]
    return ", ".join(words) if words else "rotate_half"


def rotary_out_dtype(form: int, q: torch.dtype, cos: torch.dtype) -> torch.dtype:
    """The outputs' dtype (csrc/rotary/rotary.cpp rotary_out_dtype)."""
    if form & CAST_BACK:
        return q
    return torch.promote_types(torch.float32 if form & UPCAST else q, cos)


def _rotate(r: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-r[..., 1::2], r[..., ::2]), dim=-1).flatten(-2)
    h = r.shape[-1] // 2
    return torch.cat((-r[..., h:], r[..., :h]), dim=-1)


def _native_one(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, form: int) -> torch.Tensor:
    dr = c.shape[-1]

    def part(rotated: bool) -> torch.Tensor:
        xc = x.float() if form & UPCAST else x
        if not form & PARTIAL:
            return xc
        return xc[..., :dr] if rotated else xc[..., dr:]

    r = part(True)
    r2 = part(True) if form & UPCAST and form & UPCAST_EACH else r  # ModernBERT's q.float() twice
    y = (r * c) + (_rotate(r2, bool(form & INTERLEAVED)) * s)
    if form & PARTIAL:
        y = torch.cat((y, part(False)), dim=-1)
    return y.to(x.dtype) if form & CAST_BACK else y


def native_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    form: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model of ``form`` computes, op for op (the forward the fused op reproduces; what
    runs under torch.func transforms, ONNX export and, by default, torch.compile), its
    backward native autograd's."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _native_one(q, c, s, form), _native_one(k, c, s, form)


def _check_operands(q, k, cos, sin, unsqueeze_dim, form) -> None:
    """What the C++ checks refuse, for the fake kernels (same messages, naming the argument)."""
    torch._check_value(
        0 <= form <= ALL_FLAGS,
        lambda: (
            f"fastlayers.rotary: form must be a combination of the rotary flags (0 to "
            f"{ALL_FLAGS}), got {form}"
        ),
    )
    check_same_device("rotary", q, input_name="q", k=k, cos=cos, sin=sin)
    torch._check(
        k.dtype == q.dtype,
        lambda: (
            f"fastlayers.rotary: k has dtype {k.dtype} but q has dtype {q.dtype}; they must match"
        ),
    )
    torch._check(
        sin.dtype == cos.dtype and sin.shape == cos.shape,
        lambda: (
            "fastlayers.rotary: sin must have cos's dtype and shape, got "
            f"{sin.dtype} {list(sin.shape)} and {cos.dtype} {list(cos.shape)}"
        ),
    )
    dims = cos.dim() + 1
    torch._check_index(
        -dims <= unsqueeze_dim < dims,
        lambda: (
            f"fastlayers.rotary: unsqueeze_dim must be in [{-dims}, {dims - 1}] for cos of "
            f"{cos.dim()} dimensions, got {unsqueeze_dim}"
        ),
    )


def _out_like(x: torch.Tensor, c_shape: torch.Size, dtype: torch.dtype, form: int):
    rot = (*x.shape[:-1], c_shape[-1]) if form & PARTIAL else x.shape
    shape = torch.broadcast_shapes(rot, c_shape)
    if form & PARTIAL:
        shape = (*shape[:-1], shape[-1] + x.shape[-1] - c_shape[-1])
        return x.new_empty(shape, dtype=dtype)
    if shape == x.shape:
        return torch.empty_like(x, dtype=dtype)
    return x.new_empty(shape, dtype=dtype)


@torch.library.register_fake("fastlayers::rotary_fwd")
def _rotary_fwd_fake(q, k, cos, sin, unsqueeze_dim, form):
    _check_operands(q, k, cos, sin, unsqueeze_dim, form)
    c_shape = cos.unsqueeze(unsqueeze_dim).shape
    dtype = rotary_out_dtype(form, q.dtype, cos.dtype)
    return _out_like(q, c_shape, dtype, form), _out_like(k, c_shape, dtype, form)


@torch.library.register_fake("fastlayers::rotary_bwd")
def _rotary_bwd_fake(grad_q, grad_k, cos, sin, unsqueeze_dim, form, q_dtype):
    def grad(g):
        if g is None:
            return cos.new_empty((0,), dtype=q_dtype)
        check_same_device("rotary", cos, input_name="cos", grad=g)
        return torch.empty_like(g, dtype=q_dtype)  # the grad's layout

    return grad(grad_q), grad(grad_k)


def _rotary_op_path(q, k, cos, sin, unsqueeze_dim, form):
    """The torch.ops call; under torch.compile (config.compile_rotary == 'inductor') the model's
    composite, which Inductor fuses with its neighbours."""
    if torch.compiler.is_compiling() and config.compile_rotary == "inductor":
        return native_rotary(q, k, cos, sin, unsqueeze_dim, form)
    return rotary_fwd(q, k, cos, sin, unsqueeze_dim, form)


# What dynamo traces in place of _C.rotary (eager calls run the C++ entry).
torch.compiler.substitute_in_graph(_C.rotary, skip_signature_check=True)(_rotary_op_path)

rotary_forward = fused_entry(
    "rotary_forward",
    "rotary",
    _rotary_op_path,
    native_rotary,
    """``rotary_forward(q, k, cos, sin, unsqueeze_dim, form)``: (q_out, k_out), by
    fastlayers.ops._native.fused_entry's call path.""",
)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    form: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` in one call: q and k
    (one dtype, any head counts: GQA) rotated by ``cos``/``sin`` ([B or 1, S, rotary dims], one
    dtype, unsqueezed at ``unsqueeze_dim`` to broadcast over heads). ``form`` combines the flags
    INTERLEAVED, UPCAST, UPCAST_EACH, PARTIAL and CAST_BACK to name the model's own sequence
    (0: LLaMA, Mistral, Qwen, Gemma). On CPU the results are native's bit for bit, forward and
    backward; on CUDA one kernel rotates q and k, rounding where the model rounds. The outputs
    are new tensors (q and k are never written); backward saves cos and sin only, and
    differentiates q and k (cos and sin must not require grad). Under torch.compile it traces as
    the model's composite (``fastlayers.config.compile_rotary``); under torch.func transforms
    and ONNX export it computes the composite."""
    return rotary_forward(q, k, cos, sin, unsqueeze_dim, form)
