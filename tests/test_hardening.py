"""Hardening: the fused layers and patched models under concurrent Python threads (outputs and
gradients equal to the same work run alone), no host-device synchronisation in forward or
backward, no memory growth over many iterations (CUDA allocator exactly flat, host RSS bounded),
and the GIL released while a CPU op computes. CPU versions run in CI; `cuda` ones on a GPU."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import pytest
import torch
import torch.nn.functional as F
from fastlayers.patching.checking.numerics import default_tolerance
from numerics import DTYPES, max_err
from test_training import tiny_model
from tiny_models import MODELS, build, first_output, make_inputs
from torch import nn

import fastlayers
from fastlayers.functional import layer_norm, linear_gelu, linear_gelu_path, relu_scale
from fastlayers.ops.linear_act import fallback_rows, sm90_available

MiB = 1 << 20

# ------------------------------------------------------------------------------------------
# Thread safety: each thread runs forward + backward over its own fresh random inputs; every
# output and gradient must equal what the same model computes alone on the same inputs.


@dataclass
class Workload:
    """A model, the tensors whose gradients are checked, and (input, grad_output) pairs."""

    name: str
    model: nn.Module
    params: list[tuple[str, nn.Parameter]]
    inputs: list[tuple[torch.Tensor, torch.Tensor]]

    def run(self, i: int) -> list[torch.Tensor | None]:
        """[output, d input, d params...] of iteration i (autograd.grad: no .grad is touched,
        so threads may share one model)."""
        x = self.inputs[i][0].detach().requires_grad_()
        if isinstance(self.model, nn.Sequential):
            out = self.model(x)
        else:
            out = first_output(self.model(inputs_embeds=x))
        params = [p for _, p in self.params]
        grads = torch.autograd.grad(out, [x, *params], self.inputs[i][1], allow_unused=True)
        return [out.detach(), *grads]

    def names(self) -> list[str]:
        return ["output", "grad input", *(f"grad {n}" for n, _ in self.params)]


def hf_workload(name: str, device: str, dtype: torch.dtype, iters: int, model=None) -> Workload:
    """A patched tiny HF model of tiny_models (or `model`, shared with another workload) fed
    through inputs_embeds: the embeddings of fresh random ids. The word-embedding table itself
    is left out of the graph (its gradient would be megabytes per iteration; the gradient with
    respect to the embeddings carries the same information)."""
    if model is None:
        model = build(name, device, dtype)
        fastlayers.patch(model)
    table = model.get_input_embeddings().weight
    params = [(n, p) for n, p in model.named_parameters() if p is not table]
    inputs = []
    with torch.no_grad():
        for _ in range(iters):
            ids = make_inputs(MODELS[name][2], device, batch=3, seq=16)["input_ids"]
            x = model.get_input_embeddings()(ids)
            inputs.append((x, torch.randn_like(x)))
    return Workload(name, model, params, inputs)


def layer_stack(device: str, dtype: torch.dtype, k: int, n: int) -> nn.Sequential:
    """Every fused layer in one model; ReLUScale in place on the GELU output (autograd path)."""
    stack = nn.Sequential(
        fastlayers.LayerNorm(k),
        fastlayers.FusedLinearGELU(k, n),
        fastlayers.ReLUScale(0.5, inplace=True),
        nn.Linear(n, k),
    )
    return stack.to(device, dtype)


def stack_workload(device: str, dtype: torch.dtype, iters: int, model=None) -> Workload:
    """On CUDA, 4096 x 256 -> 1024: the fused sm90 kernel on H100/H200 in half precision."""
    rows, k, n = (4096, 256, 1024) if device == "cuda" else (256, 64, 128)
    model = model if model is not None else layer_stack(device, dtype, k, n)
    if sm90_available(device) and dtype != torch.float32:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        assert linear_gelu_path(x, model[1].weight, model[1].bias) == "cutlass_sm90"
    inputs = [
        (
            torch.randn(rows, k, device=device, dtype=dtype),
            torch.randn(rows, k, device=device, dtype=dtype),
        )
        for _ in range(iters)
    ]
    return Workload("stack", model, list(model.named_parameters()), inputs)


def make_pair(pair: str, device: str, dtype: torch.dtype, iters: int) -> list[Workload]:
    """'a+b': two workloads with their own models; 'a+a(shared)': one model, two threads."""
    first, second = pair.split("+")
    build_one = stack_workload if first == "stack" else _hf(first)
    a = build_one(device, dtype, iters)
    if second.endswith("(shared)"):
        return [a, build_one(device, dtype, iters, model=a.model)]
    build_two = stack_workload if second == "stack" else _hf(second)
    return [a, build_two(device, dtype, iters)]


def _hf(name: str) -> Callable[..., Workload]:
    return lambda device, dtype, iters, model=None: hf_workload(name, device, dtype, iters, model)


def run_concurrently(
    workloads: list[Workload], streams: list[torch.cuda.Stream | None]
) -> list[list[list[torch.Tensor | None]]]:
    """Runs each workload's iterations in its own thread (on streams[i] when given), all
    started together; re-raises the first error of any thread."""
    barrier = threading.Barrier(len(workloads))
    results: list[list] = [[] for _ in workloads]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            stream = streams[i]
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                barrier.wait()
                for j in range(len(workloads[i].inputs)):
                    results[i].append(workloads[i].run(j))
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(workloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def first_difference(got, ref) -> tuple[int, float] | None:
    """(index, max abs difference) of the first tensor of `got` not bitwise equal to `ref`."""
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        if (a is None) != (b is None):
            return k, float("inf")
        if a is not None and not torch.equal(a, b):
            return k, max_err(a, b)
    return None


def assert_same_as_alone(workload: Workload, results, reference, exact: bool, dtype) -> None:
    """Bitwise equal when `exact`; else within the end-to-end tolerance (rounding-size
    differences from a library's algorithm choice pass with a warning; a race is far above)."""
    rtol, atol = default_tolerance(dtype)
    names = workload.names()
    inexact = []
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        diff = first_difference(got, ref)
        if diff is None:
            continue
        what = f"{workload.name}, iteration {i}, {names[diff[0]]}: max difference {diff[1]:.3g}"
        assert not exact, f"{what} from the same work run alone (expected bitwise equality)"
        inexact.append(what)
        for j, (a, b) in enumerate(zip(got, ref, strict=True)):
            if a is not None:
                bound = atol + rtol * b.abs().max().item()
                err = max_err(a, b)
                where = f"{workload.name}, iteration {i}, {names[j]}"
                assert err <= bound, f"{where}: {err:.3g} > {bound:.3g} (tolerance)"
    if inexact:
        warnings.warn(
            f"{len(inexact)} of {len(results)} iterations not bitwise equal to a lone run (which "
            f"is not bitwise repeatable here either), within tolerance; first: {inexact[0]}",
            stacklevel=2,
        )


def check_threads(pair: str, device: str, dtype, iters: int, streams: str = "same") -> None:
    workloads = make_pair(pair, device, dtype, iters)
    reference = [[w.run(j) for j in range(iters)] for w in workloads]
    # Is a lone run bitwise repeatable? Ours are (no atomics, fixed reduction orders), and so
    # are ATen's CPU ops here and cuBLAS on one stream (and on several: PyTorch gives each
    # stream its own workspace, which cuBLAS's docs say keeps results bitwise). On CPU that is
    # required; on CUDA, if not, the comparison falls back to a tolerance.
    again = [w.run(0) for w in workloads]
    firsts = [r[0] for r in reference]
    exact = all(first_difference(a, r) is None for a, r in zip(again, firsts, strict=True))
    if device == "cuda":
        torch.cuda.synchronize()
        if streams == "own":
            stream_list = [torch.cuda.Stream() for _ in workloads]
        else:
            stream_list = [torch.cuda.current_stream()] * len(workloads)
    else:
        assert exact, f"{pair}: a lone CPU run repeated is not bitwise identical"
        stream_list = [None] * len(workloads)
    results = run_concurrently(workloads, stream_list)
    if device == "cuda":
        torch.cuda.synchronize()
    for w, got, ref in zip(workloads, results, reference, strict=True):
        assert len(got) == iters
        assert_same_as_alone(w, got, ref, exact, dtype)


@pytest.mark.parametrize("pair", ["bert+gpt2", "bert+bert(shared)", "stack+stack(shared)"])
def test_cpu_threads_give_the_results_of_a_lone_run(pair):
    """CPU, float32, bitwise: fastlayers' CPU kernels sum in a fixed order whatever the thread
    count (fixed row chunks), and the ATen ops of these models are deterministic too (checked
    first: a lone run repeated is bitwise identical)."""
    iters = 12 if pair.startswith("stack") else 16
    check_threads(pair, "cpu", torch.float32, iters)


@pytest.mark.cuda
@pytest.mark.parametrize("streams", ["own", "same"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pair", ["bert+gpt2", "bert+bert(shared)", "stack+stack(shared)"])
def test_cuda_threads_give_the_results_of_a_lone_run(pair, dtype, streams):
    """Each thread on its own CUDA stream (kernels must launch on the current stream, backward
    on the forward's) or both on one. Attention runs its math backend: the fused SDPA kernels'
    backward may use atomics, which would blur a bitwise comparison."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    iters = 24 if pair.startswith("stack") else 64
    with sdpa_kernel(SDPBackend.MATH):  # global flags: they hold in the worker threads too
        check_threads(pair, "cuda", dtype, iters, streams)


# ------------------------------------------------------------------------------------------
# Steps shared by the synchronisation and memory tests: each call makes fresh inputs and runs
# forward and backward (and an inference forward), keeping nothing.


def forward_backward(module: nn.Module, shape, dtype, autocast: bool = False) -> None:
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    amp = torch.autocast("cuda", dtype=dtype) if autocast else contextlib.nullcontext()
    with amp:
        y = module(x)
    params = [p for p in module.parameters() if p.requires_grad]
    torch.autograd.grad(y, [x, *params], torch.randn_like(y))
    with torch.no_grad(), amp:
        module(x)  # the inference path (Linear + GELU: no pre-activation kept)


def relu_scale_inplace_steps(shape, dtype) -> None:
    with torch.no_grad():
        relu_scale(torch.randn(shape, device="cuda", dtype=dtype), 0.5, inplace=True)
        strided = torch.randn(shape[::-1], device="cuda", dtype=dtype).t()  # copy-back path
        relu_scale(strided, 0.5, inplace=True)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    y = relu_scale(x * 2.0, 0.5, inplace=True)  # tracked by autograd: out of place + copy_
    torch.autograd.grad(y, x, torch.randn_like(y))


def cuda_layer_steps(dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """name -> step, for every CUDA kernel path of the package in `dtype`."""
    dev = "cuda"
    ln = fastlayers.LayerNorm(768, device=dev, dtype=dtype)
    ln_odd = fastlayers.LayerNorm(771, device=dev, dtype=dtype)  # generic (scalar) kernels
    relu = fastlayers.ReLUScale(0.5)
    fused = fastlayers.FusedLinearGELU(256, 1024, device=dev, dtype=dtype)
    small = fastlayers.FusedLinearGELU(256, 1024, approximate="tanh", device=dev, dtype=dtype)
    fallback_rows_small = fallback_rows(256, 1024, dtype)
    w_kn = torch.randn(256, 1024, device=dev, dtype=dtype, requires_grad=True)  # Conv1D layout
    steps = {
        "layer_norm": lambda: forward_backward(ln, (512, 768), dtype),
        "layer_norm_generic": lambda: forward_backward(ln_odd, (64, 771), dtype),
        "relu_scale": lambda: forward_backward(relu, (4096, 1024), dtype),
        "relu_scale_inplace": lambda: relu_scale_inplace_steps((4096, 1024), dtype),
        "linear_gelu_fallback": lambda: forward_backward(small, (fallback_rows_small, 256), dtype),
    }
    if dtype != torch.float32:
        ln32 = fastlayers.LayerNorm(768, device=dev)  # float32 params, half input (autocast)
        steps["layer_norm_autocast"] = lambda: forward_backward(ln32, (512, 768), dtype, True)
        # 4096 x 1024 output: 256 tiles of 128 x 128, the fused sm90 kernel on H100/H200.
        steps["linear_gelu_fused"] = lambda: forward_backward(fused, (4096, 256), dtype)

        def transposed() -> None:
            x = torch.randn(4096, 256, device=dev, dtype=dtype, requires_grad=True)
            y = linear_gelu(x, w_kn, None, "tanh", weight_transposed=True)
            torch.autograd.grad(y, [x, w_kn], torch.randn_like(y))

        steps["linear_gelu_fused_w_kn"] = transposed
        if sm90_available(dev):
            x = torch.randn(4096, 256, device=dev, dtype=dtype)
            assert linear_gelu_path(x, fused.weight, fused.bias) == "cutlass_sm90"
            assert linear_gelu_path(x, w_kn, weight_transposed=True) == "cutlass_sm90"
    x = torch.randn(fallback_rows_small, 256, device=dev, dtype=dtype)
    assert linear_gelu_path(x, small.weight, small.bias).startswith("fallback: ")
    return steps


def model_training_step(kind: str, dtype: torch.dtype, patched: bool) -> Callable[[], None]:
    """One training step of test_training's tiny LM (vocab 64) on CUDA: forward, loss,
    backward, AdamW (capturable: its step counters stay on the GPU), grads set to None."""
    model = tiny_model(kind).to("cuda", dtype)
    if patched:
        fastlayers.patch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)

    def step() -> None:
        ids = torch.randint(0, 64, (4, 16), device="cuda")
        labels = torch.randint(0, 64, (4, 16), device="cuda")
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------------------
# No host-device synchronisation. torch.cuda.set_sync_debug_mode sees the synchronising calls
# that go through torch (.item(), blocking copies, torch.cuda.synchronize); the profiler's
# record of CUDA runtime/driver calls also sees raw ones (a cudaDeviceSynchronize in C++).

SYNCING_CALLS = {
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cudaMemcpyFromSymbol",
    "cudaMemcpyToSymbol",
    "cudaFree",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuEventSynchronize",
    "cuMemcpy",
    "cuMemcpyDtoH",
    "cuMemcpyHtoD",
    "cuMemFree",
}
_PROBE = "fastlayers_sync_probe"


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def sync_warnings(step: Callable[[], None]) -> list[str]:
    """Where step() made a synchronising call through torch (sync debug mode 'warn')."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_debug_mode("warn"):
            step()
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def profiled_sync_calls(step: Callable[[], None]) -> list[str] | None:
    """The synchronising CUDA runtime/driver calls made during step(), from the profiler; None
    where the profiler recorded no runtime calls at all (nothing to conclude from)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(_PROBE):
            step()
    events = prof.events()  # leaving `profile` synchronises: count only inside the probe
    windows = [e.time_range for e in events if e.name == _PROBE and e.device_type == DeviceType.CPU]
    if len(windows) != 1:
        return None
    w = windows[0]
    inside = [e for e in events if w.start <= e.time_range.start and e.time_range.end <= w.end]
    if not any("LaunchKernel" in e.name for e in inside):
        return None
    return [e.name for e in inside if e.name.removesuffix("_v2") in SYNCING_CALLS]


def assert_no_sync(step: Callable[[], None], what: str) -> None:
    for _ in range(2):  # first calls create cuBLAS handles, workspaces, cached blocks
        step()
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        step()
    calls = profiled_sync_calls(step)
    if calls is None:
        warnings.warn(f"{what}: the profiler recorded no CUDA runtime calls", stacklevel=2)
    else:
        assert not calls, f"{what}: synchronising CUDA calls {calls}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_layers_never_synchronise(dtype):
    for name, step in cuda_layer_steps(dtype).items():
        assert_no_sync(step, name)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_cuda_patched_training_step_adds_no_synchronisation(kind):
    """A whole training step of a patched model under sync debug mode 'error'. transformers
    itself may synchronise somewhere (its mask code has done so): then the patched model must
    make no more synchronising calls than the native one, and none from fastlayers."""
    native = model_training_step(kind, torch.bfloat16, patched=False)
    patched = model_training_step(kind, torch.bfloat16, patched=True)
    for step in (native, patched, native, patched):
        step()
    torch.cuda.synchronize()
    native_syncs = sync_warnings(native)
    if not native_syncs:
        with sync_debug_mode("error"):
            patched()
    else:
        patched_syncs = sync_warnings(patched)
        ours = [s for s in patched_syncs if "fastlayers" in s or "patching" in s]
        assert not ours and len(patched_syncs) <= len(native_syncs), (patched_syncs, native_syncs)
    native_calls, patched_calls = profiled_sync_calls(native), profiled_sync_calls(patched)
    if native_calls is not None and patched_calls is not None:
        assert len(patched_calls) <= len(native_calls), (patched_calls, native_calls)


# ------------------------------------------------------------------------------------------
# No memory growth.


def cuda_memory() -> tuple[int, int, int]:
    """(allocated, reserved, allocation retries): host-side allocator counters, no sync."""
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), retries


def settled_cuda_memory(base: tuple[int, int, int], wait_s: float = 0.5) -> tuple[int, int, int]:
    """cuda_memory(), read again for up to `wait_s` while it differs from `base`. A CUDA
    backward runs on the autograd engine's device thread, which drops the finished graph task
    (holding the gradients it returned) shortly after torch.autograd.grad has returned: a
    reading taken at once can still count the last step's gradients (seen on a busy H100:
    exactly one step's dx + dW + db). What a step leaks never comes back."""
    deadline = time.monotonic() + wait_s
    now = cuda_memory()
    while now != base and time.monotonic() < deadline:
        time.sleep(0.001)
        now = cuda_memory()
    return now


def assert_flat_cuda_memory(step: Callable[[], None], what: str, iters: int = 50) -> None:
    """After warm-up, allocated bytes exactly flat step after step; reserved bytes (the
    caching allocator's segments) and allocation retries unchanged."""
    for _ in range(5):  # the allocator's segments settle after the first calls
        step()
    # garbage an earlier test in this worker left in reference cycles (CUDA tensors among it)
    # would otherwise be freed by the collector in the middle of the steps (a one-off failure,
    # 113 KB gone from step 29 of 50 on with 4 workers on an H100, fits that)
    gc.collect()
    torch.cuda.synchronize()
    time.sleep(0.05)  # the device thread has let go of the last step's gradients
    base = cuda_memory()
    samples = []
    for _ in range(iters):
        step()
        samples.append(settled_cuda_memory(base))
    grew = [(i, s) for i, s in enumerate(samples) if s != base]
    assert not grew, f"{what}: (allocated, reserved, retries) {base} after warm-up, then {grew[:5]}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_layers_memory_is_flat(dtype):
    for name, step in cuda_layer_steps(dtype).items():
        assert_flat_cuda_memory(step, name)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_cuda_patched_training_step_memory_is_flat(kind):
    assert_flat_cuda_memory(model_training_step(kind, torch.bfloat16, patched=True), kind)


def cpu_layer_step(layers: dict[str, nn.Module]) -> None:
    """Forward and backward of each fused layer on small fresh CPU inputs, plus in place."""
    x = torch.randn(64, 256, requires_grad=True)
    for name in ("layer_norm", "linear_gelu", "linear_relu"):
        y = layers[name](x)
        params = list(layers[name].parameters())
        torch.autograd.grad(y, [x, *params], torch.randn_like(y))
    y = layers["relu_scale"](x)
    torch.autograd.grad(y, x, torch.randn_like(y))
    with torch.no_grad():
        relu_scale(torch.randn(64, 256), 0.5, inplace=True)
        layer_norm(torch.randn(64, 256), 256)


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_cpu_host_memory_does_not_grow():
    """A few thousand CPU iterations of the layers and a patched tiny model step, with the
    cycle collector off: everything must be freed by reference counting alone. RSS may move
    by allocator noise, bounded by 16 MiB here; a leaked activation-sized tensor (64 x 256
    float32, 64 KiB) would add 125 MiB over 2000 steps (a leaked statistics or bias-gradient
    tensor, 0.25-1 KiB, would stay under the bound). Python objects: flat."""
    layers = {
        "layer_norm": fastlayers.LayerNorm(256),
        "linear_gelu": fastlayers.FusedLinearGELU(256, 256),
        "linear_relu": fastlayers.FusedLinearReLU(256, 256),
        "relu_scale": fastlayers.ReLUScale(0.5),
    }
    model = build("bert")
    fastlayers.patch(model)
    ids = make_inputs("ids", "cpu", batch=2, seq=16)

    def model_step() -> None:
        out = first_output(model(**ids))
        torch.autograd.grad(out, list(model.encoder.parameters()), torch.randn_like(out))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops gain nothing from a team; a busy CI host stalls one
    try:
        for _ in range(100):
            cpu_layer_step(layers)
            model_step()
        gc.collect()
        gc.disable()
        rss0, objects0 = rss(), len(gc.get_objects())
        for i in range(2000):
            cpu_layer_step(layers)
            if i % 10 == 0:
                model_step()
        rss1, objects1 = rss(), len(gc.get_objects())
    finally:
        gc.enable()
        torch.set_num_threads(threads)
    assert rss1 - rss0 <= 16 * MiB, f"RSS grew by {(rss1 - rss0) / MiB:.1f} MiB"
    assert objects1 - objects0 <= 50, f"{objects1 - objects0} more Python objects"


# ------------------------------------------------------------------------------------------
# The GIL: a CPU op must let other Python threads run while it computes, as torch's ops do.


def longest_stall_ms(fn: Callable[[], object], calls: int = 2) -> tuple[float, float]:
    """(longest time a pure-Python thread could not run, mean time of one fn() call), in ms,
    with fn() called in this thread."""
    state = {"last": time.perf_counter(), "gap": 0.0}
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            now = time.perf_counter()
            state["gap"] = max(state["gap"], now - state["last"])
            state["last"] = now

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)  # a waiting thread asks for the GIL after 1 ms
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.01)
        state["gap"] = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - t0) / calls
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    return state["gap"] * 1e3, elapsed * 1e3


@pytest.mark.parametrize(
    "op",
    [
        "layer_norm",  # _C.layer_norm, the eager fast path (releases the GIL since this test)
        "linear_gelu",
        "relu_scale",  # the torch.ops path
    ],
)
def test_cpu_ops_release_the_gil(op):
    x = torch.randn(8192, 2048)  # 64 MiB: tens of milliseconds per call on two cores
    w = torch.randn(1024, 2048) / 64
    fn = {
        "layer_norm": lambda: layer_norm(x, 2048),
        "linear_gelu": lambda: linear_gelu(x[:2048], w),
        "relu_scale": lambda: relu_scale(x, 0.5),
    }[op]
    fn()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core for the op, one for the spinner: no CPU contention
    try:  # best of three: the GIL stalls a thread every time, the OS only now and then
        stall, per_call = min(longest_stall_ms(fn) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    if per_call < 10:
        pytest.skip(f"{op} took {per_call:.1f} ms: too short to tell")
    assert stall < 0.5 * per_call, f"{op}: other threads stalled {stall:.0f} of {per_call:.0f} ms"
