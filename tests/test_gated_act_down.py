"""fastlayers.functional.gated_act_down: F.linear(act(gate) * up, weight, bias) whose autograd
node keeps gate, up and the weight but not the product, which its backward recomputes in the
pass that computes the product's gradients (gated_act_bwd's third output). Its output and every
gradient must be those of gated_act followed by F.linear bit for bit (the same kernels and GEMM
calls), on CPU and CUDA, under autocast too; it must keep one [..., intermediate] tensor less."""

import pytest
import torch
import torch.nn.functional as F
from numerics import DEVICES, poison_allocator

from fastlayers.functional import gated_act, gated_act_down
from fastlayers.ops.gated_act import ACTIVATIONS, gated_act_bwd, gated_act_down_op, gated_act_fwd

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def leaves(shape, out, device, dtype, bias, chunked=False, scale=3.0):
    """Fresh random gate, up (halves of one [.., 2I] leaf where chunked), weight and bias."""
    if chunked:
        h = torch.randn(*shape[:-1], 2 * shape[-1], device=device, dtype=dtype) * scale
        h.requires_grad_()
        gate, up = h.chunk(2, dim=-1)
        roots = [h]
    else:
        gate = (torch.randn(shape, device=device, dtype=dtype) * scale).requires_grad_()
        up = (torch.randn(shape, device=device, dtype=dtype) * scale).requires_grad_()
        roots = [gate, up]
    w = torch.randn(out, shape[-1], device=device, dtype=dtype) / shape[-1] ** 0.5
    w.requires_grad_()
    b = torch.randn(out, device=device, dtype=dtype).requires_grad_() if bias else None
    return gate, up, w, b, [*roots, w] + ([b] if bias else [])


def reference(gate, up, w, b, activation):
    """What the patched gated MLP computed before: fastlayers' product, then F.linear."""
    return F.linear(gated_act(gate, up, activation), w, b)


def run(fn, gate, up, w, b, roots, dy):
    y = fn(gate, up, w, b)
    return (y, *torch.autograd.grad(y, roots, dy))


