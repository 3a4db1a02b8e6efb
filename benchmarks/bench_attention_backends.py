"""Which attention backend a patched model should let scaled_dot_product_attention pick: torch's
own choice (cuDNN where it takes the call) against the same call with cuDNN's attention off (the
flash or memory-efficient kernel), at the shapes the benchmarks' models run. Per case: the
steady time of one call (forward, or forward + backward for training), the kernel torch's choice
runs, and the first call of each of five new shapes (what cuDNN's execution plan build per new
shape costs). torch only: no fastlayers build needed.

    python benchmarks/bench_attention_backends.py [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import gpu_name, kernel_times_us, write_results


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    padded: bool  # a padding mask (about a third of the keys masked out, per row)
    causal: bool
    train: bool  # forward + backward


CASES = (
    Case("minilm encode", 64, 64, 12, 12, 32, True, False, False),
    Case("bert-base encode", 32, 128, 12, 12, 64, True, False, False),
    Case("bert-base train", 32, 128, 12, 12, 64, True, False, True),
    Case("llama-1b train, no padding", 8, 1024, 16, 4, 128, False, True, True),
    Case("llama-1b SFT, padded", 8, 1024, 16, 16, 128, True, True, True),
    Case("llama-1b prefill, no padding", 8, 1024, 16, 4, 128, False, True, False),
)


def operands(case: Case, seq: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (random, bf16) and the boolean mask [batch, 1, seq, seq] transformers passes (None
    when unpadded): right padding of a random third of each row's keys, causal where asked."""
    shape = (case.batch, case.heads, seq, case.head_dim)
    kv_shape = (case.batch, case.kv_heads, seq, case.head_dim)
    grad = case.train
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    if not case.padded:
        return q, k, v, None
    lengths = torch.randint(max(1, 2 * seq // 3), seq + 1, (case.batch,), device="cuda")
    lengths[0] = seq
    keys = torch.arange(seq, device="cuda")[None, :] < lengths[:, None]
    mask = keys[:, None, None, :].expand(case.batch, 1, seq, seq)
    if case.causal:
        mask = mask & torch.ones(seq, seq, device="cuda", dtype=torch.bool).tril()
    return q, k, v, mask


def call(case: Case, q, k, v, mask) -> Callable[[], object]:
    """One attention call as transformers' sdpa_attention_forward makes it (a causal call
    without padding passes is_causal and no mask; GQA through enable_gqa)."""
    gqa = case.kv_heads != case.heads
    causal = case.causal and mask is None
    dy = torch.randn_like(q)

    def run() -> object:
        out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
        if case.train:
            out.backward(dy)
        return out

    return run


def steady_ms(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def first_call_ms(case: Case, seqs: list[int]) -> float:
    """Mean wall time of the first call at each of ``seqs`` (new shapes), synchronised."""
    total = 0.0
    for seq in seqs:
        fn = call(case, *operands(case, seq))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        total += time.perf_counter() - t0
    return 1e3 * total / len(seqs)


def top_kernel(fn: Callable[[], object]) -> str:
    times = kernel_times_us(fn, reps=3)
    attention = {k: t for k, t in times.items() if "attention" in k.lower() or "fmha" in k.lower()}
    name = max(attention or times, key=(attention or times).get)
    return name[:60]


def measure(case: Case, cudnn: bool, shape_round: int) -> dict:
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        fn = call(case, *operands(case, case.seq))
        steady = steady_ms(fn)
        # new shapes no earlier measurement has built plans for (each way its own lengths)
        base = case.seq // 2 + 1 + 5 * shape_round
        first = first_call_ms(case, [base + i for i in range(5)])
        return {"steady_ms": steady, "first_call_ms": first, "kernel": top_kernel(fn)}
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for case in CASES:
        torch_choice = measure(case, True, 0)
        no_cudnn = measure(case, False, 1)
        rows.append({"case": case.name, "torch": torch_choice, "no_cudnn": no_cudnn})
        print(case.name, rows[-1], flush=True)
    lines = [
        f"GPU: {gpu_name()}, torch {torch.__version__}, bf16",
        "",
        "| case | torch's choice: kernel | steady ms | first call of a new shape ms | "
        "cuDNN off: kernel | steady ms | first call ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, n = r["torch"], r["no_cudnn"]
        lines.append(
            f"| {r['case']} | {t['kernel']} | {t['steady_ms']:.3f} | {t['first_call_ms']:.2f} | "
            f"{n['kernel']} | {n['steady_ms']:.3f} | {n['first_call_ms']:.2f} |"
        )
    table = "\n".join(lines)
    write_results(args.out, "attention_backends", table, {"rows": rows})


if __name__ == "__main__":
    main()
