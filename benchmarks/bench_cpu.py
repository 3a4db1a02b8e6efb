"""CPU timings: fastlayers' CPU kernels against the native modules, per call and for the default
model (all-MiniLM-L6-v2) patched, native and fastlayers alternating round by round so that load
from other processes hits both alike. Prints a markdown table; with --out also writes
bench_cpu.md / bench_cpu.json there.

    python benchmarks/bench_cpu.py [--threads N] [--rounds R] [--out DIR] [--skip-model]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import write_results

import fastlayers
from fastlayers.functional import layer_norm, linear_gelu, relu_scale

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def call_us(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of fn() in microseconds over reps calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def alternate(native: Callable[[], object], ours: Callable[[], object], rounds: int, reps: int):
    """(native, ours) medians over rounds, each round timing native then ours (reps calls each)
    after a warm-up call of each."""
    native(), ours()
    n, o = [], []
    for _ in range(rounds):
        n.append(call_us(native, reps))
        o.append(call_us(ours, reps))
    return statistics.median(n), statistics.median(o)


def op_cases(dtype: torch.dtype):
    """(name, native fn, fastlayers fn) per op: forward, and forward + backward."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    cases = []
    for shape in ((4096, 384), (32, 128, 384)):
        x, w, b = randn(*shape), randn(384), randn(384)
        label = "x".join(map(str, shape))
        cases.append(
            (
                f"LayerNorm {label} fwd",
                lambda x=x, w=w, b=b: F.layer_norm(x, (384,), w, b),
                lambda x=x, w=w, b=b: layer_norm(x, 384, w, b),
            )
        )
    xg, wg, bg = randn(4096, 384, grad=True), randn(384, grad=True), randn(384, grad=True)
    dy = randn(4096, 384)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(xg, (384,), wg, bg), (xg, wg, bg), dy)

    cases.append(("LayerNorm 4096x384 fwd+bwd", fwd_bwd(F.layer_norm), fwd_bwd(layer_norm)))
    r = randn(32, 128, 1536)
    cases.append(
        (
            "ReLU 32x128x1536: relu vs relu_scale(1)",
            lambda: torch.relu(r),
            lambda: relu_scale(r, 1.0),
        )
    )
    cases.append(
        (
            "ReLU 32x128x1536: relu*0.5 vs relu_scale(0.5)",
            lambda: torch.relu(r) * 0.5,
            lambda: relu_scale(r, 0.5),
        )
    )
    xl, wl, bl = randn(4096, 384), randn(1536, 384) / 20, randn(1536)
    cases.append(
        (
            "Linear+GELU 4096x384->1536 fwd",
            lambda: F.gelu(F.linear(xl, wl, bl)),
            lambda: linear_gelu(xl, wl, bl),
        )
    )
    return cases


def model_times(dtype: torch.dtype, rounds: int, reps: int) -> tuple[float, float]:
    """(native, patched) median ms per forward of the default model, 32 sentences x 128
    tokens, in eval mode under no_grad; patch/unpatch between the timings of each round."""
    from fastlayers.patching.checking.models import default_model_path, load_model, make_inputs

    folder = default_model_path()
    model, _ = load_model(folder)
    model = model.to(dtype)
    inputs, _ = make_inputs(folder, model, 32, 128, torch.device("cpu"))

    def forward():
        with torch.no_grad():
            model(**inputs)

    native, patched = [], []
    forward()
    fastlayers.patch(copy.deepcopy(model))  # import-time work outside the timings
    for _ in range(rounds):
        native.append(call_us(forward, reps) / 1e3)
        fastlayers.patch(model)
        forward()
        patched.append(call_us(forward, reps) / 1e3)
        fastlayers.unpatch(model)
    return statistics.median(native), statistics.median(patched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20, help="calls per round (ops)")
    parser.add_argument("--model-reps", type=int, default=3, help="forwards per round (model)")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows, payload = [], []
    for dname, dtype in DTYPES.items():
        for name, native, ours in op_cases(dtype):
            n, o = alternate(native, ours, args.rounds, args.reps)
            rows.append(f"| {name} | {dname} | {n:,.0f} us | {o:,.0f} us | {n / o:.2f}x |")
            payload.append({"case": name, "dtype": dname, "native_us": n, "fastlayers_us": o})
    if not args.skip_model:
        for dname, dtype in DTYPES.items():
            n, o = model_times(dtype, args.rounds, args.model_reps)
            name = "all-MiniLM-L6-v2 forward, 32 x 128 tokens"
            rows.append(f"| {name} | {dname} | {n:,.1f} ms | {o:,.1f} ms | {n / o:.2f}x |")
            payload.append({"case": name, "dtype": dname, "native_ms": n, "fastlayers_ms": o})
    header = (
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} torch threads; torch {torch.__version__}; "
        f"{datetime.date.today().isoformat()}; median over {args.rounds} alternating rounds\n\n"
        "| case | dtype | native | fastlayers | speed-up (native / fastlayers) |\n"
        "|---|---|---:|---:|---:|"
    )
    table = header + "\n" + "\n".join(rows)
    write_results(args.out, "bench_cpu", table, {"threads": args.threads, "rows": payload})


if __name__ == "__main__":
    main()
