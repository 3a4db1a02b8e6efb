"""Rotary position embedding (q and k in one call): fastlayers.functional.rotary_embedding against
transformers' llama apply_rotary_pos_emb in eager mode, torch.compile of it (default mode) and
Liger-Kernel's LigerRopeFunction (when importable), forward and forward+backward, bf16, one run on
one GPU, at llama-1b (B=8, S=1024, H=32, Hkv=8, D=64) and a Llama-3-8B-like shape (B=8, S=4096,
H=32, Hkv=8, D=128). q and k are transposed views of [B, S, H*D] / [B, S, Hkv*D] projections (as
the models make them); cos and sin are [B, S, D] bf16, as LlamaRotaryEmbedding returns them under
bf16. The backward's grads are preallocated random tensors in the outputs' layout (as attention's
backward gives them); q and k are views of leaf projections that require grad.

Floor (memory-bound): forward reads q, k, cos and sin once and writes q_out and k_out,
2 x (bytes(q) + bytes(k)) + bytes(cos) + bytes(sin); a separate backward reads grad_q, grad_k,
cos and sin and writes dq and dk, the same again: forward+backward counts both. Bytes over the
measured copy bandwidth (read + written).

Liger rotates q and k in place (and the grads in its backward, where they are contiguous in its
layout): it gets fresh clones for every call, made outside the timed region, with the L2 flushed
after them (what it costs in a model, where q and k are fresh projection outputs).

    python benchmarks/bench_rotary.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable

import torch
from common import copy_bandwidth_gbs, event_ms, gpu_name, median_ms, warm_up_gpu, write_results

# name: (B, S, H, Hkv, D)
SHAPES = {
    "llama-1b": (8, 1024, 32, 8, 64),
    "llama-3-8b": (8, 4096, 32, 8, 128),
}
DTYPE = torch.bfloat16


def rope_tables(b: int, s: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as LlamaRotaryEmbedding makes them (theta 500000, positions 0..S-1 per batch
    row, freqs duplicated: cat(freqs, freqs)), computed in float32, then cast to dtype."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    pos = torch.arange(s, device="cuda").float().expand(b, s)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def implementations() -> tuple[dict[str, Callable], dict[str, str]]:
    """name -> f(q, k, cos, sin) -> (q_out, k_out), and notes on how each one is timed."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from fastlayers.functional import rotary_embedding

    impls: dict[str, Callable] = {
        "fastlayers": rotary_embedding,
        "eager (HF llama)": apply_rotary_pos_emb,
        "torch.compile (HF llama)": torch.compile(apply_rotary_pos_emb, dynamic=False),
    }
    notes = {
        "fastlayers": "one kernel for q and k",
        "eager (HF llama)": "",
        "torch.compile (HF llama)": "default mode",
    }
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        impls["liger"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
        notes["liger"] = "in place: fresh clones per call, untimed"
    except Exception as exc:  # not importable there
        print(f"# liger: {type(exc).__name__}: {exc}")
    return impls, notes


def median_ms_fresh(
    setup: Callable[[], tuple], fn: Callable[..., object], warmup: int = 10, reps: int = 100
) -> float:
    """median_ms for a function that consumes its inputs (rotates in place): setup() makes fresh
    inputs before every call, outside the timed region, and the L2 is flushed after it."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn(*setup())
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        args = setup()
        flush.fill_(1)
        times.append(event_ms(lambda args=args: fn(*args)))
    return statistics.median(times)


def bench_shape(name: str, shape: tuple, bw_gbs: float, do_bench) -> list[dict]:
    b, s, h, hkv, d = shape
    qp = torch.randn(b, s, h * d, device="cuda", dtype=DTYPE)
    kp = torch.randn(b, s, hkv * d, device="cuda", dtype=DTYPE)
    cos, sin = rope_tables(b, s, d, DTYPE)

    def views(qp, kp):
        return qp.view(b, s, h, d).transpose(1, 2), kp.view(b, s, hkv, d).transpose(1, 2)

    q, k = views(qp, kp)
    gq, gk = torch.randn_like(q), torch.randn_like(k)  # the outputs' layout
    qg, kg = qp.detach().clone().requires_grad_(), kp.detach().clone().requires_grad_()
    nq, nk, nc = (t.numel() * t.element_size() for t in (q, k, cos))
    fwd_bytes = 2 * (nq + nk) + 2 * nc
    floors = {"fwd": fwd_bytes, "fwd+bwd": 2 * fwd_bytes}

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ref = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    impls, notes = implementations()
    rows = []
    for mode, floor in floors.items():
        floor_ms = floor / (bw_gbs * 1e9) * 1e3
        rows.append(row(name, shape, mode, "floor (copy bandwidth)", floor_ms, floor, floor_ms))
        rows[-1]["note"] = f"{floor / 1e6:.1f} MB at {bw_gbs:.0f} GB/s"
    for impl, fn in impls.items():
        in_place = impl == "liger"

        def fresh(in_place=in_place):
            return (qp.clone(), kp.clone()) if in_place else (qp, kp)

        q_out, k_out = fn(*views(*fresh()), cos, sin)
        err = max(
            (o.double() - r).abs().max().item() for o, r in zip((q_out, k_out), ref, strict=True)
        )

        def fwd(qp_, kp_, fn=fn):
            return fn(*views(qp_, kp_), cos, sin)

        def fwd_bwd(qp_, kp_, gq_, gk_, fn=fn):
            qp_.grad = kp_.grad = None  # no accumulation kernels: the leaves take the grads
            torch.autograd.backward(fwd(qp_, kp_, fn), (gq_, gk_))

        def leaves(in_place=in_place):
            if in_place:  # Liger's backward rotates the grads in place too
                return (
                    *(t.detach().clone().requires_grad_() for t in (qp, kp)),
                    gq.clone(),
                    gk.clone(),
                )
            return qg, kg, gq, gk

        for mode, step, setup in (("fwd", fwd, fresh), ("fwd+bwd", fwd_bwd, leaves)):
            if in_place:
                ms = median_ms_fresh(setup, step)
                bench_ms = None  # do_bench cannot give fresh inputs per call outside its timing
            else:
                args = setup()
                ms = median_ms(lambda step=step, args=args: step(*args))
                bench_ms = (
                    do_bench(lambda step=step, args=args: step(*args), return_mode="median")
                    if do_bench is not None and impl in ("fastlayers", "eager (HF llama)")
                    else None
                )
            floor_ms = floors[mode] / (bw_gbs * 1e9) * 1e3
            r = row(name, shape, mode, impl, ms, floors[mode], floor_ms)
            r.update(do_bench_ms=bench_ms, max_err_vs_fp64=err, note=notes[impl])
            rows.append(r)
    return rows


def row(name, shape, mode, impl, ms, floor_bytes, floor_ms) -> dict:
    return {
        "shape": name,
        "dims": list(shape),
        "mode": mode,
        "impl": impl,
        "ms": ms,
        "gbs": floor_bytes / (ms * 1e-3) / 1e9,
        "x_floor": ms / floor_ms,
        "do_bench_ms": None,
        "max_err_vs_fp64": None,
        "note": "",
    }


def table(rows: list[dict]) -> list[str]:
    """The markdown table: one line per (shape, pass, impl); GB/s counts the floor's bytes."""
    lines = [
        "| shape (B, S, H, Hkv, D) | pass | impl | time (us) | GB/s | x floor "
        "| do_bench median (us) | max err vs fp64 | how |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        dims = ", ".join(str(v) for v in r["dims"])
        bench = f"{r['do_bench_ms'] * 1e3:.1f}" if r["do_bench_ms"] is not None else ""
        err = f"{r['max_err_vs_fp64']:.2g}" if r["max_err_vs_fp64"] is not None else ""
        lines.append(
            f"| {r['shape']} ({dims}) | {r['mode']} | {r['impl']} | {r['ms'] * 1e3:.1f} "
            f"| {r['gbs']:.0f} | {r['x_floor']:.2f} | {bench} | {err} | {r['note']} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for rotary.json and rotary.md")
    parser.add_argument("--quick", action="store_true", help="the llama-1b shape only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rotary.py times CUDA kernels: no CUDA GPU is available here")
    warnings.filterwarnings("ignore")
    try:
        from triton.testing import do_bench
    except Exception as exc:  # not importable there
        print(f"# triton do_bench: {type(exc).__name__}: {exc}")
        do_bench = None
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    print(f"# rotary on {gpu_name()}, torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s")
    rows = []
    for name, shape in list(SHAPES.items())[:1] if args.quick else SHAPES.items():
        rows += bench_shape(name, shape, bw, do_bench)
    header = (
        f"GPU: {gpu_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s, bf16; "
        "q and k transposed views of [B, S, H*D] projections, cos/sin [B, S, D] bf16\n\n"
    )
    write_results(
        args.out, "rotary", header + "\n".join(table(rows)), {"copy_gbs": bw, "rows": rows}
    )


if __name__ == "__main__":
    main()
