"""CUDA kernels of fastlayers.dropout_add_layer_norm
(csrc/dropout_add_layer_norm/dropout_add_layer_norm_cuda.cu).

The mask is checked against an independent Python Philox4x32-10 (checked itself against
Random123's known-answer vectors) applied to the rng_state the op returns: element e of a call
is kept iff word e % 4 of Philox(seed, counter = (offset / 4, e / 4)) is below the threshold
(csrc/common/philox.h). Forward and backward are then checked against native PyTorch and float64
references built with that mask (tests/numerics.py: the DESIGN.md rule), over widths that hit
every kernel path: the register-resident fast path at several threads-per-row configurations,
the generic path (odd widths, unaligned pointers, rows too wide for registers) and the float64
path. The ops are called directly (torch.ops.fastlayers.*) so that each kernel is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_to_reference, poison_allocator

import fastlayers  # noqa: F401  (loads the extension: registers torch.ops.fastlayers)

FWD = torch.ops.fastlayers.dropout_add_layer_norm_fwd
BWD = torch.ops.fastlayers.dropout_add_layer_norm_bwd

f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
# (x dtype, residual dtype): the five kernel pairs (X, S).
PAIRS = [(f32, f32), (f16, f16), (bf16, bf16), (f16, f32), (bf16, f32)]
PAIR_IDS = ["f32", "f16", "bf16", "f16+f32", "bf16+f32"]
# Widths: fast path at several threads-per-row / vectors-per-thread configurations (16-byte
# vectors of 8 elements for half x, 4 for float32), just past the TPR boundaries, and widths
# whose rows no longer fit in registers (the backward first, then the forward); 12288 and
# 16384 run 512 threads x 4 vectors for 16-bit sums (16392: 512 x 8).
FAST_COLS = [8, 264, 520, 768, 1024, 1032, 2056, 4096, 8200, 12288, 16384, 16392]
# Generic path: odd widths, a width that is a multiple of 4 but not 8 (fast for float32 x only).
GENERIC_COLS = [7, 1001, 4097, 4100]
WIDE_COLS = [20480, 40960]

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def philox4x32_10(key, counter):
    """Random123's Philox4x32-10: key (k0, k1) scalars, counter (c0, c1, c2, c3) uint32 arrays;
    returns the 4 output words as a uint32 array of shape (n, 4). Written from the paper
    (Salmon et al., SC 2011), not from csrc/common/philox.h."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32 for c in counter)
    k0, k1 = np.uint64(key[0]) & _M32, np.uint64(key[1]) & _M32
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _M32, (p0 >> _S32) ^ c3 ^ k1, p0 & _M32
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def keep_threshold(p: float) -> int:
    keep = (1.0 - p) * 4294967296.0
    if keep <= 0.0:
        return 0
    if keep >= 4294967295.0:
        return 0xFFFFFFFF
    return int(keep)


