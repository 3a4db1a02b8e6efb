"""The sm_80 fused Linear + activation kernel (CUTLASS 2.x, mma.sync), forced through its raw entry,
against cuBLAS's bare GEMM, eager Linear + activation and, on Hopper, the sm90 kernel, in one run
on one GPU (bf16 forward; wall time, CUDA-event medians, L2 flushed).

On an H100 the sm80 kernel is timed where it never runs by default: cuBLAS and eager use Hopper's
wgmma there, which mma.sync cannot match, so the rows that say how the kernel would do on an 8.x
GPU are the ones measured against itself:
- "sm80 identity": the same kernel with the identity epilogue, i.e. the bare mma.sync GEMM;
  "sm80 <act>" / "sm80 identity" is what the fused activation costs.
- "sm80 identity + <act> pass": that GEMM followed by the activation as its own pass (ATen's
  F.gelu / relu, out of place as eager): how eager does on a GPU whose cuBLAS GEMM runs as fast
  as ours.
  The fused kernel must beat this row.
- TFLOP/s against mma.sync's measured peak on the same GPU (docs/decisions.md; measured by an
  experiment script, since deleted).

    python benchmarks/bench_sm80.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F
from bench_linear_gelu import eager, make_inputs, max_err, timed
from common import gpu_name, warm_up_gpu, write_results

from fastlayers._extension import _C
from fastlayers.ops.linear_act import sm80_available, sm90_available

SHAPES = [(8192, 768, 3072), (8192, 3072, 768), (4096, 1024, 4096), (8192, 4096, 16384)]
FEW_ROWS = [(32, 768, 3072), (256, 768, 3072), (1024, 768, 3072), (2048, 768, 3072)]
CONFIGS = {-1: "auto", **_C._testing.sm80_tile_configs()}
EPILOGUES = {3: "identity", 0: "erf", 1: "tanh", 2: "relu"}  # the raw entry's numbering
ACTIVATION_OF = {"erf": "gelu", "tanh": "gelu_tanh", "relu": "relu"}


def activation_pass(form: str):
    """The activation as eager runs it after its GEMM: one out-of-place elementwise pass."""
    if form == "relu":
        return torch.relu
    approximate = "tanh" if form == "tanh" else "none"
    return functools.partial(F.gelu, approximate=approximate)


def gemm_then_pass(raw, y: torch.Tensor, form: str):
    """The sm80 identity GEMM into y, then the activation as its own pass."""
    after = activation_pass(form)

    def run():
        raw(3, -1)
        return after(y)

    return run


def bench_shape(m: int, k: int, n: int, configs: dict, forms: dict) -> list[dict]:
    x, w, b = make_inputs(m, k, n, torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    flops = 2.0 * m * n * k
    rows = []

    def add(name: str, form: str, ms: float, err: float | None = None) -> None:
        rows.append(
            {
                "shape": f"{m}x{k}->{n}",
                "impl": name,
                "form": form,
                "us": ms * 1e3,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "max_err": err,
            }
        )

    add("cuBLAS bare GEMM", "identity", timed(lambda: torch.mm(x, w.t())))
    raw = functools.partial(_C._testing.linear_act_sm80_raw, x, w, b, y, None, False)
    for epilogue, form in forms.items():
        for cfg, cname in configs.items():
            if cfg == 0 and smem < 144 * 1024:
                continue
            ms = timed(functools.partial(raw, epilogue, cfg))
            err = None
            if form != "identity" and cfg == -1:
                err = max_err(y, x, w, b, ACTIVATION_OF[form])
            add(f"sm80 {cname}", form, ms, err)
        if form == "identity":
            continue
        add(f"eager {form}", form, timed(lambda f=form: eager(ACTIVATION_OF[f])(x, w, b)))

        add(f"sm80 identity + {form} pass", form, timed(gemm_then_pass(raw, y, form)))
        if sm90_available("cuda"):
            fused90 = functools.partial(
                _C._testing.linear_act_sm90_raw, x, w, b, y, None, False, epilogue
            )
            add("sm90 fused (ours, Hopper)", form, timed(functools.partial(fused90, -1)))
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | impl | form | us | TFLOP/s | x sm80 identity | max err |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    ident = {
        r["shape"]: r["us"] for r in rows if r["impl"] == "sm80 auto" and r["form"] == "identity"
    }
    for r in rows:
        err = "" if r["max_err"] is None else f"{r['max_err']:.2e}"
        ratio = r["us"] / ident[r["shape"]] if r["shape"] in ident else float("nan")
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['form']} | {r['us']:.1f} | {r['tflops']:.0f} | "
            f"{ratio:.3f} | {err} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="auto config, erf and identity only")
    args = parser.parse_args()
    if not sm80_available("cuda"):
        sys.exit("bench_sm80: needs a GPU of compute capability 8.0+ and the sm_80 kernels")
    warm_up_gpu()
    configs = {-1: "auto"} if args.quick else CONFIGS
    forms = {3: "identity", 0: "erf"} if args.quick else EPILOGUES
    rows = []
    for m, k, n in SHAPES + FEW_ROWS:
        rows += bench_shape(m, k, n, configs, forms)
    text = f"{gpu_name()}, torch {torch.__version__}\n\n" + table(rows)
    print(text)
    write_results(args.out, "sm80", text, {"gpu": gpu_name(), "rows": rows})


if __name__ == "__main__":
    main()
