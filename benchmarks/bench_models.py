"""Whole HuggingFace models, native vs patched, in one run on one GPU: BERT-base (masked LM),
GPT-2 medium (causal LM) and ViT-B/16 (image classification), random weights from their
standard configs (nothing downloaded).

Modes: eager inference (bf16 weights, no_grad), eager training step (fp32 weights, bf16
autocast, AdamW), torch.compile inference, torch.compile training step, and CUDA graphs
(torch.compile mode="reduce-overhead", inference; the patched output is checked against eager).
Native and patched steps alternate (each its own model and optimizer, same weights and
inputs); times are medians of CUDA-event timed steps after warm-up (compilation happens there).
The eager modes also get a breakdown of the GPU time per step by kernel family (LayerNorm,
fused Linear+GELU GEMM, other GEMMs, GELU passes, attention, optimizer, other; --no-profile
skips it).

    python benchmarks/bench_models.py [--models bert-base,gpt2-medium,vit-b16]
        [--modes infer,train,compile_infer,compile_train,graphs] [--steps N] [--no-profile]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(__file__))
from common import event_and_host_ms, gpu_name, warm_up_gpu, write_results

import fastlayers

# name -> (build on the current device, input kind, batch, sequence length)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str, int, int]] = {
    "bert-base": (lambda: tf.BertForMaskedLM(tf.BertConfig()), "text", 32, 512),
    "gpt2-medium": (
        lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        "text",
        32,
        512,
    ),
    "vit-b16": (
        lambda: tf.ViTForImageClassification(tf.ViTConfig(num_labels=1000)),
        "image",
        128,
        0,
    ),
}
MODES = ("infer", "train", "compile_infer", "compile_train", "graphs")
# Under torch.compile a third model runs: patched, with fastlayers.LayerNorm traced as its fused
# op instead of aten.layer_norm (fastlayers.config.compile_layer_norm), to show which is faster.
LN_FUSED = "patched_ln_fused"

# Kernel families for --profile, first match wins. Our CUTLASS kernel's name is a
# cutlass::device_kernel<GemmUniversal<...>> whose epilogue types live in namespace fastlayers.
FAMILIES = [
    ("Linear+GELU fused GEMM", re.compile(r"cutlass.*fastlayers|fastlayers.*cutlass")),
    ("LayerNorm", re.compile(r"layer_norm|LayerNorm|ln_fwd|ln_bwd|GammaBeta|sum_partials")),
    ("GELU pass (fwd/bwd)", re.compile(r"gelu|Gelu", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|attn|softmax", re.IGNORECASE)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.IGNORECASE)),
    ("GEMM", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_", re.IGNORECASE)),
]


def make_batch(model_name: str, device: str) -> tuple[dict, int]:
    """Inputs with labels, and the tokens (or images) per step."""
    _, kind, batch, seq = MODELS[model_name]
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "image":
        pixels = torch.randn(batch, 3, 224, 224, device=device, generator=g)
        labels = torch.randint(0, 1000, (batch,), device=device, generator=g)
        return {"pixel_values": pixels, "labels": labels}, batch
    ids = torch.randint(0, 30000, (batch, seq), device=device, generator=g)
    return {"input_ids": ids, "labels": ids.clone()}, batch * seq


def build_models(model_name: str, training: bool, copies: int) -> list[torch.nn.Module]:
    """[native, patched, patched...] (``copies`` patched ones): the same random weights; bf16
    for inference, fp32 for training."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        native = MODELS[model_name][0]()
    if not training:
        native = native.to(torch.bfloat16)
    native.train(training)
    patched = []
    for _ in range(copies):
        patched.append(copy.deepcopy(native))
        fastlayers.patch(patched[-1])
    return [native, *patched]


def with_compiled_layer_norm(fn: Callable[[], object], mode: str) -> Callable[[], object]:
    def run():
        with fastlayers.config.compile_layer_norm_as(mode):
            return fn()

    return run


def step_fn(model, batch: dict, mode: str, compiled=None) -> Callable[[], object]:
    run = compiled if compiled is not None else model
    if mode in ("infer", "compile_infer", "graphs"):
        inputs = {k: v for k, v in batch.items() if k != "labels"}

        def infer():
            with torch.no_grad():
                return run(**inputs)

        return infer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def train():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return train


def compiled_for(model, mode: str):
    if mode in ("compile_infer", "compile_train"):
        return torch.compile(model)
    if mode == "graphs":
        return torch.compile(model, mode="reduce-overhead")
    return None


def kernel_families_ms(fn: Callable[[], object], steps: int = 3) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        family = next((f for f, rx in FAMILIES if rx.search(event.key)), "other")
        totals[family] += event.self_device_time_total / steps / 1e3
    return dict(totals)


def graphs_match(patched_out, eager_out) -> str:
    a = patched_out.logits.float()
    b = eager_out.logits.float()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    return f"graph vs eager rel err {err:.2g}"


def bench_model(
    name: str,
    modes: list[str],
    steps: int,
    warmup: int,
    profile: bool,
    save: Callable[[dict], None],
) -> dict:
    batch, items = make_batch(name, "cuda")
    unit = "images" if MODELS[name][1] == "image" else "tokens"
    results = {}
    for mode in modes:
        try:
            results[mode] = bench_mode(name, mode, batch, items, unit, steps, warmup, profile)
        except Exception as err:  # keep the other modes' numbers
            print(f"{name} {mode}: FAILED {type(err).__name__}: {err}", flush=True)
            results[mode] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        torch.cuda.empty_cache()
        save(results)  # after every mode: a run cut short keeps what it measured
    return results