def assert_all_equal(ours, theirs, what):
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(o, t, rtol=0, atol=0, equal_nan=True, msg=f"{what} [{i}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    "shape,out,bias,chunked",
    [
        ((7, 24), 8, False, False),
        ((2, 5, 64), 16, True, False),
        ((3, 4, 40), 9, False, True),
        ((33,), 5, True, False),
        ((1, 1, 4097), 3, False, False),
    ],
    ids=str,
)
def test_equals_gated_act_then_linear_bitwise(device, dtype, activation, shape, out, bias, chunked):
    gate, up, w, b, roots = leaves(shape, out, device, dtype, bias, chunked)
    dy = torch.randn(*shape[:-1], out, device=device, dtype=dtype)
    poison_allocator(device, 16 * gate.numel() * gate.element_size())
    ours = run(lambda *a: gated_act_down(*a, activation), gate, up, w, b, roots, dy)
    theirs = run(lambda *a: reference(*a, activation), gate, up, w, b, roots, dy)
    assert ours[0].grad_fn.name() == "fastlayers::GatedActDownBackward"
    assert all(torch.isfinite(t).all() for t in ours)
    assert_all_equal(ours, theirs, f"{device} {dtype} {activation}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("cols", [1, 7, 64, 4097], ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "chunked"])
def test_backward_recomputes_the_forward_product_bitwise(device, dtype, activation, cols, chunked):
    """gated_act_bwd's third output is gated_act_fwd's result, bit for bit, beside the same
    gradients as without it."""
    h = torch.randn(37, 2 * cols, device=device, dtype=dtype) * 3
    gate, up = h.chunk(2, dim=-1) if chunked else (h[:, :cols].contiguous(), h[:, cols:] + 0)
    dy = torch.randn(37, cols, device=device, dtype=dtype)
    poison_allocator(device, 16 * gate.numel() * gate.element_size())
    dg, du, y = gated_act_bwd(dy, gate, up, activation, [True, True, True])
    dg2, du2, none = gated_act_bwd(dy, gate, up, activation, [True, True, False])
    _, _, y_only = gated_act_bwd(dy, gate, up, activation, [False, False, True])
    assert none.numel() == 0
    assert_all_equal((y, y_only, dg, du), (gated_act_fwd(gate, up, activation), y, dg2, du2), "bwd")


@pytest.mark.parametrize("device", DEVICES)
def test_keeps_gate_up_and_weight_but_not_the_product(device):
    """The tensors the graph keeps for backward: native's down projection keeps the product
    ([..., intermediate]) beside act * up's gate and up; gated_act_down keeps gate, up and the
    weight only."""
    gate, up, w, b, _ = leaves((4, 6, 32), 8, device, torch.float32, bias=True)

    def kept(fn):
        packed = []

        def pack(t):
            packed.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(gate, up, w, b)
        # by storage: native keeps views (the product's rows, the weight transposed)
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}

    ours = kept(lambda *a: gated_act_down(*a, "silu"))
    theirs = kept(lambda *a: reference(*a, "silu"))
    params = {t.untyped_storage().data_ptr() for t in (gate, up, w)}
    assert set(ours) == params
    extra = {p: n for p, n in theirs.items() if p not in params}
    assert list(extra.values()) == [gate.numel() * gate.element_size()]  # the product


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("want", ["gate", "up", "weight", "bias", "none"])
def test_only_the_gradients_asked_for(device, want):
    gate, up, w, b, _ = leaves((5, 16), 4, device, torch.float32, bias=True)
    dy = torch.randn(5, 4, device=device)
    tensors = {"gate": gate, "up": up, "weight": w, "bias": b}
    for name, t in tensors.items():
        t.requires_grad_(name == want)
    y = gated_act_down(gate, up, w, b, "gelu")
    if want == "none":
        assert y.grad_fn is None
        torch.testing.assert_close(y, reference(gate, up, w, b, "gelu"), rtol=0, atol=0)
        return
    (ours,) = torch.autograd.grad(y, tensors[want], dy)
    (theirs,) = torch.autograd.grad(reference(gate, up, w, b, "gelu"), tensors[want], dy)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    with torch.no_grad():
        assert gated_act_down(gate, up, w, b, "gelu").grad_fn is None


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cpu", torch.bfloat16),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
        pytest.param("cuda", torch.float16, marks=pytest.mark.cuda),
    ],
    ids=str,
)
def test_autocast_with_float32_parameters_is_native(device, dtype):
    """Under autocast the projection runs in autocast's dtype with the weight's cached cast, as
    F.linear's does: the output in that dtype, the float32 weight's gradient the widened one."""
    x = torch.randn(3, 5, 16, device=device, requires_grad=True)
    wg = torch.randn(24, 16, device=device, requires_grad=True)
    wu = torch.randn(24, 16, device=device, requires_grad=True)
    wd = torch.randn(8, 24, device=device, requires_grad=True)
    bd = torch.randn(8, device=device, requires_grad=True)
    dy = torch.randn(3, 5, 8, device=device, dtype=dtype)

    def step(down):
        with torch.autocast(device, dtype=dtype):
            y = down(F.linear(x, wg), F.linear(x, wu), wd, bd, "silu")
        return (y, *torch.autograd.grad(y, (x, wg, wu, wd, bd), dy))

    ours = step(gated_act_down)
    theirs = step(reference)
    assert ours[0].dtype == dtype and ours[4].dtype == torch.float32
    assert_all_equal(ours, theirs, "autocast")


def test_double_backward_is_refused_not_wrong():
    gate, up, w, b, _ = leaves((4, 8), 3, "cpu", torch.float32, bias=False)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gated_act_down(gate, up, w, b).pow(2).sum(), gate, create_graph=True)


