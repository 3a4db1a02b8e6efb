"""Every op on a second GPU: tensors on cuda:1 are computed on cuda:1, on cuda:1's current
stream, whatever the current device is (the device guard), and give what the same call gives
with cuda:1 current. Needs two GPUs (the nvidia-h200-x2 machine)."""

import pytest
import torch
from tiny_models import build, make_inputs, run

import fastlayers
from fastlayers.ops.linear_act import sm90_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


D1 = "cuda:1"
# name -> (module on cuda:1, input shape, dtype): each CUDA kernel path of the package. Built
# when a test runs (collection must not touch CUDA: CI has no GPU).
LAYER_CASES = {
    "layer_norm": lambda: (fastlayers.LayerNorm(1024, device=D1), (64, 1024), torch.bfloat16),
    "layer_norm fp32": lambda: (fastlayers.LayerNorm(4097, device=D1), (9, 4097), torch.float32),
    "relu_scale": lambda: (fastlayers.ReLUScale(alpha=0.5), (4096, 257), torch.float16),
    # 2048 x 2048 output: 256 tiles of 128x128, waves 97% full on 132 SMs (three waves on 114):
    # the fused sm90 kernel on H100/H200.
    "linear_gelu fused": lambda: (
        fastlayers.FusedLinearGELU(256, 2048, device=D1, dtype=torch.bfloat16),
        (2048, 256),
        torch.bfloat16,
    ),
    "linear_gelu fallback": lambda: (
        fastlayers.FusedLinearGELU(72, 40, approximate="tanh", device=D1, dtype=torch.float16),
        (33, 72),
        torch.float16,
    ),
}


def forward_backward(module, x, dy):
    x = x.detach().requires_grad_()
    y = module(x)
    grads = torch.autograd.grad(y, [x, *module.parameters()], dy)
    return [y.detach(), *grads]


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_runs_on_its_inputs_device_and_current_stream(name):
    module, shape, dtype = LAYER_CASES[name]()
    if name == "linear_gelu fused" and sm90_available(D1):
        x = torch.randn(shape, device=D1, dtype=dtype)
        assert fastlayers.functional.linear_gelu_path(x, module.weight, module.bias) == (
            "cutlass_sm90"
        )
    src = torch.randn(shape, device=D1, dtype=dtype)
    dy = torch.randn((*shape[:-1], module(src).shape[-1]), device=D1, dtype=dtype)
    with torch.cuda.device(1):
        expected = forward_backward(module, src, dy)

    busy = torch.cuda.Stream(device=D1)
    x = torch.full_like(src, float("nan"))
    torch.cuda.synchronize(1)
    with torch.cuda.stream(busy), torch.cuda.device(0):
        # cuda:1's current stream is `busy` and still sleeping when x is filled: a kernel
        # launched on another stream, or on cuda:0, would read NaN or race.
        torch.cuda._sleep(20_000_000)
        x.copy_(src)
        got = forward_backward(module, x, dy)
        assert torch.cuda.current_device() == 0
    busy.synchronize()
    for g, e in zip(got, expected, strict=True):
        assert g.device == torch.device("cuda:1")
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"{name}: differs from cuda:1 run")


def test_patched_model_on_the_second_gpu_matches_native():
    native = build("bert", device="cuda:1")
    patched = build("bert", device="cuda:1")
    patched.load_state_dict(native.state_dict())
    fastlayers.patch(patched)
    inputs = make_inputs("ids", "cuda:1", batch=4, seq=16)
    with torch.cuda.device(0):
        out, ref = run(patched, inputs), run(native, inputs)
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_mixed_devices_are_refused_with_the_argument_named():
    norm = fastlayers.LayerNorm(64, device="cuda:1")
    with pytest.raises(RuntimeError, match=r"(input|weight).*cuda:0|cuda:0.*(input|weight)"):
        norm(torch.randn(8, 64, device="cuda:0"))
    lin = fastlayers.FusedLinearGELU(64, 64, device="cuda:1")
    with pytest.raises(RuntimeError, match=r"(input|weight).*cuda:0|cuda:0.*(input|weight)"):
        lin(torch.randn(8, 64, device="cuda:0"))
