"""Timing helpers shared by the benchmarks: device-event medians after warm-up with the L2
flushed between runs, measured copy bandwidth, and peers that may or may not be importable."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(
    fn: Callable[[], object], warmup: int = 10, reps: int = 100, flush_l2: bool = True
) -> float:
    """Median time of fn() in milliseconds, from CUDA events around each call. Between calls a
    buffer larger than L2 is overwritten, so every call starts with a cold cache."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.fill_(1)
        times.append(event_ms(fn))
    return statistics.median(times)


def do_bench_ms(fn: Callable[[], object]) -> float | None:
    """fn's time in milliseconds by triton's do_bench (the harness peers publish with: its own
    L2 flush, the mean), or None where triton is not importable."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return float(do_bench(fn))


# The issue-57 sweep of the row-wise ops (--sweep in bench_layer_norm, bench_rms_norm,
# bench_gated_act): every width at every row count, in each dtype asked for.
SWEEP_WIDTHS = (768, 1024, 2048, 4096, 8192, 16384)
SWEEP_ROWS = (2048, 8192, 32768, 65536)
DTYPES_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sweep_shapes() -> list[tuple[int, int]]:
    return [(rows, cols) for rows in SWEEP_ROWS for cols in SWEEP_WIDTHS]


def dtypes_named(names: str) -> dict[str, torch.dtype]:
    """``"bf16,fp32"`` -> {name: dtype}; an unknown name raises naming the choices."""
    out = {}
    for name in filter(None, names.split(",")):
        if name not in DTYPES_BY_NAME:
            raise SystemExit(f"--dtypes: unknown {name!r}; choose from {', '.join(DTYPES_BY_NAME)}")
        out[name] = DTYPES_BY_NAME[name]
    return out


def event_ms(fn: Callable[[], object]) -> float:
    """Time of one fn() call in milliseconds, from CUDA events around it."""
    return event_and_host_ms(fn)[0]


def event_and_host_ms(fn: Callable[[], object]) -> tuple[float, float]:
    """(device time from CUDA events around one fn() call, host time until fn() returned), in
    milliseconds. Host time close to device time means the GPU waited on the CPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host * 1e3


