"""The fused sm_80 Linear + activation kernel (CUTLASS 2.x, mma.sync), which serves 8.x GPUs by
default: forced through its raw entry on any GPU from 8.0 on (an H100 included), every tile
config, dtype, weight layout and epilogue against float64, outputs poisoned; the optional bias
and pre-activation; CUDA graph capture; argument errors; the 8.x dispatch where such a GPU runs
the tests. The tile and size rules are also checked for an H100, an A100 and an L4 on any
machine (the CUDA build's rule functions, no GPU needed)."""

import math

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_to_reference

from fastlayers._extension import _C
from fastlayers.functional import linear_act_path, linear_gelu
from fastlayers.ops.linear_act import sm80_available

# sm80::Config: the raw entry's config argument -> a test id
SM80_CONFIGS = {-1: "auto", **_C._testing.sm80_tile_configs()}
# the raw entry's epilogue argument -> (activation of F, its name)
EPILOGUES = {0: "gelu", 1: "gelu_tanh", 2: "relu", 3: "identity"}


def needs_sm80():
    if not sm80_available("cuda"):
        pytest.skip("needs a GPU of compute capability 8.0+ and the sm_80 CUTLASS kernels")


def fits(config: int) -> bool:
    """Whether this GPU has the shared memory for config's tile (128x256: 144 KiB)."""
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    return config != 0 or smem >= 144 * 1024


