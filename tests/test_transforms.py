"""torch.func transforms and forward-mode AD through the fused layers give native's answers
(fastlayers.ops._native routes those calls to torch's composite ops), and a GPU the build has no
kernels for runs the layers natively with one warning instead of raising."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from numerics import assert_close_to_reference
from torch import nn
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vmap

import fastlayers
from fastlayers._extension import _C
from fastlayers.ops import _native

IN, OUT = 16, 12


class _ScaledReLU(nn.Module):
    """The native computation ReLUScale replaces."""

    def __init__(self, alpha: float, inplace: bool = False) -> None:
        super().__init__()
        self.relu, self.alpha = nn.ReLU(inplace=inplace), alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x) * self.alpha


def _conv1d_gelu() -> tuple[nn.Module, nn.Module]:
    conv = pytest.importorskip("transformers.pytorch_utils").Conv1D(OUT, IN)
    nn.init.normal_(conv.bias)
    fused = fastlayers.FusedLinearGELU.from_native(conv, "tanh")
    return fused, nn.Sequential(*fused.to_native())


def _pair(name: str) -> tuple[nn.Module, nn.Module]:
    """(fused layer, native module(s) sharing its Parameters)."""
    if name == "layer_norm":
        fused = fastlayers.LayerNorm(IN)
        with torch.no_grad():  # not the identity init: gradients of weight and bias matter
            fused.weight.normal_()
            fused.bias.normal_()
        return fused, fused.to_native()
    if name in ("linear_gelu", "linear_gelu_tanh"):
        fused = fastlayers.FusedLinearGELU(
            IN, OUT, approximate="tanh" if "tanh" in name else "none"
        )
        return fused, nn.Sequential(*fused.to_native())
    if name == "linear_relu":
        fused = fastlayers.FusedLinearReLU(IN, OUT)
        return fused, nn.Sequential(*fused.to_native())
    if name == "conv1d_gelu":
        return _conv1d_gelu()
    if name == "relu_scale":
        return fastlayers.ReLUScale(-0.75), _ScaledReLU(-0.75)
    if name == "relu":
        return fastlayers.ReLUScale(1.0), nn.ReLU()
    raise ValueError(name)


LAYERS = [
    "layer_norm",
    "linear_gelu",
    "linear_gelu_tanh",
    "linear_relu",
    "conv1d_gelu",
    "relu_scale",
    "relu",
]


def _float64(native: nn.Module) -> nn.Module:
    return copy.deepcopy(native).double()


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.named_parameters()}


def _rename(params: dict[str, torch.Tensor], native: nn.Module) -> dict[str, torch.Tensor]:
    """The fused layer's parameters under the native module's names (same order)."""
    return dict(zip([k for k, _ in native.named_parameters()], params.values(), strict=True))


def _assert_rule(fused, native, ref, what: str) -> None:
    """DESIGN rule: fused no worse than 2x native's own error against float64, plus a floor."""
    if isinstance(fused, dict):
        for (k, f), n, r in zip(fused.items(), native.values(), ref.values(), strict=True):
            _assert_rule(f, n, r, f"{what}[{k}]")
        return
    assert ref.abs().max() > 0, f"{what}: the reference is all zeros, the test proves nothing"
    assert_close_to_reference(fused, native, ref, torch.float32, what)


