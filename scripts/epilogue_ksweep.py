"""What the sm90 epilogues cost, from short inner dimensions (GPU machine).

    python3 scripts/epilogue_ksweep.py [--configs 1,3] [--ks 64,256,512,768,1024,2048]

At K = 64 a tile's mainloop is nearly free and the ping-pong kernel's warp groups take their
epilogues in turn, so the time over the identity epilogue's is the epilogue math run with no
mainloop beside it; at larger K it shows how much of that math the other warp group's mainloop
hides. Times every forward epilogue (identity without and with bias, relu, tanh, erf, erf +
pre-activation) at 8192 x K -> 3072 and the backward GEMM's (identity, erf, tanh) at
8192 x K . W2[K, 3072], for each tile config given (the raw entries' numbers), bf16, L2 flushed
(benchmarks/common.median_ms).
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial

import torch

sys.path.insert(0, "benchmarks")
from common import median_ms, warm_up_gpu

from fastlayers import _C


def fwd_case(m, k, n, epilogue, bias, preact, config):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    aux = torch.empty_like(y) if preact else None
    return lambda: _C._linear_act_sm90_raw(x, w, b, y, aux, False, epilogue, config)


def dgrad_case(m, k, n, epilogue, config):
    dy = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(k, n, device="cuda") / n**0.5).to(torch.bfloat16)
    z = (2 * torch.randn(m, n, device="cuda")).to(torch.bfloat16)
    dz = torch.empty_like(z)
    return lambda: _C._linear_act_dgrad_sm90_raw(dy, w2, z, dz, False, epilogue, config)


FWD = [
    ("identity, no bias", 3, False, False),
    ("identity", 3, True, False),
    ("relu", 2, True, False),
    ("tanh", 1, True, False),
    ("erf", 0, True, False),
    ("erf + preact", 0, True, True),
]


def cell(fn_of_case, reps: int) -> str:
    """The median time of the call fn_of_case() builds, in us, or "n/a" (config not compiled)."""
    try:
        return f"{median_ms(fn_of_case(), reps=reps) * 1e3:.1f}"
    except RuntimeError as e:
        print("error:", str(e).splitlines()[0])
        return "n/a"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="1", help="raw-entry tile configs, e.g. 1,3")
    p.add_argument("--ks", default="64,256,512,768,1024,2048")
    p.add_argument("--reps", type=int, default=100)
    a = p.parse_args()
    configs = [int(c) for c in a.configs.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    warm_up_gpu()
    m, n = 8192, 3072
    rounds = math.ceil(m / 128) * math.ceil(n / 128) / sms
    print(f"forward {m}x K -> {n}, bf16, us ({rounds:.2f} 128x128 tiles per SM)")
    print("| K | config | " + " | ".join(f[0] for f in FWD) + " |")
    for k in [int(v) for v in a.ks.split(",")]:
        for c in configs:
            cells = [
                cell(partial(fwd_case, m, k, n, ep, bias, pre, c), a.reps)
                for _, ep, bias, pre in FWD
            ]
            print(f"| {k} | {c} | " + " | ".join(cells) + " |", flush=True)
    print(f"backward GEMM dz = act'(z) * (dy[{m}, K] . W2[K, {n}]), bf16, us")
    print("| K | config | identity | erf | tanh |")
    for k in (64, 256, 768, 1024):
        for c in configs:
            cells = [cell(partial(dgrad_case, m, k, n, ep, c), a.reps) for ep in (3, 0, 1)]
            print(f"| {k} | {c} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
