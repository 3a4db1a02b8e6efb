"""fastlayers.functional.rotary_embedding on CUDA against the models' own apply_rotary_pos_emb on
CUDA (transformers: llama, phi3, olmo2, cohere, modernbert): forward outputs and q/k gradients
bit for bit (torch.equal), outputs of native's dtype and strides, over dtype pairs, layouts
(transposed projection views, contiguous, slices of a fused qkv projection, misaligned), GQA,
head dims, sequence lengths, unsqueeze_dim=2; k alone in the loss, float64 (the composite),
inputs left unchanged, empty sequences, CUDA graphs. The CPU tests are in test_rotary.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from numerics import poison_allocator

from fastlayers.functional import rotary_embedding
from fastlayers.ops.rotary import CAST_BACK, INTERLEAVED, PARTIAL, UPCAST, UPCAST_EACH

pytestmark = pytest.mark.cuda

# family: (transformers module, form, rotary width as a fraction of the head dim)
FAMILIES = {
    "llama": ("llama", 0, 1),
    "phi3": ("phi3", PARTIAL, 1),
    "phi3_half": ("phi3", PARTIAL, 2),  # cos of width D/2: half the dims pass through
    "olmo2": ("olmo2", CAST_BACK, 1),
    "cohere": ("cohere", INTERLEAVED | UPCAST | CAST_BACK, 1),
    "modernbert": ("modernbert", UPCAST | UPCAST_EACH | CAST_BACK, 1),
    # no model's form (Cohere upcasts): interleaved pairs rounded per op in q's dtype, the packed
    # path's within-word pairs; its native is interleaved_native below
    "interleaved": (None, INTERLEAVED, 1),
}

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (F16, F32)]  # (q, cos)
PAIR_IDS = ["f32-f32", "bf16-bf16", "f16-f16", "bf16-f32", "f16-f32"]

# proj: transposed views of [B, S, H*D] projections; contiguous: [B, H, S, D]; qkv: slices of
# one fused [B, S, (H + 2 Hkv) * D] projection (not dense); offset: a projection's storage one
# element in (not 16-byte aligned: the element-pair path); bshd: [B, S, H, D] (unsqueeze_dim=2)
LAYOUTS = ["proj", "contiguous", "qkv", "offset"]


def interleaved_native(q, k, cos, sin, unsqueeze_dim=1):
    """rotary.h's sequence for the interleaved form without upcast, as ATen ops (each rounding to
    its result dtype): x * c + rotate(x) * s, rotate = stack([-x[..., 1::2], x[..., ::2]])."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def native_fn(family):
    module = FAMILIES[family][0]
    if module is None:
        return interleaved_native
    return importlib.import_module(
        f"transformers.models.{module}.modeling_{module}"
    ).apply_rotary_pos_emb


def make_leaves(layout, b, s, h, hkv, d, dtype):
    """Leaf tensors (random, never zeros) and a function building q and k from them (views, so
    each call reads the leaves in the layout under test)."""
    dev = "cuda"
    if layout == "qkv":
        leaves = [torch.randn(b, s, (h + 2 * hkv) * d, device=dev, dtype=dtype)]

        def views(qkv):
            q = qkv[..., : h * d].view(b, s, h, d).transpose(1, 2)
            k = qkv[..., h * d : (h + hkv) * d].view(b, s, hkv, d).transpose(1, 2)
            return q, k

        return leaves, views
    if layout == "contiguous":
        leaves = [torch.randn(b, n, s, d, device=dev, dtype=dtype) for n in (h, hkv)]
        return leaves, lambda q, k: (q, k)
    if layout == "bshd":
        leaves = [torch.randn(b, s, n, d, device=dev, dtype=dtype) for n in (h, hkv)]
        return leaves, lambda q, k: (q, k)
    if layout == "offset":
        leaves = [torch.randn(b * s * n * d + 1, device=dev, dtype=dtype) for n in (h, hkv)]

        def views(qf, kf):
            q = qf[1:].view(b, s, h, d).transpose(1, 2)
            k = kf[1:].view(b, s, hkv, d).transpose(1, 2)
            return q, k

        return leaves, views
    assert layout == "proj"
    leaves = [torch.randn(b, s, n * d, device=dev, dtype=dtype) for n in (h, hkv)]

    def views(qp, kp):
        return qp.view(b, s, h, d).transpose(1, 2), kp.view(b, s, hkv, d).transpose(1, 2)

    return leaves, views


