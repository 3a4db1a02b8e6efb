"""Property-based tests (hypothesis) of every op over shapes, strides, dtypes, alphas, eps and
devices: the result equals the reference, or a clear error naming the argument is raised; never a
crash, a hang or a silent wrong answer.

The rules (README, DESIGN.md, tests/numerics.py):
- LayerNorm and FusedLinearGELU: the error against the native module computed in float64 on the
  upcast inputs is at most 2x the native module's own error in the same dtype plus a floor, for
  the output and every gradient; non-finite values sit where the native module has them (NaN
  where NaN, the same infinity), or where the float64 reference has them where native's own
  half-precision result departs from it. On CPU FusedLinearGELU's forward is bit-identical to
  nn.Linear + nn.GELU, whatever the layouts and whether the weight requires grad.
- ReLUScale: bit-identical to torch.relu(x) * alpha in the same dtype (signed zeros included, NaN
  where NaN); gradients equal native's except where the README says otherwise (alpha = 0 gives
  exactly zero; lost where relu(x) * alpha underflows to zero for x > 0).

Inputs are random normal (hypothesis draws a seed for a torch generator, the shape, the memory
layout, the scale and the offset, not every element): empty tensors, size-1 dims, odd sizes,
one huge row, transposed, strided, misaligned (storage offset 1), expanded (stride 0) and
partially overlapping (as_strided) views.

Examples are derandomized (the same on every run: CI never flakes). For a longer, random search
run with FASTLAYERS_HYPOTHESIS=thorough (10x the examples, a fresh seed each run).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from numerics import DEVICES, DTYPES, assert_close_to_reference, poison_allocator
from torch import nn

import fastlayers
from fastlayers.functional import layer_norm, linear_gelu, relu_scale
from fastlayers.ops.relu_scale import relu_scale_backward_op

# ----------------------------------------------------------------------------------------------
# Hypothesis profiles

settings.register_profile(
    "fastlayers-ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fastlayers-thorough", settings.get_profile("fastlayers-ci"), derandomize=False
)
_MODE = os.environ.get("FASTLAYERS_HYPOTHESIS", "ci")
_PROFILE = settings.get_profile(f"fastlayers-{_MODE}")
_SCALE = 10 if _MODE == "thorough" else 1


def examples(n: int) -> settings:
    return settings(_PROFILE, max_examples=n * _SCALE)


# ----------------------------------------------------------------------------------------------
# Strategies

NAN, INF = float("nan"), float("inf")
HALF = [torch.float16, torch.bfloat16]
# Leading sizes: size-1 dims and odd sizes more often than empty ones.
SIZES = [1, 2, 3, 7, 1, 5, 16, 0]
WIDTHS = [1, 7, 8, 64, 768, 4097]
HUGE = 65536  # one row this wide: the large-row kernels, kept cheap (a single row)
MAX_ELEMS = 1 << 16  # rows are dropped from the leading shape beyond this many elements
LAYOUTS = ["contiguous", "transposed", "strided", "offset", "expanded", "overlapping"]
SCALES = [1.0, 3.0, 0.01, 100.0]
SHIFTS = [0.0, 1.5, -20.0]

dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)
layouts = st.sampled_from(LAYOUTS)
layout_dims = st.integers(0, 3)  # which dim a strided/expanded layout acts on (mod ndim)
lead_shapes = st.lists(st.sampled_from(SIZES), max_size=3)
specials = st.lists(  # (where in the storage, as a fraction; value)
    st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from([NAN, INF, -INF])),
    min_size=1,
    max_size=4,
)


def capped(lead: list[int], row: int) -> list[int]:
    """`lead` with dims shrunk (last first) until lead x row has at most MAX_ELEMS elements."""
    lead = list(lead)
    for i in reversed(range(len(lead))):
        while lead[i] > 1 and math.prod(lead) * row > MAX_ELEMS:
            lead[i] = max(1, lead[i] // 2)
    return lead


class Maker:
    """Fresh random-normal storage (scale * N(0, 1) + shift, rounded to dtype) from a seeded
    generator, optionally with NaN/+-Inf written at given fractions of each storage."""

    def __init__(self, seed, device, dtype, scale=1.0, shift=0.0, specials=()):
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype
        self.scale, self.shift, self.specials = scale, shift, specials

    def __call__(self, shape) -> torch.Tensor:
        t = torch.randn(list(shape), generator=self.gen) * self.scale + self.shift
        if t.numel():
            for frac, value in self.specials:
                t.view(-1)[int(frac * t.numel())] = value
        return t.to(self.device, self.dtype)


def laid_out(shape, layout: str, dim: int, make) -> torch.Tensor:
    """A tensor of `shape` whose memory is laid out as `layout`, its storage from make(shape)."""
    shape = [int(s) for s in shape]
    nd, n = len(shape), math.prod(shape)
    if layout == "contiguous" or nd == 0 or n == 0:
        return make(shape)
    if layout == "transposed":  # dims stored in reverse order
        return make(shape[::-1]).permute(*reversed(range(nd)))
    if layout == "strided":  # every other element along one dim
        d = dim % nd
        big = list(shape)
        big[d] *= 2
        index = [slice(None)] * nd
        index[d] = slice(None, None, 2)
        return make(big)[tuple(index)]
    if layout == "offset":  # storage offset 1: not 16-byte aligned
        return make([n + 1])[1:].view(shape)
    if layout == "expanded":  # stride 0 along one dim: many elements alias one memory location
        d = dim % nd
        small = list(shape)
        small[d] = 1
        return make(small).expand(shape)
    if layout == "overlapping":  # each row overlaps the next by half (as_strided)
        strides = [1] * nd
        for i in reversed(range(nd - 1)):
            strides[i] = max(1, shape[i + 1] * strides[i + 1] // 2)
        length = 1 + sum((s - 1) * st for s, st in zip(shape, strides, strict=True))
        return make([length]).as_strided(shape, strides)
    raise AssertionError(layout)


def leaf(t: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
    """An alias of t (same memory layout) that autograd treats as a leaf."""
    return None if t is None else t.detach().requires_grad_(grad)


def param(t: torch.Tensor | None, grad: bool) -> nn.Parameter | None:
    """A Parameter aliasing t (same memory layout), for modules and functions alike."""
    return None if t is None else nn.Parameter(t.detach(), requires_grad=grad)


def grads_of(y, inputs, dy):
    """Gradients of y (with dy) for the inputs that are tensors; None for the others."""
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(y, wanted, dy))
    return [None if t is None else next(got) for t in inputs]


def value_class(t: torch.Tensor) -> torch.Tensor:
    """Per element: 0 finite, 1 NaN, 2 +inf, 3 -inf."""
    t = t.detach()
    c = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    c[t.isnan()] = 1
    c[t == INF] = 2
    c[t == -INF] = 3
    return c


def assert_matches(fused, native, ref, dtype, what) -> None:
    """Non-finite values: NaN where native has NaN, the same infinity where native has one
    (patching's rule); where native's pattern differs from the float64 reference's rounded to
    the result's dtype (native lost a value to NaN, or the exact value overflows that dtype),
    the reference's pattern is accepted too. Finite values (where native and the reference are
    finite): the accuracy rule."""
    assert fused.shape == native.shape == ref.shape, f"{what}: shapes differ"
    cf, cn, cr = value_class(fused), value_class(native), value_class(ref.to(fused.dtype))
    bad = (cf != cn) & (cf != cr)
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        f, n, r = (t.detach().flatten()[i].item() for t in (fused, native, ref))
        raise AssertionError(
            f"{what}: {int(bad.sum())} values finite/NaN/inf unlike native's and the float64 "
            f"reference's, e.g. at flat index {i}: fused {f}, native {n}, reference {r}"
        )
    finite = (cn == 0) & ref.isfinite()
    if bool(finite.all()):
        assert_close_to_reference(fused, native, ref, dtype, what)
    else:
        assert_close_to_reference(fused[finite], native[finite], ref[finite], dtype, what)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, signed zeros included; any NaN equals any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    a_bits = a.detach().contiguous().view(ints)[~nan]
    return torch.equal(a_bits, b.detach().contiguous().view(ints)[~nan])


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    fa, fb = a.detach().flatten(), b.detach().flatten()
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    differ = (fa.view(ints) != fb.view(ints)) & ~(fa.isnan() & fb.isnan())
    i = int(differ.nonzero()[0])
    return f"flat index {i}: {fa[i].item()!r} vs {fb[i].item()!r} ({int(differ.sum())} differ)"


def as_float32(value: float) -> float:
    """value rounded to float32 as the kernels see it (overflowing to +-inf)."""
    return torch.tensor([value], dtype=torch.float64).float().item()


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


# ----------------------------------------------------------------------------------------------
# LayerNorm

NORM_SHAPES = [(w,) for w in WIDTHS] + [(2, 4), (3, 1), (1, 7), (6, 8)]
EPS = st.one_of(
    st.sampled_from([1e-5, 1e-6, 1e-12, 0.1, 1.0, 1e3]), st.floats(1e-12, 100.0, allow_nan=False)
)


@st.composite
def layer_norm_cases(draw, with_specials=False):
    if draw(st.integers(0, 9)) == 0:  # occasionally one huge row
        norm_shape, lead = (HUGE,), draw(st.sampled_from([[], [1], [1, 1]]))
    else:
        norm_shape = draw(st.sampled_from(NORM_SHAPES))
        lead = capped(draw(lead_shapes), math.prod(norm_shape))
    dtype = draw(dtypes)
    affine = draw(st.booleans())
    return {
        "shape": [*lead, *norm_shape],
        "norm_shape": norm_shape,
        "dtype": dtype,
        "param_dtype": draw(st.sampled_from([dtype, torch.float32])),
        "affine": affine,
        "bias": affine and draw(st.booleans()),
        "eps": draw(EPS),
        "layout": draw(layouts),
        "dim": draw(layout_dims),
        "scale": draw(st.sampled_from(SCALES)),
        "shift": draw(st.sampled_from(SHIFTS)),
        "module": draw(st.booleans()),  # fastlayers.LayerNorm or the functional form
        "grads": draw(st.booleans()),
        "seed": draw(seeds),
        "specials": draw(specials) if with_specials else (),
        "p_specials": draw(st.one_of(st.just(()), specials)) if with_specials else (),
        "dy_layout": draw(layouts),
    }


def run_layer_norm(case, device):
    """(fused, native in dtype, float64 reference): each a list [y, dx, dweight, dbias] (None
    where there is no such gradient), on the same inputs."""
    dtype, pdtype = case["dtype"], case["param_dtype"]
    norm_shape, eps = case["norm_shape"], case["eps"]
    make = Maker(case["seed"], device, dtype, case["scale"], case["shift"], case["specials"])
    x = laid_out(case["shape"], case["layout"], case["dim"], make)
    # NaN in the weight, NaN or +-inf in the bias. Not +-inf in the weight: the input gradient
    # is then inf - inf at some positions, and which ones differs between the fused kernels'
    # centred form rs * (g - xhat * c1 - c2) and ATen's rs * g + b * x + c (NaN in one, +-inf in
    # the other); the forward and the other gradients agree.
    w_specials = [(f, v) for f, v in case["p_specials"] if math.isnan(v)]
    w = Maker(case["seed"] + 1, device, pdtype, specials=w_specials)(norm_shape)
    b = Maker(case["seed"] + 4, device, pdtype, specials=case["p_specials"])(norm_shape)
    w, b = (w if case["affine"] else None), (b if case["bias"] else None)
    # the incoming gradient in any layout too (backward kernels must read it through strides)
    dy = laid_out(x.shape, case["dy_layout"], case["dim"], Maker(case["seed"] + 2, device, dtype))
    grads = case["grads"]
    note(f"x: shape {list(x.shape)} stride {x.stride()} offset {x.storage_offset()}")

    def go(fn, x, w, b, dy):
        x, w, b = leaf(x, grads), param(w, grads), param(b, grads)
        y = fn(x, w, b)
        return [y, *(grads_of(y, [x, w, b], dy) if grads else [None] * 3)]

    def fused_fn(x, w, b):
        if not case["module"]:
            return layer_norm(x, norm_shape, w, b, eps)
        return fastlayers.LayerNorm.from_native(_layer_norm_module(norm_shape, eps, w, b))(x)

    def native_fn(x, w, b):
        return F.layer_norm(x, norm_shape, w, b, eps)

    def cast(t, to):
        return None if t is None else t.to(to)

    # the native module with everything in dtype (native CUDA refuses float32 parameters with
    # half inputs, which fastlayers accepts); the reference on the upcast (unrounded) parameters
    native = go(native_fn, x, cast(w, dtype), cast(b, dtype), dy)
    ref = go(native_fn, x.double(), cast(w, torch.float64), cast(b, torch.float64), dy.double())
    poison_allocator(device, 4 * (x.numel() + 1024) * 4)
    fused = go(fused_fn, x, w, b, dy)
    return fused, native, ref, x


def check_layer_norm(case, device):
    fused, native, ref, x = run_layer_norm(case, device)
    y = fused[0]
    assert y.dtype == case["dtype"] and y.device == x.device and y.shape == x.shape
    dtype = case["dtype"]
    for name, f, n, r in zip(["y", "dx", "dweight", "dbias"], fused, native, ref, strict=True):
        if f is None:
            continue
        expected_dtype = dtype if name in ("y", "dx") else case["param_dtype"]
        assert f.dtype == expected_dtype, f"{name}: dtype {f.dtype}"
        assert_matches(f, n, r, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@examples(400)
@given(case=layer_norm_cases())
def test_layer_norm_matches_reference(device, case):
    check_layer_norm(case, device)


@pytest.mark.parametrize("device", DEVICES)
@examples(150)
@given(case=layer_norm_cases(with_specials=True))
def test_layer_norm_non_finite_inputs_propagate_as_native(device, case):
    check_layer_norm(case, device)


@pytest.mark.parametrize("device", DEVICES)
@examples(100)
@given(
    case=layer_norm_cases(),
    in_dtype=st.sampled_from([torch.float32, *HALF]),
    autocast_dtype=st.sampled_from(HALF),
)
def test_layer_norm_under_autocast_matches_native(device, case, in_dtype, autocast_dtype):
    """Under autocast (float32 parameters, any input dtype) the output dtype is native's
    (float32 on CUDA, as nn.LayerNorm's) and the accuracy rule holds in that dtype."""
    make = Maker(case["seed"], device, in_dtype, case["scale"], case["shift"])
    x = laid_out(case["shape"], case["layout"], case["dim"], make)
    norm_shape, eps = case["norm_shape"], case["eps"]
    pmake = Maker(case["seed"] + 1, device, torch.float32)
    w = pmake(norm_shape) if case["affine"] else None
    b = pmake(norm_shape) if case["bias"] else None
    device_type = torch.device(device).type
    with torch.autocast(device_type, dtype=autocast_dtype):
        y_nat = F.layer_norm(x, norm_shape, w, b, eps)
        poison_allocator(device, 4 * (x.numel() + 1024) * 4)
        y = fastlayers.LayerNorm.from_native(_layer_norm_module(norm_shape, eps, w, b))(x)
    assert y.dtype == y_nat.dtype and y.shape == x.shape
    if is_cuda(device) and in_dtype != torch.float32:
        assert y.dtype == torch.float32
    w64, b64 = (None if t is None else t.double() for t in (w, b))
    ref = F.layer_norm(x.double(), norm_shape, w64, b64, eps)
    assert_matches(y, y_nat, ref, y_nat.dtype, "autocast y")


def _layer_norm_module(norm_shape, eps, w, b) -> nn.LayerNorm:
    """An nn.LayerNorm holding w and b (Parameters: the very objects, so that gradients reach
    them) whatever their dtype and memory layout."""
    m = nn.LayerNorm(norm_shape, eps, elementwise_affine=False)
    m.weight = w if w is None or isinstance(w, nn.Parameter) else param(w, False)
    m.bias = b if b is None or isinstance(b, nn.Parameter) else param(b, False)
    m.elementwise_affine = w is not None
    return m


BAD_INPUT_DTYPES = [torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64]
UNSUPPORTED = "must be float32, float64, float16 or bfloat16"
# float64 inputs take float64 parameters only, as native (which refuses the mix: "mixed dtype")
MIXED_F64 = "weight has dtype Float but input has dtype Double"


def other_device(device) -> str:
    """A device other than `device` for mixed-device calls: cpu for cuda; meta for cpu (native
    refuses both; a fake kernel must not answer for the CPU kernel)."""
    return "cpu" if is_cuda(device) else "meta"


@pytest.mark.parametrize("device", DEVICES)
@examples(100)
@given(
    kind=st.sampled_from(
        [
            "input_dtype",
            "input_float64_weight_float32",
            "weight_dtype",
            "bias_dtype",
            "weight_shape",
            "bias_shape",
            "normalized_shape",
            "empty_normalized_shape",
            "weight_device",
            "bias_device",
        ]
    ),
    bad_dtype=st.sampled_from(BAD_INPUT_DTYPES),
    dtype=dtypes,
    lead=lead_shapes,
    width=st.sampled_from([1, 7, 64]),
    seed=seeds,
)
def test_layer_norm_bad_arguments_raise_clear_errors(
    device, kind, bad_dtype, dtype, lead, width, seed
):
    make = Maker(seed, device, dtype)
    x, w, b, shape = make([*lead, width]), make([width]), make([width]), [width]
    # (exception type, a regex the message must match: it names the argument)
    expect = {
        "input_dtype": (RuntimeError, f"input {UNSUPPORTED}"),
        "input_float64_weight_float32": (RuntimeError, MIXED_F64),
        "weight_dtype": (RuntimeError, "weight has dtype"),
        "bias_dtype": (RuntimeError, "bias has dtype"),
        "weight_shape": (RuntimeError, "weight has shape"),
        "bias_shape": (RuntimeError, "bias has shape"),
        "normalized_shape": (RuntimeError, "does not end with normalized_shape"),
        "empty_normalized_shape": (RuntimeError, "normalized_shape must have at least one"),
        "weight_device": (RuntimeError, "weight is on"),
        "bias_device": (RuntimeError, "bias is on"),
    }[kind]
    if kind == "input_dtype":
        x = x.to(bad_dtype)
    elif kind == "input_float64_weight_float32":
        x, w, b = x.double(), w.float(), b.double()
    elif kind == "weight_dtype":  # neither the input's dtype nor float32
        w = w.to(bad_dtype if dtype == torch.float32 else _other_half(dtype))
    elif kind == "bias_dtype":
        b = b.to(torch.float64)
    elif kind == "weight_shape":
        w = make([width + 1])
    elif kind == "bias_shape":
        b = make([1, width])
    elif kind == "normalized_shape":
        shape = [width + 1]
    elif kind == "empty_normalized_shape":
        shape = []
    elif kind == "weight_device":
        w = w.to(other_device(device))
    elif kind == "bias_device":
        b = b.to(other_device(device))
    err, match = expect
    with pytest.raises(err, match=match):
        layer_norm(x, shape, w, b)


@pytest.mark.parametrize("arg", ["weight", "bias"])
def test_layer_norm_meta_parameters_refused(arg):
    x, p = torch.randn(4, 8), {"weight": torch.ones(8), "bias": torch.zeros(8)}
    p[arg] = p[arg].to("meta")
    with pytest.raises(RuntimeError, match=f"{arg} is on meta but input is on cpu"):
        layer_norm(x, (8,), p["weight"], p["bias"])


def _other_half(dtype):
    return torch.bfloat16 if dtype == torch.float16 else torch.float16


# ----------------------------------------------------------------------------------------------
# ReLUScale

ALPHAS = st.one_of(
    st.sampled_from([1.0, 0.0, -0.0, -1.0, 2.5, -0.7, 1e-30, -1e-45, 1e30, 65504.0, 1e5]),
    st.sampled_from([3.5e38, 1e39, -1e300, INF, -INF, NAN, 5e-324]),  # beyond float32
    st.floats(allow_nan=True, allow_infinity=True),
)
RELU_SIZES = [*SIZES, 33, 4097]


@st.composite
def relu_scale_cases(draw):
    if draw(st.integers(0, 9)) == 0:
        shape = [draw(st.sampled_from([HUGE, (1 << 17) + 3]))]
    else:
        shape = capped(draw(st.lists(st.sampled_from(RELU_SIZES), max_size=4)), 1)
    return {
        "shape": shape,
        "dtype": draw(dtypes),
        "alpha": draw(ALPHAS),
        "layout": draw(layouts),
        "dim": draw(layout_dims),
        "scale": draw(st.sampled_from(SCALES)),
        "specials": draw(st.one_of(st.just(()), specials)),
        "zeros": draw(st.booleans()),  # +0.0 and -0.0 in the input too
        "module": draw(st.booleans()),
        "grads": draw(st.booleans()),
        "dy_layout": draw(layouts),
        "seed": draw(seeds),
    }


def relu_scale_input(case, device):
    make = Maker(case["seed"], device, case["dtype"], case["scale"], 0.0, case["specials"])
    if case["zeros"]:
        specials = [*case["specials"], (0.25, 0.0), (0.5, -0.0)]
        make = Maker(case["seed"], device, case["dtype"], case["scale"], 0.0, specials)
    return laid_out(case["shape"], case["layout"], case["dim"], make)


@pytest.mark.parametrize("device", DEVICES)
@examples(800)
@given(case=relu_scale_cases())
def test_relu_scale_is_bit_identical_to_native(device, case):
    x, alpha = relu_scale_input(case, device), case["alpha"]
    note(f"x: shape {list(x.shape)} stride {x.stride()} offset {x.storage_offset()}")
    grads = case["grads"]
    xn, xf = leaf(x, grads), leaf(x, grads)
    y_nat = torch.relu(xn) * alpha
    poison_allocator(device, 3 * (x.numel() + 1024) * x.element_size())
    y = fastlayers.ReLUScale(alpha)(xf) if case["module"] else relu_scale(xf, alpha)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    assert same_bits(y, y_nat), f"forward: {first_difference(y, y_nat)}"
    if not grads:
        return
    dy = laid_out(x.shape, case["dy_layout"], 1, Maker(case["seed"] + 1, device, case["dtype"]))
    (g_nat,) = torch.autograd.grad(y_nat, xn, dy)
    (g,) = torch.autograd.grad(y, xf, dy)
    assert g.dtype == x.dtype and g.shape == x.shape
    if as_float32(alpha) == 0.0:  # README: exactly zero
        assert torch.equal(g, torch.zeros_like(g))
        return
    # README: the gradient is lost where relu(x) * alpha underflows to zero for x > 0.
    lost = (x > 0) & (y == 0)
    assert torch.equal(g[lost], torch.zeros_like(g[lost]))
    kept = ~lost
    torch.testing.assert_close(g[kept], g_nat[kept], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@examples(250)
@given(case=relu_scale_cases(), tracked=st.booleans())
def test_relu_scale_inplace_matches_native(device, case, tracked):
    """inplace=True overwrites its input with relu(x) * alpha of the values before the call
    (each memory location once, even in partially overlapping views) and returns it; a view
    where several elements share one location (stride 0) is refused as torch.relu_ refuses it.
    Where autograd tracks the input, its gradient flows as for the native in-place ReLU."""
    x, alpha = relu_scale_input(case, device), case["alpha"]
    note(f"x: shape {list(x.shape)} stride {x.stride()} offset {x.storage_offset()}")
    before = x.clone()
    expected = torch.relu(before) * alpha
    shared = any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape, strict=True))
    if shared:
        with pytest.raises(RuntimeError, match="single memory location"):
            torch.relu_(x)
        with pytest.raises(RuntimeError, match="single memory location"):
            relu_scale(x, alpha, inplace=True)
        return
    if not tracked:
        out = relu_scale(x, alpha, inplace=True)
        assert out is x
        assert same_bits(x, expected), f"in place: {first_difference(x, expected)}"
        return
    base = before.detach().requires_grad_()
    h = base * 1  # a non-leaf that autograd tracks
    out = fastlayers.ReLUScale(alpha, inplace=True)(h)
    assert out is h and same_bits(h, expected), f"in place: {first_difference(h, expected)}"
    dy = Maker(case["seed"] + 1, device, case["dtype"])(x.shape)
    (g,) = torch.autograd.grad(out, base, dy)
    nat_base = before.detach().requires_grad_()
    (g_nat,) = torch.autograd.grad(torch.relu(nat_base * 1) * alpha, nat_base, dy)
    if as_float32(alpha) == 0.0:
        assert torch.equal(g, torch.zeros_like(g))
        return
    lost = (before > 0) & (expected == 0)
    torch.testing.assert_close(g[~lost], g_nat[~lost], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@examples(60)
@given(
    kind=st.sampled_from(["input_dtype", "alpha_type", "grad_shape", "grad_dtype", "grad_device"]),
    bad_dtype=st.sampled_from(BAD_INPUT_DTYPES),
    bad_alpha=st.sampled_from(["2", 1j, None, [1.0], torch.ones(2)]),
    inplace=st.booleans(),
    dtype=dtypes,
    seed=seeds,
)
def test_relu_scale_bad_arguments_raise_clear_errors(
    device, kind, bad_dtype, bad_alpha, inplace, dtype, seed
):
    x = Maker(seed, device, dtype)([3, 5])
    if kind == "input_dtype":
        bad = x.to(bad_dtype)
        with pytest.raises(RuntimeError, match=f"input {UNSUPPORTED}"):
            relu_scale(bad, 2.0, inplace=inplace)
    elif kind == "alpha_type":
        with pytest.raises(TypeError, match="alpha must be a real number"):
            relu_scale(x, bad_alpha, inplace=inplace)
        with pytest.raises(TypeError, match="alpha must be a real number"):
            fastlayers.ReLUScale(bad_alpha, inplace=inplace)
    else:
        y = relu_scale(x, 2.0)
        dy = {
            "grad_shape": lambda: Maker(seed, device, dtype)([5, 3]),
            "grad_dtype": lambda: torch.randn_like(x).to(_other_half(dtype)),
            "grad_device": lambda: torch.randn_like(x).to(other_device(device)),
        }[kind]()
        match = {"grad_shape": "grad_out has shape", "grad_dtype": "grad_out has dtype"}
        with pytest.raises(RuntimeError, match=match.get(kind, "grad_out is on")):
            relu_scale_backward_op(dy, y, 2.0)


# ----------------------------------------------------------------------------------------------
# FusedLinearGELU

FEATURES = [1, 7, 8, 33, 64, 768, 4097, 0]
MAX_MACS = 1 << 19  # rows * in * out for one example on CPU (float64 reference included)
# CUDA only: bigger sizes; the last two take the fused sm90 kernel on H100/H200 (features
# multiples of 8, over two waves of 128x128 output tiles), the first two the fallback
CUDA_BIG = [([256], 128, 256), ([4097], 64, 72), ([2050], 136, 2056), ([4, 1000], 64, 4224)]


@st.composite
def linear_gelu_cases(draw, with_specials=False):
    size = draw(st.integers(0, 9))
    if size == 0:  # one huge row
        lead, k, n = draw(st.sampled_from([[], [1]])), HUGE, draw(st.sampled_from([1, 8]))
    else:
        k, n = draw(st.sampled_from(FEATURES)), draw(st.sampled_from(FEATURES))
        if k * n > MAX_MACS:  # 4097 x 4097: fewer outputs (still odd)
            n = MAX_MACS // k
        lead = draw(lead_shapes)
        for i in reversed(range(len(lead))):  # cap rows * k * n
            while lead[i] > 1 and math.prod(lead) * max(k, 1) * max(n, 1) > MAX_MACS:
                lead[i] = max(1, lead[i] // 2)
    return {
        "lead": lead,
        "k": k,
        "n": n,
        "big": size == 1,  # replaced by a CUDA_BIG shape on CUDA
        "big_index": draw(st.integers(0, len(CUDA_BIG) - 1)),
        "dtype": draw(dtypes),
        "approximate": draw(st.sampled_from(["none", "tanh"])),
        "bias": draw(st.booleans()),
        "transposed": draw(st.booleans()),
        "layout": draw(layouts),
        "dim": draw(layout_dims),
        "w_layout": draw(st.sampled_from(["contiguous", "transposed", "strided", "offset"])),
        "b_layout": draw(st.sampled_from(["contiguous", "strided", "offset", "expanded"])),
        "scale": draw(st.sampled_from(SCALES[:3])),
        "shift": draw(st.sampled_from(SHIFTS[:2])),
        "module": draw(st.booleans()),
        "grads": draw(st.booleans()),
        "seed": draw(seeds),
        "specials": draw(specials) if with_specials else (),
        "b_specials": draw(st.one_of(st.just(()), specials)) if with_specials else (),
        "dy_layout": draw(layouts),
    }


def linear_gelu_inputs(case, device, dtype, param_dtype=None):
    """(x, weight as stored, the weight as [out, in], bias or None)."""
    lead, k, n = case["lead"], case["k"], case["n"]
    if case["big"] and is_cuda(device):
        lead, k, n = CUDA_BIG[case["big_index"]]
    param_dtype = param_dtype or dtype
    make = Maker(case["seed"], device, dtype, case["scale"], case["shift"], case["specials"])
    x = laid_out([*lead, k], case["layout"], case["dim"], make)
    # weight ~ N(0, 1/k): pre-activations of order one whatever k is
    wscale = 1 / math.sqrt(max(k, 1))
    wmake = Maker(case["seed"] + 1, device, param_dtype, wscale)
    stored = [k, n] if case["transposed"] else [n, k]
    w = laid_out(stored, case["w_layout"], 0, wmake)
    w_nk = w.t() if case["transposed"] else w
    bmake = Maker(case["seed"] + 2, device, param_dtype, specials=case["b_specials"])
    b = laid_out([n], case["b_layout"], 0, bmake) if case["bias"] else None
    return x, w, w_nk, b


def native_linear_gelu(x, w_nk, b, approximate):
    return F.gelu(F.linear(x, w_nk, b), approximate=approximate)


def fused_linear_gelu(case, x, w, b):
    approximate, transposed = case["approximate"], case["transposed"]
    if case["module"] and not transposed:
        m = fastlayers.FusedLinearGELU(1, 1, bias=False, approximate=approximate, device="meta")
        m.in_features, m.out_features = w.shape[1], w.shape[0]
        m.weight, m.bias = w, b  # Parameters (see go): the gradients reach them
        return m(x)
    return linear_gelu(x, w, b, approximate, weight_transposed=transposed)


def check_linear_gelu(case, device):
    dtype, approximate, grads = case["dtype"], case["approximate"], case["grads"]
    x, w, w_nk, b = linear_gelu_inputs(case, device, dtype)
    note(f"x: shape {list(x.shape)} stride {x.stride()}; w {list(w.shape)} stride {w.stride()}")
    dy_shape = [*x.shape[:-1], w_nk.shape[0]]
    # dy ~ N(0, 1/out_features): the input gradient, a sum over out_features, stays of order
    # one even where dy is expanded (all equal: a coherent sum), so that the absolute floor of
    # the accuracy rule keeps its meaning (in float32 one ulp of 300 is more than the floor)
    dmake = Maker(case["seed"] + 3, device, dtype, 1 / math.sqrt(max(1, w_nk.shape[0])))
    dy = laid_out(dy_shape, case["dy_layout"], case["dim"], dmake)

    def go(fn, x, w, b, dy):
        x, w, b = leaf(x, grads), param(w, grads), param(b, grads)
        y = fn(x, w, b)
        return [y, *(grads_of(y, [x, w, b], dy) if grads else [None] * 3)]

    transposed = case["transposed"]

    def as_nk(w):
        return w.t() if transposed else w

    # (native gets dy contiguous, the same values: ATen's CPU gelu_backward (oneDNN) raises
    # "could not construct a memory descriptor using strides" on partially overlapping ones)
    native = go(
        lambda x, w, b: native_linear_gelu(x, as_nk(w), b, approximate), x, w, b, dy.contiguous()
    )
    ref = go(
        lambda x, w, b: native_linear_gelu(x, as_nk(w), b, approximate),
        x.double(),
        w.double(),
        None if b is None else b.double(),
        dy.double(),
    )
    poison_allocator(device, 1 << 22)
    fused = go(lambda x, w, b: fused_linear_gelu(case, x, w, b), x, w, b, dy)
    y = fused[0]
    assert y.dtype == dtype and y.device == x.device and y.shape == native[0].shape
    if not is_cuda(device):  # README: on CPU the forward is bit-identical to the native modules
        assert same_bits(y, native[0]), f"CPU forward: {first_difference(y, native[0])}"
    names = ["y", "grad_input", "grad_weight", "grad_bias"]
    for name, f, nat, r in zip(names, fused, native, ref, strict=True):
        if f is None:
            continue
        assert f.dtype == dtype and f.shape == nat.shape, name
        assert_matches(f, nat, r, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@examples(400)
@given(case=linear_gelu_cases())
def test_linear_gelu_matches_reference(device, case):
    check_linear_gelu(case, device)


@pytest.mark.parametrize("device", DEVICES)
@examples(150)
@given(case=linear_gelu_cases(with_specials=True))
def test_linear_gelu_non_finite_inputs_propagate_as_native(device, case):
    check_linear_gelu(case, device)


@pytest.mark.parametrize("device", DEVICES)
@examples(100)
@given(
    case=linear_gelu_cases(),
    in_dtype=st.sampled_from([torch.float32, *HALF]),
    autocast_dtype=st.sampled_from(HALF),
)
def test_linear_gelu_under_autocast_matches_native(device, case, in_dtype, autocast_dtype):
    """Under autocast float32 parameters (and input) are cast to the autocast dtype as for
    nn.Linear; the output has native's dtype, and the accuracy rule holds in that dtype, output
    and gradients (on CPU the forward is bit-identical)."""
    x, w, w_nk, b = linear_gelu_inputs(case, device, in_dtype, torch.float32)
    approximate, grads = case["approximate"], case["grads"]
    device_type = torch.device(device).type
    dscale = 1 / math.sqrt(max(1, w_nk.shape[0]))
    dy = Maker(case["seed"] + 3, device, autocast_dtype, dscale)([*x.shape[:-1], w_nk.shape[0]])

    def go(fn):
        xs, ws, bs = leaf(x, grads), param(w, grads), param(b, grads)
        with torch.autocast(device_type, dtype=autocast_dtype):
            y = fn(xs, ws, bs)
        return [y, *(grads_of(y, [xs, ws, bs], dy) if grads else [None] * 3)]

    transposed = case["transposed"]

    def as_nk(w):
        return w.t() if transposed else w

    native = go(lambda x, w, b: native_linear_gelu(x, as_nk(w), b, approximate))
    poison_allocator(device, 1 << 22)
    fused = go(lambda x, w, b: fused_linear_gelu(case, x, w, b))
    assert fused[0].dtype == native[0].dtype == autocast_dtype
    if not is_cuda(device):
        assert same_bits(fused[0], native[0]), first_difference(fused[0], native[0])
    # float64 reference on the inputs as autocast rounds them
    rounded = [None if t is None else t.detach().to(autocast_dtype).double() for t in (x, w, b)]
    rounded = [leaf(t, grads) for t in rounded]
    y_ref = native_linear_gelu(rounded[0], as_nk(rounded[1]), rounded[2], approximate)
    ref = [y_ref, *(grads_of(y_ref, rounded, dy.double()) if grads else [None] * 3)]
    names = ["y", "grad_input", "grad_weight", "grad_bias"]
    for name, f, nat, r in zip(names, fused, native, ref, strict=True):
        if f is not None:
            assert f.dtype == nat.dtype, name
            assert_matches(f, nat, r, autocast_dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@examples(100)
@given(
    kind=st.sampled_from(
        [
            "input_dtype",
            "input_float64_weight_float32",
            "input_0d",
            "weight_dtype",
            "weight_float32_half_input",
            "bias_dtype",
            "in_features",
            "weight_dims",
            "bias_shape",
            "approximate",
            "weight_device",
            "bias_device",
        ]
    ),
    bad_dtype=st.sampled_from(BAD_INPUT_DTYPES),
    dtype=dtypes,
    lead=lead_shapes,
    transposed=st.booleans(),
    seed=seeds,
)
def test_linear_gelu_bad_arguments_raise_clear_errors(
    device, kind, bad_dtype, dtype, lead, transposed, seed
):
    make = Maker(seed, device, dtype)
    k, n = 8, 6
    x, b = make([*lead, k]), make([n])
    w = make([k, n] if transposed else [n, k])
    approximate = "none"
    expect = {
        "input_dtype": (RuntimeError, f"input {UNSUPPORTED}"),
        "input_float64_weight_float32": (RuntimeError, MIXED_F64),
        "input_0d": (RuntimeError, "input must have at least one dimension"),
        "weight_dtype": (RuntimeError, "weight has dtype"),
        "weight_float32_half_input": (RuntimeError, "weight has dtype Float"),
        "bias_dtype": (RuntimeError, "bias has dtype"),
        "in_features": (RuntimeError, f"in_features = {k}"),
        "weight_dims": (RuntimeError, "weight must be 2-D"),
        "bias_shape": (RuntimeError, rf"bias must have shape \[{n}\]"),
        "approximate": (ValueError, "approximate must be 'none' or 'tanh'"),
        "weight_device": (RuntimeError, "weight is on"),
        "bias_device": (RuntimeError, "bias is on"),
    }[kind]
    if kind == "input_dtype":
        x, w, b = x.to(bad_dtype), w.to(bad_dtype), b.to(bad_dtype)
    elif kind == "input_float64_weight_float32":
        x, w, b = x.double(), w.float(), b.double()
    elif kind == "input_0d":
        x = make([])
    elif kind == "weight_dtype":
        w = w.to(bad_dtype)
    elif kind == "weight_float32_half_input":  # allowed under autocast only
        x, w = x.to(_other_half(dtype) if dtype == torch.float32 else dtype), w.float()
    elif kind == "bias_dtype":
        b = b.to(_other_half(dtype))
    elif kind == "in_features":
        x = make([*lead, k + 1])
    elif kind == "weight_dims":
        w = make([n * k])
    elif kind == "bias_shape":
        b = make([n + 1])
    elif kind == "approximate":
        approximate = "erf"
    elif kind == "weight_device":
        w = w.to(other_device(device))
    elif kind == "bias_device":
        b = b.to(other_device(device))
    err, match = expect
    with pytest.raises(err, match=match):
        linear_gelu(x, w, b, approximate, weight_transposed=transposed)
