"""Kernel counts and GPU time of a patched model's training step (fp32 weights under bf16
autocast, benchmarks/bench_models.py's step) for the kernels of autocast's conversions in the
backward: fastlayers' widening and in-place addition into the engine's sums, ATen's copies
(its dtype conversions among them) and ATen's float32 additions (the engine's sums among them).

    python tools/profile_train_conversions.py [MODEL]   (default llama-1b; a CUDA GPU)

Warm-up as bench_models (the attention's backend settled), then the profiler over 3 steps
(benchmarks/common.kernel_profile); counts and times are per step."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_models as bm
from common import kernel_profile

KERNELS = ("add_widened_kernel", "widen_kernel", "CUDAFunctor_add<float>", "direct_copy")


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    models, counts = bm.models_for(name, "train", liger=False)
    batch, _ = bm.make_batch(name, "cuda")
    step = bm.step_fn(models[bm.PATCHED], batch, "train")
    for _ in range(3):
        step()
    bm.settle_attention({"patched": step}, counts, "train")
    torch.cuda.synchronize()
    total = 0.0
    found: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for kernel, (calls, us) in kernel_profile(step, reps=3, warmup=0).items():
        if us <= 0:
            continue
        total += us / 1e3
        part = next((k for k in KERNELS if k in kernel), None)
        if part is not None:
            found[part][0] += calls
            found[part][1] += us / 1e3
    print(f"{name} train: GPU {total:.2f} ms a step")
    for part, (calls, ms) in found.items():
        print(f"  {part}: {calls} calls, {ms:.3f} ms")


if __name__ == "__main__":
    main()
