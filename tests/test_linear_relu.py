"""fastlayers.FusedLinearReLU and fastlayers.functional.linear_relu: ReLU's place in the fused
Linear + activation family (accuracy against float64 for every activation is in
test_linear_gelu.py's reference test). Here: bit-identity with F.relu(F.linear) on CPU, NaN and
signed-zero rules, the backward that keeps no pre-activation, module contract, from_native /
to_native, Linear look-alikes, opcheck, torch.compile, autocast, CUDA paths and graphs."""

import math

import pytest
import torch
import torch.nn.functional as F
from numerics import DEVICES, DTYPES, FLOOR, max_err, poison_allocator
from torch import nn

import fastlayers
from fastlayers._extension import _C
from fastlayers.functional import linear_act_path, linear_relu
from fastlayers.ops.linear_act import fallback_rows, linear_act_bwd, linear_act_fwd, sm90_available


def native(x, w, b=None):
    return F.relu(F.linear(x, w, b))


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves while ``fn()`` runs (each storage once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["w_nk", "w_kn"])
def test_cpu_forward_and_input_gradients_are_bit_identical_to_native(dtype, transposed):
    """CPU: ATen's linear + relu, and dx, dW by the same GEMMs from the same dz = dy * (y > 0).
    Native for the [in, out] layout (w_kn) is HF Conv1D's: the GEMM on the stored weight as it
    lies (addmm(b, x, w_stored) = F.linear(x, w_stored.t(), b)). A contiguous [out, in] copy is
    not the same GEMM: CPU BLAS may round it differently (it does in float16/float64 on AVX-512
    EPYC CPUs with torch 2.15)."""
    w = torch.randn(200, 96, dtype=dtype)
    b = torch.randn(200, dtype=dtype)
    x = torch.randn(3, 37, 96, dtype=dtype)
    stored = w.t().contiguous() if transposed else w

    def native_of_layout(x, stored, b):
        return native(x, stored.t() if transposed else stored, b)

    with torch.no_grad():
        y = linear_relu(x, stored, b, weight_transposed=transposed)
        assert torch.equal(y, native_of_layout(x, stored, b))
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, stored, b))
    xn, wn, bn = (t.clone().requires_grad_() for t in (x, stored, b))
    y = linear_relu(xs, ws, bs, weight_transposed=transposed)
    y_nat = native_of_layout(xn, wn, bn)
    assert torch.equal(y, y_nat)
    dy = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (xs, ws, bs), dy)
    gx_n, gw_n, gb_n = torch.autograd.grad(y_nat, (xn, wn, bn), dy)
    assert torch.equal(gx, gx_n)
    assert torch.equal(gw, gw_n)
    # the bias gradient is summed in fixed row chunks (deterministic), not ATen's order
    tol = {torch.float64: 1e-12, torch.float32: 1e-4}.get(dtype, 0.5)
    torch.testing.assert_close(gb, gb_n, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_matches_native_and_gradcheck(device):
    """float64 on CPU and CUDA (ATen's double GEMM and ReLU in double, never the sm90 kernel)."""
    x = torch.randn(6, 5, 24, device=device, dtype=torch.float64)
    w = torch.randn(40, 24, device=device, dtype=torch.float64)
    b = torch.randn(40, device=device, dtype=torch.float64)
    y, y_nat = linear_relu(x, w, b), native(x, w, b)
    if device == "cpu":
        assert torch.equal(y, y_nat)
    else:  # cuBLASLt (bias + ReLU epilogue) may sum in another order than native's addmm
        torch.testing.assert_close(y, y_nat, rtol=1e-12, atol=1e-12)
    args = [
        t[:2].clone().requires_grad_() if t is x else t.clone().requires_grad_() for t in (x, w, b)
    ]
    torch.autograd.gradcheck(lambda *a: linear_relu(*a), args)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_signed_zero_follow_native(device):
    """NaN propagates through the ReLU (clamp_min's rule, ReLUScale's too); the backward passes
    the gradient where the output is NaN and nowhere y <= 0, as torch.relu's backward does."""
    k = 8
    w = torch.eye(k, device=device)
    x = torch.tensor(
        [[math.nan, -math.inf, math.inf, -0.0, 0.0, -1.5, 2.5, 1e-30]], device=device
    ).repeat(300, 1)
    for bias in (None, torch.zeros(k, device=device)):
        xs = x.clone().requires_grad_()
        y = linear_relu(xs, w, bias)
        y_nat = native(x, w, bias)
        assert torch.equal(y.isnan(), y_nat.isnan())
        finite = ~y_nat.isnan()
        assert torch.equal(y[finite], y_nat[finite])
        (g,) = torch.autograd.grad(y, xs, torch.ones_like(y))
        xn = x.clone().requires_grad_()
        (g_nat,) = torch.autograd.grad(native(xn, w, bias), xn, torch.ones_like(y))
        assert torch.equal(g.isnan(), g_nat.isnan())
        assert torch.equal(g.nan_to_num(), g_nat.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_backward_stores_no_pre_activation(device):
    """Autograd keeps input, weight and the output (which native's ReLU keeps anyway): no
    [m, n] pre-activation beside them, unlike GELU."""
    m, k, n = 512, 64, 256
    x = torch.randn(m, k, device=device, requires_grad=True)
    relu_layer = fastlayers.FusedLinearReLU(k, n, device=device)
    gelu_layer = fastlayers.FusedLinearGELU(k, n, device=device)
    out_bytes = m * n * 4
    base = x.nbytes + relu_layer.weight.nbytes
    assert saved_bytes(lambda: relu_layer(x)) == base + out_bytes
    assert saved_bytes(lambda: gelu_layer(x)) == base + out_bytes  # z instead of y
    y = relu_layer(x)
    with torch.no_grad():
        y.mul_(2)  # modifying the saved output is refused, as native's relu refuses it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_module_contract_and_native_round_trip(device):
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, device=device)
    torch.manual_seed(0)
    fused = fastlayers.FusedLinearReLU(24, 40, device=device)
    assert torch.equal(fused.weight, ref.weight) and torch.equal(fused.bias, ref.bias)
    assert list(fused.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert fastlayers.FusedLinearReLU(4, 8, bias=False).bias is None
    assert fastlayers.FusedLinearReLU(4, 8, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    meta = fastlayers.FusedLinearReLU(4, 8, device="meta")
    assert meta.weight.is_meta and meta(torch.empty(3, 4, device="meta")).shape == (3, 8)
    assert "fused=fastlayers.linear_relu" in repr(meta)
    assert not isinstance(fused, nn.Linear) and isinstance(fused, fastlayers.layers.FusedLinearAct)

    linear, relu = nn.Linear(16, 32, device=device).eval(), nn.ReLU(inplace=True)
    fused = fastlayers.FusedLinearReLU.from_native(linear, relu)
    assert fused.weight is linear.weight and fused.bias is linear.bias and not fused.training
    x = torch.randn(5, 16, device=device)
    assert torch.equal(fused(x), native(x, linear.weight, linear.bias)) or device != "cpu"
    back, relu_back = fused.to_native()
    assert type(back) is nn.Linear and back.weight is linear.weight and type(relu_back) is nn.ReLU
    torch.testing.assert_close(relu_back(back(x)), fused(x), rtol=0, atol=0)
    for other in (nn.ReLU6(), nn.LeakyReLU(), nn.GELU()):
        with pytest.raises(TypeError, match=r"relu must be an nn\.ReLU"):
            fastlayers.FusedLinearReLU.from_native(linear, other)


def test_hf_conv1d_and_linear_look_alikes():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    conv = pytorch_utils.Conv1D(40, 16)
    fused = fastlayers.FusedLinearReLU.from_native(conv)
    assert fused.weight is conv.weight and fused.weight_transposed
    x = torch.randn(2, 7, 16)
    assert torch.equal(fused(x), F.relu(conv(x)))

    class FalconLinear(nn.Linear):  # transformers' Falcon: x @ W.T (+ b), its own forward
        def forward(self, input):
            out = input @ self.weight.T
            return out if self.bias is None else out + self.bias

    class ScaledLinear(nn.Linear):
        def forward(self, input):
            return super().forward(input) * 0.5

    class DropLinear(nn.Linear):  # F.linear in eval mode only
        def forward(self, input):
            return F.dropout(super().forward(input), 0.1, self.training)

    for bias in (True, False):
        look = FalconLinear(16, 24, bias=bias)
        assert fastlayers.layers.linear_layout(look) == ("linear", None)
        fused = fastlayers.FusedLinearReLU.from_native(look)
        assert fused.weight is look.weight
        torch.testing.assert_close(fused(x), F.relu(look(x)))
    for cls in (ScaledLinear, DropLinear):
        layout, why = fastlayers.layers.linear_layout(cls(16, 24))
        assert layout is None and "does not compute F.linear" in why, why
        with pytest.raises(TypeError, match=r"does not compute F\.linear"):
            fastlayers.FusedLinearReLU.from_native(cls(16, 24))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype, m, n in ((torch.float32, 9, 32), (torch.bfloat16, 2048, 1280)):
        x = torch.randn(m, 64, device=device, dtype=dtype)
        w = torch.randn(n, 64, device=device, dtype=dtype) / 8
        b = torch.randn(n, device=device, dtype=dtype)
        for save in (False, True):
            torch.library.opcheck(linear_act_fwd, (x, w, b, "relu", False, save))
            torch.library.opcheck(linear_act_fwd, (x, w, None, "relu", False, save))
        torch.library.opcheck(
            linear_act_fwd, (x.requires_grad_(), w.requires_grad_(), b, "relu", False, False)
        )
        x, w = x.detach(), w.detach()
        y = native(x, w, b)
        dy = torch.randn_like(y)
        for wt in (False, True):
            ww = w.t().contiguous() if wt else w
            torch.library.opcheck(linear_act_bwd, (dy, y, x, ww, True, "relu", wt, [True] * 3))
        mask = [True, False, False]
        torch.library.opcheck(linear_act_bwd, (dy, y, x, w, False, "relu", False, mask))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch.compiler.reset()
    model = nn.Sequential(fastlayers.FusedLinearReLU(32, 64), nn.Linear(64, 4)).to(device)
    compiled = torch.compile(model, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(6, 32, device=device, requires_grad=True)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
            g = torch.autograd.grad(out.sum(), [x, *model.parameters()])
            g_ref = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
            for a, b in zip(g, g_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_behaves_as_nn_linear(device):
    fused = fastlayers.FusedLinearReLU(64, 32, device=device)
    x = torch.randn(300, 64, device=device, requires_grad=True)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        y = fused(x)
        y_nat = native(x, fused.weight, fused.bias)
    assert y.dtype == y_nat.dtype == torch.bfloat16
    assert max_err(y, y_nat) <= 2 * FLOOR[torch.bfloat16] + 0.02 * y_nat.abs().max().item()
    (g,) = torch.autograd.grad(y.float().sum(), x)
    (g_nat,) = torch.autograd.grad(y_nat.float().sum(), x)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, g_nat, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(6, 8, device=device)
    with pytest.raises(RuntimeError, match="input must be float32, float64, float16 or bfloat16"):
        linear_relu(x.long(), w.long())
    with pytest.raises(RuntimeError, match="weight has dtype BFloat16 but input has dtype Float"):
        linear_relu(x, w.bfloat16())
    with pytest.raises(RuntimeError, match=r"bias must have shape \[6\]"):
        linear_relu(x, w, torch.randn(7, device=device))
    with pytest.raises(RuntimeError, match="in_features = 8"):
        linear_relu(torch.randn(4, 5, device=device), w)
    with pytest.raises(RuntimeError, match="saved has shape"):
        linear_act_bwd(x[:, :6], x[:2, :6], x, w, False, "relu", False, [True] * 3)
    with pytest.raises(ValueError, match="activation must be one of"):
        linear_act_path(x, w, activation="silu")
    with pytest.raises(RuntimeError, match="double backward"):
        xg = x.clone().requires_grad_()
        torch.autograd.grad(linear_relu(xg, w).pow(2).sum(), xg, create_graph=True)


# ---------------------------------------------------------------------------------------- CUDA

# (rows, in, out) on H100/H200: odd sizes take the fallback; with a bias, cuBLASLt's bias + ReLU
# below three waves of 128x128 tiles and the fused kernel from there (the last case); without
# one, the fused kernel (64x64 tiles for the second, 128x128 for the fourth) but for the third,
# whose tiles fill two waves to 61% (cuBLAS + pass).
CUDA_CASES = [
    (7, 33, 17),
    (64, 256, 512),
    (2048, 256, 1280),
    (3000, 136, 1160),
    (4096, 72, 1672),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w_nk", "w_kn"])
def test_cuda_matches_native_within_one_rounding(dtype, bias, transposed):
    """Fused (one rounding of relu(fp32 accumulator)) and fallback both agree with native to
    within one output rounding; the ReLU mask is native's wherever z is not within that rounding
    of zero."""
    sized_out = (fallback_rows(256, 512, dtype), 256, 512)  # the fallback for its size on sm90
    for m, k, n in [*CUDA_CASES, sized_out]:
        w = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        stored = w.t().contiguous() if transposed else w
        poison_allocator("cuda", 1 << 24)
        y = linear_relu(x, stored, b, weight_transposed=transposed)
        ref = native(x.double(), w.double(), None if b is None else b.double())
        y_nat = native(x, w, b)
        bound = 2 * max_err(y_nat, ref) + FLOOR[dtype]
        assert max_err(y, ref) <= bound, (m, k, n, linear_act_path(x, stored, b, activation="relu"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_path_choice_and_nan(dtype):
    k, n = 64, 2048
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    rows = (4096, fallback_rows(k, n, dtype))
    big, small = (torch.randn(m, k, device="cuda", dtype=dtype) for m in rows)
    path = linear_act_path(big, w, b, activation="relu")
    assert path == ("cutlass_sm90" if sm90_available("cuda") else path)
    assert linear_act_path(small, w, b, activation="relu").startswith("fallback: ")
    if sm90_available("cuda"):  # cuBLASLt's one-kernel bias + ReLU below three waves
        one_wave = torch.randn(512, k, device="cuda", dtype=dtype)  # 4 x 16 tiles of 128x128
        with_bias = linear_act_path(one_wave, w, b, activation="relu")
        assert with_bias.startswith("fallback: fewer than three waves of 128x128 output tiles")
        assert linear_act_path(one_wave, w, None, activation="relu") == "cutlass_sm90"
    for x in (big, small):  # both paths: a NaN input row stays NaN (cuBLASLt's epilogue too)
        x = x.clone()
        x[3, 5] = math.nan
        y = linear_relu(x, w, b)
        assert y[3].isnan().all() and not y[4].isnan().any()


@pytest.mark.cuda
def test_cuda_sm90_relu_epilogue_equals_relu_of_identity_epilogue():
    if not sm90_available("cuda"):
        pytest.skip("needs an sm_90 GPU and the CUTLASS kernels")
    m, k, n = 1000, 256, 384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    outs = []
    for epilogue in (2, 3):  # relu, identity (Activation values)
        y = torch.full((m, n), math.nan, device="cuda", dtype=torch.bfloat16)
        _C._testing.linear_act_sm90_raw(x, w, b, y, None, False, epilogue, -1)
        outs.append(y)
    # relu commutes with rounding to bfloat16: relu(round(z)) == round(relu(z))
    assert torch.equal(outs[0], torch.relu(outs[1]))


@pytest.mark.cuda
@pytest.mark.parametrize("m, n", [(512, 512), (2048, 1280)], ids=["fallback", "fused_size"])
def test_cuda_graph_capture(m, n):
    layer = fastlayers.FusedLinearReLU(256, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.autograd.grad(layer(x), [x, layer.weight, layer.bias], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
        gx, gw, gb = torch.autograd.grad(y, [x, layer.weight, layer.bias], dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    params = [t.detach().clone().requires_grad_() for t in (x, layer.weight, layer.bias)]
    y_ref = linear_relu(*params)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for g, g_ref in zip((gx, gw, gb), torch.autograd.grad(y_ref, params, dy), strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
