"""LayerNorm as PyTorch machinery sees it: opcheck, torch.compile, autocast, CUDA graphs,
streams and devices."""

import os

import pytest
import torch
from numerics import DEVICES
from torch import nn

import fastlayers
from fastlayers.config import COMPILE_LAYER_NORM_MODES, compile_layer_norm_as
from fastlayers.ops.layer_norm import layer_norm_bwd, layer_norm_fwd


def fwd_samples(device):
    for dtype in (torch.float32, torch.bfloat16):
        for shape, norm in [((4, 32), [32]), ((2, 3, 5, 6), [5, 6]), ((7, 4097), [4097])]:
            x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(norm, device=device, requires_grad=True)  # float32 params
            b = torch.randn(norm, device=device, dtype=dtype, requires_grad=True)
            yield (x, norm, w, b, 1e-5)
            yield (x.detach(), norm, None, None, 1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forward(device):
    for args in fwd_samples(device):
        torch.library.opcheck(layer_norm_fwd, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward(device):
    x = torch.randn(6, 48, device=device, dtype=torch.bfloat16)
    w = torch.randn(48, device=device)
    b = torch.randn(48, device=device)
    _, mean, rstd = layer_norm_fwd(x, [48], w, b, 1e-5)
    dy = torch.randn_like(x)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        torch.library.opcheck(layer_norm_bwd, (dy, x, mean, rstd, [48], w, b, mask))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = fastlayers.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.fc(x) + x)


@pytest.mark.parametrize("mode", COMPILE_LAYER_NORM_MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_no_recompiles(device, mode):
    torch.compiler.reset()
    model = Block(64).to(device)
    compiled = torch.compile(model, fullgraph=True)
    with compile_layer_norm_as(mode), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(8, 16, 64, device=device, requires_grad=True)
            y = compiled(x)
            y_eager = model(x)
            torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
            dy = torch.randn_like(y)
            g = torch.autograd.grad(y, [x, model.norm.weight], dy)
            g_eager = torch.autograd.grad(y_eager, [x, model.norm.weight], dy)
            for a, b in zip(g, g_eager, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def traced_targets(fn, *args) -> list:
    """The call_function targets of the graphs dynamo hands to the backend for fn(*args)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compiler.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets


def test_compile_traces_layer_norm_as_aten_or_as_the_fused_op_by_setting():
    """Default: torch.compile sees aten layer_norm (Inductor fuses it with the residual add);
    'fused': fastlayers' op. Changing the setting recompiles (dynamo guards on it)."""
    model = Block(32)
    x = torch.randn(4, 32)
    if "FASTLAYERS_COMPILE_LAYER_NORM" not in os.environ:
        assert fastlayers.config.compile_layer_norm == "inductor"
    with compile_layer_norm_as("inductor"):
        default = traced_targets(model, x)
    assert torch.nn.functional.layer_norm in default and layer_norm_fwd not in default
    with compile_layer_norm_as("fused"):
        fused = traced_targets(model, x)
    assert layer_norm_fwd in fused and torch.nn.functional.layer_norm not in fused

    torch.compiler.reset()
    compiled = torch.compile(model, fullgraph=True)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with compile_layer_norm_as("inductor"):
        compiled(x)
        with compile_layer_norm_as("fused"):
            compiled(x)
        compiled(x)
    assert counters["stats"]["unique_graphs"] == 2


def test_compile_keeps_the_fused_op_where_aten_would_compute_otherwise():
    """Half input with float32 parameters outside autocast (native CUDA refuses it) and float64
    input with float32 parameters (refused, as in eager) keep our op; under autocast float32
    parameters go to aten, and so does float64 with float64 parameters (aten computes it in
    float64, as our op does)."""
    norm = fastlayers.LayerNorm(16)  # float32 parameters
    half = torch.randn(3, 16, dtype=torch.bfloat16)
    x64 = torch.randn(3, 16, dtype=torch.float64)
    with compile_layer_norm_as("inductor"):
        assert layer_norm_fwd in traced_targets(norm, half)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.nn.functional.layer_norm in traced_targets(norm, half)
        with pytest.raises(Exception, match="weight has dtype Float but input has dtype Double"):
            traced_targets(norm, x64)
        assert torch.nn.functional.layer_norm in traced_targets(norm.double(), x64)


@pytest.mark.parametrize("mode", COMPILE_LAYER_NORM_MODES)
def test_compiled_mixed_dtypes_match_eager(mode):
    """bf16 input with float32 parameters, outside autocast: compiled (either way) gives the
    eager fused layer's dtype and values."""
    norm = fastlayers.LayerNorm(48)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(5, 7, 48, dtype=torch.bfloat16)
    torch.compiler.reset()
    with compile_layer_norm_as(mode):
        y = torch.compile(norm, fullgraph=True)(x)
    y_eager = norm(x)
    assert y.dtype == y_eager.dtype
    torch.testing.assert_close(y.float(), y_eager.float(), rtol=0, atol=0.0625)


def test_config_rejects_unknown_modes():
    before = fastlayers.config.compile_layer_norm
    with pytest.raises(ValueError, match="compile_layer_norm"):
        fastlayers.config.set_compile_layer_norm("triton")
    assert fastlayers.config.compile_layer_norm == before


@pytest.mark.cuda
def test_cuda_autocast_output_dtype_and_values_match_native():
    native = nn.LayerNorm(768, device="cuda")
    fused = fastlayers.LayerNorm.from_native(native)
    x = torch.randn(4, 9, 768, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_native, y_fused = native(x), fused(x)
    assert y_fused.dtype == y_native.dtype
    torch.testing.assert_close(y_fused, y_native, rtol=2e-6, atol=2e-6)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    fused = fastlayers.LayerNorm(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        for _ in range(2):
            torch.autograd.grad(fused(x), [x, fused.weight], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused(x)
        gx, gw = torch.autograd.grad(y, [x, fused.weight], dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    y_ref = fused(x)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, [x, fused.weight], dy)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)


@pytest.mark.cuda
def test_launches_on_the_current_stream():
    fused = fastlayers.LayerNorm(4096, device="cuda")
    src = torch.randn(2048, 4096, device="cuda")
    x = torch.zeros_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keep the stream busy, so a kernel on another races
        x.copy_(src)
        y = fused(x)
    stream.synchronize()
    torch.testing.assert_close(y, fused(src), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_inputs_device():
    fused = fastlayers.LayerNorm(256, device="cuda:1")
    x = torch.randn(32, 256, device="cuda:1", requires_grad=True)
    with torch.cuda.device(0):
        y = fused(x)
        y.sum().backward()
    assert y.device == x.device == x.grad.device == fused.weight.grad.device
    torch.testing.assert_close(y.cpu(), fused.cpu()(x.detach().cpu()), rtol=1e-5, atol=1e-5)


def test_fx_trace_and_torch_function_mode_take_the_op_path():
    model = nn.Sequential(nn.Linear(16, 16), fastlayers.LayerNorm(16))
    traced = torch.fx.symbolic_trace(model)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert layer_norm_fwd in targets
    x = torch.randn(3, 16)
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)

    seen = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        model(x)
    assert layer_norm_fwd in seen
