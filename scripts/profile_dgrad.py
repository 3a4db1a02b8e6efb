"""Per-kernel GPU time of the MLP backward's activation-gradient step at BERT-base and GPT-2
medium shapes (bf16): linear_act_dgrad with and without the bias gradient, and the unfused
backward pass it replaces (op linear_act_bwd, db only and dz + db), from the profiler.

    python scripts/profile_dgrad.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import kernel_times_us

from fastlayers.ops.linear_act import linear_act_bwd, linear_act_dgrad

SHAPES = [("BERT-base", 8192, 768, 3072), ("GPT-2 medium", 8192, 1024, 4096)]


def kernels(fn) -> list[tuple[str, float]]:
    """(kernel name, us per call), the longest first."""
    times = kernel_times_us(fn)
    return [(k[:90], us) for k, us in sorted(times.items(), key=lambda r: -r[1]) if us > 0]


def profile_shape(label: str, m: int, n2: int, n1: int) -> None:
    dy = torch.randn(m, n2, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(n2, n1, device="cuda") / n2**0.5).to(torch.bfloat16)
    z = torch.randn(m, n1, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 64, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(n1, 64, device="cuda", dtype=torch.bfloat16)
    da = torch.randn(m, n1, device="cuda", dtype=torch.bfloat16)
    cases = {
        "linear_act_dgrad (dz)": lambda: linear_act_dgrad(dy, w2, z, "gelu", False, False),
        "linear_act_dgrad (dz + db)": lambda: linear_act_dgrad(dy, w2, z, "gelu", False, True),
        "backward pass, db only": lambda: linear_act_bwd(
            da, z, x, w1, True, "gelu", False, [False, False, True]
        ),
        "dz.sum(0)": lambda: da.sum(0),
    }
    for name, fn in cases.items():
        print(f"{label} {name}:")
        for k, us in kernels(fn):
            print(f"    {us:8.1f} us  {k}")


for shape in SHAPES:
    profile_shape(*shape)
