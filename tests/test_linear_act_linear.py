"""fastlayers.functional.linear_act_linear, the MLP op Linear -> activation -> Linear whose
backward fuses the activation's derivative into the GEMM of the second Linear's input gradient
(op linear_act_dgrad): accuracy against float64 native layers
(DESIGN.md rule), every activation and weight layout, the fused sm90 backward GEMM and its
fallback, determinism of the bias gradient, bad inputs, opcheck, torch.compile, CUDA graphs."""

import math

import pytest
import torch
from numerics import DEVICES, DTYPES, assert_close_to_reference, poison_allocator
from sm90_sizes import TILE_CONFIGS

from fastlayers._extension import _C
from fastlayers.functional import linear_act_linear
from fastlayers.ops.linear_act import (
    GELU_APPROXIMATE,
    fallback_rows,
    linear_act_dgrad,
    linear_act_dgrad_path,
    linear_act_fwd,
    native_linear_act_linear,
    sm90_available,
)

column_sums = torch.ops.fastlayers.column_sums.default

ACTIVATIONS = ["gelu", "gelu_tanh", "relu"]
# (leading shape, in, hidden, out): small and odd sizes (on H100/H200 the multiples of 8 take
# the 64x64-tile kernels), empty rows.
SHAPES = [((1,), 8, 16, 8), ((7,), 33, 17, 5), ((3, 5), 24, 40, 16), ((0,), 16, 8, 8)]
# Partial tiles in rows, hidden and out. On H100/H200 the backward GEMM of (96,) runs fused
# (64x64 tiles); the others' dz tiles fill 61-82% of two 128x128 waves: the fallback by size.
CUDA_SHAPES = [
    ((96,), 256, 1024, 264),  # 64x64 tiles, one row chunk for the bias gradients
    ((1037,), 64, 3072, 136),
    ((4, 300), 128, 2056, 72),
    ((2048,), 72, 1160, 1000),
]


def make_mlp(k, hidden, n, dtype, device, bias, w1t, w2t):
    """Native-layout weights ([out, in]) and the stored ones ([in, out] where transposed)."""
    w1 = (torch.randn(hidden, k, device=device) / math.sqrt(max(k, 1))).to(dtype)
    w2 = (torch.randn(n, hidden, device=device) / math.sqrt(hidden)).to(dtype)
    b1 = torch.randn(hidden, device=device).to(dtype) if bias else None
    b2 = torch.randn(n, device=device).to(dtype) if bias else None
    stored1 = w1.t().contiguous() if w1t else w1
    stored2 = w2.t().contiguous() if w2t else w2
    return (w1, b1, w2, b2), (stored1, b1, stored2, b2)


def grads_of(fn, tensors, dy):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    wanted = [t for t in leaves if t is not None]
    return y, torch.autograd.grad(y, wanted, dy)


