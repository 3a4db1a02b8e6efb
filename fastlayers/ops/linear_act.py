"""Linear + bias + activation ops (GELU erf/tanh, ReLU): typed functional API over
torch.ops.fastlayers.linear_act_fwd/_bwd and their fake (meta) kernels. Autograd, autocast and
argument checks live in C++ (csrc/linear_act/linear_act.cpp); the activation is one enum from the
schema's string to the CUDA epilogue (csrc/common/activation.h)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastlayers._extension import _C
from fastlayers.ops._checks import check_same_device
from fastlayers.ops._native import fused_entry

linear_act_fwd = torch.ops.fastlayers.linear_act_fwd.default
linear_act_bwd = torch.ops.fastlayers.linear_act_bwd.default
linear_act_dgrad = torch.ops.fastlayers.linear_act_dgrad.default
linear_act_linear_op = torch.ops.fastlayers.linear_act_linear.default

# The schema's activation names: exact (erf) GELU, tanh-approximated GELU, ReLU.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
# nn.GELU's ``approximate`` -> the activation name.
GELU_ACTIVATION = {"none": "gelu", "tanh": "gelu_tanh"}
# ... and back: the activation name -> nn.GELU's ``approximate``.
GELU_APPROXIMATE = {activation: approximate for approximate, activation in GELU_ACTIVATION.items()}
APPROXIMATIONS = tuple(GELU_ACTIVATION)


def _check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(
            f"fastlayers.linear_gelu: approximate must be 'none' or 'tanh', got {approximate!r}"
        )


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"fastlayers.linear_act: activation must be one of {ACTIVATIONS}, got {activation!r}"
        )


def _linear_act_op(input, weight, bias, activation, weight_transposed):
    return linear_act_fwd(input, weight, bias, activation, weight_transposed, False)[0]


def native_linear_act(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    weight_transposed: bool,
) -> torch.Tensor:
    """What nn.Linear (or HF Conv1D, weight [in, out]) followed by the activation computes."""
    z = F.linear(input, weight.t() if weight_transposed else weight, bias)
    if activation == "relu":
        return F.relu(z)
    return F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


@torch.compiler.substitute_in_graph(_C.linear_act, skip_signature_check=True)
def _linear_act_traced(input, weight, bias, activation, weight_transposed):
    return _linear_act_op(input, weight, bias, activation, weight_transposed)


linear_act_forward = fused_entry(
    "linear_act_forward",
    "linear_act",
    _linear_act_op,
    native_linear_act,
    """``linear_act_forward(input, weight, bias, activation, weight_transposed)``: the output of
    linear_act_fwd by fastlayers.ops._native.fused_entry's call path (under torch.func
    transforms, forward-mode AD and ONNX export, and on a GPU this build has no kernels for, the
    native ``act(F.linear(...))``).""",
)


def _out_features(weight: torch.Tensor, weight_transposed: bool) -> int:
    return weight.shape[1] if weight_transposed else weight.shape[0]


@torch.library.register_fake("fastlayers::linear_act_fwd")
def _linear_act_fwd_fake(
    input, weight, bias, activation, weight_transposed, save_preact, save_derivative=False
):
    check_same_device("linear_act", input, weight=weight, bias=bias)
    check_activation(activation)
    torch._check(
        not (save_preact and save_derivative),
        lambda: "fastlayers.linear_act: save_preact and save_derivative cannot both be set",
    )
    torch._check(
        not save_derivative or activation in GELU_APPROXIMATE,
        lambda: "fastlayers.linear_act: save_derivative is for the GELU activations",
    )
    in_features = weight.shape[0] if weight_transposed else weight.shape[1]
    torch._check(
        input.shape[-1] == in_features,
        lambda: (
            f"fastlayers.linear_act: input of shape {list(input.shape)} does not match weight "
            f"of shape {list(weight.shape)}"
        ),
    )
    shape = [*input.shape[:-1], _out_features(weight, weight_transposed)]
    kept = save_preact or save_derivative
    preact = input.new_empty(shape) if kept else input.new_empty((0,))
    return input.new_empty(shape), preact


@torch.library.register_fake("fastlayers::linear_act_bwd")
def _linear_act_bwd_fake(
    grad_out, saved, input, weight, has_bias, activation, weight_transposed, output_mask
):
    check_same_device("linear_act", input, weight=weight, grad_out=grad_out, saved=saved)
    dx = input.new_empty(input.shape) if output_mask[0] else input.new_empty((0,))
    dw = weight.new_empty(weight.shape) if output_mask[1] else input.new_empty((0,))
    n = _out_features(weight, weight_transposed)
    db = input.new_empty((n,)) if output_mask[2] and has_bias else input.new_empty((0,))
    return dx, dw, db


@torch.library.register_fake("fastlayers::linear_act_dgrad")
def _linear_act_dgrad_fake(
    grad_out,
    weight,
    saved,
    activation,
    weight_transposed,
    want_db,
    saved_is_derivative=False,
    want_grad_out_sums=False,
):
    check_same_device("linear_act", grad_out, input_name="grad_out", weight=weight, saved=saved)
    n = weight.shape[0] if weight_transposed else weight.shape[1]
    db = saved.new_empty((n,)) if want_db else saved.new_empty((0,))
    sums = saved.new_empty((grad_out.shape[-1],)) if want_grad_out_sums else saved.new_empty((0,))
    return saved.new_empty(saved.shape), db, sums


@torch.library.register_fake("fastlayers::column_sums")
def _column_sums_fake(grad):
    torch._check(
        grad.dim() >= 1, lambda: "fastlayers.column_sums: grad must have at least one dimension"
    )
    return grad.new_empty((grad.shape[-1],))


@torch.library.register_fake("fastlayers::linear_act_linear")
def _linear_act_linear_fake(
    input, weight1, bias1, weight2, bias2, activation, weight1_transposed, weight2_transposed
):
    check_same_device(
        "linear_act_linear", input, weight1=weight1, bias1=bias1, weight2=weight2, bias2=bias2
    )
    check_activation(activation)
    in1, hidden = weight1.shape if weight1_transposed else reversed(weight1.shape)
    in2, out2 = weight2.shape if weight2_transposed else reversed(weight2.shape)
    torch._check(
        input.shape[-1] == in1 and in2 == hidden,
        lambda: (
            f"fastlayers.linear_act_linear: input of shape {list(input.shape)}, weight1 of shape "
            f"{list(weight1.shape)} and weight2 of shape {list(weight2.shape)} do not chain"
        ),
    )
    return input.new_empty([*input.shape[:-1], out2])


def linear_gelu(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    approximate: str = "none",
    *,
    weight_transposed: bool = False,
) -> torch.Tensor:
    """``gelu(linear(input, weight, bias), approximate=approximate)`` in one fused op.

    ``weight`` is ``[out_features, in_features]`` as for :func:`torch.nn.functional.linear`,
    or ``[in_features, out_features]`` with ``weight_transposed=True`` (HuggingFace ``Conv1D``'s
    layout; the weight is read in place, never transposed or copied). ``approximate`` is
    ``'none'`` (exact erf GELU, ``nn.GELU``'s default) or ``'tanh'``. Inputs float32, float16,
    bfloat16 or float64, with parameters of the same dtype (under ``torch.autocast`` float32
    parameters are cast as ``nn.Linear``'s are); any leading shape.
    """
    _check_approximate(approximate)
    activation = GELU_ACTIVATION[approximate]
    return linear_act_forward(input, weight, bias, activation, bool(weight_transposed))


def linear_relu(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_transposed: bool = False,
) -> torch.Tensor:
    """``relu(linear(input, weight, bias))`` in one fused op: the ReLU in the GEMM's epilogue
    (CUTLASS on H100/H200, cuBLASLt's bias + ReLU epilogue elsewhere). On CPU bit-identical to
    ``F.relu(F.linear(...))``. Arguments as for :func:`linear_gelu`. Backward reads the ReLU's
    mask from the output itself (no pre-activation is stored)."""
    return linear_act_forward(input, weight, bias, "relu", bool(weight_transposed))


def sm90_available(device: torch.device | str) -> bool:
    """Whether the fused sm_90a kernel can run on ``device``: a CUDA device of compute
    capability 9.0 (H100/H200) and a build with the CUTLASS kernels. :func:`linear_act_path`
    says whether a given call takes it."""
    device = torch.device(device)
    return (
        device.type == "cuda"
        and _C.build_info()["cutlass_sm90"]
        and torch.cuda.get_device_capability(device) == (9, 0)
    )


def sm80_available(device: torch.device | str) -> bool:
    """Whether the fused sm_80 kernel (CUTLASS 2.x, mma.sync) can run on ``device``: a CUDA
    device of compute capability 8.0 or newer and a build with those kernels (built only with
    ``FASTLAYERS_BUILD_SM80=1``). Where built, it serves 8.x GPUs (:func:`linear_act_path` says
    which calls); on newer GPUs only the tests and benchmarks force it
    (``_C._testing.linear_act_sm80_raw``)."""
    device = torch.device(device)
    return (
        device.type == "cuda"
        and _C.build_info().get("cutlass_sm80", False)
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def linear_act_path(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "gelu",
    weight_transposed: bool = False,
) -> str:
    """Which CUDA implementation the fused Linear + ``activation`` takes for these arguments:
    ``'cutlass_sm90'`` or ``'cutlass_sm80'`` (one fused GEMM: H100/H200, 8.x GPUs) or
    ``'fallback: <reason>'`` (GELU: a cuBLAS GEMM and a separate GELU pass; ReLU: cuBLASLt's
    bias + ReLU epilogue, or a GEMM and an in-place ReLU without bias). CUDA tensors only."""
    check_activation(activation)
    if not hasattr(_C, "linear_act_path"):
        raise RuntimeError("fastlayers.linear_act_path: this build has no CUDA kernels")
    return _C.linear_act_path(input, weight, bias, activation, bool(weight_transposed))


def linear_gelu_path(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_transposed: bool = False,
) -> str:
    """:func:`linear_act_path` for GELU (both forms take the same path)."""
    return linear_act_path(input, weight, bias, weight_transposed=weight_transposed)


def native_linear_act_linear(
    input: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    activation: str,
    weight1_transposed: bool,
    weight2_transposed: bool,
) -> torch.Tensor:
    """What Linear (or Conv1D) -> activation -> Linear (or Conv1D) computes natively."""
    h = native_linear_act(input, weight1, bias1, activation, weight1_transposed)
    return F.linear(h, weight2.t() if weight2_transposed else weight2, bias2)


def linear_act_linear(
    input: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    activation: str = "gelu",
    *,
    weight1_transposed: bool = False,
    weight2_transposed: bool = False,
) -> torch.Tensor:
    """The MLP ``linear(act(linear(input, weight1, bias1)), weight2, bias2)`` as one op.

    The forward is :func:`linear_gelu` / :func:`linear_relu` (the activation in the first GEMM's
    epilogue) and the second Linear; the backward fuses the activation's derivative into the
    GEMM that computes the second Linear's input gradient (on H100/H200: its epilogue reads the
    saved pre-activation and writes ``dz``), so the separate elementwise pass, which read that
    gradient and the pre-activation and wrote ``dz``, is gone; the first bias's gradient is
    ``dz``'s column sum (on H100/H200 summed by that epilogue in float before ``dz`` is rounded,
    in a fixed order; elsewhere from the rounded ``dz``, as for ``nn.Linear``). ``activation``
    is ``'gelu'``, ``'gelu_tanh'`` or ``'relu'``; weights as for :func:`linear_gelu`
    (``*_transposed``: stored ``[in_features, out_features]``, HuggingFace ``Conv1D``)."""
    check_activation(activation)
    return linear_act_linear_entry(
        input,
        weight1,
        bias1,
        weight2,
        bias2,
        activation,
        bool(weight1_transposed),
        bool(weight2_transposed),
    )


@torch.compiler.substitute_in_graph(_C.linear_act_linear, skip_signature_check=True)
def _linear_act_linear_traced(*args):
    return linear_act_linear_op(*args)


linear_act_linear_entry = fused_entry(
    "linear_act_linear", "linear_act_linear", linear_act_linear_op, native_linear_act_linear
)


def linear_act_dgrad_path(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    saved: torch.Tensor,
    *,
    activation: str = "gelu",
    weight_transposed: bool = False,
) -> str:
    """Which CUDA implementation :func:`linear_act_linear`'s backward takes for the activation's
    gradient through the second Linear (``grad_out`` at its output, its ``weight``, ``saved``
    the pre-activation, or the activation's output for ReLU): ``'cutlass_sm90'`` (one GEMM
    whose epilogue applies the derivative) or ``'fallback: <reason>'``
    (cuBLAS, then the elementwise backward pass). CUDA tensors only."""
    check_activation(activation)
    if not hasattr(_C, "linear_act_dgrad_path"):
        raise RuntimeError("fastlayers.linear_act_dgrad_path: this build has no CUDA kernels")
    return _C.linear_act_dgrad_path(grad_out, weight, saved, activation, bool(weight_transposed))


def fallback_rows(k: int, n: int, dtype: torch.dtype, device: str = "cuda") -> int:
    """Rows for which a [rows, k] input times an [n, k] weight in dtype takes the fallback, found
    by asking :func:`linear_act_path` rather than restating its size rule (for tests and the
    sanitizer driver, which must cover both paths). With
    the sm90 kernels: the fewest multiple of 128 refused for its size alone (more rows than fit
    one wave of the small tiles, too few to fill the large tiles' waves); otherwise (no sm90
    kernels, float32 or float64) every call falls back, and 64 rows do."""
    if not sm90_available(device) or dtype not in (torch.float16, torch.bfloat16):
        return 64
    w = torch.empty(n, k, device=device, dtype=dtype)
    for tiles in range(1, 1025):
        x = torch.empty(128 * tiles, k, device=device, dtype=dtype)
        if "output tiles" in linear_act_path(x, w, None, activation="gelu"):
            return 128 * tiles
    raise AssertionError(f"no row count sends {k} -> {n} to the fallback for its size")
