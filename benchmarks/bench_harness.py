"""Our timing harness (common.median_ms: CUDA events around each call, a 256 MB buffer
overwritten between calls, median) against triton's do_bench (the harness peers publish with:
its own L2 flush, mean by default) on the same calls in one process: FusedLinearGELU forward +
backward (``torch.autograd.grad`` over x, w and b) and eager Linear + GELU, at the shapes the
two disagreed on. Inputs two ways: weights scaled by 1/sqrt(k) (the benchmarks' inputs) and
plain unit normals, since a GEMM's power draw, and so its clock, depends on its data.

    python benchmarks/bench_harness.py [--shapes 8192x4096x16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import gpu_name, median_ms, warm_up_gpu, write_results

from fastlayers.functional import linear_gelu


def cases(m: int, k: int, n: int, dtype: torch.dtype, scaled: bool):
    x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device="cuda") * (k**-0.5 if scaled else 1.0)
    w = w.to(dtype).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), dynamic=False)
    impls = {
        "fastlayers": lambda: linear_gelu(x, w, b, "none"),
        "eager": lambda: F.gelu(F.linear(x, w, b)),
        "torch.compile": lambda: compiled(x, w, b),
    }
    return {
        name: (lambda f=f: torch.autograd.grad(f(), [x, w, b], dy)) for name, f in impls.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8192x4096x16384,8192x768x3072")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    from triton.testing import do_bench

    warm_up_gpu()
    rows, payload = [], []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        for dname, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            for scaled in (True, False):
                fns = cases(m, k, n, dtype, scaled)
                harnesses = ("ours", "do_bench", "do_bench_median")
                results = {name: {h: [] for h in harnesses} for name in fns}
                for _ in range(args.rounds):  # alternate harnesses and impls round by round
                    for name, fn in fns.items():
                        results[name]["ours"].append(1e3 * median_ms(fn, warmup=3, reps=50))
                        results[name]["do_bench"].append(1e3 * do_bench(fn))
                        results[name]["do_bench_median"].append(
                            1e3 * do_bench(fn, return_mode="median")
                        )
                for name, r in results.items():
                    med = {h: statistics.median(v) for h, v in r.items()}
                    rows.append((shape, dname, "1/sqrt(k)" if scaled else "unit", name, med))
                    payload.append(
                        {"shape": shape, "dtype": dname, "scaled": scaled, "impl": name, **r}
                    )
                    print(
                        shape,
                        dname,
                        scaled,
                        name,
                        {h: round(v) for h, v in med.items()},
                        flush=True,
                    )
    table = "\n".join(
        [
            f"{gpu_name()}: fwd+bwd (autograd.grad over x, w, b), us, median of "
            f"{args.rounds} rounds",
            "",
            "| shape | dtype | weights | impl | ours (median_ms) | do_bench (mean) | "
            "do_bench (median) |",
            "|---|---|---|---|---:|---:|---:|",
            *[
                f"| {s} | {d} | {w} | {i} | {m['ours']:.0f} | {m['do_bench']:.0f} | "
                f"{m['do_bench_median']:.0f} |"
                for s, d, w, i, m in rows
            ],
        ]
    )
    write_results(args.out, "harness", table, {"rows": payload})


if __name__ == "__main__":
    main()
