"""What the main job's users run, timed every way they could run it: a sentence-embedding model
(default: the all-MiniLM-L6-v2 of fastlayers[demo], or a model folder) encoding real texts of
varied length (the paragraphs of Python's documentation topics), sorted by length and cut into
batches padded to their longest, as sentence-transformers' ``encode`` batches them. Whole passes
over all batches (outputs kept on the GPU), wall time, for: native eager, patched eager, patched
padding-free (``unpad``; ``unpad_native``: padding-free alone; ``unpad_replay``: its packed
calls replayed from graphs keyed by packed size), native and patched with
fastlayers' replay (CUDA graphs per shape bucket), and torch.compile
(mode="reduce-overhead", and "default") of the native and the patched model. Each way's setup
(the first pass: captures, compilation) is reported apart from its median pass; the timed
passes run in rounds, one pass of each way per round in rotating order, since a host-bound
pass's time drifts with the host.

    python benchmarks/bench_encode.py [MODEL] [--batch 128] [--texts N] [--passes 5]
        [--dtype bfloat16] [--ways native,patched,replay_native,replay,compile_ro,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from common import gpu_name, load_encoder, warm_up_gpu, write_results
from fastlayers.patching.checking.throughput import real_batches, real_texts

import fastlayers

WAYS = (
    "native",
    "patched",
    "unpad",
    "unpad_native",
    "unpad_replay",
    "replay_native",
    "replay",
    "compile_ro_native",
    "compile_ro",
    "compile_native",
    "compile",
)


def build(way: str, base: torch.nn.Module):
    """The callable for one way, from a fresh copy of ``base`` (compiled ways: a fresh dynamo
    cache key each, as each is its own model object)."""
    model = copy.deepcopy(base)
    if way in ("patched", "replay", "compile_ro", "compile", "unpad", "unpad_replay"):
        replay = way in ("replay", "unpad_replay")
        fastlayers.patch(model, replay=replay, unpad=way.startswith("unpad"))
    elif way == "unpad_native":  # padding-free alone, no fused layers
        fastlayers.patch(model, layers=(), unpad=True)
    elif way == "replay_native":
        fastlayers.patch(model, layers=(), replay=True)
    if way.startswith("compile"):
        mode = "reduce-overhead" if way.startswith("compile_ro") else "default"
        return torch.compile(model, mode=mode)
    return model


def one_pass(fn, batches) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        outs = [fn(**b) for b in batches]
    torch.cuda.synchronize()
    del outs
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--texts", type=int, default=0, help="0: all")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out")
    args = parser.parse_args()
    base, what, tokenizer, length = load_encoder(args.model, args.dtype)
    texts = real_texts()[: args.texts or None]
    data = real_batches(tokenizer, texts, args.batch, length, torch.device("cuda"))
    torch._dynamo.config.cache_size_limit = 64  # each compiled way sees every batch shape
    warm_up_gpu()
    rows, payload = [], {"model": what, "texts": len(texts), "batch": args.batch}
    payload["padding_share"] = data.padding_share
    ways = args.ways.split(",")
    fns, setups = {}, {}
    for way in ways:  # built and set up (captured, compiled) first
        fns[way] = build(way, base)
        setups[way] = one_pass(fns[way], data.batches)
        one_pass(fns[way], data.batches)
        print(f"{way}: set up in {setups[way]:.2f} s", flush=True)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(args.passes):  # then timed in rounds, the order rotating: the host drifts
        for way in ways[i % len(ways) :] + ways[: i % len(ways)]:
            times[way].append(one_pass(fns[way], data.batches))
    native_ms = 1e3 * statistics.median(times["native"]) if "native" in times else None
    for way in ways:
        ms = 1e3 * statistics.median(times[way])
        speedup = native_ms / ms if native_ms else float("nan")
        rows.append((way, ms, len(texts) / (ms / 1e3), speedup, setups[way]))
        payload[way] = {"ms": ms, "times_ms": [1e3 * t for t in times[way]], "setup_s": setups[way]}
        print(f"{way}: {ms:.1f} ms per pass, {speedup:.2f}x", flush=True)
    table = "\n".join(
        [
            f"{what}, {gpu_name()}, {args.dtype}: {len(texts)} texts, batches of {args.batch} "
            f"sorted by length, padded to their longest ({data.padding_share:.0%} padding); "
            f"median of {args.passes} passes",
            "",
            "| way | ms per pass | texts/s | vs native eager | setup (first pass) s |",
            "|---|---:|---:|---:|---:|",
            *[f"| {w} | {ms:.1f} | {tps:.0f} | {x:.2f}x | {s:.2f} |" for w, ms, tps, x, s in rows],
        ]
    )
    write_results(args.out, "encode", table, payload)


if __name__ == "__main__":
    main()
