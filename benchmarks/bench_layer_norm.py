"""LayerNorm: fastlayers against eager nn.LayerNorm, torch.compile, Apex and Liger-Kernel (when
importable), forward and forward+backward, in one run on one GPU.

Floor (memory-bound): forward moves x in and y out, 2 x bytes(x); forward+backward is counted
as the issue defines it, read x and dy, write y and dx = 4 x bytes(x). A separate forward and
backward must read x (or y) twice, so 5 x bytes(x) is the least any unfused implementation
can move; the table shows both ratios. Bandwidth is the measured device copy rate.

    python benchmarks/bench_layer_norm.py [--out DIR] [--quick | --sweep] [--dtypes fp32,bf16,fp16]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from common import (
    copy_bandwidth_gbs,
    dtypes_named,
    gpu_name,
    host_us_per_call,
    row_norm_table,
    sweep_shapes,
    time_row_norms,
    warm_up_gpu,
    write_results,
)
from torch import nn

import fastlayers

SHAPES = [(32768, 4096), (8192, 8192), (16384, 1024), (8192, 768), (1, 768)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def peers(cols: int, dtype: torch.dtype) -> dict[str, nn.Module]:
    """Every implementation, sharing one set of parameters."""
    native = nn.LayerNorm(cols, device="cuda", dtype=dtype)
    with torch.no_grad():
        native.weight.copy_(torch.randn_like(native.weight))
        native.bias.copy_(torch.randn_like(native.bias))
    impls: dict[str, nn.Module] = {
        "fastlayers": fastlayers.LayerNorm.from_native(native),
        "eager": native,
        "torch.compile": torch.compile(native, dynamic=False),
    }
    try:
        from apex.normalization import FusedLayerNorm

        apex = FusedLayerNorm(cols).to(device="cuda", dtype=dtype)
        apex.weight, apex.bias = native.weight, native.bias
        impls["apex"] = apex
    except Exception:
        pass
    try:
        from liger_kernel.transformers import LigerLayerNorm

        liger = LigerLayerNorm(cols, eps=native.eps).to(device="cuda", dtype=dtype)
        liger.weight, liger.bias = native.weight, native.bias
        impls["liger"] = liger
    except Exception:
        pass
    return impls


def bench_shape(rows: int, cols: int, dtype: torch.dtype, bw_gbs: float) -> list[dict]:
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    impls = peers(cols, dtype)
    native = impls["eager"]
    ref = nn.functional.layer_norm(
        x.double(), (cols,), native.weight.double(), native.bias.double(), native.eps
    )
    return time_row_norms(impls, x, ref, lambda mod: [mod.weight, mod.bias], bw_gbs)


def host_overhead() -> list[dict]:
    x = torch.randn(1, 768, device="cuda")
    xg = x.clone().requires_grad_()
    native = nn.LayerNorm(768, device="cuda")
    out = []
    for name, mod in (("fastlayers", fastlayers.LayerNorm.from_native(native)), ("eager", native)):
        out.append(
            {
                "impl": name,
                "fwd_us": host_us_per_call(lambda mod=mod: mod(x)),
                "fwd+bwd_us": host_us_per_call(lambda mod=mod: mod(xg).sum().backward()),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for layer_norm.json and .md")
    parser.add_argument("--quick", action="store_true", help="three shapes, bf16 only")
    parser.add_argument(
        "--sweep", action="store_true", help="every width 768-16384 at every row count 2k-64k"
    )
    parser.add_argument("--dtypes", default=None, help="comma-separated, of fp32,bf16,fp16")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    print(f"# LayerNorm on {gpu_name()}, torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s")
    rows = []
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    if args.dtypes:
        dtypes = dtypes_named(args.dtypes)
    shapes = sweep_shapes() if args.sweep else SHAPES[:3] if args.quick else SHAPES
    for shape in shapes:
        for dtype in dtypes.values():
            rows += bench_shape(*shape, dtype, bw)
    host = host_overhead()
    lines = row_norm_table(rows, host, "(1, 768) fp32")
    header = f"GPU: {gpu_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s\n\n"
    write_results(
        args.out,
        "layer_norm",
        header + "\n".join(lines),
        {"copy_gbs": bw, "rows": rows, "host": host},
    )


if __name__ == "__main__":
    main()
