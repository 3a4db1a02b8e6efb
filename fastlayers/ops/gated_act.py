"""Gated activation ops: act(gate) * up in one pass (the elementwise core of LLaMA/Gemma/T5 v1.1
gated MLPs), over torch.ops.fastlayers.gated_act_fwd/_bwd, with fake kernels; for inference,
gated_act_linear: act(gate) * (input . weight^T), the up projection with the product in its GEMM
epilogue on sm_90 GPUs; for training, gated_act_down: the down projection of the product, whose
backward recomputes the product instead of keeping it. Autograd and argument checks live in C++
(csrc/gated_act/gated_act.cpp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastlayers._extension import _C
from fastlayers.ops._checks import SUPPORTED_DTYPES, check_same_device
from fastlayers.ops._native import fused_entry

gated_act_fwd = torch.ops.fastlayers.gated_act_fwd.default
gated_act_bwd = torch.ops.fastlayers.gated_act_bwd.default
gated_act_linear_op = torch.ops.fastlayers.gated_act_linear.default
gated_act_down_op = torch.ops.fastlayers.gated_act_down.default

# The schema's activation names: SiLU (SwiGLU), exact (erf) GELU, tanh GELU (GeGLU), ReLU.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def _activation_error(activation: object) -> str:
    return (
        f"fastlayers.gated_act: activation must be 'silu', 'gelu', 'gelu_tanh' or 'relu', got "
        f"{activation!r}"
    )


def _check_operands(op: str, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """What the C++ checks refuse, for the fake kernels (same messages, naming the argument)."""
    torch._check_value(activation in ACTIVATIONS, lambda: _activation_error(activation))
    check_same_device(op, gate, input_name="gate", up=up)
    torch._check(
        up.dtype == gate.dtype,
        lambda: (
            f"fastlayers.{op}: up has dtype {up.dtype} but gate has dtype {gate.dtype}; "
            "they must match"
        ),
    )
    torch._check(
        up.shape == gate.shape,
        lambda: (
            f"fastlayers.{op}: up has shape {list(up.shape)} but gate has shape "
            f"{list(gate.shape)}; they must match"
        ),
    )


@torch.library.register_fake("fastlayers::gated_act_fwd")
def _gated_act_fwd_fake(gate, up, activation):
    _check_operands("gated_act", gate, up, activation)
    return gate.new_empty(gate.shape)


@torch.library.register_fake("fastlayers::gated_act_bwd")
def _gated_act_bwd_fake(grad_out, gate, up, activation, output_mask):
    _check_operands("gated_act", gate, up, activation)
    check_same_device("gated_act", gate, input_name="gate", grad_out=grad_out)

    def grad(want: bool) -> torch.Tensor:
        return gate.new_empty(gate.shape) if want else gate.new_empty((0,))

    return grad(output_mask[0]), grad(output_mask[1]), grad(output_mask[2])


@torch.library.register_fake("fastlayers::gated_act_linear")
def _gated_act_linear_fake(gate, input, weight, activation):
    op = "gated_act_linear"
    torch._check_value(activation in ACTIVATIONS, lambda: _activation_error(activation))
    torch._check(
        input.dtype in SUPPORTED_DTYPES,
        lambda: (
            f"fastlayers.{op}: input must be float32, float64, float16 or bfloat16, got "
            f"{input.dtype}"
        ),
    )
    torch._check(
        input.dim() >= 1, lambda: f"fastlayers.{op}: input must have at least one dimension"
    )
    check_same_device(op, input, weight=weight, gate=gate)
    for name, t in (("weight", weight), ("gate", gate)):
        torch._check(
            t.dtype == input.dtype,
            lambda name=name, t=t: (
                f"fastlayers.{op}: {name} has dtype {t.dtype} but input has dtype "
                f"{input.dtype}; they must match"
            ),
        )
    torch._check(weight.dim() == 2, lambda: f"fastlayers.{op}: weight must be 2-D")
    torch._check(
        weight.shape[1] == input.shape[-1],
        lambda: f"fastlayers.{op}: input's last dimension must be in_features = {weight.shape[1]}",
    )
    shape = [*input.shape[:-1], weight.shape[0]]
    torch._check(
        list(gate.shape) == shape,
        lambda: (
            f"fastlayers.{op}: gate has shape {list(gate.shape)} but input . weight^T has "
            f"shape {shape}; they must match"
        ),
    )
    return gate.new_empty(gate.shape)


@torch.library.register_fake("fastlayers::gated_act_down")
def _gated_act_down_fake(gate, up, weight, bias, activation):
    op = "gated_act_down"
    _check_operands("gated_act", gate, up, activation)  # gated_act_fwd's checks, in C++
    torch._check(gate.dim() >= 1, lambda: f"fastlayers.{op}: gate must have at least one dimension")
    torch._check(weight.dim() == 2, lambda: f"fastlayers.{op}: weight must be 2-D")
    torch._check(
        weight.shape[1] == gate.shape[-1],
        lambda: (
            f"fastlayers.{op}: weight of shape {list(weight.shape)} does not take the "
            f"product's {gate.shape[-1]} features"
        ),
    )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        check_same_device(op, gate, input_name="gate", **{name: t})
        torch._check(
            t.dtype == gate.dtype,
            lambda name=name, t=t: (
                f"fastlayers.{op}: {name} has dtype {t.dtype} but gate has dtype "
                f"{gate.dtype}; they must match"
            ),
        )
    if bias is not None:
        torch._check(
            list(bias.shape) == [weight.shape[0]],
            lambda: f"fastlayers.{op}: bias must have shape [{weight.shape[0]}]",
        )
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


def _native_gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` as native computes it (the CPU op is bit-identical to this)."""
    if activation == "silu":
        a = F.silu(gate)
    elif activation == "gelu":
        a = F.gelu(gate)
    elif activation == "gelu_tanh":
        a = F.gelu(gate, approximate="tanh")
    elif activation == "relu":
        a = torch.relu(gate)
    else:
        raise ValueError(_activation_error(activation))
    return a * up