def philox_mask(rng_state: torch.Tensor, n: int, p: float, start: int = 0) -> torch.Tensor:
    """Keep mask of elements start .. start + n - 1 of a call whose rng_state is (seed, offset)."""
    seed, offset = (int(v) % 2**64 for v in rng_state.cpu().tolist())
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    g0, g1 = start // 4, (start + n - 1) // 4 + 1
    groups = np.arange(g0, g1, dtype=np.uint64)
    lo = np.uint64(offset // 4)
    words = philox4x32_10(
        (seed & 0xFFFFFFFF, seed >> 32), (lo & _M32, lo >> _S32, groups & _M32, groups >> _S32)
    ).reshape(-1)
    w = words[start - 4 * g0 : start - 4 * g0 + n]
    return torch.from_numpy(w < keep_threshold(p))


def scale_of(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def dropped(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """round_X(kept ? x / (1 - p) : 0) as the op defines it: for float32/half/bf16 the product
    of x and the float32 1 / (1 - p) in float32, rounded to x's dtype."""
    if x.dtype == f64:
        return torch.where(mask, x * scale_of(p), torch.zeros_like(x))
    prod = (x.float() * torch.tensor(scale_of(p), dtype=f32, device=x.device)).to(x.dtype)
    return torch.where(mask, prod, torch.zeros_like(x))


def make_inputs(shape, x_dtype, r_dtype, ncols_dims=1, params="same", device="cuda"):
    """x, residual (None if r_dtype is None), weight, bias of the normalized shape."""
    x = torch.randn(shape, device=device, dtype=x_dtype)
    r = None if r_dtype is None else torch.randn(shape, device=device, dtype=r_dtype)
    s_dtype = x_dtype if r is None else torch.promote_types(x_dtype, r_dtype)
    norm = tuple(shape[len(shape) - ncols_dims :])
    p_dtype = {"same": s_dtype, "float": f32 if s_dtype != f64 else f64}.get(params)
    w = b = None
    if params in ("same", "float"):
        w = torch.randn(norm, device=device, dtype=p_dtype)
        b = torch.randn(norm, device=device, dtype=p_dtype)
    elif params == "weight":
        w = torch.randn(norm, device=device, dtype=s_dtype)
    return x, r, list(norm), w, b


def fwd(x, r, norm, w, b, p, *, training=True, store_sum=True, out_dtype=None, eps=1e-5):
    return FWD(x, r, norm, w, b, eps, p, training, store_sum, out_dtype)


def native_sum(x, r, mask, p):
    d = dropped(x, mask, p)
    return d if r is None else d + r


def native_scale(dtype: torch.dtype, p: float) -> float:
    """1 / (1 - p) as a Python float that ATen multiplies x by in the dtype's compute type:
    float32-rounded for float32/half/bf16 x (so x * scale is the op's float32 product)."""
    return scale_of(p) if dtype == f64 else float(np.float32(scale_of(p)))


def references(x, r, norm, w, b, mask, p, eps=1e-5, out_dtype=None, gy=None, gs=None):
    """(native, float64 reference) dicts of y, s and, when gy is given, the gradients gx, gr,
    gw, gb of x, residual, weight and bias (y's gradient gy; s's gradient gs, or none). Native:
    where(mask, x * scale, 0) + residual then F.layer_norm in the inputs' dtypes (out_dtype:
    layer_norm on s and the parameters cast to it, as autocast runs it); reference: the same
    on float64 copies."""
    out = []
    for ref in (False, True):

        def cast(t, ref=ref):
            return None if t is None else (t.detach().double() if ref else t.detach())

        xi, ri, wi, bi = (cast(t) for t in (x, r, w, b))
        leaves = [t for t in (xi, ri, wi, bi) if t is not None]
        if gy is not None:
            for t in leaves:
                t.requires_grad_(True)
        d = torch.where(mask, xi * native_scale(xi.dtype, p), torch.zeros_like(xi))
        s = d if ri is None else d + ri
        s_ln, wi_ln, bi_ln = s, wi, bi
        if not ref:
            # Native's own error in the dtype it computes in: layer_norm on s in out_dtype (as
            # autocast runs it), parameters in that dtype (native CUDA refuses float32
            # parameters with a half input, which the op accepts; as tests/test_layer_norm.py).
            s_ln = s if out_dtype is None else s.to(out_dtype)
            wi_ln = None if wi is None else wi.to(s_ln.dtype)
            bi_ln = None if bi is None else bi.to(s_ln.dtype)
        y = F.layer_norm(s_ln, norm, wi_ln, bi_ln, eps)
        res = {"y": y.detach(), "s": s.detach()}
        if gy is not None:
            outs, grads = [y], [cast(gy)]
            if gs is not None:
                outs.append(s)
                grads.append(cast(gs))
            g = torch.autograd.grad(outs, leaves, grads)
            names = [n for n, t in zip("xrwb", (xi, ri, wi, bi), strict=True) if t is not None]
            res.update({"g" + n: gi for n, gi in zip(names, g, strict=True)})
        out.append(res)
    return out


def check_mask_from_sum(s, x, r, rng_state, p):
    """The mask the kernel drew equals the Python Philox mask of rng_state: s is bit-identical
    to the native sum built with that mask."""
    mask = philox_mask(rng_state, x.numel(), p).to(x.device).view(x.shape)
    expected = native_sum(x, r, mask, p)
    assert s.dtype == expected.dtype
    assert torch.equal(s, expected), "sum differs from the native sum with the Python mask"
    return mask


# ----------------------------------------------------------------------------------------------
# The Python Philox itself (runs everywhere)


@pytest.mark.parametrize(
    "key,counter,expected",
    [
        ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        (
            (0xFFFFFFFF, 0xFFFFFFFF),
            (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
            (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
        ),
        (
            (0xA4093822, 0x299F31D0),
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_python_philox_matches_random123_known_answers(key, counter, expected):
    words = philox4x32_10(key, [np.array([c], dtype=np.uint64) for c in counter])
    assert tuple(int(w) for w in words[0]) == expected


# ----------------------------------------------------------------------------------------------
# Mask


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [8, 768, 1024, 4096, 7, 4097, 4100, 40960])
@pytest.mark.parametrize("x_dtype", [f32, f16, bf16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_matches_python_philox(cols, x_dtype, p):
    x = torch.ones(3, cols, device="cuda", dtype=x_dtype)
    _, s, _, _, rng = fwd(x, None, [cols], None, None, p)
    assert rng.dtype == torch.int64 and rng.shape == (2,) and rng.device == x.device
    mask = philox_mask(rng, x.numel(), p).cuda().view(x.shape)
    assert torch.equal(s != 0, mask)
    assert torch.equal(s, dropped(x, mask, p))


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_one_minus_p(p):
    x = torch.ones(512, 4096, device="cuda", dtype=f16)
    _, s, _, _, _ = fwd(x, None, [4096], None, None, p)
    kept = (s != 0).double().mean().item()
    n = x.numel()
    assert abs(kept - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5 + 1e-9


@pytest.mark.cuda
def test_each_call_takes_a_fresh_philox_offset_of_the_cuda_generator():
    x = torch.randn(4, 1024, device="cuda", dtype=f16)
    torch.cuda.manual_seed(1234)
    rng1 = fwd(x, None, [1024], None, None, 0.5)[4].cpu()
    rng2 = fwd(x, None, [1024], None, None, 0.5)[4].cpu()
    assert rng1[0] == rng2[0], "same generator seed"
    assert int(rng2[1]) - int(rng1[1]) == 4, "one Philox counter per 4 elements: offset += 4"
    gen = torch.cuda.default_generators[x.device.index]
    assert int(rng1[0]) % 2**64 == gen.initial_seed() % 2**64


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 4097])
def test_cpu_backward_regenerates_the_cuda_mask(cols):
    """The CPU backward given the CUDA forward's rng_state drops the same elements."""
    p = 0.5
    x, r, norm, w, b = make_inputs((4, cols), f32, f32)
    y, s, mean, rstd, rng = fwd(x, r, norm, w, b, p)
    gy = torch.randn_like(y)
    grads = {}
    for dev in ("cuda", "cpu"):

        def to(t, dev=dev):
            return None if t is None else t.to(dev)

        gx = BWD(
            to(gy),
            None,
            to(s),
            to(mean),
            to(rstd),
            to(rng),
            norm,
            to(w),
            to(b),
            p,
            True,
            f32,
            [True, False, False, False],
        )[0]
        grads[dev] = gx.cpu()
    assert torch.equal(grads["cuda"] != 0, grads["cpu"] != 0)
    mask = philox_mask(rng, x.numel(), p).view(x.shape)
    assert torch.equal(grads["cuda"] != 0, mask)


# ----------------------------------------------------------------------------------------------
# Forward and backward against the references


def run_and_check(
    x,
    r,
    norm,
    w,
    b,
    p,
    *,
    out_dtype=None,
    grad_sum=False,
    gy_float=False,
    mask_out=(True, True, True, True),
    training=True,
):
    """Forward + backward of the op on CUDA against native and float64 references."""
    poison_allocator("cuda", 8 * 4 * x.numel() * 4)
    y, s, mean, rstd, rng = fwd(x, r, norm, w, b, p, training=training, out_dtype=out_dtype)
    drop = training and p > 0
    if drop:
        mask = check_mask_from_sum(s, x, r, rng, p)
    else:
        assert torch.equal(rng.cpu(), torch.zeros(2, dtype=torch.int64))
        mask = torch.ones_like(x, dtype=torch.bool)
        assert torch.equal(s, native_sum(x, r, mask, 0.0))
    s_dtype = s.dtype
    gy = torch.randn(y.shape, device="cuda", dtype=f32 if gy_float else y.dtype)
    gs = torch.randn_like(s) if grad_sum else None
    native, ref = references(
        x, r, norm, w, b, mask, p if drop else 0.0, out_dtype=out_dtype, gy=gy, gs=gs
    )
    assert y.dtype == (out_dtype or s_dtype)
    assert_close_to_reference(y, native["y"], ref["y"], y.dtype, "y")
    # mean / rstd of the S-rounded sum
    s64 = s.double().reshape(mean.numel(), -1)
    assert torch.allclose(mean.double().flatten(), s64.mean(-1), rtol=1e-5, atol=1e-5)
    rstd64 = torch.rsqrt(s64.var(-1, unbiased=False) + 1e-5)
    assert torch.allclose(rstd.double().flatten(), rstd64, rtol=1e-4, atol=1e-6)

    poison_allocator("cuda", 8 * 4 * x.numel() * 4)
    gx, gr, gw, gb = BWD(gy, gs, s, mean, rstd, rng, norm, w, b, p, drop, x.dtype, list(mask_out))
    # name, result, whether the input exists, the gradient's dtype, the dtype computed in
    compute = out_dtype or s_dtype
    expect = [
        ("gx", gx, True, x.dtype, x.dtype),
        ("gr", gr, r is not None, s_dtype, s_dtype),
        ("gw", gw, w is not None, None if w is None else w.dtype, compute),
        ("gb", gb, b is not None, None if b is None else b.dtype, compute),
    ]
    for wanted, (name, got, present, dtype, floor) in zip(mask_out, expect, strict=True):
        if not wanted or (name in ("gw", "gb") and not present):
            assert got.numel() == 0, f"{name} not asked for (or no such input) but returned"
            continue
        if not present:  # grad_residual of a call without residual: ds, not checked here
            continue
        assert got.dtype == dtype, f"{name}: dtype {got.dtype} != {dtype}"
        assert_close_to_reference(got, native[name], ref[name], floor, name)
    if mask_out[0] and drop:
        assert not gx[~mask].any(), "grad_x nonzero where the mask dropped"
    return rng


@pytest.mark.cuda
@pytest.mark.parametrize("cols", FAST_COLS + GENERIC_COLS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_forward_backward_match_reference(pair, cols):
    x, r, norm, w, b = make_inputs((3, cols), *pair)
    run_and_check(x, r, norm, w, b, 0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", WIDE_COLS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_rows_too_wide_for_registers(pair, cols):
    x, r, norm, w, b = make_inputs((2, cols), *pair)
    run_and_check(x, r, norm, w, b, 0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 4097])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("params", ["same", "float", "weight", "none"])
def test_parameter_dtypes_and_absence(pair, cols, params):
    x, r, norm, w, b = make_inputs((2, 3, cols), *pair, params=params)
    run_and_check(x, r, norm, w, b, 0.2)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [768, 4097])
@pytest.mark.parametrize("x_dtype", [f32, f16, bf16], ids=["f32", "f16", "bf16"])
def test_without_residual(x_dtype, cols):
    x, r, norm, w, b = make_inputs((4, cols), x_dtype, None)
    run_and_check(x, r, norm, w, b, 0.25)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [768, 4097])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_prenorm_grad_sum_and_float32_grad_y(pair, cols):
    x, r, norm, w, b = make_inputs((4, cols), *pair)
    run_and_check(x, r, norm, w, b, 0.4, grad_sum=True, gy_float=True)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 4100])
@pytest.mark.parametrize("pair", [(f16, f16), (bf16, bf16)], ids=["f16", "bf16"])
def test_float32_output(pair, cols):
    x, r, norm, w, b = make_inputs((4, cols), *pair, params="float")
    run_and_check(x, r, norm, w, b, 0.1, out_dtype=f32, grad_sum=True)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mask_out",
    [
        (True, False, False, False),
        (False, True, False, False),
        (False, False, True, True),
        (True, True, False, False),
        (False, False, False, True),
        (False, False, False, False),
    ],
)
@pytest.mark.parametrize("cols", [1024, 4097])
def test_output_mask_subsets(mask_out, cols):
    x, r, norm, w, b = make_inputs((4, cols), f16, f16)
    run_and_check(x, r, norm, w, b, 0.5, mask_out=mask_out, grad_sum=True)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "pair",
    [(f32, bf16), (bf16, f16), (f16, bf16), (f32, f16)],
    ids=["f32+bf16", "bf16+f16", "f16+bf16", "f32+f16"],
)
@pytest.mark.parametrize("cols", [1024, 4097])
def test_residual_cast_to_the_sum_dtype(pair, cols):
    """S = promote(x, residual) is float32 here while x or the residual is narrower: the
    residual is widened on the host, the (x, float32) kernels run."""
    x, r, norm, w, b = make_inputs((3, cols), *pair, params="float")
    run_and_check(x, r, norm, w, b, 0.3)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "pair",
    [(f64, f64), (f32, f64), (f16, f64), (f64, None)],
    ids=["f64", "f32+f64", "f16+f64", "f64-no-residual"],
)
@pytest.mark.parametrize("cols", [7, 1024])
def test_float64_sum(pair, cols):
    x, r, norm, w, b = make_inputs((3, cols), *pair)
    run_and_check(x, r, norm, w, b, 0.3, grad_sum=r is not None)


@pytest.mark.cuda
@pytest.mark.parametrize("training,p", [(False, 0.5), (True, 0.0)])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_no_dropout_draws_nothing(pair, training, p):
    x, r, norm, w, b = make_inputs((4, 1024), *pair)
    before = torch.cuda.get_rng_state()
    fwd(x, r, norm, w, b, p, training=training)
    assert torch.equal(torch.cuda.get_rng_state(), before), "the generator must not advance"
    run_and_check(x, r, norm, w, b, p, training=training, grad_sum=True)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 4097])