def cos_sin(cos_batch, s, dr, dtype):
    """Random angles per element (cos[i] != cos[i + h], unlike a model's tables, so that a kernel
    mixing up the halves fails)."""
    angle = torch.rand(cos_batch, s, dr, device="cuda") * 200 - 100
    return angle.cos().to(dtype), angle.sin().to(dtype)


def run_both(
    family, leaves, views, cos, sin, unsqueeze_dim=1, use_q=True, use_k=True, grad_fn=None
):
    """Forward and backward (random grads of the outputs' dtype; grad_fn(*shape) makes them in
    that dtype where given) through native and ours, each on its own copy of the leaves; returns
    [(outputs, leaf grads)] for native, ours."""
    form = FAMILIES[family][1]
    native = native_fn(family)
    results = []
    grads = None
    for fn in (
        lambda q, k: native(q, k, cos, sin, unsqueeze_dim),
        lambda q, k: rotary_embedding(q, k, cos, sin, unsqueeze_dim, form),
    ):
        mine = [leaf.detach().clone().requires_grad_() for leaf in leaves]
        q, k = views(*mine)
        poison_allocator("cuda", 4 * sum(t.numel() * 4 for t in mine) + 4096)
        outs = fn(q, k)
        if grads is None:
            grads = [
                torch.randn_like(o) if grad_fn is None else grad_fn(*o.shape).to(o.dtype)
                for o in outs
            ]
        pairs = [(o, g) for o, g, use in zip(outs, grads, (use_q, use_k), strict=True) if use]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        results.append(([o.detach() for o in outs], [t.grad for t in mine]))
    return results


def assert_same(results, what, bitwise=False):
    """Outputs and grads equal to native's (bitwise: bit for bit, signed zeros included)."""
    same = same_bits if bitwise else torch.equal
    (n_out, n_grad), (o_out, o_grad) = results
    for name, n, o in zip(("q_out", "k_out"), n_out, o_out, strict=True):
        assert o.dtype == n.dtype, f"{what} {name}: dtype {o.dtype} != native {n.dtype}"
        assert o.shape == n.shape, f"{what} {name}: shape {tuple(o.shape)} != {tuple(n.shape)}"
        assert strides(o) == strides(n), f"{what} {name}: strides {o.stride()} != {n.stride()}"
        assert same(o, n), f"{what} {name}: {mismatch(o, n)}"
    for i, (n, o) in enumerate(zip(n_grad, o_grad, strict=True)):
        assert (n is None) == (o is None), f"{what} grad {i}: {o is None=} but native {n is None=}"
        if n is not None:
            assert o.dtype == n.dtype, f"{what} grad {i}: dtype {o.dtype} != {n.dtype}"
            assert same(o, n), f"{what} grad {i}: {mismatch(o, n)}"


def same_bits(o, n):
    """o and n of one 16-bit dtype hold the same bit patterns (torch.equal takes -0 == +0)."""
    return o.dtype == n.dtype and torch.equal(o.view(torch.int16), n.view(torch.int16))


def strides(t):
    """t's strides where they mean something (a size-1 dim's stride is arbitrary: empty_like
    keeps the input's, TensorIterator picks another)."""
    return [st for st, n in zip(t.stride(), t.shape, strict=True) if n > 1]


def mismatch(o, n):
    diff = (o.double() - n.double()).abs().nan_to_num(float("inf"))
    return f"{int((diff > 0).sum())} of {o.numel()} differ, max {diff.max().item():.3g}"


def check(family, dtypes, layout, cos_batch, b, s, h, hkv, d, **kw):
    q_dtype, cos_dtype = dtypes
    dr = d // FAMILIES[family][2]
    leaves, views = make_leaves(layout, b, s, h, hkv, d, q_dtype)
    cos, sin = cos_sin(b if cos_batch == "B" else 1, s, dr, cos_dtype)
    what = f"{family} {q_dtype}/{cos_dtype} {layout} cos[{cos_batch}] B{b} S{s} H{h}/{hkv} D{d}"
    assert_same(run_both(family, leaves, views, cos, sin, **kw), what)


# ----------------------------------------------------------------------------------------------
# Every form x dtype pair x layout


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cos_batch", ["1", "B"])
def test_forms_dtypes_layouts_equal_native(family, dtypes, layout, cos_batch):
    check(family, dtypes, layout, cos_batch, b=2, s=7, h=4, hkv=2, d=64)


