#!/usr/bin/env bash
# mma.sync's register-only tensor-core peak (scripts/mma_sync_peak.cu) beside cuBLAS's bare bf16
# GEMM at the sizes of issue 20, on the GPU machine:  bash scripts/mma_sync_peak.sh
set -euo pipefail
nvcc -O3 -arch=sm_90a -o /tmp/mma_sync_peak scripts/mma_sync_peak.cu
/tmp/mma_sync_peak
python3 - <<'PY'
import sys

import torch

sys.path.insert(0, "benchmarks")
from common import median_ms, warm_up_gpu

warm_up_gpu()
for m, k, n in ((8192, 8192, 8192), (8192, 768, 3072), (8192, 1024, 4096), (8192, 4096, 16384)):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.mm(x, w.t()), reps=20)
    print(f"cuBLAS bf16 {m}x{k}->{n}: {2 * m * k * n / ms / 1e9:7.1f} TFLOP/s ({ms * 1e3:.1f} us)")
PY
