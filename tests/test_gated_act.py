"""fastlayers.functional.gated_act: act(gate) * up. CPU results are native's bit for bit; CUDA
results against native CUDA and the float64 reference (DESIGN rule); strided (chunked) operands,
odd and empty sizes, errors naming the argument, ops machinery, torch.compile and torch.func."""

import pytest
import torch
import torch.nn.functional as F
from numerics import DEVICES, assert_close_to_reference, poison_allocator

from fastlayers.functional import gated_act
from fastlayers.ops.gated_act import ACTIVATIONS, _native_gated_act, gated_act_bwd, gated_act_fwd

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(1, 1), (3, 7), (2, 4097), (2, 3, 64), (5, 1, 24)]


def native(gate, up, activation):
    """The composite written out, independently of the module under test."""
    act = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
        "relu": torch.relu,
    }[activation]
    return act(gate) * up


def operands(shape, device, dtype, chunked):
    """Random gate and up (never zeros); chunked: the halves of h.chunk(2, -1), strided rows."""
    if chunked:
        h = torch.randn(*shape[:-1], 2 * shape[-1], device=device, dtype=dtype) * 3
        return h.chunk(2, dim=-1)
    return (torch.randn(shape, device=device, dtype=dtype) * 3 for _ in range(2))


def fwd_bwd(fn, gate, up, dy):
    """fn(gate, up) and the gradients of <y, dy> w.r.t. gate and up. Contiguous operands become
    fresh leaves; strided ones (chunk halves) stay halves of a fresh leaf h, so that fn reads
    them strided (clone() would make them contiguous)."""
    if gate.is_contiguous() and up.is_contiguous():
        g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
        y = fn(g, u)
        return (y, *torch.autograd.grad(y, (g, u), dy))
    h = torch.cat([gate, up], dim=-1).detach().requires_grad_()
    y = fn(*h.chunk(2, dim=-1))
    (dh,) = torch.autograd.grad(y, h, dy)
    return (y, *dh.chunk(2, dim=-1))


def assert_equal(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)


def ulp_tolerance(dtype):
    """Two units in the last place (relative): act(gate) may round to the neighbour of native's
    value, and the product's rounding can add one more."""
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": torch.finfo(dtype).tiny}


def assert_matches_native(ours, nat, activation):
    """Forward against native on one device: equal on CPU (ATen's own ops) and for ReLU; within
    ulp_tolerance on CUDA, whose library exp/erf/tanh and contractions may differ by an ulp."""
    if ours.device.type == "cpu" or activation == "relu":
        assert_equal(ours, nat, activation)
    else:
        torch.testing.assert_close(ours, nat, **ulp_tolerance(ours.dtype), msg=activation)


# ----------------------------------------------------------------------------------------------
# CPU: native's result bit for bit


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "chunked"])
def test_cpu_forward_and_backward_equal_native_bitwise(shape, dtype, activation, chunked):
    gate, up = operands(shape, "cpu", dtype, chunked)
    dy = torch.randn(shape, dtype=dtype)
    y, dg, du = fwd_bwd(lambda g, u: gated_act(g, u, activation), gate, up, dy)
    y_n, dg_n, du_n = fwd_bwd(lambda g, u: native(g, u, activation), gate, up, dy)
    assert y.dtype == dtype and y.is_contiguous()
    assert y.grad_fn.name() == "fastlayers::GatedActBackward"  # the fused op, not the fallback
    assert_equal(y, y_n, "forward")
    assert_equal(dg, dg_n, "grad gate")
    assert_equal(du, du_n, "grad up")


def test_native_reference_is_the_composite():
    gate, up = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    for activation in ACTIVATIONS:
        assert torch.equal(_native_gated_act(gate, up, activation), native(gate, up, activation))


# ----------------------------------------------------------------------------------------------
# Every device: the float64 reference (DESIGN rule), strided and odd layouts, empty tensors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (4, 4097), (2, 5, 256)], ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "chunked"])
def test_matches_float64_reference(device, activation, dtype, shape, chunked):
    gate, up = operands(shape, device, dtype, chunked)
    dy = torch.randn(shape, device=device, dtype=dtype)
    poison_allocator(device, 8 * gate.numel() * gate.element_size())
    ours = fwd_bwd(lambda g, u: gated_act(g, u, activation), gate, up, dy)
    nat = fwd_bwd(lambda g, u: native(g, u, activation), gate, up, dy)
    ref = fwd_bwd(lambda g, u: native(g, u, activation), gate.double(), up.double(), dy.double())
    assert ours[0].is_contiguous()
    for what, o, n, r in zip(("forward", "grad gate", "grad up"), ours, nat, ref, strict=True):
        assert o.dtype == dtype and (chunked or o.is_contiguous()), what
        assert_close_to_reference(o, n, r, dtype, f"{activation} {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_equals_contiguous_and_other_layouts_work(device):
    """The halves of h.chunk(2, -1) (read in place on CUDA) give what contiguous copies give;
    a misaligned chunk, a transposed operand and an expanded one too. On CPU the op is native's
    on the same operands, bit for bit: ATen's own GELU rounds a strided input (its scalar loop)
    and a contiguous one (its vectorized erf) up to an ulp apart, so layouts are not compared
    bit for bit there."""
    h = torch.randn(3, 5, 2 * 40, device=device, dtype=torch.bfloat16)
    for gate, up in (h.chunk(2, -1), h[..., 1:-1].chunk(2, -1)):
        for activation in ACTIVATIONS:
            expected = gated_act(gate.contiguous(), up.contiguous(), activation)
            got = gated_act(gate, up, activation)
            if device == "cuda":
                assert_equal(got, expected, activation)
            else:
                assert_equal(got, native(gate, up, activation), activation)
            contiguous = native(gate.contiguous(), up.contiguous(), activation)
            assert_matches_native(expected, contiguous, activation)
    gate = torch.randn(16, 9, device=device).t()  # last dimension not contiguous
    up = torch.randn(9, device=device).expand(16, 9).t()  # stride-0 rows
    y = gated_act(gate, up, "silu")
    assert y.is_contiguous()
    torch.testing.assert_close(y, native(gate, up, "silu"), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0,), (0, 8), (4, 0), (2, 0, 3)], ids=str)
