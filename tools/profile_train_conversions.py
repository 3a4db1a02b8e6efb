"""Kernel counts and GPU time of a patched model's training step (fp32 weights under bf16
autocast, benchmarks/bench_models.py's step) for the kernels of autocast's conversions in the
backward: fastlayers' widening and in-place addition into the engine's sums, ATen's copies
(its dtype conversions among them) and ATen's float32 additions (the engine's sums among them).

    python tools/profile_train_conversions.py [MODEL]   (default llama-1b; a CUDA GPU)

Warm-up as bench_models (the attention's backend settled), then the profiler over 3 steps;
counts and times are per step."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_models as bm

KERNELS = ("add_widened_kernel", "widen_kernel", "CUDAFunctor_add<float>", "direct_copy")
STEPS = 3


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    models, counts = bm.models_for(name, "train", liger=False)
    batch, _ = bm.make_batch(name, "cuda")
    step = bm.step_fn(models[bm.PATCHED], batch, "train")
    for _ in range(3):
        step()
    bm.settle_attention({"patched": step}, counts, "train")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    total = 0.0
    found: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        ms = event.self_device_time_total / STEPS / 1e3
        total += ms
        part = next((k for k in KERNELS if k in event.key), None)
        if part is not None:
            found[part][0] += event.count // STEPS
            found[part][1] += ms
    print(f"{name} train: GPU {total:.2f} ms a step")
    for part, (calls, ms) in found.items():
        print(f"  {part}: {calls} calls, {ms:.3f} ms")


if __name__ == "__main__":
    main()