def test_saved_operand_modified_in_place_is_caught():
    gate, up, w, b, _ = leaves((4, 8), 3, "cpu", torch.float32, bias=False)
    up = up.detach()
    y = gated_act_down(gate, up, w, b)
    up.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows(device):
    gate, up, w, b, roots = leaves((0, 16), 4, device, torch.float32, bias=True)
    dy = torch.randn(0, 4, device=device)
    ours = run(lambda *a: gated_act_down(*a, "silu"), gate, up, w, b, roots, dy)
    theirs = run(lambda *a: reference(*a, "silu"), gate, up, w, b, roots, dy)
    assert ours[0].shape == (0, 4)
    assert_all_equal(ours, theirs, "empty")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    g = torch.randn(4, 8, device=device)
    w = torch.randn(3, 8, device=device)
    with pytest.raises(RuntimeError, match=r"weight of shape \[3, 7\] does not take the product"):
        gated_act_down(g, g, w[:, :7])
    with pytest.raises(RuntimeError, match="weight must be 2-D"):
        gated_act_down(g, g, w[0])
    with pytest.raises(RuntimeError, match="weight has dtype Half but gate has dtype Float"):
        gated_act_down(g, g, w.half())
    with pytest.raises(RuntimeError, match=r"bias must have shape \[3\]"):
        gated_act_down(g, g, w, torch.randn(4, device=device))
    with pytest.raises(RuntimeError, match=r"up has shape \[4, 7\] but gate has shape \[4, 8\]"):
        gated_act_down(g, g[:, :7], w)
    with pytest.raises(ValueError, match="activation must be"):
        gated_act_down(g, g, w, None, "swish")


def test_wrong_device_raises_in_the_fake_kernel():
    g = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight is on meta but gate is on cpu"):
        gated_act_down_op(g, g, torch.randn(3, 8, device="meta"), None, "silu")


@pytest.mark.cuda
def test_wrong_device_raises():
    g = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="weight is on cpu but gate is on cuda"):
        gated_act_down(g, g, torch.randn(3, 8))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    h = torch.randn(6, 2 * 24, device=device)
    gate, up = h.chunk(2, dim=-1)
    w, b = torch.randn(5, 24, device=device), torch.randn(5, device=device)
    for activation in ACTIVATIONS:
        torch.library.opcheck(gated_act_down_op, (gate, up, w, b, activation))
        grads = [t.clone().requires_grad_() for t in (gate, up, w, b)]
        torch.library.opcheck(gated_act_down_op, (*grads, activation))
        torch.library.opcheck(gated_act_down_op, (gate, up, w, None, activation))


def test_torch_compile_fullgraph_traces_the_native_composite():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    gate, up, w, b, _ = leaves((4, 16), 8, "cpu", torch.float32, bias=True)
    fn = torch.compile(lambda *a: gated_act_down(*a, "silu"), backend=backend, fullgraph=True)
    torch.testing.assert_close(fn(gate, up, w, b), reference(gate, up, w, b, "silu"))
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert not any("fastlayers" in t for t in targets), targets


def test_torch_func_takes_the_native_route():
    gate, up, w, b, _ = leaves((4, 16), 8, "cpu", torch.float64, bias=True)
    tangent = torch.randn_like(gate)
    _, t = torch.func.jvp(lambda g: gated_act_down(g, up, w, b, "gelu_tanh"), (gate,), (tangent,))
    _, t_n = torch.func.jvp(lambda g: reference(g, up, w, b, "gelu_tanh"), (gate,), (tangent,))
    torch.testing.assert_close(t, t_n)


@pytest.mark.cuda
def test_cuda_keeps_one_product_less_memory():
    """Allocated memory after the forward (what the graph keeps): one [tokens, intermediate]
    product less than gated_act + F.linear."""
    gate, up, w, _, _ = leaves((2048, 1024), 256, "cuda", torch.bfloat16, bias=False)
    product_bytes = gate.numel() * gate.element_size()

    def held(fn):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = fn(gate, up, w, None)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, y

    ours, y = held(lambda *a: gated_act_down(*a, "silu"))
    del y
    theirs, _ = held(lambda *a: reference(*a, "silu"))
    assert theirs - ours == product_bytes


@pytest.mark.cuda
def test_cuda_graph_capture():
    gate, up, w, b, roots = leaves((64, 512), 128, "cuda", torch.bfloat16, bias=True)
    dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        return run(lambda *a: gated_act_down(*a, "silu"), gate, up, w, b, roots, dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in roots:
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert_all_equal(captured, step(), "replay")
