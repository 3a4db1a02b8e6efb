"""float64 through every op and a patched model: forward against native float64, gradcheck of
each op's backward, double backward refused clearly, mixed float64/float32 refused as native
refuses it, opcheck, and .double() HuggingFace models (T5 uses ReLU) patched and run.

CUDA float64 runs simple double-precision kernels (LayerNorm:
csrc/layer_norm/layer_norm_cuda_f64.cu; ReLUScale and the GELU passes: the shared elementwise
kernels in double; the GEMMs: cuBLAS's DGEMM through ATen), never the CUTLASS sm90 kernel."""

import copy

import pytest
import torch
import torch.nn.functional as F
from numerics import DEVICES
from tiny_models import MODELS, build, make_inputs, run

import fastlayers
from fastlayers.functional import layer_norm, linear_gelu, linear_relu, relu_scale
from fastlayers.ops.layer_norm import layer_norm_bwd, layer_norm_fwd
from fastlayers.ops.linear_act import linear_act_bwd, linear_act_fwd
from fastlayers.ops.relu_scale import relu_scale_backward_op, relu_scale_inplace_op, relu_scale_op

F64 = torch.float64
APPROX = ["none", "tanh"]


def rand(*shape, device, requires_grad=False):
    return torch.randn(*shape, device=device, dtype=F64, requires_grad=requires_grad)


