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
import contextlib
import copy
import json
import statistics
import subprocess
import sys
import time

import torch
from common import gpu_name, load_encoder, warm_up_gpu, write_results
from fastlayers.patching.checking.stream import (
    cudnn_attention_off,
    percentile,
    request_seconds,
    runtime_forward,
    stream_requests,
)
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
    requests, share = stream_requests(
        tokenizer,
        real_texts(),
        args.requests,
        args.max_batch,
        length,
        torch.device("cuda"),
        seed=args.seed,
    )
    warm_up_gpu()
    rows, payload = [], {"model": what, "requests": args.requests, "max_batch": args.max_batch}
    payload["padding_share"] = share
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
        with cudnn_attention_off() if way == "native_no_cudnn" else contextlib.nullcontext():
            times = request_seconds(model, requests, torch.device("cuda"))
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
        row["graphs"] = forward.graph_count() if forward is not None else None
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