def test_empty_tensors(device, shape):
    gate = torch.randn(shape, device=device, requires_grad=True)
    up = torch.randn(shape, device=device, requires_grad=True)
    y = gated_act(gate, up, "silu")
    assert y.shape == gate.shape
    dg, du = torch.autograd.grad(y, (gate, up), torch.randn(shape, device=device))
    assert dg.shape == gate.shape and du.shape == up.shape
    dg, du, y = gated_act_bwd(
        torch.randn(shape, device=device), gate, up, "relu", [True, False, True]
    )
    assert dg.shape == gate.shape and du.numel() == 0 and y.shape == gate.shape


@pytest.mark.parametrize("device", DEVICES)
def test_scalar_operands(device):
    gate, up = torch.tensor(1.5, device=device), torch.tensor(-2.0, device=device)
    assert_matches_native(gated_act(gate, up), native(gate, up, "silu"), "silu")


# ----------------------------------------------------------------------------------------------
# Autograd


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_only_where_asked_and_no_node_without_grad(device):
    gate = torch.randn(4, 16, device=device, requires_grad=True)
    up = torch.randn(4, 16, device=device)
    dy = torch.randn(4, 16, device=device)
    (dg,) = torch.autograd.grad(gated_act(gate, up, "gelu"), gate, dy)
    (dg_n,) = torch.autograd.grad(native(gate, up, "gelu"), gate, dy)
    torch.testing.assert_close(dg, dg_n)
    with torch.no_grad():
        assert gated_act(gate, up).grad_fn is None
    assert gated_act(gate.detach(), up).grad_fn is None
    dg, du, y = gated_act_bwd(dy, gate.detach(), up, "silu", [False, True, False])
    assert dg.numel() == 0 and du.shape == up.shape and y.numel() == 0


def test_double_backward_is_refused_not_wrong():
    gate = torch.randn(4, 8, requires_grad=True)
    up = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gated_act(gate, up).pow(2).sum(), gate, create_graph=True)


def test_saved_operand_modified_in_place_is_caught():
    gate = torch.randn(4, 8, requires_grad=True)
    up = torch.randn(4, 8)
    y = gated_act(gate, up)
    up.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ----------------------------------------------------------------------------------------------
# Errors name the argument


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    g = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match="up has dtype Half but gate has dtype Float"):
        gated_act(g, g.half())
    with pytest.raises(RuntimeError, match=r"up has shape \[4, 7\] but gate has shape \[4, 8\]"):
        gated_act(g, g[:, :7])
    with pytest.raises(RuntimeError, match="gate must be float32, float64, float16 or bfloat16"):
        gated_act(g.long(), g.long())
    with pytest.raises(ValueError, match="activation must be 'silu', 'gelu', 'gelu_tanh' or"):
        gated_act(g, g, "swish")
    with pytest.raises(RuntimeError, match=r"grad_out has shape \[4, 7\]"):
        gated_act_bwd(g[:, :7], g, g, "silu", [True, True, False])
    with pytest.raises(ValueError, match="activation must be"):
        gated_act_bwd(g, g, g, "tanh", [True, True, False])


def test_wrong_device_raises_in_the_fake_kernel():
    # cpu + meta dispatches to the fake kernel, which must refuse as the real kernels do
    with pytest.raises(RuntimeError, match="up is on meta but gate is on cpu"):
        gated_act_fwd(torch.randn(4), torch.randn(4, device="meta"), "silu")


@pytest.mark.cuda
def test_wrong_device_raises():
    with pytest.raises(RuntimeError, match="up is on cpu but gate is on cuda"):
        gated_act(torch.randn(4, device="cuda"), torch.randn(4))


def test_silu_does_not_reach_linear_act():
    """kSiLU joined the shared Activation enum: linear_act still refuses it."""
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises((RuntimeError, ValueError), match="activation must be"):
        torch.ops.fastlayers.linear_act_fwd(x, w, None, "silu", False, False)