def assert_matches_native(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float64 against native float64: a few units in the last place of the row scale."""
    assert got.dtype == F64, f"{what}: dtype {got.dtype}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    assert err <= 1e-13 * scale, f"{what}: error {err:.3g} against native float64"


# ----------------------------------------------------------------------------------------------
# Forward and gradients against native float64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_float64_matches_native_and_gradcheck(device, affine):
    x = rand(3, 5, 7, 8, device=device, requires_grad=True)
    w = rand(7, 8, device=device, requires_grad=True) if affine != "none" else None
    b = rand(7, 8, device=device, requires_grad=True) if affine == "both" else None
    y = layer_norm(x, (7, 8), w, b, 1e-5)
    assert_matches_native(y, F.layer_norm(x, (7, 8), w, b, 1e-5), "layer_norm y")
    dy = rand(*y.shape, device=device)
    inputs = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(F.layer_norm(x, (7, 8), w, b, 1e-5), inputs, dy)
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want, strict=False):
        assert_matches_native(g, r, f"layer_norm {name}")
    small = [t[:2, :3].detach().clone().requires_grad_() if t is x else t for t in inputs]
    torch.autograd.gradcheck(
        lambda *a: layer_norm(a[0], (7, 8), *a[1:], *([None] * (3 - len(a))), eps=1e-5), small
    )


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_float64_statistics_are_float64(device):
    """mean/rstd are the accumulation type: float64 (native_layer_norm's too), in the fake
    kernel as in the real ones."""
    x = rand(4, 6, 16, device=device)
    w, b = rand(16, device=device), rand(16, device=device)
    _, mean, rstd = layer_norm_fwd(x, [16], w, b, 1e-5)
    _, n_mean, n_rstd = torch.native_layer_norm(x, (16,), w, b, 1e-5)
    assert mean.dtype == rstd.dtype == F64 and mean.shape == (4, 6)
    assert_matches_native(mean, n_mean.view(4, 6), "mean")
    assert_matches_native(rstd, n_rstd.view(4, 6), "rstd")
    with torch._subclasses.FakeTensorMode():
        fake = layer_norm_fwd(
            torch.empty(4, 6, 16, dtype=F64, device=device), [16], None, None, 0.1
        )
    assert [t.dtype for t in fake] == [F64] * 3
    with pytest.raises(RuntimeError, match="rstd must be a float64 tensor"):
        layer_norm_bwd(x, x, mean, rstd.float(), [16], w, b, [True, True, True])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("weight_transposed", [False, True])
def test_linear_gelu_float64_matches_native_and_gradcheck(device, approximate, weight_transposed):
    x = rand(2, 5, 12, device=device, requires_grad=True)
    w = rand(9, 12, device=device)
    w = (w.t().contiguous() if weight_transposed else w).requires_grad_()
    b = rand(9, device=device, requires_grad=True)
    w_native = w.t() if weight_transposed else w
    y = linear_gelu(x, w, b, approximate, weight_transposed=weight_transposed)
    y_native = F.gelu(F.linear(x, w_native, b), approximate=approximate)
    assert_matches_native(y, y_native, "linear_gelu y")
    dy = rand(*y.shape, device=device)
    got = torch.autograd.grad(y, (x, w, b), dy)
    want = torch.autograd.grad(y_native, (x, w, b), dy)
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want, strict=True):
        assert_matches_native(g, r, f"linear_gelu {name}")
    torch.autograd.gradcheck(
        lambda *a: linear_gelu(*a, approximate, weight_transposed=weight_transposed), (x, w, b)
    )
    torch.autograd.gradcheck(
        lambda xx, ww: linear_gelu(xx, ww, None, approximate, weight_transposed=weight_transposed),
        (x, w),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alpha", [1.0, 0.37, -2.5, 1e300])
def test_relu_scale_float64_bit_identical_and_gradcheck(device, alpha):
    """alpha is applied in float64 (1e300 overflows float32 but not float64)."""
    x = rand(4, 33, device=device)
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")], dtype=F64)
    y, want = relu_scale(x, alpha), torch.relu(x) * alpha
    inplace = x.clone()
    relu_scale(inplace, alpha, inplace=True)
    if device == "cpu":  # bit for bit, signs of zeros included
        assert torch.equal(y.view(torch.int64), want.view(torch.int64))
        assert torch.equal(inplace.view(torch.int64), y.view(torch.int64))
    else:  # the sign of relu(-0.0) is fmax's choice on CUDA (README)
        torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(inplace, y, rtol=0, atol=0, equal_nan=True)
    # gradcheck away from the kink at 0, where finite differences are meaningless
    xg = rand(5, 7, device=device)
    xg = (xg + xg.sign() * 0.1).requires_grad_()
    torch.autograd.gradcheck(lambda t: relu_scale(t, alpha if alpha != 1e300 else 3.0), (xg,))
    dy = rand(*xg.shape, device=device)
    got = torch.autograd.grad(relu_scale(xg, alpha), xg, dy)[0]
    want = torch.autograd.grad(torch.relu(xg) * alpha, xg, dy)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_double_backward_raises_clearly(device):
    """gradgradcheck cannot pass (double backward is not implemented): it must raise, naming
    the op, never return wrong second derivatives."""
    x = rand(3, 8, device=device, requires_grad=True)
    w, b = rand(8, device=device, requires_grad=True), rand(8, device=device, requires_grad=True)
    wl = rand(4, 8, device=device, requires_grad=True)
    cases = {
        "layer_norm": lambda t: layer_norm(t, 8, w, b),
        "linear_act": lambda t: linear_gelu(t, wl, None),
        "relu_scale": lambda t: relu_scale(t, 0.5),
    }
    cases = [*cases.items(), ("linear_act", lambda t: linear_relu(t, wl, None))]
    for op, fn in cases:
        with pytest.raises(RuntimeError, match=f"fastlayers.{op}: double backward"):
            torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_float64_opcheck(device):
    x, dy = rand(6, 16, device=device), rand(6, 16, device=device)
    w, b = rand(16, device=device), rand(16, device=device)
    torch.library.opcheck(layer_norm_fwd, (x, [16], w, b, 1e-5))
    torch.library.opcheck(layer_norm_fwd, (x.clone().requires_grad_(), [16], None, b, 1e-5))
    _, mean, rstd = layer_norm_fwd(x, [16], w, b, 1e-5)
    torch.library.opcheck(layer_norm_bwd, (dy, x, mean, rstd, [16], w, b, [True, True, True]))
    wl, bl = rand(24, 16, device=device), rand(24, device=device)
    for save in (False, True):
        torch.library.opcheck(linear_act_fwd, (x, wl, bl, "gelu", False, save))
    z = F.linear(x, wl, bl)
    torch.library.opcheck(
        linear_act_bwd, (torch.randn_like(z), z, x, wl, True, "gelu_tanh", False, [True] * 3)
    )
    torch.library.opcheck(relu_scale_op, (x.clone().requires_grad_(), -1.5))
    torch.library.opcheck(relu_scale_inplace_op, (x.clone(), 2.0))
    torch.library.opcheck(relu_scale_backward_op, (dy, relu_scale(x, 2.0), 2.0))


# ----------------------------------------------------------------------------------------------
# Mixed float64 / float32: refused where native refuses, naming the argument


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_float64_and_float32_refused_as_native(device):
    x64, x32 = rand(4, 8, device=device), torch.randn(4, 8, device=device)
    w32, w64 = torch.randn(8, device=device), rand(8, device=device)
    # native refuses both mixes for layer_norm, and any mix for linear
    for x, w in ((x64, w32), (x32, w64)):
        with pytest.raises(RuntimeError):
            F.layer_norm(x, (8,), w, None)
        with pytest.raises(RuntimeError):
            F.linear(x, w.expand(3, 8))
    with pytest.raises(RuntimeError, match="weight has dtype Float but input has dtype Double"):
        layer_norm(x64, 8, w32)
    with pytest.raises(RuntimeError, match="bias has dtype Float but input has dtype Double"):
        layer_norm(x64, 8, w64, w32)
    with pytest.raises(RuntimeError, match="weight has dtype Double but input has dtype Float"):
        layer_norm(x32, 8, w64)
    with pytest.raises(RuntimeError, match="weight has dtype Float but input has dtype Double"):
        linear_gelu(x64, w32.expand(3, 8).contiguous())
    with pytest.raises(RuntimeError, match="bias has dtype Double but input has dtype Float"):
        linear_gelu(x32, torch.randn(3, 8, device=device), rand(3, device=device))
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        layer_norm_fwd(x64, [8], None, None, 1e-5, torch.float32)


# ----------------------------------------------------------------------------------------------
# Patched .double() models


@pytest.mark.parametrize("name", ["t5", "bert", "sequential"])
def test_patched_double_model_runs_and_matches_native(name):
    """A .double() model: patch swaps what it swaps in float32 (T5: its MLPs and T5LayerNorms),
    runs in float64,
    and matches the native model in float64; fastlayers.check passes on it."""
    model = build(name, dtype=F64)
    inputs = make_inputs(MODELS[name][2], "cpu", dtype=F64)
    native = copy.deepcopy(model)
    report = fastlayers.patch(model)
    assert report.counts() == MODELS[name][1], str(report)
    y, y_native = run(model, inputs), run(native, inputs)
    assert y.dtype == F64
    assert_matches_native(y, y_native, f"{name} patched output")
    # backward (eval mode: no dropout draws): every parameter's gradient matches native's
    outs = []
    for m in (model, native):
        out = m(**inputs) if "input" not in inputs else m(inputs["input"])
        out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        out.pow(2).sum().backward()
        outs.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        assert_matches_native(outs[0][k], outs[1][k], f"{name} grad {k}")
    assert fastlayers.check(native, inputs).passed


# ----------------------------------------------------------------------------------------------
# CUDA: the float64 path is the fallback, never the sm90 kernel


@pytest.mark.cuda
def test_cuda_float64_linear_gelu_takes_the_fallback():
    from fastlayers.ops.linear_act import linear_gelu_path, sm90_available

    x = rand(4096, 1024, device="cuda")
    w = rand(1024, 1024, device="cuda")
    path = linear_gelu_path(x, w)
    assert path.startswith("fallback: ")
    if sm90_available("cuda"):  # elsewhere the GPU or the build is the reason given first
        assert path == "fallback: float64 input"


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1, 7, 768, 4097])
def test_cuda_float64_layer_norm_sizes(cols):
    """The float64 kernels over odd widths and many rows (several row chunks in the parameter
    gradients), against native float64 on CUDA, bit-identical run to run."""
    x = rand(1000, cols, device="cuda", requires_grad=True)
    w = rand(cols, device="cuda", requires_grad=True)
    b = rand(cols, device="cuda", requires_grad=True)
    dy = rand(1000, cols, device="cuda")
    runs = []
    for _ in range(2):
        y = layer_norm(x, cols, w, b)
        runs.append((y, *torch.autograd.grad(y, (x, w, b), dy)))
    y_native = F.layer_norm(x, (cols,), w, b)
    want = (y_native, *torch.autograd.grad(y_native, (x, w, b), dy))
    for name, g, r in zip(("y", "dx", "dw", "db"), runs[0], want, strict=True):
        err = (g - r).abs().max().item()
        assert err <= 1e-10 * max(r.abs().max().item(), 1.0), f"{name}: {err:.3g}"
    assert all(torch.equal(a, c) for a, c in zip(runs[0], runs[1], strict=True))
