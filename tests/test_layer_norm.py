"""fastlayers.LayerNorm and fastlayers.functional.layer_norm: API parity with nn.LayerNorm,
numerics against a float64 reference, gradients, determinism and errors."""

import inspect

import pytest
import torch
from numerics import DEVICES, DTYPES, assert_close_to_reference, poison_allocator
from torch import nn

import fastlayers
from fastlayers.functional import layer_norm


def make_layer(shape, device, param_dtype, affine=True, bias=True):
    ln = nn.LayerNorm(shape, elementwise_affine=affine, bias=bias, device=device, dtype=param_dtype)
    with torch.no_grad():  # non-trivial parameters
        for p in ln.parameters():
            p.copy_(torch.randn_like(p))
    return ln


def reference(ln: nn.LayerNorm, x: torch.Tensor):
    """nn.LayerNorm in float64 on the upcast input and parameters."""
    ref = nn.LayerNorm(
        ln.normalized_shape,
        eps=ln.eps,
        elementwise_affine=ln.elementwise_affine,
        bias=ln.bias is not None,
        dtype=torch.float64,
        device=x.device,
    )
    ref.load_state_dict({k: v.double() for k, v in ln.state_dict().items()})
    return ref, x.detach().double()


# ----------------------------------------------------------------------------------------------
# API parity


def test_signature_and_defaults_match_nn_layer_norm():
    ours = inspect.signature(fastlayers.LayerNorm.__init__)
    native = inspect.signature(nn.LayerNorm.__init__)
    assert list(ours.parameters) == list(native.parameters)
    for name, p in native.parameters.items():
        assert ours.parameters[name].default == p.default, name


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_parameters_init_and_state_dict_match(affine, bias):
    ours = fastlayers.LayerNorm((4, 6), eps=1e-6, elementwise_affine=affine, bias=bias)
    native = nn.LayerNorm((4, 6), eps=1e-6, elementwise_affine=affine, bias=bias)
    assert ours.state_dict().keys() == native.state_dict().keys()
    for k, v in native.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in native.named_parameters()]
    # A checkpoint of either loads into the other.
    trained = make_layer((4, 6), "cpu", torch.float32, affine, bias)
    ours.load_state_dict(trained.state_dict())
    native.load_state_dict(ours.state_dict())
    for k, v in trained.state_dict().items():
        assert torch.equal(native.state_dict()[k], v)
    assert isinstance(ours, nn.LayerNorm)
    assert "fused=fastlayers.layer_norm" in repr(ours) and "(4, 6)" in repr(ours)


def test_from_native_shares_parameters_and_to_native_gives_them_back():
    native = make_layer(32, "cpu", torch.float32)
    native.eval()
    native.weight.requires_grad_(False)
    fused = fastlayers.LayerNorm.from_native(native)
    assert fused.weight is native.weight and fused.bias is native.bias
    assert not fused.training and not fused.weight.requires_grad
    back = fused.to_native()
    assert type(back) is nn.LayerNorm
    assert back.weight is native.weight and back.bias is native.bias
    assert back.eps == native.eps and back.normalized_shape == native.normalized_shape
    x = torch.randn(3, 32)
    assert torch.equal(back(x), native(x))
    with pytest.raises(TypeError, match=r"native must be a torch\.nn\.LayerNorm"):
        fastlayers.LayerNorm.from_native(nn.Linear(2, 2))


def test_meta_device():
    ln = fastlayers.LayerNorm(768, device="meta")
    assert ln.weight.is_meta
    y = ln(torch.empty(2, 5, 768, device="meta", dtype=torch.bfloat16))
    assert y.shape == (2, 5, 768) and y.dtype == torch.bfloat16 and y.is_meta
    ln.to_empty(device="cpu").reset_parameters()
    assert torch.equal(ln.weight, torch.ones(768))


# ----------------------------------------------------------------------------------------------
# Numerics

SHAPES = [  # (input shape, normalized_shape)
    ((3, 1), (1,)),
    ((5, 7), (7,)),
    ((2, 3, 768), (768,)),
    ((6, 4097), (4097,)),
    ((3, 1024), (1024,)),
    ((4, 6, 8), (6, 8)),
    ((33, 4096), (4096,)),
    ((7, 2048), (2048,)),
    ((5, 8192), (8192,)),
    ((3, 16384), (16384,)),  # the forward's 8 vectors a thread at 256 (16-bit) or 512 threads
    ((20000, 128), (128,)),  # many rows per block: the persistent backward loop
    ((2, 65536), (65536,)),
]


def run_fwd_bwd(layer, x, dy):
    x = x.detach().requires_grad_()
    y = layer(x)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(y, [x, *params], dy)
    return y, grads


