"""Where a pass of the main job's batches spends its time, per way (a maintainer's check on the
GPU machine): wall per pass with the batches queued back to back, the GPU's busy time (sum of
kernel times, torch.profiler), the host time of one call (its Python up to return), and the
top host ops and kernels of the padding-free replayed way.

    python tools/unpad_profile.py MODEL_FOLDER [--ways replay,unpad,unpad_replay]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import load_encoder
from fastlayers.patching.checking.stream import runtime_forward
from fastlayers.patching.checking.throughput import real_batches, real_texts

import fastlayers


def build(way: str, base: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if way != "native":
        fastlayers.patch(model, replay="replay" in way, unpad=way.startswith("unpad"))
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--ways", default="native,patched,replay,unpad,unpad_replay")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    base, what, tokenizer, length = load_encoder(args.model, "bfloat16")
    data = real_batches(tokenizer, real_texts(), 128, length, torch.device("cuda"))
    print(what, f"{len(data.batches)} batches, {data.padding_share:.0%} padding", flush=True)
    for way in args.ways.split(","):
        model = build(way, base)
        with torch.no_grad():
            for _ in range(3):
                outs = [model(**b) for b in data.batches]
            torch.cuda.synchronize()
            walls, hosts = [], []
            for _ in range(5):
                start = time.perf_counter()
                host = 0.0
                for b in data.batches:
                    t = time.perf_counter()
                    outs.append(model(**b))
                    host += time.perf_counter() - t
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - start)
                hosts.append(host)
                outs.clear()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                outs = [model(**b) for b in data.batches]
                torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3
        print(
            f"{way}: wall {1e3 * statistics.median(walls):.1f} ms per pass, host in calls "
            f"{1e3 * statistics.median(hosts):.1f} ms, GPU busy {gpu:.1f} ms (profiled pass)",
            flush=True,
        )
        if way in ("unpad", "unpad_replay"):
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
            print(events.table(sort_by="self_device_time_total", row_limit=args.top))
        fwd = runtime_forward(model)

        stats = getattr(fwd, "stats", None)
        print(f"  stats: {dict(stats or {})}", flush=True)
        if fwd is not None and hasattr(fwd, "graph_memory"):
            inner = dict(fwd._replay.stats) if fwd._replay else None
            print(f"  graphs: {fwd.graph_count()}, replay stats {inner}")
        del model, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
