"""Training on real-length texts in random batches padded to their longest, as a fine-tuning or
SFT loop with dynamic padding sends them: BERT-base fine-tuning (sequence classification,
batches of 32 paragraphs of Python's documentation, at most 512 tokens) and llama-1b SFT
(causal LM, batches of 8 samples of 1 to 8 paragraphs each, at most 1024 tokens, labels -100 at
the padding). fp32 weights, bf16 autocast, fused AdamW, dropout off (so that every way's loss
curve can be compared step by step with native's from the same weights on the same batches).

Ways: native eager, native with cuDNN's attention off (no attention plan build per new batch
shape: what padding-free saves besides the padding), patched, patched + unpad (padding-free),
each in a process of its own
(cuDNN keeps its attention plans per process: a way run after another would find the other's
plans built for every batch shape). Per way: real tokens per second over the timed steps, peak
memory, and the largest relative difference of its loss from native's over the steps.

    python benchmarks/bench_train_padded.py [--models bert-base,llama-1b] [--steps 20]
        [--tokenizer FOLDER] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

import torch
import transformers as tf
from bench_models import _llama_1b  # bench_models' llama-1b (TinyLlama-1.1B's shape)
from common import gpu_name, write_results
from fastlayers.patching.checking import models as hf_models
from fastlayers.patching.checking.stream import cudnn_attention_off
from fastlayers.patching.checking.throughput import real_texts

import fastlayers

WAYS = ("native", "native_no_cudnn", "patched", "unpad")


def bert_base() -> torch.nn.Module:
    config = tf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
    return tf.BertForSequenceClassification(config)


# the model, texts per batch, most tokens per sample, most paragraphs per sample
MODELS = {"bert-base": (bert_base, 32, 512, 1), "llama-1b": (_llama_1b, 8, 1024, 8)}


def batches(name: str, tokenizer, steps: int, seed: int = 0) -> tuple[list[dict], float]:
    """``steps`` batches on CUDA and their share of padded tokens."""
    _, size, longest, pieces = MODELS[name]
    texts = real_texts()
    rng = random.Random(seed)
    out, real, padded = [], 0, 0
    for _ in range(steps):
        samples = ["\n\n".join(rng.sample(texts, rng.randint(1, pieces))) for _ in range(size)]
        enc = tokenizer(
            samples, padding=True, truncation=True, max_length=longest, return_tensors="pt"
        )
        batch = {k: v.cuda() for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        if name == "bert-base":
            batch["labels"] = torch.randint(0, 2, (size,), device="cuda")
        else:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        real += int(enc["attention_mask"].sum())
        padded += enc["attention_mask"].numel()
        out.append(batch)
    return out, 1 - real / padded


def run_way(way: str, model: torch.nn.Module, data: list[dict], warm: int) -> dict:
    if way == "native_no_cudnn":  # native with cuDNN's attention off: no plan build per shape
        with cudnn_attention_off():
            return run_way("native", model, data, warm)
    if way == "patched":
        fastlayers.patch(model)
    elif way == "unpad":
        fastlayers.patch(model, unpad=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    losses = []

    def step(batch: dict) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    for batch in data[:warm]:
        step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in data[warm:]:
        step(batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(int(b["attention_mask"].sum()) for b in data[warm:])
    row = {
        "tokens_per_s": tokens / seconds,
        "ms_per_step": 1e3 * seconds / (len(data) - warm),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "losses": [float(x) for x in losses],
    }
    model = opt = None  # freed before the next way
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--tokenizer", help="a model folder (default: the main job's model)")
    parser.add_argument("--out")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # one way, in this process
    args = parser.parse_args()
    tokenizer, _ = hf_models.load_tokenizer(args.tokenizer or hf_models.default_model_path())
    if args.way:  # a child: one model, one way; its row as one JSON line
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = MODELS[args.models][0]()
        data, share = batches(args.models, tokenizer, args.warm + args.steps)
        row = run_way(args.way, model, data, args.warm)
        print(json.dumps({"padding_share": share, **row}), flush=True)
        return
    lines, payload = [], {}
    for name in args.models.split(","):
        results, share = {}, 0.0
        for way in WAYS:
            cmd = [sys.executable, __file__, "--models", name, "--way", way]
            cmd += ["--steps", str(args.steps), "--warm", str(args.warm)]
            cmd += ["--tokenizer", args.tokenizer] if args.tokenizer else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
            if line is None:
                print(f"{name} {way}: failed\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
                continue
            results[way] = json.loads(line)
            share = results[way].pop("padding_share")
        if "native" not in results:
            continue
        base = results["native"]
        lines += [
            f"{name}, {gpu_name()}: fp32 weights, bf16 autocast, fused AdamW, dropout off; "
            f"batches of {MODELS[name][1]} padded to their longest ({share:.0%} padding); "
            f"{args.steps} timed steps after {args.warm}; each way in its own process",
            "",
            "| way | real tokens/s | ms per step | vs native | peak MiB | max rel. loss diff |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for way, row in results.items():
            diff = max(
                abs(a - b) / max(abs(b), 1e-6)
                for a, b in zip(row["losses"], base["losses"], strict=True)
            )
            row["max_rel_loss_diff"] = diff
            lines.append(
                f"| {way} | {row['tokens_per_s']:.0f} | {row['ms_per_step']:.1f} | "
                f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {row['peak_mib']:.0f} | "
                f"{diff:.2e} |"
            )
            print(name, way, {k: v for k, v in row.items() if k != "losses"}, flush=True)
        lines.append("")
        payload[name] = {"padding_share": share, **results}
    write_results(args.out, "train_padded", "\n".join(lines), payload)


if __name__ == "__main__":
    main()