def act(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "identity":
        return z
    if activation == "relu":
        return F.relu(z)
    return F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def run_raw(x, stored, b, epilogue, config, transposed, keep_preact=True):
    """(y, preact or None) from the raw entry, outputs pre-filled with NaN."""
    m, n = x.shape[0], stored.shape[1] if transposed else stored.shape[0]
    y = torch.full((m, n), math.nan, device="cuda", dtype=x.dtype)
    z = torch.full_like(y, math.nan) if keep_preact else None
    _C._testing.linear_act_sm80_raw(x, stored, b, y, z, transposed, epilogue, config)
    return y, z


@pytest.mark.cuda
@pytest.mark.parametrize("config", list(SM80_CONFIGS), ids=list(SM80_CONFIGS.values()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["w_nk", "w_kn"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES), ids=list(EPILOGUES.values()))
def test_every_config_dtype_layout_and_epilogue(config, dtype, transposed, epilogue):
    """Partial tiles in m, n and k (300 x 136 -> 264): the activation and the kept
    pre-activation against float64, by the DESIGN rule."""
    needs_sm80()
    if not fits(config):
        pytest.skip("this GPU lacks the shared memory for the 128x256 tile")
    m, k, n = 300, 136, 264
    w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    stored = w.t().contiguous() if transposed else w
    b = torch.randn(n, device="cuda").to(dtype)
    x = torch.randn(m, k, device="cuda").to(dtype)
    y, z = run_raw(x, stored, b, epilogue, config, transposed)
    activation = EPILOGUES[epilogue]
    z_ref = F.linear(x.double(), w.double(), b.double())
    z_nat = F.linear(x, w, b)
    assert_close_to_reference(z, z_nat, z_ref, dtype, f"config {config} preact")
    assert_close_to_reference(y, act(z_nat, activation), act(z_ref, activation), dtype, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_without_bias_or_preact_and_at_a_model_shape(bias):
    """No bias (CUTLASS reads zeros) and no pre-activation (its stores masked off), at BERT-base's
    FC1 shape with the auto config; the output against float64 on its first rows."""
    needs_sm80()
    m, k, n, dtype = 2048, 768, 3072, torch.bfloat16
    w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    x = torch.randn(m, k, device="cuda").to(dtype)
    y, _ = run_raw(x, w, b, 0, -1, False, keep_preact=False)
    ref = F.gelu(F.linear(x.double(), w.double(), None if b is None else b.double()))
    nat = F.gelu(F.linear(x, w, b))
    assert_close_to_reference(y, nat, ref, dtype, "sm80 erf, auto config")


@pytest.mark.cuda
def test_graph_capture_replays_the_kernel():
    needs_sm80()
    m, k, n, dtype = 256, 64, 128, torch.float16
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / 8
    b = torch.randn(n, device="cuda", dtype=dtype)
    y = torch.empty(m, n, device="cuda", dtype=dtype)
    _C._testing.linear_act_sm80_raw(x, w, b, y, None, False, 1, -1)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C._testing.linear_act_sm80_raw(x, w, b, y, None, False, 1, -1)
    x.copy_(torch.randn_like(x))
    y.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    nat = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert_close_to_reference(y, nat, ref, dtype, "replayed graph")


@pytest.mark.cuda
def test_bad_arguments_get_errors_that_name_them():
    needs_sm80()
    dtype = torch.bfloat16
    x = torch.randn(64, 32, device="cuda", dtype=dtype)
    w = torch.randn(48, 32, device="cuda", dtype=dtype)
    y = torch.empty(64, 48, device="cuda", dtype=dtype)
    with pytest.raises(RuntimeError, match=r"config -1\.\.2"):
        _C._testing.linear_act_sm80_raw(x, w, None, y, None, False, 0, 3)
    with pytest.raises(RuntimeError, match=r"epilogue must be 0\.\.3"):
        _C._testing.linear_act_sm80_raw(x, w, None, y, None, False, 7, 0)
    with pytest.raises(RuntimeError, match="y must be"):
        _C._testing.linear_act_sm80_raw(x, w, None, y[:, :40].contiguous(), None, False, 0, 0)
    with pytest.raises(RuntimeError, match="float32 input"):
        _C._testing.linear_act_sm80_raw(x.float(), w.float(), None, y.float(), None, False, 0, 0)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        x30, w30 = x[:, :30].contiguous(), w[:, :30].contiguous()
        _C._testing.linear_act_sm80_raw(x30, w30, None, y, None, False, 0, 0)
    shifted = torch.empty(64 * 32 + 1, device="cuda", dtype=dtype)[1:].view(64, 32)
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        _C._testing.linear_act_sm80_raw(shifted, w, None, y, None, False, 0, 0)


@pytest.mark.cuda
def test_eight_x_gpus_dispatch_to_it():
    """On a compute capability 8.x GPU, linear_gelu takes the sm80 kernel at a model shape (and
    its output is the raw entry's, bit for bit); elsewhere this has nothing to check."""
    needs_sm80()
    if torch.cuda.get_device_capability(0)[0] != 8:
        pytest.skip("the sm80 kernel is the default path on 8.x GPUs only")
    x = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16) / 32
    b = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    assert linear_act_path(x, w, b, activation="gelu") == "cutlass_sm80"
    y, _ = run_raw(x, w, b, 0, -1, False, keep_preact=False)
    assert torch.equal(linear_gelu(x, w, b), y)


# (SMs, opt-in shared memory per block, shared memory per SM) in bytes
GPUS = {
    "H100": (132, 232448, 233472),
    "A100": (108, 166912, 167936),
    "L4": (58, 101376, 102400),
}


@pytest.mark.parametrize(
    ("shape", "h100", "a100", "l4"),
    [
        ((8192, 768, 3072), 1, 0, 1),
        ((8192, 3072, 768), 1, 0, 1),
        ((8192, 4096, 16384), 0, 0, 1),
        ((2048, 768, 3072), 1, 0, 1),
        ((1024, 768, 3072), 1, 1, 1),
        ((256, 768, 3072), 2, 2, 2),
    ],
)
def test_tile_rule_by_shared_memory(shape, h100, a100, l4):
    """The sm80 tile rule (no GPU needed): where two 128x128 tiles share an SM (H100) 128x128
    unless K >= 2048 with 8 waves of 128x256 tiles; where one tile of either size fits (A100)
    128x256 from one wave of its tiles; 128x128 where 128x256 does not fit (L4); 64x64 below a
    wave of 128x128 tiles. 0 128x256, 1 128x128, 2 64x64."""
    m, k, n = shape
    got = {name: _C._testing.sm80_tile_config(m, n, k, *gpu) for name, gpu in GPUS.items()}
    assert got == {"H100": h100, "A100": a100, "L4": l4}


def test_default_size_rule_stops_at_in_features_2048():
    assert _C._testing.sm80_size_refusal(8192, 8192, 2048, 108) is None
    assert _C._testing.sm80_size_refusal(32, 3072, 768, 108) is None
    assert "in_features over 2048" in _C._testing.sm80_size_refusal(8192, 1024, 2056, 108)
