"""A serving stream, as a server runs one: requests of 1 to ``--max-batch`` real texts (Python's
documentation paragraphs, picked at random, unsorted), each tokenized and padded to its longest,
one forward per request, timed one by one from the request's arrival (host clock, the GPU
synchronised after each). Per way: the whole stream's time, the p50 / p99 / max of the
requests, the same after the first ``--warm`` requests, and the share of padded tokens. Ways:
native eager, native with cuDNN's SDPA off (``torch.backends.cuda.enable_cudnn_sdp(False)``),
patched, patched + replay, patched padding-free (``unpad``), and padding-free with its packed
calls replayed from graphs keyed by packed size (``unpad_replay``), the same with its graphs
captured ahead by ``fastlayers.warm_up`` (``unpad_replay_warm``; the warm-up timed apart, as
setup). Each way sees the same requests
in the same order, each in a process of its own (cuDNN keeps its plans per process: a way run
after another would find the other's plans built).

    python benchmarks/bench_stream.py [MODEL] [--requests 400] [--max-batch 64] [--warm 50]
        [--dtype bfloat16] [--ways native,native_no_cudnn,patched,replay,unpad] [--warm-tokens N]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import subprocess
import sys
import time

import torch
from common import gpu_name, load_encoder, warm_up_gpu, write_results
from fastlayers.patching.checking.throughput import real_texts

import fastlayers

WAYS = (
    "native",
    "native_no_cudnn",
    "patched",
    "replay",
    "unpad",
    "unpad_replay",
    "unpad_replay_warm",
)
# unpad_replay_warm: the graphs of up to --max-batch sequences and --warm-tokens real tokens
# captured ahead (fastlayers.warm_up, timed apart as setup), as a server does at start-up


def build(way: str, base: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if way != "native" and way != "native_no_cudnn":
        replay = way in ("replay", "unpad_replay", "unpad_replay_warm")
        fastlayers.patch(model, replay=replay, unpad=way.startswith("unpad"))
    return model


def runtime_forward(model: torch.nn.Module):
    """The replay or padding-free forward a patch set on one of ``model``'s modules, or None."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if hasattr(forward, "stats"):
            return forward
    return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def stream(model, requests, no_cudnn: bool) -> list[float]:
    """Seconds per request, in order."""
    times = []
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    if no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with torch.no_grad():
            for batch in requests:
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(**batch)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                del out
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-tokens", type=int, default=4096)
    parser.add_argument("--out")
    args = parser.parse_args()
    base, what, tokenizer, length = load_encoder(args.model, args.dtype)
    texts = real_texts()
    rng = random.Random(args.seed)
    requests, tokens, padded = [], 0, 0
    for _ in range(args.requests):
        picked = rng.sample(texts, rng.randint(1, args.max_batch))
        enc = tokenizer(
            picked, padding=True, truncation=True, max_length=length, return_tensors="pt"
        )
        tokens += int(enc["attention_mask"].sum())
        padded += enc["attention_mask"].numel()
        requests.append({k: v.to("cuda") for k, v in enc.items()})
    warm_up_gpu()
    rows, payload = [], {"model": what, "requests": args.requests, "max_batch": args.max_batch}
    payload["padding_share"] = 1 - tokens / padded
    ways = args.ways.split(",")
    if len(ways) > 1:  # each way in a process of its own
        for way in ways:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--ways", way, "--out", ""]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
            if line is None:
                print(f"{way}: failed\n{done.stdout[-2000:]}{done.stderr[-3000:]}", flush=True)
                continue
            row = json.loads(line)
            payload[way] = row
            rows.append((way, row))
            print(way, {k: v for k, v in row.items() if k != "stats"}, flush=True)
    for way in ways if len(ways) == 1 else ():
        model = build(way, base)
        setup = 0.0
        if way == "unpad_replay_warm":
            start = time.perf_counter()
            fastlayers.warm_up(model, requests[0], args.max_batch, args.warm_tokens)
            torch.cuda.synchronize()
            setup = time.perf_counter() - start
        times = stream(model, requests, no_cudnn=way == "native_no_cudnn")
        ms = [1e3 * t for t in times]
        later = ms[args.warm :] or ms
        row = {
            "total_s": sum(times),
            "p50_ms": statistics.median(ms),
            "p99_ms": percentile(ms, 0.99),
            "max_ms": max(ms),
            "later_p50_ms": statistics.median(later),
            "later_p99_ms": percentile(later, 0.99),
            "setup_s": setup,
        }
        forward = runtime_forward(model)
        row["stats"] = dict(getattr(forward, "stats", None) or {})
        graphs = getattr(forward, "graphs", None) or getattr(forward, "graph_count", None)
        row["graphs"] = graphs() if graphs is not None else None
        memory = getattr(forward, "graph_memory", None)  # padding-free replay's graphs
        row["graph_mib"] = memory() / 2**20 if memory is not None else None
        print(json.dumps(row), flush=True)
        return
    table = "\n".join(
        [
            f"{what}, {gpu_name()}, {args.dtype}: {args.requests} requests of 1 to "
            f"{args.max_batch} random texts, unsorted, each padded to its longest "
            f"({payload['padding_share']:.0%} padding); one forward per request",
            "",
            f"| way | total s | p50 ms | p99 ms | max ms | p50 / p99 after the first {args.warm} "
            "| graphs | set up ahead s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *[
                f"| {w} | {r['total_s']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{r['max_ms']:.1f} | {r['later_p50_ms']:.2f} / {r['later_p99_ms']:.2f} | "
                f"{r['graphs'] if r['graphs'] is not None else '-'} | {r['setup_s']:.2f} |"
                for w, r in rows
            ],
        ]
    )
    write_results(args.out, "stream", table, payload)


if __name__ == "__main__":
    main()