def _gated_act_op_path(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The torch.ops call; under torch.compile the native composite, which Inductor fuses with
    its neighbours (the down projection's input, the gate/up GEMMs' epilogue)."""
    if torch.compiler.is_compiling():
        return _native_gated_act(gate, up, activation)
    return gated_act_fwd(gate, up, activation)


# What dynamo traces in place of _C.gated_act (eager calls run the C++ entry).
torch.compiler.substitute_in_graph(_C.gated_act, skip_signature_check=True)(_gated_act_op_path)

gated_act_forward = fused_entry(
    "gated_act_forward",
    "gated_act",
    _gated_act_op_path,
    _native_gated_act,
    """``gated_act_forward(gate, up, activation)``: ``act(gate) * up``, by
    fastlayers.ops._native.fused_entry's call path.""",
)


def _native_gated_act_linear(
    gate: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``act(gate) * F.linear(input, weight)`` as native computes it."""
    return _native_gated_act(gate, F.linear(input, weight), activation)


def _gated_act_linear_op_path(
    gate: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, activation: str
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _native_gated_act_linear(gate, input, weight, activation)
    return gated_act_linear_op(gate, input, weight, activation)


torch.compiler.substitute_in_graph(_C.gated_act_linear, skip_signature_check=True)(
    _gated_act_linear_op_path
)

gated_act_linear_forward = fused_entry(
    "gated_act_linear_forward",
    "gated_act_linear",
    _gated_act_linear_op_path,
    _native_gated_act_linear,
    """``gated_act_linear_forward(gate, input, weight, activation)``: ``act(gate) *
    F.linear(input, weight)`` for inference (no backward; calls that record gradients are
    refused), by fastlayers.ops._native.fused_entry's call path. On CPU native's bits; on an
    sm_90 GPU, where the GEMM's size rule takes the call, the up projection's GEMM is CUTLASS's
    with the product in its epilogue (each factor rounded to the dtype first, as native rounds
    them; the GEMM within the fused GEMMs' bounds, not cuBLAS's bits), else cuBLAS's GEMM and
    gated_act.""",
)


def _native_gated_act_down(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` as native computes it."""
    return F.linear(_native_gated_act(gate, up, activation), weight, bias)


def _gated_act_down_op_path(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _native_gated_act_down(gate, up, weight, bias, activation)
    return gated_act_down_op(gate, up, weight, bias, activation)


torch.compiler.substitute_in_graph(_C.gated_act_down, skip_signature_check=True)(
    _gated_act_down_op_path
)

gated_act_down_forward = fused_entry(
    "gated_act_down_forward",
    "gated_act_down",
    _gated_act_down_op_path,
    _native_gated_act_down,
    """``gated_act_down_forward(gate, up, weight, bias, activation)``: ``F.linear(act(gate) *
    up, weight, bias)`` whose autograd node keeps gate, up and the weight but not the product,
    by fastlayers.ops._native.fused_entry's call path (see :func:`gated_act_down`).""",
)


def gated_act_down(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)``: a gated MLP's down projection of its product,
    for training. The output and every gradient are those of :func:`gated_act` followed by
    ``F.linear`` (the same kernels and GEMM calls), but the backward recomputes the product
    from ``gate`` and ``up`` (which act * up's backward keeps anyway) in the pass that computes
    their gradients, instead of keeping it from the forward: one [..., intermediate] tensor
    less per MLP between the forward and the backward. Under autocast the projection runs in
    autocast's dtype, as ``F.linear`` would (the weight's cast cached for the region).
    ``weight``: [out, intermediate]; ``bias``: [out] or None; in ``gate``'s dtype outside
    autocast."""
    return gated_act_down_forward(gate, up, weight, bias, activation)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` in one pass: the gated MLP's ``down(act(gate(x)) * up(x))`` core.

    ``activation``: ``"silu"`` (LLaMA, Mistral, Qwen: ``F.silu``), ``"gelu"`` (``F.gelu``),
    ``"gelu_tanh"`` (Gemma, T5 v1.1: ``F.gelu(approximate="tanh")``) or ``"relu"``.
    ``gate`` and ``up`` have one shape, dtype (float32, float16, bfloat16, float64) and device;
    they may be the halves of ``h.chunk(2, dim=-1)``, read in place on CUDA. The result is
    contiguous, in their dtype. On CPU it is native's result bit for bit; on CUDA it rounds as
    native does (``act(gate)`` to the dtype, then the product). Backward saves ``gate`` and
    ``up`` only. Under torch.compile it traces as the native composite (Inductor fuses it);
    under torch.func transforms, forward-mode AD and ONNX export, and on a GPU this build has no
    kernels for, it computes the native composite.
    """
    return gated_act_forward(gate, up, activation)


def gated_act_linear_path(
    gate: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, activation: str = "silu"
) -> str:
    """Which CUDA implementation gated_act_linear takes for these arguments: ``'cutlass_sm90'``
    (the product in the up GEMM's epilogue) or ``'fallback: <reason>'`` (cuBLAS's GEMM and
    gated_act). CUDA tensors only."""
    torch._check_value(activation in ACTIVATIONS, lambda: _activation_error(activation))
    if not hasattr(_C, "gated_act_linear_path"):
        raise RuntimeError("fastlayers.gated_act_linear_path: this build has no CUDA kernels")
    return _C.gated_act_linear_path(gate, input, weight, activation)