def assert_mlp_matches_reference(device, dtype, activation, transposed, bias, shapes):
    """y and every gradient of linear_act_linear against native in float64 (the DESIGN bound)."""
    layout = "conv1d" if transposed else "linear"
    for lead, k, hidden, n in shapes:
        native_params, stored = make_mlp(k, hidden, n, dtype, device, bias, transposed, transposed)
        x = torch.randn(*lead, k, device=device).to(dtype)
        dy = torch.randn(*lead, n, device=device).to(dtype)
        what = f"{lead}x{k}->{hidden}->{n} {layout}"

        def native(x, w1, b1, w2, b2):
            return native_linear_act_linear(x, w1, b1, w2, b2, activation, False, False)

        ref_y, ref_g = grads_of(
            native,
            [t.double() if t is not None else None for t in (x, *native_params)],
            dy.double(),
        )
        nat_y, nat_g = grads_of(native, [x, *native_params], dy)
        poison_allocator(device, 1 << 26)

        def fused(x, w1, b1, w2, b2):
            return linear_act_linear(
                x,
                w1,
                b1,
                w2,
                b2,
                activation,
                weight1_transposed=transposed,
                weight2_transposed=transposed,
            )

        y, g = grads_of(fused, [x, *stored], dy)
        assert y.dtype == dtype and y.shape == (*lead, n)
        assert_close_to_reference(y, nat_y, ref_y, dtype, f"{what} y")
        names = (
            ["input", "weight1", "bias1", "weight2", "bias2"]
            if bias
            else ["input", "weight1", "weight2"]
        )
        for name, gf, gn, gr in zip(names, g, nat_g, ref_g, strict=True):
            if transposed and name.startswith("weight"):
                gf = gf.t()
            assert_close_to_reference(gf, gn, gr, dtype, f"{what} grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_forward_and_backward_match_reference(device, dtype, activation, layout, bias):
    shapes = SHAPES + (CUDA_SHAPES if torch.device(device).type == "cuda" else [])
    assert_mlp_matches_reference(device, dtype, activation, layout == "conv1d", bias, shapes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_forward_is_bit_identical_to_native(dtype, activation):
    for layout in (False, True):
        _, stored = make_mlp(24, 40, 16, dtype, "cpu", True, layout, layout)
        x = torch.randn(3, 5, 24).to(dtype)
        y = linear_act_linear(
            x, *stored, activation, weight1_transposed=layout, weight2_transposed=layout
        )
        assert torch.equal(y, native_linear_act_linear(x, *stored, activation, layout, layout))


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_gradients_asked_for(device):
    _, (w1, b1, w2, b2) = make_mlp(16, 32, 8, torch.float32, device, True, False, False)
    x = torch.randn(4, 16, device=device)
    w2 = w2.clone().requires_grad_()
    (g,) = torch.autograd.grad(linear_act_linear(x, w1, b1, w2, b2).sum(), [w2])
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
    torch.testing.assert_close(g, torch.ones(4, 8, device=device).t() @ h)
    b1 = b1.clone().requires_grad_()
    (gb,) = torch.autograd.grad(linear_act_linear(x, w1, b1, w2.detach(), b2).sum(), [b1])
    b1n = b1.detach().clone().requires_grad_()
    (gbn,) = torch.autograd.grad(
        native_linear_act_linear(x, w1, b1n, w2, b2, "gelu", False, False).sum(), [b1n]
    )
    torch.testing.assert_close(gb, gbn, rtol=1e-5, atol=1e-6)


def test_float64_gradcheck():
    for activation in ("gelu", "gelu_tanh"):
        for layout in (False, True):
            _, stored = make_mlp(5, 7, 3, torch.float64, "cpu", True, layout, not layout)
            args = [torch.randn(4, 5, dtype=torch.float64), *stored]
            args = [a.clone().requires_grad_() for a in args]

            def fn(*a, activation=activation, layout=layout):
                return linear_act_linear(
                    *a, activation, weight1_transposed=layout, weight2_transposed=not layout
                )

            assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    _, (w1, b1, w2, b2) = make_mlp(16, 32, 8, torch.float32, device, True, False, False)
    x = torch.randn(4, 16, device=device)
    with pytest.raises(RuntimeError, match="weight2"):
        linear_act_linear(x, w1, b1, w2[:, :31], b2)
    with pytest.raises(RuntimeError, match="bias2"):
        linear_act_linear(x, w1, b1, w2, b2[:7])
    with pytest.raises(RuntimeError, match=r"weight1 of shape .* does not take the input's 15"):
        linear_act_linear(x[:, :15], w1, b1, w2, b2)
    with pytest.raises(RuntimeError, match="weight1 has dtype Double"):
        linear_act_linear(x, w1.double(), b1, w2, b2)
    with pytest.raises(RuntimeError, match="bias1 must have shape"):
        linear_act_linear(x, w1, b1[:3], w2, b2)
    with pytest.raises(RuntimeError, match="weight2 has dtype Half"):
        linear_act_linear(x, w1, b1, w2.half(), b2)
    with pytest.raises(ValueError, match="activation"):
        linear_act_linear(x, w1, b1, w2, b2, "silu")
    if torch.device(device).type == "cuda":
        with pytest.raises(RuntimeError, match="weight2 is on cpu"):
            linear_act_linear(x, w1, b1, w2.cpu(), b2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    _, (w1, b1, w2, _) = make_mlp(16, 32, 8, torch.float32, device, True, False, True)
    x = torch.randn(2, 3, 16, device=device, requires_grad=True)
    args = (x, w1.requires_grad_(), b1, w2.requires_grad_(), None, "gelu_tanh", False, True)
    torch.library.opcheck(torch.ops.fastlayers.linear_act_linear.default, args)
    dgrad_args = (
        torch.randn(6, 8, device=device),
        w2.detach(),
        torch.randn(6, 32, device=device),
        "gelu",
        True,
        True,
    )
    torch.library.opcheck(linear_act_dgrad, dgrad_args)
    torch.library.opcheck(linear_act_dgrad, (*dgrad_args, True))  # saved_is_derivative
    torch.library.opcheck(linear_act_dgrad, (*dgrad_args, False, True))  # want_grad_out_sums
    torch.library.opcheck(column_sums, (torch.randn(2, 3, 8, device=device),))
    x1 = torch.randn(2, 3, 16, device=device)
    fwd_args = (x1, w1.detach(), b1, "gelu", False, False, True)  # save_derivative
    torch.library.opcheck(linear_act_fwd, fwd_args)


def gelu_derivative(z, activation):
    """gelu'(z) by ATen's GELU backward (float opmath; z's dtype out)."""
    return torch.ops.aten.gelu_backward(
        torch.ones_like(z), z, approximate=GELU_APPROXIMATE[activation]
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_forward_keeps_the_derivative_when_asked(device, dtype, activation):
    """save_derivative: the second output is gelu'(z) (what the MLP's backward GEMM multiplies by
    where the sm90 kernel runs), y as without it."""
    for lead, k, n in [((37,), 24, 40), ((3, 5), 64, 136)]:
        x = torch.randn(*lead, k, device=device).to(dtype)
        w = (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype)
        b = torch.randn(n, device=device).to(dtype)
        y_plain, _ = linear_act_fwd(x, w, b, activation, False, False)
        _, z = linear_act_fwd(x, w, b, activation, False, True)
        poison_allocator(device, 1 << 24)
        y, kept = linear_act_fwd(x, w, b, activation, False, False, True)
        assert torch.equal(y, y_plain)
        assert kept.shape == z.shape and kept.dtype == dtype
        z64 = torch.nn.functional.linear(x.double(), w.double(), b.double())
        what = f"{lead}x{k}->{n} {activation} derivative"
        assert_close_to_reference(
            kept, gelu_derivative(z, activation), gelu_derivative(z64, activation), dtype, what
        )


@pytest.mark.parametrize("device", DEVICES)
def test_save_derivative_bad_uses_raise(device):
    x = torch.randn(4, 16, device=device)
    w = torch.randn(8, 16, device=device)
    with pytest.raises(RuntimeError, match="save_preact and save_derivative"):
        linear_act_fwd(x, w, None, "gelu", False, True, True)
    with pytest.raises(RuntimeError, match="save_derivative is for the GELU"):
        linear_act_fwd(x, w, None, "relu", False, False, True)
    with pytest.raises(RuntimeError, match="records no autograd"):
        linear_act_fwd(x.requires_grad_(), w, None, "gelu", False, False, True)
    with torch._subclasses.FakeTensorMode():  # the fake kernel refuses what the kernels refuse
        fx, fw = torch.empty(4, 16, device=device), torch.empty(8, 16, device=device)
        with pytest.raises(RuntimeError, match="save_derivative is for the GELU"):
            linear_act_fwd(fx, fw, None, "relu", False, False, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_dgrad_from_a_saved_derivative(device, dtype, transposed):
    """saved_is_derivative: dz = saved * (dy . W2), db its column sums."""
    m, n2, n1 = 150, 24, 72
    dy = torch.randn(m, n2, device=device).to(dtype)
    w2 = (torch.randn(n2, n1, device=device) / math.sqrt(n2)).to(dtype)
    stored = w2.t().contiguous() if transposed else w2
    g = (torch.rand(m, n1, device=device) * 1.3 - 0.2).to(dtype)  # gelu' spans [-0.17, 1.13]
    poison_allocator(device, 1 << 24)
    dz, db, no_sums = linear_act_dgrad(dy, stored, g, "gelu", transposed, True, True)
    ref = (dy.double() @ (stored.double().t() if transposed else stored.double())) * g.double()
    nat = (dy @ (stored.t() if transposed else stored)) * g
    assert_close_to_reference(dz, nat, ref, dtype, "dz")
    assert_close_to_reference(db, nat.sum(0), ref.sum(0), dtype, "db")
    assert no_sums.numel() == 0
    # want_grad_out_sums: the next Linear's bias gradient, grad_out's column sums
    dz2, no_db, sums = linear_act_dgrad(dy, stored, g, "gelu", transposed, False, True, True)
    assert torch.equal(dz2, dz) and no_db.numel() == 0
    assert_close_to_reference(sums, dy.sum(0), dy.double().sum(0), dtype, "grad_out sums")
    _, _, empty_sums = linear_act_dgrad(dy[:0], stored, g[:0], "gelu", transposed, True, True, True)
    assert torch.equal(empty_sums, torch.zeros(n2, device=device, dtype=dtype))
    no_features = stored[:0] if transposed else stored[:, :0]  # n1 = 0: grad_out still summed
    _, _, sums0 = linear_act_dgrad(dy, no_features, g[:, :0], "gelu", transposed, True, True, True)
    assert_close_to_reference(sums0, dy.sum(0), dy.double().sum(0), dtype, "grad_out sums, n1 0")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(37, 136), (2, 150, 768), (0, 16), (5, 0), (24,)], ids=str)
def test_column_sums_match_reference(device, dtype, shape):
    """The MLP's second bias gradient: grad summed over its leading dimensions, within the
    DESIGN rule of ATen's sum against float64, and (CUDA) the same bits run to run."""
    rows, n = math.prod(shape[:-1]), shape[-1]
    grad = torch.randn(shape, device=device, dtype=dtype)
    poison_allocator(device, 1 << 20)
    got = column_sums(grad)
    assert got.dtype == dtype and got.shape == (n,)
    native = grad.reshape(rows, n).sum(0)
    ref = grad.double().reshape(rows, n).sum(0)
    assert_close_to_reference(got, native, ref, dtype, f"column_sums {shape}")
    assert torch.equal(got, column_sums(grad)), "not deterministic"
    strided = torch.randn(*shape[:-1], 2 * n, device=device, dtype=dtype)[..., ::2]
    assert_close_to_reference(
        column_sums(strided),
        strided.reshape(rows, n).sum(0),
        strided.double().reshape(rows, n).sum(0),
        dtype,
        "column_sums, strided",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_column_sums_bad_inputs(device):
    with pytest.raises(RuntimeError, match="grad must have at least one dimension"):
        column_sums(torch.tensor(1.0, device=device))
    with pytest.raises(RuntimeError, match="grad must be float32"):
        column_sums(torch.ones(4, 4, device=device, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch.compiler.reset()
    _, (w1, b1, w2, b2) = make_mlp(32, 64, 8, torch.float32, device, True, False, False)
    params = [p.requires_grad_() for p in (w1, b1, w2, b2)]

    def mlp(x):
        return linear_act_linear(x, *params, "gelu")

    compiled = torch.compile(mlp, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(6, 32, device=device, requires_grad=True)
            out = compiled(x)
            torch.testing.assert_close(out, mlp(x), rtol=1e-5, atol=1e-5)
            g = torch.autograd.grad(out.sum(), [x, *params])
            g_ref = torch.autograd.grad(mlp(x).sum(), [x, *params])
            for a, b in zip(g, g_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.compiler.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_both_linears_in_the_autocast_dtype(device):
    _, (w1, b1, w2, b2) = make_mlp(16, 32, 8, torch.float32, device, True, False, False)
    x = torch.randn(4, 16, device=device)
    dtype = torch.bfloat16
    with torch.autocast(torch.device(device).type, dtype=dtype):
        y = linear_act_linear(x, w1, b1, w2, b2)
        y_native = native_linear_act_linear(x, w1, b1, w2, b2, "gelu", False, False)
    assert y.dtype == y_native.dtype == dtype
    torch.testing.assert_close(y, y_native, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------- the sm90 GEMM


def needs_sm90():
    if not sm90_available("cuda"):
        pytest.skip("needs an H100/H200 and a build with the sm90 kernels")


def autograd_dgrad(dy, w2, saved, activation, transposed, dtype):
    """(dz, db) as native autograd computes them in ``dtype``: da = dy . W2 rounded to the dtype,
    then the activation's backward (for ReLU, saved is its output: the same mask)."""
    dy, w2, saved = (t.to(dtype) for t in (dy, w2, saved))
    da = dy @ (w2.t() if transposed else w2)
    z = saved.clone().requires_grad_()
    if activation == "relu":
        out = torch.relu(z)
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        out = torch.nn.functional.gelu(z, approximate=approximate)
    (dz,) = torch.autograd.grad(out, z, da)
    return dz, dz.sum(0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_cuda_fused_dgrad_matches_reference(dtype, activation, transposed):
    needs_sm90()
    # output tiles past two waves on any sm_90 GPU (the fused path), partial in m, n and k; 64x64
    # tiles (200 rows); the cooperative 256x128 kernel past in_features 2048, with an odd number
    # of column tiles (11: the 1x2 cluster's second tile past the last column); 1037 rows are an
    # odd number of 128-row tiles (the 2x1 cluster's second tile past the last row). db comes
    # from the GEMM's per-warp column sums.
    shapes = [(1037, 136, 3848), (2048, 1000, 3208), (1024, 64, 5000), (200, 136, 520)]
    for m, n2, n1 in [*shapes, (256 * 27, 2056, 1400)]:
        dy = torch.randn(m, n2, device="cuda").to(dtype)
        w2 = (torch.randn(n2, n1, device="cuda") / math.sqrt(n2)).to(dtype)
        stored = w2.t().contiguous() if transposed else w2
        saved = (2 * torch.randn(m, n1, device="cuda")).to(dtype)
        if activation == "relu":
            saved = saved.relu()
        assert (
            linear_act_dgrad_path(
                dy, stored, saved, activation=activation, weight_transposed=transposed
            )
            == "cutlass_sm90"
        )
        poison_allocator("cuda", 1 << 26)
        # grad_out's column sums asked too: their finish shares db's launch
        args = (dy, stored, saved, activation, transposed)
        dz, db, sums = linear_act_dgrad(*args, True, False, True)
        dz_ref, db_ref = autograd_dgrad(dy, stored, saved, activation, transposed, torch.float64)
        nat_dz, nat_db = autograd_dgrad(dy, stored, saved, activation, transposed, dtype)
        what = f"{m}x{n2}->{n1}"
        assert_close_to_reference(dz, nat_dz, dz_ref, dtype, f"{what} dz")
        assert_close_to_reference(db, nat_db, db_ref, dtype, f"{what} db")
        sums_ref = dy.double().sum(0)
        assert_close_to_reference(sums, dy.sum(0), sums_ref, dtype, f"{what} grad_out sums")
        dz2, db2, no_sums = linear_act_dgrad(*args, True)
        assert torch.equal(dz, dz2) and torch.equal(db, db2), "not deterministic"
        assert no_sums.numel() == 0
        dz3, db3, sums3 = linear_act_dgrad(*args, False, False, True)
        assert torch.equal(dz, dz3) and db3.numel() == 0 and torch.equal(sums, sums3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_cuda_mlp_keeping_the_derivative_matches_reference(dtype, activation, layout):
    """Where the sm90 forward kernel runs, the MLP keeps gelu'(z), which its epilogue computes
    beside gelu(z), and the backward GEMM multiplies by it: y and the gradients stay within the
    DESIGN bound of float64 (BERT-base and GPT-2 medium widths)."""
    needs_sm90()
    transposed = layout == "conv1d"
    shapes = [((2048,), 768, 3072, 768), ((4, 256), 1024, 4096, 1024)]
    for lead, k, hidden, _ in shapes:
        w1 = torch.empty(k, hidden) if transposed else torch.empty(hidden, k)
        x = torch.empty(*lead, k)
        for act in ("gelu", "gelu_tanh"):
            assert _C._testing.linear_act_keeps_derivative(
                x.to("cuda", dtype), w1.to("cuda", dtype), True, act, transposed
            )
        assert not _C._testing.linear_act_keeps_derivative(
            x.to("cuda", dtype), w1.to("cuda", dtype), True, "relu", transposed
        )
        assert not _C._testing.linear_act_keeps_derivative(x, w1, True, "gelu", transposed)  # CPU
    assert_mlp_matches_reference("cuda", dtype, activation, transposed, True, shapes)


@pytest.mark.cuda
def test_cuda_dgrad_path_choice():
    needs_sm90()
    dy = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(768, 3072, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    assert linear_act_dgrad_path(dy, w2, z) == "cutlass_sm90"
    assert linear_act_dgrad_path(dy[:64], w2, z[:64]) == "cutlass_sm90"  # 64x64 tiles
    # up to in_features 1024 at any size: where the forward's waves rule sends the forward to its
    # fallback, the backward GEMM (db from its epilogue) still beats cuBLAS + the backward pass
    m = fallback_rows(768, 3072, torch.bfloat16)
    assert linear_act_dgrad_path(dy[:m], w2, z[:m]) == "cutlass_sm90"
    # past it the waves rule, counted on unpaired 128x128 tiles up to 1536 rows: 384 x 2048 ->
    # 8192 fills two waves to 73% (fallback); 640 rows make three (fused)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms == 132:  # the H100 SXM the rule was measured on
        dy_k = torch.randn(640, 2048, device="cuda", dtype=torch.bfloat16)
        w2_k = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
        z_k = torch.randn(640, 8192, device="cuda", dtype=torch.bfloat16)
        by_size = linear_act_dgrad_path(dy_k[:384], w2_k, z_k[:384])
        assert by_size.startswith("fallback: its 128x128 output tiles fill under 85%"), by_size
        assert linear_act_dgrad_path(dy_k, w2_k, z_k) == "cutlass_sm90"
    assert linear_act_dgrad_path(dy.float(), w2.float(), z.float()) == "fallback: float32 input"
    odd = linear_act_dgrad_path(dy[:, :767], w2[:767], z)
    assert odd.startswith("fallback: in_features")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_specials_propagate_through_the_fused_dgrad(dtype):
    needs_sm90()
    m, n2, n1 = 1024, 64, 3072
    dy = torch.randn(m, n2, device="cuda").to(dtype)
    w2 = torch.randn(n2, n1, device="cuda").to(dtype) / 8
    saved = torch.randn(m, n1, device="cuda").to(dtype)
    saved[0, 0], saved[1, 1], saved[2, 2] = float("nan"), -30.0, 30.0
    dz, db, _ = linear_act_dgrad(dy, w2, saved, "gelu", False, True)
    assert dz[0, 0].isnan() and db[0].isnan()
    assert dz[1, 1] == 0
    da = (dy.float() @ w2.float())[2, 2]
    torch.testing.assert_close(dz[2, 2].float(), da, rtol=1e-2, atol=1e-2)
    assert torch.isfinite(dz[3:]).all()


@pytest.mark.cuda
def test_cuda_graph_capture():
    needs_sm90()
    _, (w1, b1, w2, b2) = make_mlp(256, 3072, 768, torch.bfloat16, "cuda", True, False, False)
    params = [p.requires_grad_() for p in (w1, b1, w2, b2)]
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.autograd.grad(linear_act_linear(x, *params), [x, *params], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear_act_linear(x, *params)
        grads = torch.autograd.grad(y, [x, *params], dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    xs = x.detach().clone().requires_grad_()
    y_ref = linear_act_linear(xs, *params)
    grads_ref = torch.autograd.grad(y_ref, [xs, *params], dy)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("config", list(TILE_CONFIGS), ids=list(TILE_CONFIGS.values()))
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_cuda_every_dgrad_tile_config(config, transposed):
    """Every compiled tile config (auto picks 64x64 tiles for small problems, else by the GEMM's K:
    ping-pong up to 2048, then the cooperative 256x128 tile), through the raw entry: the
    identity epilogue is the GEMM, erf is the op's result, with the bias gradient from the
    epilogue's column sums when asked (an empty tensor when not)."""
    needs_sm90()
    m, n2, n1 = 1000, 2056, 1160
    dy = torch.randn(m, n2, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(n2, n1, device="cuda") / math.sqrt(n2)).to(torch.bfloat16)
    stored = w2.t().contiguous() if transposed else w2
    z = torch.randn(m, n1, device="cuda", dtype=torch.bfloat16)
    dz = torch.full_like(z, float("nan"))
    no_db = _C._testing.linear_act_dgrad_sm90_raw(dy, stored, z, dz, transposed, 3, config)
    assert no_db.numel() == 0
    torch.testing.assert_close(dz.float(), dy.float() @ w2.float(), rtol=1e-2, atol=1e-2)
    db = _C._testing.linear_act_dgrad_sm90_raw(
        dy, stored, z, dz.fill_(float("nan")), transposed, 0, config, want_db=True
    )
    ref, ref_db = autograd_dgrad(dy, stored, z, "gelu", transposed, torch.float64)
    nat, nat_db = autograd_dgrad(dy, stored, z, "gelu", transposed, torch.bfloat16)
    assert_close_to_reference(dz, nat, ref, torch.bfloat16, f"config {config} dz")
    assert db.shape == (n1,) and db.dtype == torch.bfloat16
    assert_close_to_reference(db, nat_db, ref_db, torch.bfloat16, f"config {config} db")


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_dgrad_fallback_raw_entry_is_the_fallback(activation):
    """The benchmarks' raw entry of the backward GEMM's fallback (cuBLAS, then the backward pass)
    gives the fallback path's dz and db bit for bit, and refuses the identity epilogue."""
    from fastlayers._extension import _C

    m, n2, n1 = 300, 136, 1004  # n1 not a multiple of 8: the fallback on every GPU
    dy = torch.randn(m, n2, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(n2, n1, device="cuda") / math.sqrt(n2)).to(torch.bfloat16)
    z = (2 * torch.randn(m, n1, device="cuda")).to(torch.bfloat16)
    saved = z.relu() if activation == "relu" else z
    assert linear_act_dgrad_path(dy, w2, saved, activation=activation).startswith("fallback")
    dz, db, _ = linear_act_dgrad(dy, w2, saved, activation, False, True)
    epilogue = ACTIVATIONS.index(activation)  # 0 erf, 1 tanh, 2 relu: the Activation values
    raw_dz, raw_db = _C._testing.linear_act_dgrad_fallback_raw(dy, w2, saved, False, epilogue, True)
    assert torch.equal(raw_dz, dz) and torch.equal(raw_db, db)
    _, no_db = _C._testing.linear_act_dgrad_fallback_raw(dy, w2, saved, False, epilogue, False)
    assert no_db.numel() == 0
    with pytest.raises(RuntimeError, match=r"epilogue must be 0\.\.2"):
        _C._testing.linear_act_dgrad_fallback_raw(dy, w2, saved, False, 3, True)