def bench_mode(name, mode, batch, items, unit, steps, warmup, profile) -> dict:
    """One mode: native and patched models built, warmed up (compiled), timed in alternation."""
    torch._dynamo.reset()
    compiled_ln_ab = mode.startswith("compile")
    labels = ["native", "patched", *([LN_FUSED] if compiled_ln_ab else [])]
    built = build_models(name, mode.endswith("train"), len(labels) - 1)
    models = dict(zip(labels, built, strict=True))
    fns = {}
    for label, model in models.items():
        fns[label] = step_fn(model, batch, mode, compiled_for(model, mode))
    if compiled_ln_ab:
        fns["patched"] = with_compiled_layer_norm(fns["patched"], "inductor")
        fns[LN_FUSED] = with_compiled_layer_norm(fns[LN_FUSED], "fused")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {label: [] for label in labels}
    host: dict[str, list[float]] = {label: [] for label in labels}
    for i in range(steps):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:  # rotate the order
            device_ms, host_ms = event_and_host_ms(fns[label])
            times[label].append(device_ms)
            host[label].append(host_ms)
    row = {label: statistics.median(t) for label, t in times.items()}
    row["host"] = {label: statistics.median(t) for label, t in host.items()}
    row["speedup"] = row["native"] / row["patched"]
    if compiled_ln_ab:
        row["speedup_ln_fused"] = row["native"] / row[LN_FUSED]
    row["unit"] = unit
    row["per_s"] = {k: items / (row[k] * 1e-3) for k in ("native", "patched")}
    if mode == "graphs":
        eager = step_fn(models["patched"], batch, "infer")()
        row["check"] = graphs_match(fns["patched"](), eager)
    if profile and mode != "graphs":
        row["families"] = {k: kernel_families_ms(fn) for k, fn in fns.items()}
    if profile and mode in ("infer", "train"):
        row["host_ops"] = {k: host_top_ops(fn) for k, fn in fns.items()}
        row["syncs"] = {k: syncs_per_step(fn) for k, fn in fns.items()}
        print(f"{name} {mode}: device synchronisations per step {row['syncs']}")
        for label, ops in row["host_ops"].items():
            print(f"{name} {mode} {label}: host time by op (ms per step, self):")
            for op, ms, calls in ops:
                print(f"    {ms:8.3f}  {calls:6d}  {op}")
    extra = f", LN fused under compile {row[LN_FUSED]:.2f} ms" if compiled_ln_ab else ""
    print(
        f"{name} {mode}: native {row['native']:.2f} ms (host {row['host']['native']:.2f}), "
        f"patched {row['patched']:.2f} ms (host {row['host']['patched']:.2f}), "
        f"{row['speedup']:.3f}x{extra} {row.get('check', '')}",
        flush=True,
    )
    return row


def syncs_per_step(fn: Callable[[], object]) -> int:
    """How many times one step makes the host wait for the GPU (torch's sync debug mode)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchroniz" in str(w.message) for w in caught)


def host_top_ops(fn: Callable[[], object], steps: int = 3, top: int = 14) -> list:
    """The host (CPU) self time per step of the ops and modules that cost most, with their call
    counts: where a host-bound step spends its time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    rows = [("(all)", total, 0)]
    rows += [
        (e.key[:90], e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in events[:top]
    ]
    return rows


def table(name: str, results: dict) -> str:
    _, _, batch, seq = MODELS[name]
    shape = f"batch {batch}" + (f", seq {seq}" if seq else "")
    lines = [
        f"### {name} ({shape})",
        "",
        "| mode | native ms/step | patched ms/step | native per s | patched per s | speed-up "
        "| host ms native / patched | patched, LN fused under compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | failed: {r['error']} | | | | | | |")
            continue
        note = f" ({r['check']})" if "check" in r else ""
        ab = f"{r[LN_FUSED]:.2f} ms, {r['speedup_ln_fused']:.3f}x" if LN_FUSED in r else ""
        lines.append(
            f"| {mode}{note} | {r['native']:.2f} | {r['patched']:.2f} | "
            f"{r['per_s']['native']:.0f} {r['unit']} | {r['per_s']['patched']:.0f} {r['unit']} | "
            f"{r['speedup']:.3f}x | {r['host']['native']:.2f} / {r['host']['patched']:.2f} | "
            f"{ab} |"
        )
    for mode, r in results.items():
        if "families" not in r:
            continue
        fam = r["families"]
        labels = list(fam)
        names = sorted(set().union(*fam.values()))
        lines += [
            "",
            f"GPU time per step by kernel family, {mode} (ms):",
            "",
            "| family | " + " | ".join(labels) + " |",
            "|---" * (len(labels) + 1) + "|",
        ]
        for f in names:
            lines.append(f"| {f} | " + " | ".join(f"{fam[k].get(f, 0):.2f}" for k in labels) + " |")
        totals = " | ".join(f"{sum(fam[k].values()):.2f}" for k in labels)
        lines.append(f"| total | {totals} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--out")
    args = parser.parse_args()
    models = args.models.split(",")
    modes = args.modes.split(",")
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown {m!r}; choose from {', '.join(MODELS)}")
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: unknown {m!r}; choose from {', '.join(MODES)}")
    warm_up_gpu()
    print(f"GPU: {gpu_name()}, torch {torch.__version__}, transformers {tf.__version__}")
    for name in models:

        def save(results: dict, name: str = name) -> None:
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"models_{name}.md"), "w") as f:
                    f.write(table(name, results) + "\n")

        results = bench_model(name, modes, args.steps, args.warmup, args.profile, save)
        write_results(args.out, f"models_{name}", table(name, results), {"results": results})


if __name__ == "__main__":
    main()