# ----------------------------------------------------------------------------------------------
# Head dims (vector and element-pair paths), sequence lengths, GQA


@pytest.mark.parametrize("family", ["llama", "cohere", "phi3_half", "modernbert"])
@pytest.mark.parametrize("dtypes", [(BF16, BF16), (F16, F32)], ids=["bf16-bf16", "f16-f32"])
@pytest.mark.parametrize("d", [64, 128, 256, 80, 96, 8, 24])
@pytest.mark.parametrize("s", [1, 7, 1024])
@pytest.mark.parametrize("heads", [(32, 8), (4, 1)], ids=["32-8", "4-1"])
def test_head_dims_seq_lens_gqa_equal_native(family, dtypes, d, s, heads):
    h, hkv = heads
    b = 1 if s == 1024 else 2
    check(family, dtypes, "proj", "B", b=b, s=s, h=h, hkv=hkv, d=d)


@pytest.mark.parametrize("family", ["llama", "olmo2", "phi3_half", "interleaved", "cohere"])
@pytest.mark.parametrize("dtypes", [(BF16, BF16), (F16, F16)], ids=["bf16-bf16", "f16-f16"])
@pytest.mark.parametrize("d", [128, 64])
def test_wide_exponents_equal_native(family, dtypes, d):
    # q, k, cos, sin and the grads spread over many binades, so that sums of terms far apart in
    # magnitude, cancellations and subnormal results are rounded: the packed path's ops must round
    # as float32-then-the-dtype does, signed zeros included. The span keeps every product and
    # sum finite (NaN payloads are not compared).
    dtype = dtypes[0]
    span = 60 if dtype == BF16 else 5
    b, s, h, hkv = 2, 33, 8, 2
    dr = d // FAMILIES[family][2]

    def spread(*shape):
        t = torch.randn(*shape, device="cuda") * torch.exp2(
            torch.randint(-span, span + 1, shape, device="cuda").float()
        )
        return t.to(dtype)

    leaves = [spread(b, s, n * d) for n in (h, hkv)]
    cos, sin = spread(b, s, dr), spread(b, s, dr)

    def views(qp, kp):
        return qp.view(b, s, h, d).transpose(1, 2), kp.view(b, s, hkv, d).transpose(1, 2)

    results = run_both(family, leaves, views, cos, sin, grad_fn=spread)
    assert_same(results, f"{family} {dtype} D{d} wide exponents", bitwise=True)


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, F32)], ids=["f32-f32", "bf16-f32"])
def test_large_tensor_takes_the_grid_stride_loop(dtypes):
    # more units than the capped grid has threads, q and k each over several grid strides
    check("llama", dtypes, "proj", "1", b=4, s=4096, h=32, hkv=8, d=128)


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("cos_batch", ["1", "B"])
def test_unsqueeze_dim_2_bshd_equal_native(dtypes, cos_batch):
    check("llama", dtypes, "bshd", cos_batch, b=2, s=7, h=4, hkv=2, d=64, unsqueeze_dim=2)


# ----------------------------------------------------------------------------------------------
# The kernel path: one launch for q and k, forward and backward (the composite launches several)


