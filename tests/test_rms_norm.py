"""fastlayers.RMSNorm and fastlayers.functional.rms_norm: each model's RMSNorm (torch.nn.RMSNorm,
HuggingFace LLaMA/Qwen3, T5, Gemma, OLMo2) recognised by what its forward computes, reproduced bit
for bit on CPU and within the bound on CUDA, forward and backward; API parity, errors, compile,
torch.func, opcheck."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from numerics import DEVICES, assert_close_to_reference, poison_allocator
from tiny_models import DECODER
from torch import nn

import fastlayers
from fastlayers.functional import rms_norm
from fastlayers.layers import RMSNorm, recognise_rms_norm

transformers = pytest.importorskip("transformers")
from transformers.models.cohere.modeling_cohere import CohereLayerNorm  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402

# (name, builder(hidden), expected form, eps attribute, weight offset)
NORMS = [
    ("nn", lambda h: nn.RMSNorm(h, eps=1e-6), "torch", "eps", 0.0),
    ("nn_eps_none", lambda h: nn.RMSNorm(h), "torch", "eps", 0.0),
    ("llama", lambda h: LlamaRMSNorm(h, eps=1e-6), "cast_first", "variance_epsilon", 0.0),
    ("qwen3", lambda h: Qwen3RMSNorm(h, eps=1e-6), "cast_first", "variance_epsilon", 0.0),
    ("t5", lambda h: T5LayerNorm(h, eps=1e-6), "t5", "variance_epsilon", 0.0),
    ("gemma", lambda h: GemmaRMSNorm(h, eps=1e-6), "gemma", "eps", 1.0),
    ("olmo2", lambda h: Olmo2RMSNorm(h, eps=1e-6), "float32", "variance_epsilon", 0.0),
]
NORM_IDS = [n[0] for n in NORMS]
# (input dtype, weight dtype) pairings the models run: same dtype, float32 master weights, and
# the casts' corner cases
PAIRINGS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
]
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRINGS]


def make(builder, hidden, w_dtype, device):
    m = builder(hidden).to(device=device, dtype=w_dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn_like(m.weight) * 0.5 + 1.0)
    return m


def reference(x: torch.Tensor, m: nn.Module, eps_attr: str, offset: float) -> torch.Tensor:
    """The RMSNorm in float64 (no intermediate roundings), differentiable."""
    eps = getattr(m, eps_attr)
    if eps is None:
        eps = torch.finfo(torch.float32).eps
    x64 = x.double()
    w64 = m.weight.double() + offset
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


# ----------------------------------------------------------------------------------------------
# Recognition and API


@pytest.mark.parametrize("name,builder,form,eps_attr,offset", NORMS, ids=NORM_IDS)
def test_each_model_norm_is_recognised_in_its_form(name, builder, form, eps_attr, offset):
    assert recognise_rms_norm(builder(32))[:2] == (form, eps_attr)


class _PlusOne(LlamaRMSNorm):
    def forward(self, hidden_states):
        return super().forward(hidden_states) + 1


class _OwnEps(LlamaRMSNorm):
    def forward(self, hidden_states):  # a constant, not the attribute
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-2)
        return self.weight * h.to(hidden_states.dtype)


class _CastLast(LlamaRMSNorm):  # a rounding order none of the forms has: half weight product
    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.to(hidden_states.dtype) * h.to(hidden_states.dtype)).to(torch.float16)


@pytest.mark.parametrize("cls", [_PlusOne, _OwnEps, _CastLast, CohereLayerNorm])
def test_modules_computing_otherwise_are_refused_with_the_reason(cls):
    form, _, why = recognise_rms_norm(cls(32))
    assert form is None and "does not compute an RMSNorm form" in why
    with pytest.raises(TypeError, match="does not compute"):
        RMSNorm.from_native(cls(32))


def test_not_shaped_like_an_rms_norm():
    form, _, why = recognise_rms_norm(nn.LayerNorm(8))
    assert form is None and "not shaped like an RMSNorm" in why


def test_signature_and_defaults_match_nn_rms_norm():
    ours = inspect.signature(fastlayers.RMSNorm.__init__)
    native = inspect.signature(nn.RMSNorm.__init__)
    assert list(ours.parameters) == list(native.parameters)
    for name, p in native.parameters.items():
        assert ours.parameters[name].default == p.default, name


@pytest.mark.parametrize("affine", [True, False])
def test_constructed_directly_like_nn_rms_norm(affine):
    ours, native = (
        fastlayers.RMSNorm([3, 8], elementwise_affine=affine),
        nn.RMSNorm([3, 8], elementwise_affine=affine),
    )
    assert ours.state_dict().keys() == native.state_dict().keys()
    assert ours.form == "torch" and isinstance(ours, nn.RMSNorm)
    if affine:
        native.weight.data.normal_()
        ours.load_state_dict(native.state_dict())
    x = torch.randn(2, 5, 3, 8)
    assert torch.equal(ours(x), native(x))


def test_from_native_shares_the_weight_and_keeps_the_eps_attribute():
    native = LlamaRMSNorm(16, eps=1e-5)
    fused = RMSNorm.from_native(native)
    assert fused.weight is native.weight
    assert fused.variance_epsilon == 1e-5 and "variance_epsilon=1e-05" in repr(fused)
    assert fused.state_dict().keys() == native.state_dict().keys()
    fused.variance_epsilon = 0.5  # read on every call
    x = torch.randn(3, 16)
    native.variance_epsilon = 0.5
    assert torch.equal(fused(x), native(x))
    with pytest.raises(TypeError, match="unpatch puts the model's own module back"):
        fused.to_native()
    back = RMSNorm.from_native(nn.RMSNorm(16)).to_native()
    assert type(back) is nn.RMSNorm


def test_meta_device():
    layer = fastlayers.RMSNorm(64, device="meta")
    y = layer(torch.empty(2, 64, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 64)


# ----------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("x_dtype,w_dtype", PAIRINGS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,builder,form,eps_attr,offset", NORMS, ids=NORM_IDS)
def test_cpu_forward_is_bit_identical_and_backward_within_bound(
    name, builder, form, eps_attr, offset, x_dtype, w_dtype
):
    native = make(builder, 96, w_dtype, "cpu")
    fused = RMSNorm.from_native(native)
    x = torch.randn(4, 7, 96, dtype=x_dtype) * 3
    xn, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yn, yf = native(xn), fused(xf)
    assert yf.dtype == yn.dtype and torch.equal(yf, yn), name
    _check_backward(native, fused, xn, xf, yn, yf, eps_attr, offset, x_dtype)


def _check_backward(native, fused, xn, xf, yn, yf, eps_attr, offset, x_dtype):
    g = torch.randn_like(yn)
    gn = torch.autograd.grad(yn, (xn, native.weight), g)
    gf = torch.autograd.grad(yf, (xf, fused.weight), g)
    x64 = xn.detach().double().requires_grad_()
    w64 = native.weight.detach().double().requires_grad_()
    eps = getattr(native, eps_attr) or torch.finfo(torch.float32).eps
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (w64 + offset)
    rx, rw = torch.autograd.grad(ref, (x64, w64), g.double())
    assert_close_to_reference(gf[0], gn[0], rx, x_dtype, "dx")
    # the weight's gradient sums over rows: the bound scales with the native error
    assert_close_to_reference(gf[1], gn[1], rw, native.weight.dtype, "dweight")


@pytest.mark.parametrize("cols", [1, 7, 4097])
def test_cpu_odd_sizes_and_empty(cols):
    native = make(lambda h: LlamaRMSNorm(h), cols, torch.bfloat16, "cpu")
    fused = RMSNorm.from_native(native)
    for rows in (0, 3):
        x = torch.randn(rows, cols, dtype=torch.bfloat16)
        assert torch.equal(fused(x), native(x))


def test_non_contiguous_input():
    native = make(lambda h: GemmaRMSNorm(h), 32, torch.float32, "cpu")
    fused = RMSNorm.from_native(native)
    x = torch.randn(32, 6, dtype=torch.bfloat16).t()
    assert torch.equal(fused(x), native(x))


# ----------------------------------------------------------------------------------------------
# Errors


def test_bad_inputs_name_the_argument():
    w = torch.randn(8)
    with pytest.raises(RuntimeError, match="does not end with normalized_shape"):
        rms_norm(torch.randn(2, 9), 8, w)
    with pytest.raises(RuntimeError, match="weight has shape"):
        rms_norm(torch.randn(2, 8), 8, torch.randn(9))
    with pytest.raises(RuntimeError, match="input must be float32"):
        rms_norm(torch.randint(0, 3, (2, 8)), 8, w)
    with pytest.raises(RuntimeError, match="needs a weight"):
        rms_norm(torch.randn(2, 8), 8, None, 1e-6, "gemma")
    with pytest.raises(ValueError, match="form must be one of"):
        rms_norm(torch.randn(2, 8), 8, w, 1e-6, "llama4")
    with pytest.raises(RuntimeError, match="form must be 0"):
        torch.ops.fastlayers.rms_norm_fwd(torch.randn(2, 8), [8], w, 1e-6, 9)


@pytest.mark.parametrize("form", ["torch", "cast_first", "t5", "gemma", "float32"])
def test_opcheck(form):
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, dtype=torch.float32, requires_grad=True)
    code = fastlayers.ops.rms_norm.FORMS[form]
    torch.library.opcheck(torch.ops.fastlayers.rms_norm_fwd, (x, [16], w, 1e-6, code))
    y, rstd = torch.ops.fastlayers.rms_norm_fwd(x, [16], w, 1e-6, code)
    torch.library.opcheck(
        torch.ops.fastlayers.rms_norm_bwd,
        (torch.randn_like(y), x.detach(), rstd, [16], w.detach(), code, [True, True]),
    )


# ----------------------------------------------------------------------------------------------
# Compile and torch.func


@pytest.mark.parametrize("mode", ["inductor", "fused"])
def test_torch_compile_fullgraph_cpu(mode):
    native = make(lambda h: LlamaRMSNorm(h), 64, torch.float32, "cpu")
    fused = RMSNorm.from_native(native)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with fastlayers.config.compile_rms_norm_as(mode):
        torch._dynamo.reset()
        out = torch.compile(fused, fullgraph=True)(x)
    expected = native(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_torch_func_routes_to_the_composite():
    native = make(lambda h: T5LayerNorm(h), 16, torch.float32, "cpu")
    fused = RMSNorm.from_native(native)
    x = torch.randn(3, 16)
    gf = torch.func.vmap(torch.func.grad(lambda r: fused(r).sum()))(x)
    gn = torch.func.vmap(torch.func.grad(lambda r: native(r).sum()))(x)
    assert torch.equal(gf, gn)


# ----------------------------------------------------------------------------------------------
# The patcher


def _tiny_llama():
    cfg = transformers.LlamaConfig(**DECODER)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_patch_swaps_llama_norms_exactly_and_unpatch_restores():
    model = _tiny_llama()
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    report = fastlayers.patch(model, layers=("rms_norm",))
    assert report.counts() == {"rms_norm": 5}
    assert type(model.model.norm) is RMSNorm and model.model.norm.form == "cast_first"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    model.model.norm.variance_epsilon = 1e-3  # a setting changed after the patch
    fastlayers.unpatch(model)
    assert type(model.model.norm) is LlamaRMSNorm and model.model.norm.variance_epsilon == 1e-3


def test_patch_reports_a_norm_it_cannot_reproduce():
    model = nn.Sequential(nn.Linear(8, 8), CohereLayerNorm(8))
    report = fastlayers.patch(model, layers=("rms_norm",))
    assert report.counts() == {}
    assert any(s.rule == "rms_norm" and "does not compute" in s.reason for s in report.skips)


# ----------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape", [(3, 1), (5, 7), (64, 768), (33, 4096), (4, 4097), (2, 8192), (0, 64)]
)
@pytest.mark.parametrize("x_dtype,w_dtype", PAIRINGS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,builder,form,eps_attr,offset", NORMS, ids=NORM_IDS)
def test_cuda_forward_and_backward_within_bound(
    name, builder, form, eps_attr, offset, x_dtype, w_dtype, shape
):
    native = make(builder, shape[-1], w_dtype, "cuda")
    _check_cuda_rms_norm(
        name, native, eps_attr, offset, torch.randn(*shape, dtype=x_dtype, device="cuda") * 3
    )


def _check_cuda_rms_norm(name, native, eps_attr, offset, x):
    """RMSNorm.from_native(native) on x against native: the output dtype, the output within the
    bound of a float64 reference, and (for a non-empty x) the backward (_check_backward)."""
    fused = RMSNorm.from_native(native)
    xn, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yn = native(xn)
    poison_allocator("cuda", 4 * x.numel() * 4 + 4096)
    yf = fused(xf)
    assert yf.dtype == yn.dtype
    ref = reference(x, native, eps_attr, offset)
    assert_close_to_reference(yf, yn, ref, yn.dtype, f"{name} forward")
    if x.numel():
        _check_backward(native, fused, xn, xf, yn, yf, eps_attr, offset, x.dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add_rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cols", [64, 768, 2048, 8192])
@pytest.mark.parametrize(
    "name,builder,form,eps_attr,offset", [NORMS[2], NORMS[5]], ids=["llama", "gemma"]
)
def test_cuda_backward_many_row_groups_per_block(
    name, builder, form, eps_attr, offset, cols, dtype, add
):
    """Enough rows that each block of the persistent backward sums several row groups into its
    dweight partial (the shapes above give each block one): 64 and 768 columns run blocks of 4
    and 2 rows, 2,048 and 8,192 blocks of one."""
    rows = 20000 if cols <= 768 else 6000
    native = make(builder, cols, dtype, "cuda")
    x = torch.randn(rows, cols, dtype=dtype, device="cuda") * 2
    if add:
        _check_add_rms_norm(name, native, form, eps_attr, offset, x, torch.randn_like(x) * 3)
    else:
        _check_cuda_rms_norm(name, native, eps_attr, offset, x)


@pytest.mark.cuda
def test_cuda_non_contiguous_and_nn_rms_norm_autocast():
    native = make(lambda h: nn.RMSNorm(h, eps=1e-6), 256, torch.float32, "cuda")
    fused = RMSNorm.from_native(native)
    x = torch.randn(256, 40, device="cuda", dtype=torch.bfloat16).t()
    ref = reference(x, native, "eps", 0.0)
    assert_close_to_reference(fused(x), native(x), ref, torch.bfloat16, "non-contiguous")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yn, yf = native(x), fused(x)
    assert yf.dtype == yn.dtype  # float32 where this torch's autocast lists rms_norm
    assert_close_to_reference(yf, yn, ref, yn.dtype, "autocast")


@pytest.mark.cuda
def test_cuda_graph_capture():
    native = make(lambda h: LlamaRMSNorm(h), 2048, torch.bfloat16, "cuda")
    fused = RMSNorm.from_native(native)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    fused(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused(x))


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [768, 2048, 4096, 8192, 16384, 4097])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add_rms"])
def test_cuda_cast_first_output_rounds_as_llama_from_its_rstd(add, dtype, cols):
    # LLaMA's form in one 16-bit dtype: y = (x.float() * rstd).to(dtype) * w, each op rounded
    # (and s = residual + x), bit for bit given the kernel's own rstd, at widths of the packed
    # output pass (768-4096) and of the float one (8192+, 4097); values spread over many binades
    # so that the packed ops' roundings (sum, product) are exercised
    span = 40 if dtype == torch.bfloat16 else 6

    def spread(*shape):
        e = torch.randint(-span, span + 1, shape, device="cuda").float()
        return (torch.randn(*shape, device="cuda") * torch.exp2(e)).to(dtype)

    x, w = spread(67, cols), spread(cols)
    x[:, :3] = 0.0  # zero products of either sign
    x[:, 3:5] = -0.0
    w[1::7] = -0.0  # native multiplies by w itself: -0 weights give zeros of the other sign
    w[2::7] = 0.0
    code = fastlayers.ops.rms_norm.FORMS["cast_first"]
    poison_allocator("cuda", 8 * x.numel() * 4 + 4096)
    if add:
        residual = spread(67, cols)
        y, s, rstd = torch.ops.fastlayers.add_rms_norm_fwd(x, residual, [cols], w, 1e-6, code)
        assert torch.equal(s, residual + x)
    else:
        y, rstd = torch.ops.fastlayers.rms_norm_fwd(x, [cols], w, 1e-6, code)
        s = x
    expected = (s.float() * rstd.unsqueeze(-1)).to(dtype) * w
    assert y.dtype == dtype
    bits, want = y.view(torch.int16), expected.view(torch.int16)  # signed zeros included
    assert torch.equal(bits, want), f"{int((bits != want).sum())} of {y.numel()} differ"


@pytest.mark.parametrize("device", DEVICES)
def test_patched_tiny_llama_generates_the_same_tokens(device):
    model = _tiny_llama().to(device)
    ids = torch.randint(0, 100, (2, 5), device=device)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kw)
    fastlayers.patch(model)
    assert torch.equal(model.generate(ids, **kw), expected)


# ----------------------------------------------------------------------------------------------
# Residual add + RMSNorm: the op and rule residual_rms_norm

from fastlayers.functional import add_rms_norm  # noqa: E402


def _native_add_norm(native, x, residual):
    s = residual + x
    return native(s), s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,w_dtype", PAIRINGS, ids=PAIR_IDS)
@pytest.mark.parametrize("name,builder,form,eps_attr,offset", NORMS, ids=NORM_IDS)
def test_add_rms_norm_matches_native(
    name, builder, form, eps_attr, offset, x_dtype, w_dtype, device
):
    native = make(builder, 256, w_dtype, device)
    x = torch.randn(4, 9, 256, dtype=x_dtype, device=device) * 2
    _check_add_rms_norm(name, native, form, eps_attr, offset, x, torch.randn_like(x) * 3)


def _check_add_rms_norm(name, native, form, eps_attr, offset, x, residual):
    """add_rms_norm(x, residual) against native's residual + x then norm: the sum bit for bit,
    the output bit for bit on CPU and within the bound on CUDA, and the gradients of x, residual
    and the weight within the bound of a float64 reference."""
    device, x_dtype, cols = x.device.type, x.dtype, x.shape[-1]
    leaves = [t.clone().requires_grad_() for t in (x, residual, x, residual)]
    yn, sn = _native_add_norm(native, leaves[0], leaves[1])
    eps = getattr(native, eps_attr)
    poison_allocator(device, 8 * x.numel() * 4 + 4096)
    yf, sf = add_rms_norm(leaves[2], leaves[3], cols, native.weight, eps, form)
    assert yf.dtype == yn.dtype and torch.equal(sf, sn)
    if device == "cpu":
        assert torch.equal(yf, yn)
    else:
        ref = reference(sn.detach(), native, eps_attr, offset)
        assert_close_to_reference(yf, yn, ref, yn.dtype, f"{name} add + norm")
    gy, gs = torch.randn_like(yn), torch.randn_like(sn)
    gn = torch.autograd.grad((yn, sn), (leaves[0], leaves[1], native.weight), (gy, gs))
    gf = torch.autograd.grad((yf, sf), (leaves[2], leaves[3], native.weight), (gy, gs))
    s64 = sn.detach().double().requires_grad_()
    w64 = native.weight.detach().double().requires_grad_()
    e = eps or torch.finfo(torch.float32).eps
    ref = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + e) * (w64 + offset)
    rs, rw = torch.autograd.grad(ref, (s64, w64), gy.double())
    rs = rs + gs.double()
    assert_close_to_reference(gf[0], gn[0], rs, x_dtype, "dx")
    assert_close_to_reference(gf[1], gn[1], rs, x_dtype, "dresidual")
    assert_close_to_reference(gf[2], gn[2], rw, native.weight.dtype, "dweight")


def test_add_rms_norm_opcheck_and_errors():
    x = torch.randn(3, 16, requires_grad=True)
    r = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    torch.library.opcheck(torch.ops.fastlayers.add_rms_norm_fwd, (x, r, [16], w, 1e-6, 1))
    with pytest.raises(RuntimeError, match="residual has shape"):
        add_rms_norm(x, torch.randn(3, 15), 16, w)


def test_rule_fuses_the_decoder_layers_residual_add_and_keeps_the_sum():
    model = _tiny_llama()
    model.train()
    native = copy.deepcopy(model)
    report = fastlayers.patch(model, layers=("residual_rms_norm",))
    assert report.counts() == {"residual_rms_norm": 2}
    assert [s.fused for s in report.swaps] == ["add_rms_norm (prenorm)"] * 2
    ids = torch.randint(0, 100, (2, 9))
    out = model(ids, labels=ids)
    ref = native(ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)
    out.loss.backward()
    ref.loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), native.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("device", DEVICES)
def test_rule_fuses_under_autocast_where_the_sum_promotes(monkeypatch, device):
    """fp32 weights under bf16 autocast: the attention's bf16 output is added to the float32
    residual. The fused op takes the promoted sum (the bf16 operand converted first, exactly):
    on CPU logits, loss and gradients equal native's bit for bit; on CUDA within the bounds of
    the float32 kernel against the native float32 sequence."""
    import fastlayers.patching.rules.residual_rms_norm as rule

    model = _tiny_llama().to(device)
    model.train()
    native = copy.deepcopy(model)
    fastlayers.patch(model, layers=("residual_rms_norm",))
    calls = []
    fused = rule.add_rms_norm_forward
    monkeypatch.setattr(
        rule, "add_rms_norm_forward", lambda *a: calls.append(a[0].dtype) or fused(*a)
    )
    ids = torch.randint(0, 100, (2, 9), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "computes add + RMSNorm natively"
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(ids, labels=ids)
            ref = native(ids, labels=ids)
        out.loss.backward()
    ref.loss.backward()
    assert calls == [torch.float32] * 2
    if device == "cpu":
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    else:  # bf16 projections downstream of a float32 norm an ulp apart
        torch.testing.assert_close(out.logits, ref.logits, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-3, atol=1e-3)
    for (n, p), (_, q) in zip(model.named_parameters(), native.named_parameters(), strict=True):
        tol = {"rtol": 1e-4, "atol": 1e-6} if device == "cpu" else {"rtol": 5e-2, "atol": 5e-3}
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=n)
        assert p.grad.dtype == q.grad.dtype, n


class _UsedBefore(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(8)

    def forward(self, x, r):
        s = r + x
        t = s * 2  # the sum used before the norm
        return self.norm(s) + t


def test_rule_skips_a_sum_used_before_the_norm():
    report = fastlayers.patch(nn.Sequential(_UsedBefore()), layers=("residual_rms_norm",))
    assert report.counts() == {}
    assert any("used before the RMSNorm" in s.reason for s in report.skips)
