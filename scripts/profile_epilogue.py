"""Where the sm90 fused GEMM's activation epilogue spends its time, on the GPU machine.

Runs the raw sm90 kernel (fastlayers._C._linear_act_sm90_raw) at one shape with each epilogue:
identity (the GEMM alone), relu, tanh, erf, erf + pre-activation store.

    python3 scripts/profile_epilogue.py time [--m 8192 --k 768 --n 3072 --config 1]
        each epilogue run back to back for --seconds, CUDA-event time per call, and the SM clock
        and board power that `nvidia-smi` sampled meanwhile (is the epilogue's cost its
        instructions, or a lower clock under the power limit?)
    python3 scripts/profile_epilogue.py ncu [...]
        two warm-up calls per epilogue, then one call each: profile the last five calls with
        `ncu -k regex:device_kernel --launch-skip 10 --launch-count 5`
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from fastlayers import _C

EPILOGUES = [
    ("identity", 3, False),
    ("relu", 2, False),
    ("tanh", 1, False),
    ("erf", 0, False),
    ("erf+preact", 0, True),
]


def make_call(args: argparse.Namespace, epilogue: int, preact: bool):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    x = torch.randn(args.m, args.k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(args.n, args.k, device="cuda", dtype=dtype, generator=gen) / args.k**0.5
    b = torch.randn(args.n, device="cuda", dtype=dtype, generator=gen)
    y = torch.empty(args.m, args.n, device="cuda", dtype=dtype)
    aux = torch.empty_like(y) if preact else None

    def call() -> None:
        _C._linear_act_sm90_raw(x, w, b, y, aux, False, epilogue, args.config)

    return call


def smi_sampler(path: str) -> subprocess.Popen:
    query = "timestamp,clocks.sm,power.draw"
    return subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=open(path, "w"),
    )


def smi_window(path: str, start: float, end: float) -> tuple[float, float, int]:
    """Mean SM clock (MHz) and power (W) of the samples taken in [start, end] (epoch s)."""
    clocks, watts = [], []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            clock, power = float(parts[1]), float(parts[2])
        except ValueError:
            continue
        if start <= stamp <= end:
            clocks.append(clock)
            watts.append(power)
    if not clocks:
        return float("nan"), float("nan"), 0
    return statistics.fmean(clocks), statistics.fmean(watts), len(clocks)


def time_epilogues(args: argparse.Namespace) -> None:
    log = "/tmp/profile_epilogue_smi.csv"
    sampler = smi_sampler(log)
    time.sleep(1.0)
    rows = []
    try:
        for name, epilogue, preact in EPILOGUES:
            call = make_call(args, epilogue, preact)
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            t0 = time.time()
            calls = 0
            start_ev.record()
            while time.time() - t0 < args.seconds:
                for _ in range(50):
                    call()
                calls += 50
                torch.cuda.synchronize()
            end_ev.record()
            torch.cuda.synchronize()
            t1 = time.time()
            us = start_ev.elapsed_time(end_ev) * 1e3 / calls
            rows.append((name, us, t0 + 0.5, t1))
            time.sleep(1.0)  # let the clock recover between epilogues
    finally:
        time.sleep(0.2)
        sampler.terminate()
        sampler.wait()
    print(
        f"{args.dtype} {args.m}x{args.k}->{args.n} config {args.config}, back to back, "
        f"{args.seconds} s each"
    )
    print(f"{'epilogue':12s} {'us/call':>9s} {'SM MHz':>8s} {'W':>7s} {'samples':>8s}")
    for name, us, start, end in rows:
        clock, watts, n = smi_window(log, start, end)
        print(f"{name:12s} {us:9.1f} {clock:8.0f} {watts:7.1f} {n:8d}")


def ncu_calls(args: argparse.Namespace) -> None:
    calls = [make_call(args, epilogue, preact) for _, epilogue, preact in EPILOGUES]
    for call in calls:  # warm-up: two launches each (ncu --launch-skip 10)
        call()
        call()
    for call in calls:
        call()
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["time", "ncu"])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=768)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--config", type=int, default=-1, help="-1 auto, 0 coop, 1 pingpong")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if args.what == "time":
        time_epilogues(args)
    else:
        ncu_calls(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
