"""RMSNorm: fastlayers against the model's own eager module (HuggingFace LlamaRMSNorm), eager
torch.nn.RMSNorm (torch's fused CUDA kernel), torch.compile of the model's module and Liger-Kernel's
LigerRMSNorm in LLaMA casting mode (when importable), forward and forward+backward, one run on one
GPU. Every implementation shares one weight.

Floor (memory-bound), as bench_layer_norm.py counts it: forward reads x and writes y, 2 x
bytes(x); forward+backward reads x and dy and writes y and dx, 4 x bytes(x) (a separate backward
re-reads x: 5 x bytes(x) is the least an unfused pair can move; both ratios are shown).

    python benchmarks/bench_rms_norm.py [--out DIR] [--quick | --sweep] [--dtypes fp32,bf16,fp16]
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
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fastlayers

SHAPES = [(32768, 4096), (8192, 8192), (16384, 2048), (8192, 768), (32768, 768)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def peers(cols: int, dtype: torch.dtype) -> dict[str, nn.Module]:
    """Every implementation, sharing one weight."""
    native = LlamaRMSNorm(cols, eps=1e-6).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        native.weight.copy_(torch.randn_like(native.weight) * 0.5 + 1)
    torch_rms = nn.RMSNorm(cols, eps=1e-6, device="cuda", dtype=dtype)
    torch_rms.weight = native.weight
    impls: dict[str, nn.Module] = {
        "fastlayers": fastlayers.RMSNorm.from_native(native),
        "eager (HF)": native,
        "eager nn.RMSNorm": torch_rms,
        "torch.compile (HF)": torch.compile(native, dynamic=False),
    }
    try:
        from liger_kernel.transformers import LigerRMSNorm

        liger = LigerRMSNorm(cols, eps=1e-6, casting_mode="llama").to(device="cuda", dtype=dtype)
        liger.weight = native.weight
        impls["liger"] = liger
    except Exception as exc:  # not importable there
        print(f"# liger: {type(exc).__name__}: {exc}")
    return impls


def bench_shape(rows: int, cols: int, dtype: torch.dtype, bw_gbs: float) -> list[dict]:
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    impls = peers(cols, dtype)
    native = impls["eager (HF)"]
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * native.weight.double()
    # every implementation holds the one shared weight
    return time_row_norms(impls, x, ref, lambda mod: [native.weight], bw_gbs)


def host_overhead() -> list[dict]:
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    native = LlamaRMSNorm(2048).to(device="cuda", dtype=torch.bfloat16)
    torch_rms = nn.RMSNorm(2048, device="cuda", dtype=torch.bfloat16)
    out = []
    for name, mod in (
        ("fastlayers", fastlayers.RMSNorm.from_native(native)),
        ("eager (HF)", native),
        ("eager nn.RMSNorm", torch_rms),
    ):
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
    parser.add_argument("--out", default=None, help="folder for rms_norm.json and .md")
    parser.add_argument("--quick", action="store_true", help="three shapes, bf16 only")
    parser.add_argument(
        "--sweep", action="store_true", help="every width 768-16384 at every row count 2k-64k"
    )
    parser.add_argument("--dtypes", default=None, help="comma-separated, of fp32,bf16,fp16")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    print(f"# RMSNorm on {gpu_name()}, torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s")
    rows = []
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    if args.dtypes:
        dtypes = dtypes_named(args.dtypes)
    shapes = sweep_shapes() if args.sweep else SHAPES[:3] if args.quick else SHAPES
    for shape in shapes:
        for dtype in dtypes.values():
            rows += bench_shape(*shape, dtype, bw)
    host = host_overhead()
    lines = row_norm_table(rows, host, "(1, 2048) bf16")
    header = f"GPU: {gpu_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s\n\n"
    write_results(
        args.out,
        "rms_norm",
        header + "\n".join(lines),
        {"copy_gbs": bw, "rows": rows, "host": host},
    )


if __name__ == "__main__":
    main()
