#!/usr/bin/env bash
# mma.sync's register-only tensor-core peak (scripts/mma_sync_peak.cu) beside cuBLAS's bare bf16
# GEMM at the sizes of issue 20, on the GPU machine:  bash scripts/mma_sync_peak.sh
set -euo pipefail
nvcc -O3 -arch=sm_90a -o /tmp/mma_sync_peak scripts/mma_sync_peak.cu
/tmp/mma_sync_peak
python3 - <<'PY'
import torch

for m, k, n in ((8192, 8192, 8192), (8192, 768, 3072), (8192, 1024, 4096), (8192, 4096, 16384)):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        torch.mm(x, w.t())
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        torch.mm(x, w.t())
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    ms = sorted(times)[len(times) // 2]
    print(f"cuBLAS bf16 {m}x{k}->{n}: {2 * m * k * n / ms / 1e9:7.1f} TFLOP/s ({ms * 1e3:.1f} us)")
PY
