"""The gated activation act(gate) * up (SwiGLU's SiLU, GeGLU's tanh GELU): fastlayers against eager
(``F.silu(g) * u``), torch.compile of it and Liger-Kernel's LigerSiLUMulFunction (when
importable), forward and forward+backward, one run on one GPU, on the intermediate activations
of llama-1b (8 x 1024 tokens, 5632), a Llama-3-8B-like MLP (8 x 1024, 14336) and a
Gemma-2B-like one (8 x 1024, 16384); contiguous operands and the halves of one [.., 2I] tensor
(Phi-3's chunked gate_up).

Floor (memory-bound): forward reads gate and up and writes y, 3 x bytes(gate); backward reads
dy, gate and up and writes dgate and dup, 5 x bytes(gate); forward+backward 8 x bytes(gate).

    python benchmarks/bench_gated_act.py [--out DIR] [--sweep] [--dtypes bf16,fp16,fp32]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from common import (
    copy_bandwidth_gbs,
    do_bench_ms,
    dtypes_named,
    gpu_name,
    median_ms,
    sweep_shapes,
    warm_up_gpu,
    write_results,
)

from fastlayers.functional import gated_act

SHAPES = [(8192, 5632), (8192, 14336), (8192, 16384)]


def eager(activation: str):
    if activation == "silu":
        return lambda g, u: F.silu(g) * u
    return lambda g, u: F.gelu(g, approximate="tanh") * u


def impls(activation: str) -> dict:
    out = {
        "fastlayers": lambda g, u: gated_act(g, u, activation),
        "eager": eager(activation),
        "torch.compile": torch.compile(eager(activation), dynamic=False),
    }
    try:
        if activation == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            out["liger"] = LigerSiLUMulFunction.apply
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction

            out["liger"] = LigerGELUMulFunction.apply
    except Exception as exc:
        print(f"# liger: {type(exc).__name__}: {exc}")
    return out


def bench(
    rows: int,
    cols: int,
    activation: str,
    chunked: bool,
    bw: float,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    if chunked:
        h = torch.randn(rows, 2 * cols, device="cuda", dtype=dtype)
        g, u = h.chunk(2, dim=-1)
    else:
        g = torch.randn(rows, cols, device="cuda", dtype=dtype)
        u = torch.randn_like(g)
    dy = torch.randn(rows, cols, device="cuda", dtype=dtype)
    gg, ug = g.detach().requires_grad_(), u.detach().requires_grad_()
    nbytes = g.numel() * g.element_size()
    ref = eager(activation)(g.double(), u.double())
    results = []
    for name, fn in impls(activation).items():
        err = (fn(g, u).double() - ref).abs().max().item()
        for mode, step, floor in (
            ("fwd", lambda fn=fn: fn(g, u), 3 * nbytes),
            ("fwd+bwd", lambda fn=fn: torch.autograd.grad(fn(gg, ug), (gg, ug), dy), 8 * nbytes),
        ):
            ms = median_ms(step)
            peer_ms = do_bench_ms(step)
            floor_ms = floor / (bw * 1e9) * 1e3
            results.append(
                {
                    "shape": [rows, cols],
                    "dtype": str(dtype).split(".")[-1],
                    "activation": activation,
                    "layout": "chunked" if chunked else "contiguous",
                    "mode": mode,
                    "impl": name,
                    "ms": ms,
                    "do_bench_ms": peer_ms,
                    "x_floor": ms / floor_ms,
                    "max_err_vs_fp64": err,
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="every width 768-16384 at every row count 2k-64k, SiLU, contiguous",
    )
    parser.add_argument("--dtypes", default="bf16", help="comma-separated, of fp32,bf16,fp16")
    args = parser.parse_args()
    dtypes = dtypes_named(args.dtypes)
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    rows = []
    for dtype in dtypes.values():
        if args.sweep:
            for shape in sweep_shapes():
                rows += bench(*shape, "silu", False, bw, dtype)
            continue
        for shape in SHAPES:
            for activation in ("silu", "gelu_tanh"):
                rows += bench(*shape, activation, False, bw, dtype)
            rows += bench(*shape, "silu", True, bw, dtype)
    lines = [
        "| shape | dtype | act | layout | pass | impl | time (us) | do_bench (us) | x floor "
        "| max err vs fp64 |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        peer = f"{r['do_bench_ms'] * 1e3:.1f}" if r["do_bench_ms"] is not None else ""
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['activation']} "
            f"| {r['layout']} | {r['mode']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {peer} "
            f"| {r['x_floor']:.2f} | {r['max_err_vs_fp64']:.2g} |"
        )
    header = f"GPU: {gpu_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s\n\n"
    write_results(args.out, "gated_act", header + "\n".join(lines), {"copy_gbs": bw, "rows": rows})


if __name__ == "__main__":
    main()
