"""Memory growth over many iterations: forward + backward of each fused layer at realistic sizes
and of a patched tiny HuggingFace model, sampling the CUDA caching allocator's statistics and
the host RSS every `--every` iterations after a warm-up.

Fails (exit 1) when, after warm-up, allocated, active or reserved CUDA bytes or the allocation
retries change at all (every iteration frees what it allocates, in the same sizes, so the
allocator's state is a fixed point), or when RSS grows by more than `--rss-bound-mib` (glibc
and the CUDA driver may move RSS by a few MiB; a leaked activation per step is megabytes).

    python tools/memory_growth.py                   # cuda, bf16, 10000 iterations each
    python tools/memory_growth.py --device cpu --iters 300    # quick local smoke test
    python tools/memory_growth.py --out out         # also out/memory_growth.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import fastlayers
from fastlayers.functional import linear_gelu_path, relu_scale

MiB = 1 << 20
Step = Callable[[], None]


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # /proc/self/statm: pages; the second field is the resident set
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample(device: str) -> dict[str, int]:
    """Allocator counters (host-side, no synchronisation needed) and RSS."""
    out = {"rss": rss_bytes()}
    if device == "cuda":
        stats = torch.cuda.memory_stats()
        out["allocated"] = stats.get("allocated_bytes.all.current", 0)
        out["active"] = stats.get("active_bytes.all.current", 0)
        out["reserved"] = stats.get("reserved_bytes.all.current", 0)
        out["retries"] = stats.get("num_alloc_retries", 0)
    return out


def grad_step(module: torch.nn.Module, shape: tuple[int, ...], dtype, device) -> Step:
    """Forward + backward on fresh random input each call; grads by autograd.grad (kept
    nowhere)."""
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> None:
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        y = module(x)
        torch.autograd.grad(y, [x, *params], torch.randn_like(y))

    return step


def workloads(device: str, dtype: torch.dtype) -> dict[str, tuple[str, Step]]:
    """name -> (description, step). CUDA: realistic sizes (BERT-base rows of 8192 tokens);
    CPU: small ones, for a quick smoke test."""
    import transformers as tf

    big = device == "cuda"
    rows, hidden, ffn = (8192, 768, 3072) if big else (256, 256, 1024)
    small_rows = 256 if big else 32  # below one wave of 128x128 tiles: the fallback path
    kw = {"device": device, "dtype": dtype}
    ln = fastlayers.LayerNorm(hidden, **kw)
    relu = fastlayers.ReLUScale(0.5)
    fused = fastlayers.FusedLinearGELU(hidden, ffn, **kw)
    path = "cpu"
    if device == "cuda":
        x = torch.randn(rows, hidden, **kw)
        path = linear_gelu_path(x, fused.weight, fused.bias)
        small_path = linear_gelu_path(x[:small_rows], fused.weight, fused.bias)
    else:
        small_path = "cpu"

    def relu_inplace() -> None:
        with torch.no_grad():
            relu_scale(torch.randn(rows, ffn, **kw), 0.5, inplace=True)

    config = tf.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64
    )
    model = tf.BertModel(config).to(device=device, dtype=dtype).eval()
    fastlayers.patch(model)
    batch, seq = (8, 128) if big else (2, 32)
    model_params = [p for p in model.parameters() if p.requires_grad]

    def model_step() -> None:
        ids = torch.randint(0, 90, (batch, seq), device=device)
        out = model(input_ids=ids).last_hidden_state
        out.backward(torch.randn_like(out))
        for p in model_params:  # set_to_none: fresh gradient tensors every step
            p.grad = None

    return {
        "layer_norm": (f"LayerNorm {rows}x{hidden}", grad_step(ln, (rows, hidden), dtype, device)),
        "relu_scale": (f"ReLUScale {rows}x{ffn}", grad_step(relu, (rows, ffn), dtype, device)),
        "relu_scale_inplace": (f"ReLUScale in place {rows}x{ffn}, no grad", relu_inplace),
        "linear_gelu": (
            f"FusedLinearGELU {rows}x{hidden}->{ffn} ({path})",
            grad_step(fused, (rows, hidden), dtype, device),
        ),
        "linear_gelu_small": (
            f"FusedLinearGELU {small_rows}x{hidden}->{ffn} ({small_path})",
            grad_step(fused, (small_rows, hidden), dtype, device),
        ),
        "patched_bert": (
            f"patched tiny BERT {batch}x{seq} fwd+bwd",
            model_step,
        ),
    }


def run_one(step: Step, device: str, iters: int, warmup: int, every: int) -> list[dict]:
    """Samples after warm-up (iteration 0) and every `every` iterations."""
    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    samples = [{"iter": 0, **sample(device)}]
    for i in range(1, iters + 1):
        step()
        if i % every == 0 or i == iters:
            if device == "cuda":
                torch.cuda.synchronize()  # RSS after the work, not while it is queued
            samples.append({"iter": i, **sample(device)})
    return samples


def verdict(samples: list[dict], rss_bound: int) -> list[str]:
    """What grew after warm-up (empty: nothing)."""
    base, problems = samples[0], []
    for key in ("allocated", "active", "reserved", "retries"):
        if key in base:
            changed = [s["iter"] for s in samples if s[key] != base[key]]
            if changed:
                last = samples[-1][key] - base[key]
                problems.append(f"{key} changed (first at iteration {changed[0]}, end {last:+d})")
    rss_growth = max(s["rss"] for s in samples) - base["rss"]
    if rss_growth > rss_bound:
        problems.append(f"RSS grew {rss_growth / MiB:.1f} MiB > {rss_bound / MiB:.0f} MiB")
    return problems


def table(results: dict[str, dict]) -> str:
    cols = ["allocated", "active", "reserved"]
    head = "| workload | iter | " + " | ".join(f"{c} MiB" for c in cols)
    lines = [head + " | retries | RSS MiB | RSS +MiB |", "|" + " --- |" * (len(cols) + 5)]
    for name, r in results.items():
        rss0 = r["samples"][0]["rss"]
        for s in r["samples"]:
            mem = " | ".join(f"{s[c] / MiB:.2f}" if c in s else "-" for c in cols)
            rss = f"{s['rss'] / MiB:.1f} | {(s['rss'] - rss0) / MiB:+.1f}"
            lines.append(f"| {name} | {s['iter']} | {mem} | {s.get('retries', '-')} | {rss} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--iters", type=int, default=None, help="default: 10000 cuda, 300 cpu")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--every", type=int, default=None, help="sample period; default iters/10")
    ap.add_argument("--rss-bound-mib", type=float, default=16.0)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--out", default=None, help="folder for memory_growth.md and .json")
    args = ap.parse_args()
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    iters = args.iters or (10000 if device == "cuda" else 300)
    every = args.every or max(1, iters // 10)
    rss_bound = int(args.rss_bound_mib * MiB)
    torch.manual_seed(0)

    results: dict[str, dict] = {}
    chosen = set(filter(None, args.only.split(",")))
    for name, (what, step) in workloads(device, dtype).items():
        if chosen and name not in chosen:
            continue
        t0 = time.perf_counter()
        samples = run_one(step, device, iters, args.warmup, every)
        seconds = time.perf_counter() - t0
        problems = verdict(samples, rss_bound)
        results[name] = {"what": what, "seconds": seconds, "samples": samples, "problems": problems}
        status = "FAIL: " + "; ".join(problems) if problems else "ok"
        print(f"{name}: {what}, {iters} iterations in {seconds:.1f} s: {status}", flush=True)

    failed = [n for n, r in results.items() if r["problems"]]
    text = table(results)
    summary = f"{len(results) - len(failed)}/{len(results)} workloads flat" + (
        f"; grew: {', '.join(failed)}" if failed else ""
    )
    print(text + "\n\n" + summary)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        header = (
            f"memory_growth: {device} ({gpu}), {dtype}, {iters} iterations after a warm-up of "
            f"{args.warmup}, RSS bound {args.rss_bound_mib} MiB, torch {torch.__version__}"
        )
        Path(args.out, "memory_growth.md").write_text(f"{header}\n\n{text}\n\n{summary}\n")
        payload = {"device": device, "gpu": gpu, "dtype": str(dtype), "iters": iters}
        payload |= {"torch": torch.__version__, "rss_bound_mib": args.rss_bound_mib}
        payload["results"] = results
        Path(args.out, "memory_growth.json").write_text(json.dumps(payload, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