def kernel_profile(
    fn: Callable[[], object], reps: int = 20, warmup: int = 3
) -> dict[str, tuple[int, float]]:
    """Each kernel fn() launches: (launches, GPU microseconds) per call of fn, read by the
    profiler over ``reps`` calls after ``warmup`` unprofiled ones (kernel name -> pair)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.count // reps, e.self_device_time_total / reps) for e in prof.key_averages()}


def kernel_times_us(fn: Callable[[], object], reps: int = 20) -> dict[str, float]:
    """GPU time of each kernel fn() launches, in microseconds per call (kernel name -> time),
    read by the profiler. Inputs stay in L2 between calls, for every implementation alike."""
    return {name: us for name, (_, us) in kernel_profile(fn, reps).items()}


def kernel_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """GPU busy time of fn() in milliseconds: the summed durations of the kernels it launches
    (kernel_times_us), so host launch time and gaps do not count."""
    return sum(kernel_times_us(fn, reps).values()) / 1e3


def paired_kernel_ms(
    fn: Callable[[], object], floor_fn: Callable[[], object], rounds: int = 9
) -> list[tuple[float, float]]:
    """GPU busy time (kernel_ms) of fn and of floor_fn, measured alternately: one (fn, floor)
    pair per round. Their ratio per round is steady where each one alone drifts with the GPU's
    clocks between and within runs."""
    return [(kernel_ms(fn), kernel_ms(floor_fn)) for _ in range(rounds)]


def copy_bandwidth_gbs(nbytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, reps=20, flush_l2=False)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def host_us_per_call(fn: Callable[[], object], calls: int = 2000) -> float:
    """Host time per call in microseconds on a tiny input: the launch path, not the kernel."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keeps the GPU busy for a while so that clocks have ramped before the first timing."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def write_results(out_dir: str | None, name: str, table: str, payload: dict) -> None:
    """Prints the table; with out_dir, also writes NAME.md (the table) and NAME.json (the
    payload with the GPU and torch version)."""
    print(table)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        gpu = gpu_name() if torch.cuda.is_available() else None  # None: a CPU benchmark
        json.dump({"gpu": gpu, "torch": torch.__version__, **payload}, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")


def gpu_name() -> str:
    return torch.cuda.get_device_name()


def time_row_norms(
    impls: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    ref: torch.Tensor,
    params_of: Callable[[Any], list[torch.Tensor]],
    bw_gbs: float,
) -> list[dict]:
    """A row-normalisation benchmark's rows for one input (bench_layer_norm.py,
    bench_rms_norm.py): each implementation's forward and forward + backward (gradients of x and
    of ``params_of(impl)``) against the copy floor (2 and 4 x bytes(x); the 5-tensor minimum of an
    unfused pair beside it), and its max error against the float64 ``ref``."""
    rows, cols = x.shape
    dy = torch.randn_like(x)
    xg = x.clone().requires_grad_()
    nbytes = x.numel() * x.element_size()
    results = []
    for name, mod in impls.items():
        err = (mod(x).double() - ref).abs().max().item()

        def fwd(mod=mod):
            return mod(x)

        def fwd_bwd(mod=mod):
            return torch.autograd.grad(mod(xg), [xg, *params_of(mod)], dy)

        for mode, fn, floor_bytes in (("fwd", fwd, 2 * nbytes), ("fwd+bwd", fwd_bwd, 4 * nbytes)):
            ms = median_ms(fn)
            peer_ms = do_bench_ms(fn)
            # Small shapes are dominated by host launch time: also report GPU busy time.
            gpu_ms = kernel_ms(fn) if rows * cols <= 1 << 24 else None
            floor_ms = floor_bytes / (bw_gbs * 1e9) * 1e3
            results.append(
                {
                    "shape": [rows, cols],
                    "dtype": str(x.dtype).split(".")[-1],
                    "mode": mode,
                    "impl": name,
                    "ms": ms,
                    "do_bench_ms": peer_ms,
                    "gpu_ms": gpu_ms,
                    "gbs": floor_bytes / (ms * 1e-3) / 1e9,
                    "x_floor": ms / floor_ms,
                    "x_min5": ms / (floor_ms * 5 / 4) if mode == "fwd+bwd" else None,
                    "max_err_vs_fp64": err,
                }
            )
    return results


def row_norm_table(rows: list[dict], host: list[dict], host_title: str) -> list[str]:
    """The table of a row-normalisation benchmark (bench_layer_norm.py, bench_rms_norm.py): one
    line per (shape, dtype, pass, impl) row, then the host time per call of each impl."""
    lines = [
        "| shape | dtype | pass | impl | time (us) | do_bench (us) | GPU busy (us) | GB/s "
        "| x floor | x 5-tensor min | max err vs fp64 |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        min5 = f"{r['x_min5']:.2f}" if r["x_min5"] is not None else ""
        gpu = f"{r['gpu_ms'] * 1e3:.1f}" if r["gpu_ms"] is not None else ""
        peer = f"{r['do_bench_ms'] * 1e3:.1f}" if r.get("do_bench_ms") is not None else ""
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['mode']} | {r['impl']} | "
            f"{r['ms'] * 1e3:.1f} | {peer} | {gpu} | {r['gbs']:.0f} | {r['x_floor']:.2f} | "
            f"{min5} | {r['max_err_vs_fp64']:.2g} |"
        )
    lines += [
        "",
        f"| host time per call, {host_title} | fwd (us) | fwd+bwd (us) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {h['impl']} | {h['fwd_us']:.1f} | {h['fwd+bwd_us']:.1f} |" for h in host]
    return lines


def load_encoder(model: str | None, dtype: str):
    """(model on CUDA in ``dtype``, eval; what it is; its tokenizer; its longest text in tokens)
    for a model folder, or the main job's default model: what the encode benchmarks run."""
    from fastlayers.patching.checking import models as hf_models

    folder = model or hf_models.default_model_path()
    base, what = hf_models.load_model(folder)
    base = base.to("cuda", getattr(torch, dtype)).eval()
    tokenizer, _ = hf_models.load_tokenizer(folder)
    return base, what, tokenizer, hf_models.max_text_length(folder, base, tokenizer)