# ----------------------------------------------------------------------------------------------
# Ops machinery, torch.compile, torch.func


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(device, dtype):
    h = torch.randn(6, 2 * 24, device=device, dtype=dtype)
    gate, up = h.chunk(2, dim=-1)
    dy = torch.randn(6, 24, device=device, dtype=dtype)
    for activation in ACTIVATIONS:
        torch.library.opcheck(gated_act_fwd, (gate, up, activation))
        leaves = (gate.clone().requires_grad_(), up.clone().requires_grad_())
        torch.library.opcheck(gated_act_fwd, (*leaves, activation))
        for mask in ([True, True, False], [True, False, True], [False, True, False]):
            torch.library.opcheck(gated_act_bwd, (dy, gate, up, activation, mask))


def test_torch_compile_fullgraph_traces_the_native_composite():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def mlp(x, w_in, w_out):
        gate, up = (x @ w_in).chunk(2, dim=-1)
        return gated_act(gate, up, "silu") @ w_out

    w_in, w_out = torch.randn(16, 64, requires_grad=True), torch.randn(32, 16)
    torch.compiler.reset()
    x = torch.randn(5, 16)
    torch.testing.assert_close(
        torch.compile(mlp, fullgraph=True, backend=backend)(x, w_in, w_out), mlp(x, w_in, w_out)
    )
    code = graphs[0].code
    assert "silu" in code and "fastlayers" not in code, code
    torch.compiler.reset()
    inductor = torch.compile(mlp, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(5, 16)
            expected = mlp(x, w_in, w_out)
            torch.testing.assert_close(inductor(x, w_in, w_out), expected, rtol=1e-5, atol=1e-5)
            (g,) = torch.autograd.grad(inductor(x, w_in, w_out).sum(), w_in)
            (g_ref,) = torch.autograd.grad(expected.sum(), w_in)
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    torch.compiler.reset()


def test_torch_func_takes_the_native_route():
    gate, up = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    for activation in ACTIVATIONS:
        ours = torch.func.grad(lambda g, a=activation: gated_act(g, up, a).sum())(gate)
        nat = torch.func.grad(lambda g, a=activation: native(g, up, a).sum())(gate)
        torch.testing.assert_close(ours, nat, rtol=0, atol=0)
        batched = torch.func.vmap(lambda g, u, a=activation: gated_act(g, u, a))(gate, up)
        torch.testing.assert_close(batched, native(gate, up, activation), rtol=0, atol=0)
    tangent = torch.randn_like(gate)
    _, t = torch.func.jvp(lambda g: gated_act(g, up, "gelu_tanh"), (gate,), (tangent,))
    _, t_n = torch.func.jvp(lambda g: native(g, up, "gelu_tanh"), (gate,), (tangent,))
    torch.testing.assert_close(t, t_n, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# CUDA against native CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 7, 64, 4097, 11008])
@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "chunked"])
def test_cuda_matches_native_cuda(activation, dtype, cols, chunked):
    """ReLU is native's bit for bit, forward and backward. The others compute act in float as
    native does and round where native rounds: the forward and grad up are expected equal,
    allowed two units in the last place (library exp/erf/tanh and the compiler's contractions);
    grad gate rounds dy * up * act'(gate) once where native rounds dy * up first: the DESIGN
    bound against float64."""
    shape = (37, cols)
    gate, up = operands(shape, "cuda", dtype, chunked)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    poison_allocator("cuda", 8 * gate.numel() * gate.element_size())
    y, dg, du = fwd_bwd(lambda g, u: gated_act(g, u, activation), gate, up, dy)
    y_n, dg_n, du_n = fwd_bwd(lambda g, u: native(g, u, activation), gate, up, dy)
    assert torch.isfinite(y).all() and torch.isfinite(dg).all() and torch.isfinite(du).all()
    if activation == "relu":
        for what, o, n in (("forward", y, y_n), ("grad gate", dg, dg_n), ("grad up", du, du_n)):
            assert_equal(o, n, what)
        return
    torch.testing.assert_close(y, y_n, **ulp_tolerance(dtype))
    torch.testing.assert_close(du, du_n, **ulp_tolerance(dtype))
    dg_ref = fwd_bwd(lambda g, u: native(g, u, activation), gate.double(), up.double(), dy.double())
    assert_close_to_reference(dg, dg_n, dg_ref[1], dtype, f"{activation} grad gate")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_large_tensor_takes_the_grid_stride_loop(dtype):
    # more units than the capped grid has threads (the grid-stride loop), chunked operands
    h = torch.randn(4096, 2 * 11008, device="cuda", dtype=dtype)
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(
        gated_act(gate, up), native(gate, up, "silu"), **ulp_tolerance(dtype)
    )


@pytest.mark.cuda
def test_cuda_graph_capture():
    h = torch.randn(64, 2 * 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        gate, up = h.chunk(2, dim=-1)
        y = gated_act(gate, up, "silu")
        (g,) = torch.autograd.grad(y, h, dy)
        return y, g

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, g = step()
    with torch.no_grad():
        h.copy_(torch.randn_like(h))
    graph.replay()
    torch.cuda.synchronize()
    y_e, g_e = step()
    assert torch.equal(y, y_e) and torch.equal(g, g_e)