def launches(fn):
    """(rotary kernels, all kernels) that fn() launches, read by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return (
        sum(e.count for e in kernels if "rotary_kernel" in e.key),
        sum(e.count for e in kernels),
    )


TAKES = (
    [(f, dt, "proj", 64) for f in FAMILIES for dt in [(BF16, BF16), (F16, F32)]]
    + [("llama", (F32, F32), layout, 64) for layout in ("contiguous", "qkv", "offset", "bshd")]
    + [(f, (BF16, BF16), "proj", d) for f in ("llama", "cohere") for d in (8, 24, 80, 256)]
)


@pytest.mark.parametrize(("family", "dtypes", "layout", "d"), TAKES, ids=str)
def test_kernel_takes_the_call_in_one_launch(family, dtypes, layout, d):
    form = FAMILIES[family][1]
    unsqueeze_dim = 2 if layout == "bshd" else 1
    leaves, views = make_leaves(layout, 2, 7, 4, 2, d, dtypes[0])
    leaves = [t.requires_grad_() for t in leaves]
    cos, sin = cos_sin(2, 7, d // FAMILIES[family][2], dtypes[1])
    q, k = views(*leaves)
    outs = []
    fwd = launches(lambda: outs.append(rotary_embedding(q, k, cos, sin, unsqueeze_dim, form)))
    assert fwd == (1, 1), f"forward: {fwd[0]} rotary kernels of {fwd[1]} kernels launched"
    grads = [torch.randn_like(o) for o in outs[0]]
    bwd = launches(lambda: torch.autograd.backward(outs[0], grads))
    assert bwd[0] == 1, f"backward: {bwd[0]} rotary kernels launched"


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (F32, BF16)], ids=str)
def test_composite_where_the_kernel_does_not_take(dtypes):
    leaves, views = make_leaves("proj", 2, 7, 4, 2, 64, dtypes[0])
    cos, sin = cos_sin(2, 7, 64, dtypes[1])
    assert launches(lambda: rotary_embedding(*views(*leaves), cos, sin))[0] == 0


# ----------------------------------------------------------------------------------------------
# One output in the loss, float64, inputs untouched, empty, CUDA graphs


@pytest.mark.parametrize("family", ["llama", "cohere", "modernbert", "phi3_half"])
@pytest.mark.parametrize("used", ["k", "q"])
def test_one_output_in_the_loss(family, used):
    # the other output's grad is absent: the backward gets one grad (None for the other)
    check(
        family,
        (BF16, F32),
        "proj",
        "B",
        b=2,
        s=7,
        h=4,
        hkv=2,
        d=64,
        use_q=used == "q",
        use_k=used == "k",
    )


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cos_dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_float64_runs_the_composite_equal_native(family, cos_dtype):
    check(family, (torch.float64, cos_dtype), "proj", "B", b=2, s=7, h=4, hkv=2, d=64)


@pytest.mark.parametrize("family", ["llama", "cohere"])
def test_float32_q_bfloat16_cos_runs_the_composite_equal_native(family):
    # a dtype pair the kernels do not take: the composite on the GPU, still native's bits
    check(family, (F32, BF16), "proj", "B", b=2, s=7, h=4, hkv=2, d=64)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", ["proj", "qkv"])
def test_inputs_are_not_modified(family, layout):
    form = FAMILIES[family][1]
    leaves, views = make_leaves(layout, 2, 7, 4, 2, 64, BF16)
    cos, sin = cos_sin(2, 7, 64 // FAMILIES[family][2], F32)
    before = [t.clone() for t in (*leaves, cos, sin)]
    q_out, _ = rotary_embedding(*views(*leaves), cos, sin, 1, form)
    torch.cuda.synchronize()
    for t, b in zip((*leaves, cos, sin), before, strict=True):
        assert torch.equal(t, b)
    assert q_out.data_ptr() not in {t.data_ptr() for t in leaves}


@pytest.mark.parametrize("family", ["llama", "cohere", "phi3_half"])
@pytest.mark.parametrize("dtypes", [(BF16, BF16), (BF16, F32), (F32, F32)], ids=str)
def test_empty_sequence(family, dtypes):
    check(family, dtypes, "proj", "B", b=2, s=0, h=4, hkv=2, d=64)


@pytest.mark.parametrize("family", ["llama", "cohere"])
def test_cuda_graph_capture_and_replay(family):
    form = FAMILIES[family][1]
    native = native_fn(family)
    b, s, h, hkv, d = 2, 33, 8, 2, 128
    qp = torch.randn(b, s, h * d, device="cuda", dtype=BF16, requires_grad=True)
    kp = torch.randn(b, s, hkv * d, device="cuda", dtype=BF16, requires_grad=True)
    cos, sin = cos_sin(b, s, d, BF16)
    gq = torch.randn(b, h, s, d, device="cuda", dtype=BF16)
    gk = torch.randn(b, hkv, s, d, device="cuda", dtype=BF16)

    def step(fn):
        q = qp.view(b, s, h, d).transpose(1, 2)
        k = kp.view(b, s, hkv, d).transpose(1, 2)
        q_out, k_out = fn(q, k)
        dq, dk = torch.autograd.grad((q_out, k_out), (qp, kp), (gq, gk))
        return q_out, k_out, dq, dk

    def ours(q, k):
        return rotary_embedding(q, k, cos, sin, 1, form)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(ours)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(ours)
    with torch.no_grad():
        for t in (qp, kp, cos, sin, gq, gk):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    expected = step(lambda q, k: native(q, k, cos, sin))
    for name, c, e in zip(("q_out", "k_out", "dq", "dk"), captured, expected, strict=True):
        assert torch.equal(c, e), f"{name}: {mismatch(c, e)}"