def _inputs(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 2.0


@pytest.mark.parametrize("name", LAYERS)
def test_jvp_matches_native(name):
    fused, native = _pair(name)
    native64 = _float64(native)
    x, tx = _inputs(3, 5, IN), _inputs(3, 5, IN)
    p = _params(fused)
    tp = {k: torch.randn_like(v) for k, v in p.items()}

    def run(module, params, tangents, dtype):
        params = _rename(params, module) if module is not fused else params
        tangents = _rename(tangents, module) if module is not fused else tangents
        cast = {k: v.to(dtype) for k, v in params.items()}
        tcast = {k: v.to(dtype) for k, v in tangents.items()}
        return jvp(
            lambda ps, xx: functional_call(module, ps, (xx,)),
            (cast, x.to(dtype)),
            (tcast, tx.to(dtype)),
        )

    (y, ty), (yn, tyn), (y64, ty64) = (
        run(fused, p, tp, torch.float32),
        run(native, p, tp, torch.float32),
        run(native64, p, tp, torch.float64),
    )
    _assert_rule(y, yn, y64, f"{name} jvp primal")
    _assert_rule(ty, tyn, ty64, f"{name} jvp tangent")


@pytest.mark.parametrize("name", LAYERS)
def test_forward_ad_dual_matches_native(name):
    fused, native = _pair(name)
    native64 = _float64(native)
    x, tx = _inputs(4, IN), _inputs(4, IN)

    def tangent(module, dtype):
        with fwAD.dual_level():
            out = module(fwAD.make_dual(x.to(dtype), tx.to(dtype)))
            primal, t = fwAD.unpack_dual(out)
        assert t is not None, f"{name}: no tangent"
        return primal, t

    (y, t), (yn, tn), (y64, t64) = (
        tangent(fused, torch.float32),
        tangent(native, torch.float32),
        tangent(native64, torch.float64),
    )
    _assert_rule(y, yn, y64, f"{name} forward_ad primal")
    _assert_rule(t, tn, t64, f"{name} forward_ad tangent")


@pytest.mark.parametrize("inplace", [False, True])
def test_forward_ad_relu_scale_inplace(inplace):
    x, tx = _inputs(4, IN), _inputs(4, IN)
    with fwAD.dual_level():
        # in place, the tangent is updated in place too: give it its own copy
        dual = fwAD.make_dual(x.clone(), tx.clone())
        got = fwAD.unpack_dual(fastlayers.ReLUScale(2.5, inplace=inplace)(dual))
        want = fwAD.unpack_dual(torch.relu(fwAD.make_dual(x.double(), tx.double())) * 2.5)
    assert got.tangent is not None
    torch.testing.assert_close(got.primal, want.primal.float())
    torch.testing.assert_close(got.tangent, want.tangent.float())


@pytest.mark.parametrize("name", LAYERS)
def test_per_sample_grads_vmap_grad(name):
    """Per-sample gradients (DP-SGD): vmap(grad(loss of one sample))."""
    fused, native = _pair(name)
    native64 = _float64(native)
    batch = 5
    x, g = (
        _inputs(batch, 3, IN),
        torch.randn(batch, 3, OUT if "linear" in name or "gelu" in name else IN),
    )
    p = _params(fused)

    def per_sample(module, dtype):
        params = {k: v.to(dtype) for k, v in (p if module is fused else _rename(p, module)).items()}

        def loss(ps, xi, gi):
            return (functional_call(module, ps, (xi[None],))[0] * gi).sum()

        # gradient w.r.t. the parameters when there are any, else w.r.t. the input
        argnums = 0 if params else 1
        return vmap(grad(loss, argnums=argnums), in_dims=(None, 0, 0))(
            params, x.to(dtype), g.to(dtype)
        )

    got, want, ref = (
        per_sample(fused, torch.float32),
        per_sample(native, torch.float32),
        per_sample(native64, torch.float64),
    )
    if isinstance(got, dict):
        want, ref = (
            dict(zip(got, want.values(), strict=True)),
            dict(zip(got, ref.values(), strict=True)),
        )
    _assert_rule(got, want, ref, f"{name} per-sample grads")


@pytest.mark.parametrize("jac", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
@pytest.mark.parametrize("name", LAYERS)
def test_jacobians_match_native(name, jac):
    fused, native = _pair(name)
    native64 = _float64(native)
    x = _inputs(2, IN)
    got, want, ref = jac(fused)(x), jac(native)(x), jac(native64)(x.double())
    _assert_rule(got, want, ref, f"{name} {jac.__name__}")


def test_plain_eager_calls_keep_the_fused_path():
    """The routing is for transforms only: a plain call, even under autograd, is not routed."""
    x = _inputs(2, IN).requires_grad_()
    assert not _native.computes_natively(x)
    with torch.no_grad():
        assert not _native.computes_natively(x)
    with fwAD.dual_level():
        assert _native.computes_natively(x)
    assert vmap(lambda t: torch.tensor(_native.computes_natively(t)))(x).all()


# --- GPUs without kernels (item 11) -----------------------------------------------------------


@pytest.fixture
def fresh_no_kernel_state(monkeypatch):
    """A clean per-process state: no device marked, the one warning not given yet."""
    monkeypatch.setattr(_native, "_NO_KERNEL_DEVICES", set())
    monkeypatch.setattr(_native, "_warned", False)


def _layers_and_natives():
    for name in ("layer_norm", "linear_gelu", "linear_relu", "conv1d_gelu", "relu_scale"):
        fused, native = _pair(name)
        yield name, fused, native


def _fake_missing_kernels(monkeypatch, device: torch.device) -> None:
    """Makes `device` look like a GPU this build has no kernels for: the probe says so and every
    kernel entry raises as check_kernel_image does."""
    message = "fastlayers: the compiled extension has no CUDA kernels for this GPU (Fake T4)"

    def no_kernel(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(_native, "kernels_run_on", lambda d: torch.device(d) != device)
    monkeypatch.setattr(_native, "no_kernels_reason", lambda d: f"{message}; rebuild: pip ...")
    monkeypatch.setattr(_C, "layer_norm", no_kernel)
    monkeypatch.setattr(_C, "linear_act", no_kernel)
    monkeypatch.setattr(_C, "relu_scale", no_kernel)
    relu_mod = sys.modules["fastlayers.ops.relu_scale"]
    monkeypatch.setattr(relu_mod, "relu_scale_op", no_kernel)
    monkeypatch.setattr(relu_mod, "relu_scale_inplace_op", no_kernel)


def test_layers_without_kernels_compute_natively_and_warn_once(monkeypatch, fresh_no_kernel_state):
    _fake_missing_kernels(monkeypatch, torch.device("cpu"))
    x = _inputs(3, IN).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, fused, native in _layers_and_natives():
            for _ in range(2):  # the first call finds out, the second routes before the kernel
                got, want = fused(x), native(x)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
                (gx,) = torch.autograd.grad(got.sum(), x)
                (wx,) = torch.autograd.grad(want.sum(), x)
                torch.testing.assert_close(gx, wx, rtol=0, atol=0, msg=name)
        inplace = fastlayers.ReLUScale(0.5, inplace=True)
        y = _inputs(3, IN)
        torch.testing.assert_close(inplace(y.clone()), torch.relu(y) * 0.5, rtol=0, atol=0)
    ours = [w for w in caught if "no CUDA kernels" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "Fake T4" in str(ours[0].message) and "rebuild" in str(ours[0].message)
    assert "native ops" in str(ours[0].message)


def test_other_kernel_errors_still_raise(monkeypatch, fresh_no_kernel_state):
    """Only the missing-kernel error is routed; a bad argument still raises as before."""
    with pytest.raises(RuntimeError, match="shape"):
        fastlayers.functional.layer_norm(_inputs(3, IN), (IN + 1,))
    assert not _native._NO_KERNEL_DEVICES


def test_kernels_run_on_answers():
    assert _native.kernels_run_on("cpu")
    assert _native.no_kernels_reason("cpu") is None
    if not _C.build_info()["cuda"]:
        assert _C.kernels_run_on(0) is False  # a CPU-only build has no CUDA kernels at all


@pytest.mark.cuda
def test_cuda_forced_no_kernels_matches_native(monkeypatch, fresh_no_kernel_state):
    device = torch.device("cuda", torch.cuda.current_device())
    assert _C.kernels_run_on(device.index), "this build's kernels should run on the test GPU"
    assert _native.kernels_run_on(device)
    _native._NO_KERNEL_DEVICES.add(device)  # force the "no kernels here" answer
    monkeypatch.setattr(_native, "no_kernels_reason", lambda d: "no CUDA kernels (forced)")
    x = _inputs(4, 7, IN).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, fused, native in _layers_and_natives():
            fused, native = fused.to(device), native.to(device)
            torch.testing.assert_close(fused(x), native(x), rtol=0, atol=0, msg=name)
    assert len([w for w in caught if "forced" in str(w.message)]) == 1
