"""Linear + bias + GELU: fastlayers against eager (F.linear then F.gelu), cuBLASLt's tanh-GELU
epilogue (torch._addmm_activation) and torch.compile, forward and forward+backward, in one run on
one GPU.

Floor (GEMM-bound): forward, the plain GEMM torch.mm(x, w.t()) of the same shape and dtype;
forward+backward, the three plain GEMMs (x w^T, dz w, dz^T x), timed in the same run. Ratios
below 1.10 / 1.05 are the issue's targets. --sweep also times every compiled sm90 tile config
with the erf, tanh and identity epilogues (the identity isolates the GEMM from the GELU).

    python benchmarks/bench_linear_gelu.py [--out DIR] [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import gpu_name, median_ms, warm_up_gpu, write_results

import fastlayers
from fastlayers._extension import _C
from fastlayers.functional import linear_gelu, linear_gelu_path
from fastlayers.ops.linear_act import sm90_available

SHAPES = [(8192, 768, 3072), (8192, 4096, 16384), (4096, 1024, 4096), (32, 768, 3072)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = {
    0: "coop 256x128 c2x1",
    1: "pingpong 128x128 c2x1 epi 64x64",
}
EPILOGUES = {0: "erf", 1: "tanh", 2: "relu", 3: "identity"}
ERR_ROWS = 256  # rows of the output checked against float64


def timed(fn, budget_s: float = 0.4) -> float:
    """Median ms of fn, with as many repetitions as fit the budget (10 to 100)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = int(max(10, min(100, budget_s / max(once, 1e-6))))
    return median_ms(fn, warmup=3, reps=reps)


def make_inputs(m: int, k: int, n: int, dtype: torch.dtype):
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    return x, w, b


def max_err(y: torch.Tensor, x, w, b, approximate: str) -> float:
    ref = F.gelu(F.linear(x[:ERR_ROWS].double(), w.double(), b.double()), approximate=approximate)
    return (y[:ERR_ROWS].double() - ref).abs().max().item()


def eager(approximate: str):
    return lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate)


def forward_impls(dtype: torch.dtype, with_compile: bool) -> dict:
    impls = {
        "fastlayers erf": lambda x, w, b: linear_gelu(x, w, b, "none"),
        "fastlayers tanh": lambda x, w, b: linear_gelu(x, w, b, "tanh"),
        "eager erf": eager("none"),
        "eager tanh": eager("tanh"),
        "cuBLASLt tanh epilogue": lambda x, w, b: torch._addmm_activation(
            b, x, w.t(), use_gelu=True
        ),
    }
    if with_compile:
        impls["torch.compile erf"] = torch.compile(eager("none"), dynamic=False)
        impls["torch.compile tanh"] = torch.compile(eager("tanh"), dynamic=False)
    return impls


def bench_shape(m, k, n, dname, dtype, with_compile, rows):
    # Every shape compiles afresh: the impls share code objects, and dynamo's recompile limit
    # would otherwise silently fall back to eager on later shapes.
    torch.compiler.reset()
    x, w, b = make_inputs(m, k, n, dtype)
    gemm_ms = timed(lambda: torch.mm(x, w.t()))
    flops = 2 * m * n * k
    path = linear_gelu_path(x, w, b)
    for name, fn in forward_impls(dtype, with_compile).items():
        approximate = "tanh" if "tanh" in name else "none"
        ms = timed(lambda fn=fn: fn(x, w, b))
        rows.append(
            {
                "shape": f"{m}x{k}->{n}",
                "dtype": dname,
                "pass": "fwd",
                "impl": name,
                "ms": ms,
                "floor_ms": gemm_ms,
                "x_floor": ms / gemm_ms,
                "tflops": flops / ms / 1e9,
                "err": max_err(fn(x, w, b), x, w, b, approximate),
                "path": path if name.startswith("fastlayers") else "",
            }
        )
    if dtype == torch.float32:
        return  # the fp32 target is the forward
    # forward + backward against the three plain GEMMs
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    dz = torch.randn(m, n, device="cuda", dtype=dtype)

    def three_gemms():
        torch.mm(x, w.t())
        torch.mm(dz, w)
        torch.mm(dz.t(), x)

    floor_ms = timed(three_gemms)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    train = {
        "fastlayers erf": lambda: linear_gelu(xg, wg, bg, "none"),
        "fastlayers tanh": lambda: linear_gelu(xg, wg, bg, "tanh"),
        "eager erf": lambda: eager("none")(xg, wg, bg),
    }
    if with_compile:
        compiled = torch.compile(eager("none"), dynamic=False)
        train["torch.compile erf"] = lambda: compiled(xg, wg, bg)
    for name, fwd in train.items():
        ms = timed(lambda fwd=fwd: torch.autograd.grad(fwd(), [xg, wg, bg], dy))
        rows.append(
            {
                "shape": f"{m}x{k}->{n}",
                "dtype": dname,
                "pass": "fwd+bwd",
                "impl": name,
                "ms": ms,
                "floor_ms": floor_ms,
                "x_floor": ms / floor_ms,
                "tflops": 3 * flops / ms / 1e9,
                "err": float("nan"),
                "path": "",
            }
        )


