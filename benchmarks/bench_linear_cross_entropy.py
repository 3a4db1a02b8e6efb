"""A causal LM's head + loss, forward and backward: fastlayers.functional.linear_cross_entropy
against eager (F.linear, .float(), F.cross_entropy: what transformers' ForCausalLMLoss runs),
torch.compile of it, and Liger-Kernel's fused linear cross-entropy (when importable), one run on
one GPU. Tokens 8 x 1024, hidden 2048, vocabularies 128,256 (LLaMA-3) and 32,000 (LLaMA-2); bf16
hidden states and weights, and float32 weights under bf16 autocast (a training step's case);
labels all real, or half of them ignore_index (prompts and padding). Per row: forward +
backward time (median of CUDA-event timings), peak memory above the inputs, the loss's and
the gradients' largest relative difference from eager's.

    python benchmarks/bench_linear_cross_entropy.py [--out DIR] [--quick] [--chunks 256,1024]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import gpu_name, warm_up_gpu, write_results

from fastlayers.functional import linear_cross_entropy

TOKENS, HIDDEN = 8 * 1024, 2048


def eager(hidden, weight, target):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, target, ignore_index=-100)


def implementations(chunks: list[int]) -> dict[str, Callable]:
    impls: dict[str, Callable] = {"fastlayers": linear_cross_entropy}
    for c in chunks:
        impls[f"fastlayers, {c} rows a chunk"] = lambda h, w, t, c=c: linear_cross_entropy(
            h, w, t, rows_per_chunk=c
        )
    impls["eager"] = eager
    impls["torch.compile"] = torch.compile(eager, dynamic=False)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        impls["Liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as err:  # not importable here
        print(f"no Liger row ({type(err).__name__}: {err})")
    return impls


def measure(fn: Callable, hidden, weight, target, reps: int) -> dict:
    times = []
    for i in range(reps + 2):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weight.dtype == torch.float32):
            loss = fn(hidden, weight, target)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() - base
    return {
        "ms": statistics.median(times),
        "peak_mib": peak / 2**20,
        "loss": loss.detach().float(),
        "grads": (hidden.grad.float(), weight.grad.float()),
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chunks", default="256,2048")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",") if c]
    warm_up_gpu()
    impls = implementations(chunks)
    reps = 3 if args.quick else 10
    lines = [
        f"{gpu_name()}, torch {torch.__version__}: head + loss forward + backward, "
        f"{TOKENS} tokens, hidden {HIDDEN}",
        "",
        "| vocabulary | weights | labels | way | ms | vs eager | peak MiB above inputs | "
        "loss rel. diff | d_hidden rel. diff | d_weight rel. diff |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    payload: dict = {}
    cases = [(128256, torch.bfloat16, 0.0), (128256, torch.float32, 0.0)]
    cases += [(128256, torch.bfloat16, 0.5), (32000, torch.bfloat16, 0.0)]
    for vocab, wdtype, ignored in cases[:2] if args.quick else cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        hdtype = torch.bfloat16 if wdtype == torch.bfloat16 else torch.float32
        hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).to(hdtype)
        weight = (0.02 * torch.randn(vocab, HIDDEN, device="cuda", generator=g)).to(wdtype)
        hidden.requires_grad_()
        weight.requires_grad_()
        target = torch.randint(0, vocab, (TOKENS,), device="cuda", generator=g)
        if ignored:
            target[torch.rand(TOKENS, device="cuda", generator=g) < ignored] = -100
        rows, base = {}, None
        for name, fn in impls.items():
            try:
                rows[name] = measure(fn, hidden, weight, target, reps)
            except Exception as err:
                print(f"{vocab} {wdtype} {name}: failed ({type(err).__name__}: {err})")
                torch.cuda.empty_cache()
                continue
            torch.cuda.empty_cache()
        base = rows.get("eager")
        for name, r in rows.items():
            diffs = ["-", "-", "-"]
            if base is not None:
                diffs = [
                    f"{rel(r['loss'], base['loss']):.1e}",
                    *(f"{rel(a, b):.1e}" for a, b in zip(r["grads"], base["grads"], strict=True)),
                ]
            speed = f"{base['ms'] / r['ms']:.2f}x" if base is not None else "-"
            weights = "bf16" if wdtype == torch.bfloat16 else "fp32, bf16 autocast"
            lines.append(
                f"| {vocab} | {weights} | {1 - ignored:.0%} real | {name} | {r['ms']:.2f} | "
                f"{speed} | {r['peak_mib']:.0f} | {' | '.join(diffs)} |"
            )
            key = f"{vocab}/{weights}/{ignored}/{name}"
            payload[key] = {"ms": r["ms"], "peak_mib": r["peak_mib"]}
            print(lines[-1], flush=True)
        del hidden, weight, rows, base
        torch.cuda.empty_cache()
    write_results(args.out, "linear_cross_entropy", "\n".join(lines), payload)


if __name__ == "__main__":
    main()
