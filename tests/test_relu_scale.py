"""fastlayers.ReLUScale and fastlayers.functional.relu_scale: exact agreement with
torch.relu(x) * alpha (same dtype, bit for bit), gradients, in-place semantics, ops machinery."""

import pytest
import torch
from numerics import DEVICES, DTYPES, poison_allocator
from torch import nn

import fastlayers
from fastlayers.functional import relu_scale
from fastlayers.ops.relu_scale import relu_scale_backward_op, relu_scale_inplace_op, relu_scale_op

ALPHAS = [1.0, 2.5, -0.7, 0.0]
SHAPES = [(0,), (1,), (7,), (4097,), (3, 5, 33), (1 << 17,)]


def native(x, alpha):
    return torch.relu(x) * alpha


def random_input(shape, device, dtype):
    x = torch.randn(shape, device=device, dtype=dtype) * 3
    if x.numel() > 4:
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")], dtype=dtype)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_equal_native_bitwise(shape, alpha, dtype, device):
    x = random_input(shape, device, dtype)
    dy = torch.randn(shape, device=device, dtype=dtype)
    xr = x.clone().requires_grad_()
    y_ref = native(xr, alpha)
    (g_ref,) = torch.autograd.grad(y_ref, xr, dy)
    poison_allocator(device, 3 * x.numel() * x.element_size())
    xf = x.clone().requires_grad_()
    y = relu_scale(xf, alpha)
    (g,) = torch.autograd.grad(y, xf, dy)
    assert y.dtype == dtype and g.dtype == dtype
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    if alpha != 0.0:  # alpha = 0: our gradient is exactly 0; native's is NaN where dy is NaN
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_large_tensor_takes_the_unrolled_grid(dtype):
    # Small tensors run one vector per thread; from ~2 blocks per SM of 8 (forward) or 4
    # (backward) vectors per thread on, the unrolled grid: this size exercises it, with a tail.
    n = (1 << 24) + 3
    x = random_input((n,), "cuda", dtype)
    dy = torch.randn(n, device="cuda", dtype=dtype)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = native(xr, 2.5), relu_scale(xf, 2.5)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    g_ref, g = torch.autograd.grad(y_ref, xr, dy)[0], torch.autograd.grad(y, xf, dy)[0]
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_misaligned(device):
    base = torch.randn(64, 33, device=device, dtype=torch.bfloat16)
    for x in (base.t(), base.view(-1)[1:].view(-1)):
        torch.testing.assert_close(relu_scale(x, 1.5), native(x, 1.5), rtol=0, atol=0)
        y = x.clone()
        relu_scale(y, 1.5, inplace=True)
        torch.testing.assert_close(y, native(x, 1.5), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_behaves_as_nn_relu_inplace(device):
    x = torch.randn(100, device=device)
    expected = native(x, 2.0)
    out = relu_scale(x, 2.0, inplace=True)
    assert out is x and torch.equal(x, expected)
    # A leaf that requires grad: the same error as nn.ReLU(inplace=True).
    leaf = torch.randn(8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        nn.ReLU(inplace=True)(leaf)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fastlayers.ReLUScale(2.0, inplace=True)(leaf)
    # A non-leaf: gradients flow as for the native in-place ReLU followed by a scale.
    w = torch.randn(8, device=device, requires_grad=True)
    h = w * 3
    y = fastlayers.ReLUScale(-0.5, inplace=True)(h)
    assert y is h
    (g,) = torch.autograd.grad(y.sum(), w)
    torch.testing.assert_close(g, torch.where(w > 0, -1.5, 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_inplace_on_partially_overlapping_view_scales_each_location_once(device, dtype):
    """A view whose elements share memory (stride (1, 1)): every location becomes
    relu(v) * alpha of its value before the call, once. The CPU half path ran ATen's relu_ then
    mul_, which multiplied a shared location once per element reading it (0.25x for alpha 0.5,
    +0.0 for alpha -0.0; found by the property tests in CI)."""
    for alpha in (0.5, -0.0, -2.0):
        base = torch.tensor([1.0, -2.0, 3.0, 4.0], device=device, dtype=dtype)
        view = base.as_strided((3, 2), (1, 1))
        expected = torch.relu(base.clone()) * alpha  # each location once
        relu_scale(view, alpha, inplace=True)
        assert torch.equal(base, expected) and torch.equal(base.signbit(), expected.signbit()), (
            alpha,
            base,
            expected,
        )


def test_inplace_on_a_tensor_saved_for_backward_is_caught():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    y = x @ w  # saves x for w's gradient
    relu_scale(x, 2.0, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_module_api():
    m = fastlayers.ReLUScale(0.5)
    assert m.state_dict() == {} and list(m.parameters()) == []
    assert "alpha=0.5" in repr(m)
    relu = nn.ReLU(inplace=True).eval()
    fused = fastlayers.ReLUScale.from_native(relu, alpha=3.0)
    assert fused.alpha == 3.0 and fused.inplace and not fused.training
    back = fastlayers.ReLUScale.from_native(nn.ReLU()).to_native()
    assert type(back) is nn.ReLU and not back.inplace
    with pytest.raises(ValueError, match=r"alpha=3\.0 has no single native module"):
        fused.to_native()
    with pytest.raises(TypeError, match=r"relu must be a torch\.nn\.ReLU"):
        fastlayers.ReLUScale.from_native(nn.GELU())


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    with pytest.raises(RuntimeError, match="input must be float32, float64, float16 or bfloat16"):
        relu_scale(torch.ones(3, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match="input must be float32, float64, float16 or bfloat16"):
        relu_scale(torch.ones(3, dtype=torch.complex64, device=device))
    y = torch.randn(4, device=device)
    with pytest.raises(RuntimeError, match="grad_out has shape"):
        relu_scale_backward_op(torch.randn(5, device=device), y, 1.0)
    with pytest.raises(RuntimeError, match="double backward"):
        x = torch.randn(4, device=device, requires_grad=True)
        torch.autograd.grad(relu_scale(x, 2.0).pow(2).sum(), x, create_graph=True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 5, device=device, dtype=dtype)
        torch.library.opcheck(relu_scale_op, (x.clone().requires_grad_(), -1.5))
        torch.library.opcheck(relu_scale_op, (x, 2.0))
        torch.library.opcheck(relu_scale_inplace_op, (x.clone(), 2.0))
        torch.library.opcheck(relu_scale_backward_op, (torch.randn_like(x), relu_scale(x), 2.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_opcheck_permuted_input(device, dtype, alpha):
    """A transposed input gives a contiguous result, as the fake kernel says (on CPU, alpha = 1
    and half inputs run ATen's relu, which keeps a permuted input's strides)."""
    x = torch.randn(5, 37, device=device, dtype=dtype).t()
    g = torch.randn(5, 37, device=device, dtype=dtype).t()
    torch.library.opcheck(relu_scale_op, (x, alpha))
    torch.library.opcheck(
        relu_scale_backward_op, (g, relu_scale(x, alpha).t().contiguous().t(), alpha)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph(device, inplace):
    torch.compiler.reset()
    act = fastlayers.ReLUScale(0.5, inplace=inplace)
    model = nn.Sequential(nn.Linear(32, 32), act, nn.Linear(32, 4)).to(device)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        x = torch.randn(6, 32, device=device)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(6, 32, device=device, requires_grad=True)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            (g,) = torch.autograd.grad(compiled(x).sum(), x)
            (g_ref,) = torch.autograd.grad(model(x).sum(), x)
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_graph_capture():
    x = torch.randn(1 << 16, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.autograd.grad(relu_scale(x, 1.25), x, dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = relu_scale(x, 1.25)
        (g,) = torch.autograd.grad(y, x, dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, native(x.detach(), 1.25))
    assert torch.equal(g, torch.where(x.detach() > 0, dy * 1.25, 0.0).to(g.dtype))


def test_alpha_tensor_that_requires_grad_is_refused():
    """Its gradient would be lost (alpha is read once, as a float): refused, not ignored."""
    x = torch.randn(8)
    with pytest.raises(TypeError, match="alpha must be a real number"):
        fastlayers.functional.relu_scale(x, torch.tensor(0.5, requires_grad=True))
    with pytest.raises(TypeError, match="alpha must be a real number"):
        fastlayers.ReLUScale(torch.tensor([0.5], requires_grad=True))
    expected = torch.relu(x) * 0.5
    assert torch.equal(fastlayers.functional.relu_scale(x, torch.tensor(0.5)), expected)