@pytest.mark.parametrize(
    "pair",
    [(f32, f32), (bf16, bf16), (f16, f32), (f64, f64)],
    ids=["f32", "bf16", "f16+f32", "f64"],
)
def test_p_one_keeps_nothing(pair, cols):
    x, r, norm, w, b = make_inputs((3, cols), *pair)
    y, s, mean, rstd, rng = fwd(x, r, norm, w, b, 1.0)
    assert torch.equal(s, r.to(s.dtype)), "nothing kept: s = residual"
    assert torch.isfinite(y).all()
    gx, gr, _, _ = BWD(
        torch.randn_like(y),
        None,
        s,
        mean,
        rstd,
        rng,
        norm,
        w,
        b,
        1.0,
        True,
        x.dtype,
        [True, True, True, True],
    )
    assert not gx.any() and torch.isfinite(gr).all()


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 1032])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("which", ["x", "residual", "both", "transposed"])
def test_unaligned_and_non_contiguous_inputs(pair, cols, which):
    """x or the residual starting one element past a 16-byte boundary (contiguous: the generic
    path) or non-contiguous (copied contiguous first; the mask index is the element's index in
    contiguous x)."""
    shape = (3, cols)

    def offset_view(dtype):
        flat = torch.randn(3 * cols + 1, device="cuda", dtype=dtype)
        return flat[1:].view(shape)

    x, r, norm, w, b = make_inputs(shape, *pair)
    if which in ("x", "both"):
        x = offset_view(pair[0])
    if which in ("residual", "both"):
        r = offset_view(pair[1])
    if which == "transposed":
        x = torch.randn(cols, 3, device="cuda", dtype=pair[0]).t()
        assert not x.is_contiguous()
    run_and_check(x, r, norm, w, b, 0.3, grad_sum=True)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "pair",
    [(f32, f32), (bf16, f32), (f16, f16), (f32, bf16), (f64, f64)],
    ids=["f32", "bf16+f32", "f16", "f32+bf16", "f64"],
)
@pytest.mark.parametrize("cols", [1024, 4097])
def test_expanded_residual_and_gradients(pair, cols):
    """Stride-0 (expanded) residual, grad_y and grad_sum, as autograd hands over the gradient of
    a sum (.sum().backward()): the results of their contiguous copies, bit for bit."""
    x = torch.randn(4, cols, device="cuda", dtype=pair[0])
    r = torch.randn(1, cols, device="cuda", dtype=pair[1]).expand(4, cols)
    s_dtype = torch.promote_types(*pair)
    w = torch.randn(cols, device="cuda", dtype=s_dtype)
    b = torch.randn(cols, device="cuda", dtype=s_dtype)
    gy = torch.full((1, 1), 1.5, device="cuda", dtype=s_dtype).expand(4, cols)
    gs = torch.full((1, 1), -0.5, device="cuda", dtype=s_dtype).expand(4, cols)
    results = []
    for r_, gy_, gs_ in ((r, gy, gs), (r.contiguous(), gy.contiguous(), gs.contiguous())):
        torch.manual_seed(5)
        y, s, mean, rstd, rng = fwd(x, r_, [cols], w, b, 0.3)
        grads = BWD(gy_, gs_, s, mean, rstd, rng, [cols], w, b, 0.3, True, x.dtype, [True] * 4)
        results.append((y, s, mean, rstd, rng, *grads))
    for a, c in zip(*results, strict=True):
        assert torch.equal(a, c)