def check_against_reference(shape, norm_shape, device, dtype, param_dtype, x=None, **kw):
    layer = make_layer(norm_shape, device, param_dtype, **kw)
    fused = fastlayers.LayerNorm.from_native(layer)
    # The baseline error is nn.LayerNorm's with everything in `dtype` (native CUDA refuses
    # float32 parameters with half inputs, which fastlayers accepts).
    native = make_layer(norm_shape, device, dtype, **kw)
    native.load_state_dict(layer.state_dict())
    if x is None:
        x = torch.randn(shape, device=device, dtype=dtype) * 3 + 1.5
    dy = torch.randn(x.shape, device=device, dtype=dtype)
    ref_layer, xr = reference(layer, x)
    y_ref, g_ref = run_fwd_bwd(ref_layer, xr, dy.double())
    y_nat, g_nat = run_fwd_bwd(native, x, dy)
    poison_allocator(device, 4 * x.numel() * 4)
    y, g = run_fwd_bwd(fused, x, dy)
    assert y.dtype == dtype and y.device == x.device
    assert_close_to_reference(y, y_nat, y_ref, dtype, "output")
    names = ["dx", "dweight", "dbias"][: len(g)]
    for name, a, b, r in zip(names, g, g_nat, g_ref, strict=True):
        assert a.dtype == (dtype if name == "dx" else param_dtype), name
        assert_close_to_reference(a, b, r, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,norm_shape", SHAPES, ids=str)
def test_matches_float64_reference(shape, norm_shape, device, dtype):
    check_against_reference(shape, norm_shape, device, dtype, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,norm_shape", [((4, 8, 768), (768,)), ((3, 100), (100,))], ids=str)
def test_float32_parameters_with_half_input(shape, norm_shape, device, dtype):
    check_against_reference(shape, norm_shape, device, dtype, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine,bias", [(True, False), (False, False)])
def test_without_bias_or_affine(device, affine, bias):
    check_against_reference(
        (9, 512), (512,), device, torch.float32, torch.float32, affine=affine, bias=bias
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_and_offset_input(device, dtype):
    base = torch.randn(64, 2, 40, device=device, dtype=dtype)
    check_against_reference(None, (64,), device, dtype, dtype, x=base.permute(1, 2, 0))
    flat = torch.randn(1 + 6 * 256, device=device, dtype=dtype)  # storage offset: misaligned
    check_against_reference(None, (256,), device, dtype, dtype, x=flat[1:].view(6, 256))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    ln = fastlayers.LayerNorm(768, device=device)
    x = torch.randn(0, 768, device=device, requires_grad=True)
    y = ln(x)
    assert y.shape == (0, 768)
    y.sum().backward()
    assert x.grad.shape == (0, 768)
    assert torch.equal(ln.weight.grad, torch.zeros(768, device=device))
    assert torch.equal(ln.bias.grad, torch.zeros(768, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [768, 4097])
def test_gradients_are_bit_identical_across_runs(device, cols):
    ln = make_layer(cols, device, torch.float32)
    fused = fastlayers.LayerNorm.from_native(ln)
    x = torch.randn(3000, cols, device=device)
    dy = torch.randn_like(x)
    first = run_fwd_bwd(fused, x, dy)[1]
    for _ in range(3):
        again = run_fwd_bwd(fused, x, dy)[1]
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_functional_matches_module(device):
    ln = make_layer((6, 8), device, torch.float32)
    x = torch.randn(5, 6, 8, device=device)
    expected = fastlayers.LayerNorm.from_native(ln)(x)
    got = layer_norm(x, (6, 8), ln.weight, ln.bias, ln.eps)
    assert torch.equal(got, expected)
    assert torch.equal(layer_norm(x[0, 0], 8), layer_norm(x[0, 0], [8]))


def test_double_backward_is_refused_not_wrong():
    ln = fastlayers.LayerNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(ln(x).pow(2).sum(), x, create_graph=True)


# ----------------------------------------------------------------------------------------------
# Errors name the argument


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise_clear_errors(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(RuntimeError, match="does not end with normalized_shape"):
        layer_norm(x, (9,))
    with pytest.raises(RuntimeError, match="weight has shape"):
        layer_norm(x, (8,), torch.ones(9, device=device))
    with pytest.raises(RuntimeError, match="bias has dtype"):
        layer_norm(x, (8,), w, torch.ones(8, device=device, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="input must be float32, float64, float16 or bfloat16"):
        layer_norm(torch.ones(4, 8, dtype=torch.int32, device=device), (8,))
    with pytest.raises(RuntimeError, match="weight has dtype Float but input has dtype Double"):
        layer_norm(x.double(), (8,), w)  # native refuses the mix too
    with pytest.raises(RuntimeError, match="at least one dimension"):
        layer_norm(x, ())


@pytest.mark.cuda
def test_wrong_device_raises():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="weight is on cpu"):
        layer_norm(x, (8,), torch.ones(8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [768, 1000, 4097])
@pytest.mark.parametrize("layout", ["contiguous", "expanded"])
def test_rows_of_equal_values_normalise_to_exactly_zero(device, dtype, cols, layout):
    """A row of equal values has variance 0, so x - mean must be exactly 0: a mean off by one
    rounding is amplified by rstd = 1/sqrt(eps) (found by the property tests on CUDA, error
    3.8e-5 for 768 equal float32 values where native's is 0)."""
    values = torch.randn(6, 1, device=device).to(dtype) * 3 + 1.7
    x = values.expand(6, cols)
    if layout == "contiguous":
        x = x.contiguous()
    x.requires_grad_(True)
    w = torch.randn(cols, device=device, dtype=dtype)
    b = torch.randn(cols, device=device, dtype=dtype)
    y = layer_norm(x, (cols,), w, b, eps=1e-5)
    native = torch.nn.functional.layer_norm(x, (cols,), w, b, eps=1e-5)
    ref = torch.nn.functional.layer_norm(x.double(), (cols,), w.double(), b.double(), eps=1e-5)
    assert torch.equal(ref, b.double().expand_as(ref))  # the normalised value is exactly 0
    assert_close_to_reference(y, native, ref, dtype, "y")
