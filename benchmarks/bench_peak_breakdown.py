"""What a step holds at its memory peak, and where compiled steps spend GPU time, for the models
of bench_models.py: native, patched and (--liger) Liger-Kernel's patch side by side.

--memory MODES: one step of each model under torch.cuda's allocator history; the bytes live at
the step's peak (above what the model holds between steps) grouped by the innermost frame in
fastlayers, Liger, transformers or the benchmark, largest first.
--kernels MODES: three profiled steps of each model; the GPU time per step by kernel name, the
kernels whose time differs most between native and patched first.

    python benchmarks/bench_peak_breakdown.py --model llama-1b --memory train,train_bf16 --liger
    python benchmarks/bench_peak_breakdown.py --model llama-1b --kernels compile_infer
"""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict

import bench_models as bm
import torch
from common import kernel_times_us

OWN = ("fastlayers", "liger_kernel", "transformers", "bench_models", "bench_peak_breakdown")


def where(frames: list) -> str:
    for f in frames:
        if any(part in f["filename"] for part in OWN):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return frames[0]["name"] if frames else "?"


def peak_groups(fn) -> tuple[float, list]:
    """The step's peak above its start (MiB) and the bytes live then, by frame."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict = {}
    for event in snap["device_traces"][torch.cuda.current_device()]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            now += event["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action == "free_requested":
            now -= event["size"]
            live.pop(event["addr"], None)
    groups: dict[str, float] = defaultdict(float)
    for size, frame in at_peak.values():
        groups[frame] += size / 2**20
    return peak / 2**20, sorted(groups.items(), key=lambda kv: -kv[1])


def memory(name: str, mode: str, liger: bool, batch: dict) -> None:
    for label, model in bm.models_for(name, mode, liger)[0].items():
        fn = bm.step_fn(model, batch, mode)
        for _ in range(3):
            fn()
        peak, groups = peak_groups(fn)
        print(f"\n{name} {mode} {label}: peak {peak:.0f} MiB above the step's start; live then:")
        for frame, mib in groups[:24]:
            if mib >= 1:
                print(f"  {mib:9.1f}  {frame}")


def kernels(name: str, mode: str, batch: dict) -> None:
    models = bm.models_for(name, mode, False)[0]
    # a control: an unpatched copy of native, built as the patched one is (deepcopy); each
    # model profiled twice, in the order patched, native, copy, then again, so that a
    # difference which follows the order or the copy, not the patch, shows
    models["native copy"] = copy.deepcopy(models["native"])
    fns = {k: bm.step_fn(m, batch, mode, bm.compiled_for(m, mode)) for k, m in models.items()}
    per: dict[str, dict[str, float]] = {k: defaultdict(float) for k in fns}
    for turn in range(2):
        for label in ("patched", "native", "native copy"):
            step = {k: us / 1e3 for k, us in kernel_times_us(fns[label], reps=3).items() if us > 0}
            for k, ms in step.items():
                per[label][k] += ms / 2
            print(f"{name} {mode} {label} (turn {turn}): GPU {sum(step.values()):.3f} ms per step")
    a, b = per["native"], per["patched"]
    rows = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
    print(f"\n{name} {mode}: kernels by |patched - native| (ms per step)")
    for k in rows[:30]:
        x, y = a.get(k, 0.0), b.get(k, 0.0)
        print(f"  {x:8.3f} {y:8.3f} {y - x:+8.3f}  {k[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", choices=list(bm.MODELS))
    parser.add_argument("--memory", default="", help="modes, comma-separated")
    parser.add_argument("--kernels", default="", help="modes, comma-separated")
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    bm.warm_up_gpu()
    batch, _ = bm.make_batch(args.model, bm.DEVICE)
    for mode in filter(None, args.memory.split(",")):
        memory(args.model, mode, args.liger, batch)
    for mode in filter(None, args.kernels.split(",")):
        kernels(args.model, mode, batch)


if __name__ == "__main__":
    main()