@pytest.mark.cuda
def test_multi_dimensional_normalized_shape():
    x, r, norm, w, b = make_inputs((2, 3, 4, 192), f16, f16, ncols_dims=2)
    run_and_check(x, r, norm, w, b, 0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("shape,norm", [((0, 768), [768]), ((2, 0, 64), [64])])
@pytest.mark.parametrize("pair", [(f16, f16), (f64, f64)], ids=["f16", "f64"])
def test_empty_tensors(shape, norm, pair):
    x = torch.randn(shape, device="cuda", dtype=pair[0])
    r = torch.randn(shape, device="cuda", dtype=pair[1])
    w = torch.randn(norm, device="cuda", dtype=pair[1])
    b = torch.randn(norm, device="cuda", dtype=pair[1])
    y, s, mean, rstd, rng = fwd(x, r, norm, w, b, 0.5)
    assert y.shape == x.shape and s.shape == x.shape and rng.shape == (2,)
    gx, gr, gw, gb = BWD(
        torch.zeros_like(y),
        None,
        s,
        mean,
        rstd,
        rng,
        norm,
        w,
        b,
        0.5,
        True,
        x.dtype,
        [True, True, True, True],
    )
    assert gx.shape == x.shape and gx.dtype == x.dtype and gr.shape == x.shape
    assert torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


@pytest.mark.cuda
def test_sum_not_stored():
    x, r, _, w, b = make_inputs((4, 1024), f16, f16)
    for cols_x in (x, x[:, :1001].contiguous()):  # fast path; generic path (scratch sum)
        n = [cols_x.shape[-1]]
        rr = r[:, : n[0]].contiguous()
        ww, bb = w[: n[0]].contiguous(), b[: n[0]].contiguous()
        torch.manual_seed(7)
        y, s, _, _, rng = fwd(cols_x, rr, n, ww, bb, 0.3, store_sum=False)
        assert s.numel() == 0
        torch.manual_seed(7)
        y2, _, _, _, rng2 = fwd(cols_x, rr, n, ww, bb, 0.3, store_sum=True)
        assert torch.equal(rng, rng2) and torch.equal(y, y2)


# ----------------------------------------------------------------------------------------------
# Reproducibility, determinism, CUDA graphs


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 4097])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_bit_identical_reruns_under_the_same_seed(pair, cols):
    x, r, norm, w, b = make_inputs((64, cols), *pair)
    gy = torch.randn(x.shape, device="cuda", dtype=torch.promote_types(*pair))
    gs = torch.randn_like(gy)
    runs = []
    for _ in range(2):
        torch.manual_seed(2024)
        y, s, mean, rstd, rng = fwd(x, r, norm, w, b, 0.3)
        grads = BWD(
            gy, gs, s, mean, rstd, rng, norm, w, b, 0.3, True, x.dtype, [True, True, True, True]
        )
        runs.append((y, s, mean, rstd, rng, *grads))
    for a, b_ in zip(*runs, strict=True):
        assert torch.equal(a, b_)


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [1024, 4097])
@pytest.mark.parametrize(
    "pair", [(f16, f16), (bf16, f32), (f64, f64)], ids=["f16", "bf16+f32", "f64"]
)
def test_cuda_graph_replays_draw_fresh_masks_and_a_matching_backward(pair, cols):
    p = 0.4
    x, r, norm, w, b = make_inputs((8, cols), *pair)
    gy = torch.randn(x.shape, device="cuda", dtype=torch.promote_types(*pair))

    def step():
        y, s, mean, rstd, rng = fwd(x, r, norm, w, b, p)
        gx, gr, gw, gb = BWD(
            gy, None, s, mean, rstd, rng, norm, w, b, p, True, x.dtype, [True, True, True, True]
        )
        return y, s, rng, gx, gr, gw, gb

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    seen = set()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        y, s, rng, gx, gr, gw, _ = (t.clone() for t in outs)
        seen.add(tuple(rng.cpu().tolist()))
        mask = check_mask_from_sum(s, x, r, rng, p)
        native, ref = references(x, r, norm, w, b, mask, p, gy=gy)
        assert_close_to_reference(y, native["y"], ref["y"], y.dtype, "y (replay)")
        assert_close_to_reference(gx, native["gx"], ref["gx"], x.dtype, "grad_x (replay)")
        assert_close_to_reference(gr, native["gr"], ref["gr"], gr.dtype, "grad_residual")
        assert_close_to_reference(gw, native["gw"], ref["gw"], gw.dtype, "grad_weight")
        assert not gx[~mask].any()
    assert len(seen) == 3, "each replay must draw a fresh mask"


# ----------------------------------------------------------------------------------------------
# Large tensors


@pytest.mark.cuda
def test_mask_index_past_2_to_the_31():
    """Element indices beyond 2^31: the mask of the last rows still follows the Python Philox
    (int64 indexing; Philox group index past 2^29)."""
    cols = 4096
    rows = (2**31) // cols + 4
    need = 3 * rows * cols * 2 + (1 << 30)
    if torch.cuda.get_device_properties(0).total_memory < need:
        pytest.skip("needs about 14 GB of GPU memory")
    x = torch.ones(rows, cols, device="cuda", dtype=f16)
    p = 0.5
    y, s, _, _, rng = fwd(x, None, [cols], None, None, p)
    tail = 4 * cols
    start = x.numel() - tail
    mask = philox_mask(rng, tail, p, start=start).cuda()
    assert torch.equal(s.view(-1)[start:] != 0, mask)
    del y, s, x
