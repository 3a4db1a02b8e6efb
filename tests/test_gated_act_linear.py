"""fastlayers.ops.gated_act.gated_act_linear_forward: act(gate) * (input . weight^T), for
inference. CPU results are native's bit for bit; on an sm_90 GPU the product runs in the up
GEMM's epilogue (CUTLASS), checked against the float64 reference (DESIGN rule), and where the
size rule sends a call to cuBLAS it is native's bits; errors name the argument; calls that record
gradients are refused; ops machinery."""

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_to_reference, poison_allocator
from torch.library import opcheck

from fastlayers.ops.gated_act import (
    ACTIVATIONS,
    gated_act_linear_forward,
    gated_act_linear_op,
    gated_act_linear_path,
)

ACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "relu": torch.relu,
}


def native(gate, x, w, activation):
    """What a gated MLP computes natively: act(gate) * up(x), written out independently."""
    return ACT[activation](gate) * F.linear(x, w)


def operands(m, k, n, device, dtype, lead=()):
    """Random input, weight and gate (never zeros), scaled like a trained layer's."""
    x = torch.randn(*lead, m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    g = torch.randn(*lead, m, n, device=device, dtype=dtype) * 2
    return g, x, w


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_cpu_equals_native_bitwise(activation, dtype, lead):
    g, x, w = operands(7, 24, 40, "cpu", dtype, lead)
    out = gated_act_linear_forward(g, x, w, activation)
    assert out.dtype == dtype and out.shape == g.shape and out.is_contiguous()
    assert torch.equal(out, native(g, x, w, activation))


def test_cpu_strided_input_and_empty_sizes():
    g, x, w = operands(5, 16, 8, "cpu", torch.bfloat16)
    xt = x.t().contiguous().t()  # column-major
    assert torch.equal(gated_act_linear_forward(g, xt, w, "silu"), native(g, x, w, "silu"))
    for m, k, n in ((0, 16, 8), (5, 16, 0), (5, 0, 8)):
        g0, x0, w0 = operands(m, k, n, "cpu", torch.bfloat16)
        out = gated_act_linear_forward(g0, x0, w0, "silu")
        assert out.shape == (m, n) and torch.equal(out, native(g0, x0, w0, "silu"))


def test_bad_inputs_name_the_argument():
    g, x, w = operands(4, 16, 8, "cpu", torch.bfloat16)
    cases = [
        ((g, x, w.float(), "silu"), "weight has dtype"),
        ((g.float(), x, w, "silu"), "gate has dtype"),
        ((g[:, :4], x, w, "silu"), "gate has shape"),
        ((g, x[:, :8], w, "silu"), "in_features = 16"),
        ((g, x, w[0], "silu"), "weight must be 2-D"),
        ((g, x.int(), w.int(), "silu"), "input"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            gated_act_linear_forward(*args)
    with pytest.raises(ValueError, match="activation must be"):
        gated_act_linear_forward(g, x, w, "tanh")
    # the fake kernel refuses what the real one does
    meta = [t.to("meta") for t in (g, x, w)]
    for args, message in (
        ((meta[0].int(), meta[1].int(), meta[2].int()), "input must be float32"),
        ((meta[0][0, :1], meta[1][0, 0], meta[2][:1, :1]), "at least one dimension"),
        ((meta[0], meta[1], meta[2].float()), "weight has dtype"),
    ):
        with pytest.raises(RuntimeError, match=message):
            gated_act_linear_op(*args, "silu")


def test_calls_that_record_gradients_are_refused():
    g, x, w = operands(4, 16, 8, "cpu", torch.float32)
    w.requires_grad_()
    with pytest.raises(RuntimeError, match="is for inference"):
        gated_act_linear_forward(g, x, w, "silu")
    with torch.no_grad():
        out = gated_act_linear_forward(g, x, w, "silu")
    with torch.inference_mode():
        out2 = gated_act_linear_forward(g, x, w, "silu")
    assert torch.equal(out, out2) and not out.requires_grad


def test_opcheck():
    g, x, w = operands(5, 16, 8, "cpu", torch.bfloat16)
    opcheck(
        gated_act_linear_op,
        (g, x, w, "gelu_tanh"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_torch_compile_traces_the_native_composite():
    g, x, w = operands(6, 16, 8, "cpu", torch.float32)

    def fn(g, x, w):
        return gated_act_linear_forward(g, x, w, "silu")

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    with torch.no_grad():
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        assert torch.equal(compiled(g, x, w), native(g, x, w, "silu"))
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes}
    assert not any("gated_act_linear" in t for t in targets), targets  # Inductor sees native's


# ----------------------------------------------------------------------------------------------
# CUDA


def _sm90_kernels() -> bool:
    g, x, w = operands(1024, 512, 1024, "cuda", torch.bfloat16)
    return gated_act_linear_path(g, x, w) == "cutlass_sm90"


# (rows, in_features, out_features): LLaMA-like widths at test-sized rows, a ragged last row tile,
# an out_features that is not a multiple of the 128-column tile
EPILOGUE_ACTIVATIONS = ("silu", "gelu_tanh")  # the others: cuBLAS and gated_act
SM90_SHAPES = [(1024, 512, 1024), (2048, 2048, 5632), (1000, 256, 1368), (4096, 1024, 2816)]


@pytest.mark.cuda
@pytest.mark.parametrize("activation", EPILOGUE_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SM90_SHAPES, ids=str)
def test_cuda_epilogue_against_float64(activation, dtype, shape):
    """The fused path (asserted taken) against the float64 reference, bounded by native's own
    error in the dtype (DESIGN rule); no element left unwritten (poisoned allocator)."""
    if not _sm90_kernels():
        pytest.skip("no sm_90a CUTLASS kernels on this GPU/build")
    m, k, n = shape
    g, x, w = operands(m, k, n, "cuda", dtype)
    assert gated_act_linear_path(g, x, w, activation) == "cutlass_sm90"
    poison_allocator("cuda", 4 * m * n * 2)
    with torch.inference_mode():
        out = gated_act_linear_forward(g, x, w, activation)
    ref = native(g.double(), x.double(), w.double(), activation)
    assert_close_to_reference(out, native(g, x, w, activation), ref, dtype, activation)


def ulp_tolerance(dtype):
    """Two units in the last place (test_gated_act's rule for the elementwise pass: library
    exp/erf/tanh and the compiler's contractions may move act(gate) to a neighbour)."""
    return {"rtol": 2 * torch.finfo(dtype).eps, "atol": torch.finfo(dtype).tiny}


@pytest.mark.cuda
@pytest.mark.parametrize("activation", EPILOGUE_ACTIVATIONS)
def test_cuda_epilogue_rounds_each_factor_as_native(activation):
    """With an exact GEMM (small integers: every partial sum exact, so CUTLASS's and cuBLAS's
    sums are the same bits) and gates where the activation is exactly the gate (20..40: SiLU's
    exp(-z) and tanh GELU's 1 - tanh vanish in float), the epilogue's result is native's bit for
    bit: up (sums of 2,048 products of -3..3, often past bfloat16's 256 exact integers) is
    rounded to the dtype before the product, as native's tensor is. (act(gate) is exact in the
    dtype here, so its rounding is not what this checks: the float64 test bounds it.)"""
    if not _sm90_kernels():
        pytest.skip("no sm_90a CUTLASS kernels on this GPU/build")
    m, k, n = 2048, 2048, 2048  # in_features 2048: the ping-pong tiles (past it: cuBLAS)
    x = torch.randint(-3, 4, (m, k), device="cuda").to(torch.bfloat16)
    w = torch.randint(-3, 4, (n, k), device="cuda").to(torch.bfloat16)
    g = torch.randint(20, 41, (m, n), device="cuda").to(torch.bfloat16)
    assert gated_act_linear_path(g, x, w, activation) == "cutlass_sm90"
    with torch.no_grad():
        out = gated_act_linear_forward(g, x, w, activation)
    up = F.linear(x, w)
    assert not torch.equal(up.float(), x.float() @ w.float().t())  # up's rounding matters here
    assert torch.equal(out, native(g, x, w, activation))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape,dtype,why",
    [
        ((2048, 1024, 1024), torch.float32, "float32 input"),
        ((2048, 500, 1024), torch.bfloat16, "multiples of 8"),
        ((0, 64, 64), torch.bfloat16, "an empty output"),
        ((64, 64, 0), torch.bfloat16, "an empty output"),
        ((2048, 1024, 1024), torch.bfloat16, "SiLU and tanh GELU only"),
        ((8192, 4096, 14336), torch.bfloat16, "cooperative 256x128 tiles"),
    ],
    ids=["float32", "odd-k", "no-rows", "no-columns", "relu", "long-k"],
)
def test_cuda_fallback_is_cublas_and_gated_act(shape, dtype, why):
    """Calls the epilogue cannot take: cuBLAS's GEMM (native's bits) and gated_act's pass."""
    if not _sm90_kernels():  # elsewhere every call falls back, for the GPU's reason
        pytest.skip("no sm_90a CUTLASS kernels on this GPU/build")
    m, k, n = shape
    g, x, w = operands(m, k, n, "cuda", dtype)
    activation = "relu" if "SiLU" in why else "silu"
    path = gated_act_linear_path(g, x, w, activation)
    assert path.startswith("fallback") and why in path, path
    with torch.no_grad():
        out = gated_act_linear_forward(g, x, w, activation)
    torch.testing.assert_close(out, native(g, x, w, activation), **ulp_tolerance(dtype))


@pytest.mark.cuda
def test_cuda_strided_and_3d_operands():
    if not _sm90_kernels():
        pytest.skip("no sm_90a CUTLASS kernels on this GPU/build")
    g, x, w = operands(512, 1024, 2048, "cuda", torch.bfloat16, lead=(2,))
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, leading dims permuted
    gt = g.transpose(0, 1).contiguous().transpose(0, 1)
    with torch.no_grad():
        a = gated_act_linear_forward(g, x, w, "silu")
        b = gated_act_linear_forward(gt, xt, w, "silu")
    assert a.shape == (2, 512, 2048) and torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_graph_capture():
    g, x, w = operands(2048, 512, 1024, "cuda", torch.bfloat16)
    with torch.no_grad():
        expected = gated_act_linear_forward(g, x, w, "silu")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gated_act_linear_forward(g, x, w, "silu")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gated_act_linear_forward(g, x, w, "silu")
        g.copy_(torch.randn_like(g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gated_act_linear_forward(g, x, w, "silu"))
        assert not torch.equal(out, expected)
