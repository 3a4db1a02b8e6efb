"""ReLUScale: fastlayers against eager ``torch.relu(x) * a`` and torch.compile of it, forward and
backward, in one run on one GPU.

Floor (memory-bound): forward reads x and writes y, 2 x bytes(x); backward reads dy and the
forward's result and writes dx, 3 x bytes(x). Bandwidth is the measured device copy rate.

A second table answers whether swapping a bare nn.ReLU for ReLUScale(1.0) (the patcher's 'relu'
rule) gains anything: nn.ReLU against fastlayers.ReLUScale(1.0), forward and forward+backward
(floor 2 and 5 x bytes(x)), on a (32*512, 4096) bf16 and fp32 tensor, outputs and gradients
compared bit for bit. --relu-only runs just that table (about 10 s).

    python benchmarks/bench_relu_scale.py [--out DIR] [--relu-only]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from common import (
    copy_bandwidth_gbs,
    gpu_name,
    kernel_ms,
    median_ms,
    warm_up_gpu,
    write_results,
)

import fastlayers

SIZES = [1 << 28, 1 << 20]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ALPHA = 1.7


def eager(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * ALPHA


def impls() -> dict:
    return {
        "fastlayers": lambda x: fastlayers.functional.relu_scale(x, ALPHA),
        "eager": eager,
        "torch.compile": torch.compile(eager, dynamic=False),
    }


def bench(n: int, dtype: torch.dtype, bw_gbs: float) -> list[dict]:
    x = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    xg = x.clone().requires_grad_()
    nbytes = x.numel() * x.element_size()
    ref = eager(x)
    rows = []
    for name, fn in impls().items():
        exact = torch.equal(fn(x), ref)
        y = fn(xg)

        def bwd(y=y):
            return torch.autograd.grad(y, xg, dy, retain_graph=True)

        for mode, f, floor_bytes in (
            ("fwd", lambda fn=fn: fn(x), 2 * nbytes),
            ("bwd", bwd, 3 * nbytes),
        ):
            ms = median_ms(f)
            # GPU busy time: the backward's wall time also holds the autograd engine's host
            # work before its first launch, which this machine's slow CPU makes large.
            gpu_ms = kernel_ms(f)
            rows.append(
                {
                    "n": n,
                    "dtype": str(dtype).split(".")[-1],
                    "mode": mode,
                    "impl": name,
                    "ms": ms,
                    "gpu_ms": gpu_ms,
                    "gpu_x_floor": gpu_ms / (floor_bytes / (bw_gbs * 1e9) * 1e3),
                    "gbs": floor_bytes / (ms * 1e-3) / 1e9,
                    "x_floor": ms / (floor_bytes / (bw_gbs * 1e9) * 1e3),
                    "equal_to_eager": exact,
                }
            )
    return rows


RELU_SHAPE = (32 * 512, 4096)
RELU_DTYPES = [torch.bfloat16, torch.float32]


def bare_relu(dtype: torch.dtype, bw_gbs: float) -> list[dict]:
    """nn.ReLU against ReLUScale(1.0) on RELU_SHAPE: forward, forward+backward."""
    x = torch.randn(*RELU_SHAPE, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    nbytes = x.numel() * x.element_size()
    native = torch.nn.ReLU()
    ref_y = native(x)
    xg = x.clone().requires_grad_()
    (ref_dx,) = torch.autograd.grad(native(xg), xg, dy)
    rows = []
    for name, mod in (("nn.ReLU", native), ("ReLUScale(1.0)", fastlayers.ReLUScale(1.0))):
        try:
            (dx,) = torch.autograd.grad(mod(xg), xg, dy)
            equal = torch.equal(mod(x), ref_y) and torch.equal(dx, ref_dx)
        except Exception as err:
            print(f"{name} {dtype}: FAILED {type(err).__name__}: {err}", flush=True)
            continue

        def fwd_bwd(mod=mod):
            return torch.autograd.grad(mod(xg), xg, dy)

        for mode, f, floor_bytes in (
            ("fwd", lambda mod=mod: mod(x), 2 * nbytes),
            ("fwd+bwd", fwd_bwd, 5 * nbytes),
        ):
            ms = median_ms(f)
            gpu_ms = kernel_ms(f)
            floor_ms = floor_bytes / (bw_gbs * 1e9) * 1e3
            rows.append(
                {
                    "shape": list(RELU_SHAPE),
                    "dtype": str(dtype).split(".")[-1],
                    "mode": mode,
                    "impl": name,
                    "ms": ms,
                    "gpu_ms": gpu_ms,
                    "x_floor": ms / floor_ms,
                    "gpu_x_floor": gpu_ms / floor_ms,
                    "equal_to_native": equal,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for relu_scale.json and .md")
    parser.add_argument(
        "--relu-only", action="store_true", help="only nn.ReLU against ReLUScale(1.0)"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    rows = []
    for n in [] if args.relu_only else SIZES:
        for dtype in DTYPES:
            rows += bench(n, dtype, bw)
    relu_rows = []
    for dtype in RELU_DTYPES:
        relu_rows += bare_relu(dtype, bw)
    lines = [
        f"GPU: {gpu_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s, "
        f"alpha {ALPHA}",
    ]
    if rows:
        lines += [
            "",
            "| elements | dtype | pass | impl | time (us) | GB/s | x floor | GPU busy (us) "
            "| GPU busy x floor | output equal to eager |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
    for r in rows:
        lines.append(
            f"| 2^{r['n'].bit_length() - 1} | {r['dtype']} | {r['mode']} | {r['impl']} | "
            f"{r['ms'] * 1e3:.1f} | {r['gbs']:.0f} | {r['x_floor']:.3f} | "
            f"{r['gpu_ms'] * 1e3:.1f} | {r['gpu_x_floor']:.3f} | {r['equal_to_eager']} |"
        )
    lines += [
        "",
        f"Bare ReLU: nn.ReLU against ReLUScale(1.0), {RELU_SHAPE[0]}x{RELU_SHAPE[1]} "
        "(floor: forward 2, forward+backward 5 x bytes(x))",
        "",
        "| dtype | pass | impl | time (us) | x floor | GPU busy (us) | GPU busy x floor "
        "| output and gradient equal to nn.ReLU |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in relu_rows:
        lines.append(
            f"| {r['dtype']} | {r['mode']} | {r['impl']} | {r['ms'] * 1e3:.1f} | "
            f"{r['x_floor']:.3f} | {r['gpu_ms'] * 1e3:.1f} | {r['gpu_x_floor']:.3f} | "
            f"{r['equal_to_native']} |"
        )
    write_results(
        args.out,
        "relu_scale",
        "\n".join(lines),
        {"copy_gbs": bw, "rows": rows, "bare_relu": relu_rows},
    )


if __name__ == "__main__":
    main()
