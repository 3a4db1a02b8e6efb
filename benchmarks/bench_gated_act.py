"""The gated activation act(gate) * up (SwiGLU's SiLU, GeGLU's tanh GELU): fastlayers against eager
(``F.silu(g) * u``), torch.compile of it and Liger-Kernel's LigerSiLUMulFunction (when
importable), forward and forward+backward, one run on one GPU, on the intermediate activations
of llama-1b (8 x 1024 tokens, 5632), a Llama-3-8B-like MLP (8 x 1024, 14336) and a
Gemma-2B-like one (8 x 1024, 16384); contiguous operands and the halves of one [.., 2I] tensor
(Phi-3's chunked gate_up).

Floor (memory-bound): forward reads gate and up and writes y, 3 x bytes(gate); backward reads
dy, gate and up and writes dgate and dup, 5 x bytes(gate); forward+backward 8 x bytes(gate).

--epilogue: a gated MLP's up projection with the product, inference (what the gated_mlp rule
runs where no gradient is recorded): F.linear + fastlayers' gated_act (two kernels, up written
and read back), gated_act_linear (the product in the up GEMM's epilogue on sm_90), torch.compile
of act(g) * F.linear(x, w), and the bare cuBLAS GEMM (the floor: a GEMM-bound op), at the MLPs of
llama-1b (hidden 2048, intermediate 5632), Llama-3-8B (4096, 14336) and Gemma-2B (2048, 16384)
at 1,024 and 8,192 tokens; three alternated rounds, each cell the range over them.

    python benchmarks/bench_gated_act.py [--out DIR] [--sweep] [--dtypes bf16,fp16,fp32]
    python benchmarks/bench_gated_act.py --epilogue [--out DIR]
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
from fastlayers.ops.gated_act import gated_act_linear_forward, gated_act_linear_path

SHAPES = [(8192, 5632), (8192, 14336), (8192, 16384)]
# --epilogue: (hidden, intermediate, activation) of llama-1b, Llama-3-8B, Gemma-2B; token counts
MLPS = [(2048, 5632, "silu"), (4096, 14336, "silu"), (2048, 16384, "gelu_tanh")]
EPILOGUE_TOKENS = (1024, 8192)
ROUNDS = 3


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


def bench_epilogue(tokens: int, hidden: int, inter: int, activation: str) -> list[dict]:
    """The up projection with act(gate) * up, inference, bf16: time and error per implementation
    (error against float64 of act(gate) * (x . W^T))."""
    dtype = torch.bfloat16
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = torch.randn(inter, hidden, device="cuda", dtype=dtype) / hidden**0.5
    g = torch.randn(tokens, inter, device="cuda", dtype=dtype) * 2
    act = eager(activation)
    fns = {
        "cuBLAS GEMM alone (floor)": lambda: F.linear(x, w),
        "F.linear + gated_act": lambda: gated_act(g, F.linear(x, w), activation),
        "fastlayers gated_act_linear": lambda: gated_act_linear_forward(g, x, w, activation),
        "torch.compile": torch.compile(lambda g, x, w: act(g, F.linear(x, w)), dynamic=False),
    }
    ref = act(g.double(), F.linear(x.double(), w.double()))
    path = gated_act_linear_path(g, x, w, activation)
    steps = {
        name: (lambda fn=fn: fn(g, x, w)) if name == "torch.compile" else fn
        for name, fn in fns.items()
    }
    times: dict[str, list[tuple[float, float | None]]] = {name: [] for name in fns}
    with torch.inference_mode():
        for _ in range(ROUNDS):  # alternated: this machine's GEMM times drift within a run
            for name, step in steps.items():
                times[name].append((median_ms(step), do_bench_ms(step)))
        errs = {
            name: None if "floor" in name else (step().double() - ref).abs().max().item()
            for name, step in steps.items()
        }
    results = []
    for name in fns:
        ms = sorted(t for t, _ in times[name])
        peer = sorted(d for _, d in times[name] if d is not None)
        results.append(
            {
                "tokens": tokens,
                "mlp": [hidden, inter],
                "activation": activation,
                "impl": name,
                "path": path if name.startswith("fastlayers") else "",
                "ms": ms,
                "do_bench_ms": peer or None,
                "max_err_vs_fp64": errs[name],
            }
        )
    return results


def main_epilogue(out: str | None) -> None:
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    rows = []
    for hidden, inter, activation in MLPS:
        for tokens in EPILOGUE_TOKENS:
            rows += bench_epilogue(tokens, hidden, inter, activation)
    lines = [
        "| tokens | hidden -> intermediate | act | impl | time (us) | do_bench (us) "
        "| max err vs fp64 |",
        "|---:|---|---|---|---:|---:|---:|",
    ]

    def span(values: list[float] | None) -> str:
        return "" if not values else f"{values[0] * 1e3:.1f}-{values[-1] * 1e3:.1f}"

    for r in rows:
        err = "" if r["max_err_vs_fp64"] is None else f"{r['max_err_vs_fp64']:.2g}"
        impl = r["impl"] + (f" ({r['path']})" if r["path"] else "")
        lines.append(
            f"| {r['tokens']} | {r['mlp'][0]} -> {r['mlp'][1]} | {r['activation']} | {impl} "
            f"| {span(r['ms'])} | {span(r['do_bench_ms'])} | {err} |"
        )
    header = f"GPU: {gpu_name()}, torch {torch.__version__}, bf16, inference\n\n"
    write_results(out, "gated_act_epilogue", header + "\n".join(lines), {"rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="every width 768-16384 at every row count 2k-64k, SiLU, contiguous",
    )
    parser.add_argument("--dtypes", default="bf16", help="comma-separated, of fp32,bf16,fp16")
    parser.add_argument(
        "--epilogue", action="store_true", help="the up projection with the product (inference)"
    )
    args = parser.parse_args()
    if args.epilogue:
        main_epilogue(args.out)
        return
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