def sweep_shape(m: int, k: int, n: int, rows: list[dict]) -> None:
    """Every compiled sm90 tile config x epilogue for one bf16 shape, through the raw entry."""
    x, w, b = make_inputs(m, k, n, torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    pre = torch.empty_like(y)
    gemm_ms = timed(lambda: torch.mm(x, w.t()))
    variants = [(ep, ename, None) for ep, ename in EPILOGUES.items()] + [(0, "erf +preact", pre)]
    for cfg, cname in CONFIGS.items():
        for ep, ename, aux in variants:
            fn = functools.partial(_C._linear_act_sm90_raw, x, w, b, y, aux, False, ep, cfg)
            try:
                ms = timed(fn)
            except RuntimeError as err:
                print(f"sweep {m}x{k}->{n} {cname} {ename}: {err}")
                continue
            shape = f"{m}x{k}->{n}"
            rows.append(
                {
                    "shape": shape,
                    "config": cname,
                    "epilogue": ename,
                    "ms": ms,
                    "x_gemm": ms / gemm_ms,
                }
            )


def sweep_rows(m: int, k: int, n: int, rows: list[dict]) -> None:
    """A few-row problem: linear_gelu (whichever path it takes), each sm90 config (erf) and
    eager, to place the size below which the fallback (cuBLAS + GELU pass) takes over."""
    x, w, b = make_inputs(m, k, n, torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = timed(lambda: torch.mm(x, w.t()))
    timings = {
        "eager erf": timed(lambda: eager("none")(x, w, b)),
        f"linear_gelu ({linear_gelu_path(x, w, b)})": timed(lambda: linear_gelu(x, w, b, "none")),
    }
    for cfg, cname in CONFIGS.items():
        timings[cname] = timed(
            functools.partial(_C._linear_act_sm90_raw, x, w, b, y, None, False, 0, cfg)
        )
    for cname, ms in timings.items():
        rows.append(
            {
                "shape": f"{m}x{k}->{n}",
                "config": cname,
                "epilogue": "erf",
                "ms": ms,
                "x_gemm": ms / gemm_ms,
            }
        )


def sweep(rows: list[dict]) -> None:
    if not sm90_available("cuda"):
        return
    for m, k, n in [*SHAPES[:3], (8192, 2048, 8192)]:
        sweep_shape(m, k, n, rows)
    for m in (32, 128, 512, 1024, 2048):
        sweep_rows(m, 768, 3072, rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for linear_gelu.json and .md")
    parser.add_argument("--sweep", action="store_true", help="time every sm90 tile config")
    parser.add_argument("--quick", action="store_true", help="bf16 only, no torch.compile")
    parser.add_argument("--sweep-only", action="store_true", help="only the config sweep")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    rows: list[dict] = []
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    for m, k, n in [] if args.sweep_only else SHAPES:
        for dname, dtype in dtypes.items():
            with_compile = dtype == torch.bfloat16 and not args.quick
            bench_shape(m, k, n, dname, dtype, with_compile, rows)
            print(f"done {m}x{k}->{n} {dname}", flush=True)
    sweep_rows: list[dict] = []
    if args.sweep or args.sweep_only:
        sweep(sweep_rows)
    lines = [
        f"GPU: {gpu_name()}, torch {torch.__version__}, fastlayers {fastlayers.__version__}",
        "",
        "| shape (M x K -> N) | dtype | pass | impl | time (us) | TFLOP/s "
        "| x floor (plain GEMMs) | max err vs fp64 | fastlayers path |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['pass']} | {r['impl']} | {r['ms'] * 1e3:.1f} | "
            f"{r['tflops']:.0f} | {r['x_floor']:.3f} | {r['err']:.2g} | {r['path']} |"
        )
    if sweep_rows:
        lines += [
            "",
            "sm90 tile configs, bf16, forward (x plain GEMM)",
            "",
            "| shape | config | epilogue | time (us) | x GEMM |",
            "|---|---|---|---:|---:|",
        ]
        for r in sweep_rows:
            lines.append(
                f"| {r['shape']} | {r['config']} | {r['epilogue']} | {r['ms'] * 1e3:.1f} "
                f"| {r['x_gemm']:.3f} |"
            )
    write_results(args.out, "linear_gelu", "\n".join(lines), {"rows": rows, "sweep": sweep_rows})


if __name__ == "__main__":
    main()
