"""Whole HuggingFace models, native vs patched, in one run on one GPU: BERT-base (masked LM),
GPT-2 medium (causal LM), ViT-B/16 (image classification), OPT-350m (causal LM: post-LN,
ReLU FFN) and T5-base (encoder-decoder: ReLU FFN, RMSNorm), random weights from their standard
configs (nothing downloaded).

Modes: eager inference (bf16 weights, no_grad), eager training step (fp32 weights, bf16
autocast, AdamW; train_bf16: bf16 weights, no autocast), torch.compile inference, torch.compile
training step, CUDA graphs (torch.compile mode="reduce-overhead", inference; the patched output
is checked against eager),
and replay (fastlayers' host-free replay, ``patch(..., replay=True)``, of the native and the
patched model, inference; use_cache=False where the model would return a KV cache).
Native and patched steps alternate (each its own model and optimizer, same weights and
inputs); times are medians of CUDA-event timed steps after warm-up (compilation happens there).
The run goes mode by mode (every model's eager inference first, then training, ...), and each
model's table and json are rewritten after every mode, so a run cut short keeps what it
measured. The eager and compiled modes also get a breakdown of the GPU time per step by kernel
family (LayerNorm, with fastlayers' dropout + add + LayerNorm; fastlayers' fused Linear +
activation GEMM; other GEMMs, cuBLASLt epilogue GEMMs included; GELU and ReLU passes;
dropout; attention; optimizer; other; --no-profile skips it) and the eager modes the device
synchronisations per step (--host-ops adds the host time by op, a few seconds per mode).

Under torch.compile more patched models run beside native and patched (fastlayers.config at
its defaults: LayerNorm and the dropout + add + LayerNorm blocks traced as the native ops, for
Inductor to fuse), by --compile-variants: rln_fused (default) = the rewritten blocks traced as
fastlayers' fused dropout_add_layer_norm op (compile_residual_layer_norm='fused'), ln_fused =
fastlayers.LayerNorm traced as its own op (compile_layer_norm='fused'). A variant is left out
for a model where the patch has nothing it would change (T5: no LayerNorm, no such block).

Defaults: --steps 20 timed steps per model after --warmup 3 (more in eager modes where the
patched model's attention count must settle: settle_attention), batches below (MODELS). Expected
time on an H100 (estimates, not measured with these defaults): eager infer + train about 20-40
s per model (bert-base both modes well under 3 minutes); each compiled model variant about
15-40 s of compilation (compile_infer for all five models, 13 compiled models, about 4-6
minutes; five models x infer,train,compile_infer about 8 minutes).

    python benchmarks/bench_models.py [--models bert-base,gpt2-medium,vit-b16,opt-350m,t5-base]
        [--modes infer,train,compile_infer,compile_train,graphs,replay]
        [--compile-variants rln_fused,ln_fused] [--steps N] [--warmup N] [--no-profile]
        [--host-ops] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as tf
from common import event_and_host_ms, gpu_name, kernel_profile, warm_up_gpu, write_results
from fastlayers.patching import DEFAULT_LAYERS
from fastlayers.patching.fused import replay_forward
from fastlayers.patching.runtime import varlen

import fastlayers


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], torch.nn.Module]  # on the current device
    kind: str  # "text", "image" or "seq2seq"
    batch: int
    seq: int = 0  # tokens per sequence (the encoder's for seq2seq)
    dec_seq: int = 0  # seq2seq: decoder tokens per sequence


def _opt_350m() -> torch.nn.Module:
    # facebook/opt-350m's config (tf.OPTConfig()'s defaults are opt-125m's): post-LN blocks,
    # embeddings projected 512 -> 1024; no KV cache (a full-sequence step needs none).
    config = tf.OPTConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        ffn_dim=4096,
        num_attention_heads=16,
        word_embed_proj_dim=512,
        do_layer_norm_before=False,
        use_cache=False,
    )
    return tf.OPTForCausalLM(config)


def _t5_base() -> torch.nn.Module:
    # t5-base's config (tf.T5Config()'s defaults are t5-small's); ReLU FFN (wi -> ReLU -> wo).
    config = tf.T5Config(
        d_model=768,
        d_ff=3072,
        num_layers=12,
        num_heads=12,
        d_kv=64,
        decoder_start_token_id=0,
        use_cache=False,
    )
    return tf.T5ForConditionalGeneration(config)


def _llama_1b() -> torch.nn.Module:
    # the LLaMA-style model (TinyLlama-1.1B's shape): 16 heads / 4 KV heads
    config = tf.LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        use_cache=False,
    )
    return tf.LlamaForCausalLM(config)


def _llama3_1b() -> torch.nn.Module:
    # LLaMA-3.2-1B's shape: a 128,256 vocabulary (the head and its logits are a large part of a
    # training step's time and memory), tied embeddings, 32 heads / 8 KV heads
    config = tf.LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        use_cache=False,
    )
    return tf.LlamaForCausalLM(config)


def _gemma_style() -> torch.nn.Module:
    # Gemma-2B's layer shapes (GeGLU 2048 -> 16384, 8 heads / 1 KV head of 256), 12 layers and
    # a 32000 vocabulary so that the logits do not dominate
    config = tf.GemmaConfig(
        hidden_size=2048,
        intermediate_size=16384,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=32000,
        use_cache=False,
    )
    return tf.GemmaForCausalLM(config)


def _qwen3_style() -> torch.nn.Module:
    # Qwen3-1.7B's layer shapes (q/k RMSNorms per head, 16 heads / 8 KV heads of 128), 16 layers
    # and a 32000 vocabulary
    config = tf.Qwen3Config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32000,
        use_cache=False,
    )
    return tf.Qwen3ForCausalLM(config)


MODELS: dict[str, ModelSpec] = {
    "bert-base": ModelSpec(lambda: tf.BertForMaskedLM(tf.BertConfig()), "text", 32, 512),
    "gpt2-medium": ModelSpec(
        lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        "text",
        32,
        512,
    ),
    "vit-b16": ModelSpec(
        lambda: tf.ViTForImageClassification(tf.ViTConfig(num_labels=1000)), "image", 128
    ),
    # 8192 tokens: about GPT-2 medium's work per token at half its batch.
    "opt-350m": ModelSpec(_opt_350m, "text", 16, 512),
    # 512 encoder and 128 decoder tokens per sequence (T5's pre-training lengths, rounded).
    "t5-base": ModelSpec(_t5_base, "seq2seq", 32, 512, 128),
    # 8 x 1024 tokens: the LLaMA measurement
    "llama-1b": ModelSpec(_llama_1b, "text", 8, 1024),
    "llama3-1b": ModelSpec(_llama3_1b, "text", 8, 1024),
    "gemma-style": ModelSpec(_gemma_style, "text", 8, 1024),
    "qwen3-style": ModelSpec(_qwen3_style, "text", 8, 1024),
}
# Liger-Kernel's patch of the same instance (--liger): its apply function per model, its rotary
# kernel included; the patches it makes to transformers' module globals and classes are put back
# at once (Liger patches classes process-wide; the other rows must stay native), its rope
# swapped into the module around the Liger copy's calls only (liger_copy).
LIGER = "liger"
LIGER_APPLY = {
    "llama-1b": "apply_liger_kernel_to_llama",
    "llama3-1b": "apply_liger_kernel_to_llama",
    "gemma-style": "apply_liger_kernel_to_gemma",
    "qwen3-style": "apply_liger_kernel_to_qwen3",
}
MODES = ("infer", "train", "train_bf16", "compile_infer", "compile_train", "graphs", "replay")
# the eager modes (a Liger row, the profile, the attention count settled)
EAGER_MODES = ("infer", "train", "train_bf16")
DEVICE = "cuda"  # a CPU check of this script's logic sets "cpu"

# Under torch.compile, patched models with fastlayers.config settings other than the defaults
# (variant label -> (compile_layer_norm, compile_residual_layer_norm), and the patch rule whose
# swaps the setting affects): which tracing is faster decides the defaults.
PATCHED = "patched"
LN_FUSED = "patched_ln_fused"
RLN_FUSED = "patched_rln_fused"
VARIANTS = {
    PATCHED: ("inductor", "inductor", None),
    LN_FUSED: ("fused", "inductor", "layer_norm"),
    RLN_FUSED: ("inductor", "fused", "residual_layer_norm"),
}
VARIANT_OPTIONS = {"ln_fused": LN_FUSED, "rln_fused": RLN_FUSED}
VARIANT_TITLES = {
    LN_FUSED: "LN fused",
    RLN_FUSED: "dropout+add+LN fused",
    LIGER: "Liger (instance patch, its rope swapped in per call)",
}

# Kernel families for --profile, first match wins. Our CUTLASS kernel's name is a
# cutlass::device_kernel<GemmUniversal<...>> whose epilogue types live in namespace fastlayers
# (GELU, ReLU and identity epilogues alike). fastlayers' dropout + add + LayerNorm runs the
# LayerNorm kernels (fastlayers::ln::ln_fwd_vec_kernel / ln_bwd_vec_kernel with dropout-add row
# policies, sum_partials_kernel; float64 only: dropout_add_f64_kernel, dropout_grad_f64_kernel),
# so it counts as LayerNorm. GEMMs come before the activation passes: cuBLASLt's GELU / ReLU
# epilogue GEMMs (torch._addmm_activation) count as GEMMs. Attention comes before GEMM (cuDNN's
# attention kernels are named sm90_...). ReLU passes: torch's relu (clamp_min), its backward
# (threshold_backward), fastlayers' ReLUScale (elementwise_kernel<..., ReluScaleForward>) and
# Inductor's kernels that contain a relu.
FAMILIES = [
    ("fused Linear+act GEMM", re.compile(r"cutlass.*fastlayers|fastlayers.*cutlass")),
    # fastlayers' RMSNorm: the LayerNorm row kernels instantiated with RMS = true
    ("RMSNorm, fastlayers", re.compile(r"ln_(fwd|bwd)_\w+<.*, true>")),
    ("gated act, fastlayers", re.compile(r"gated_act|GatedAct", re.IGNORECASE)),
    ("rotary, fastlayers", re.compile(r"fastlayers.*rotary|rotary.*fastlayers")),
    ("rotary, Liger", re.compile(r"_triton_rope|rope_", re.IGNORECASE)),
    (
        "LayerNorm",
        re.compile(
            r"layer_norm|LayerNorm|ln_fwd|ln_bwd|GammaBeta|sum_partials|dropout_(add|grad)_f64"
        ),
    ),
    ("attention", re.compile(r"flash|fmha|attention|attn|softmax", re.IGNORECASE)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.IGNORECASE)),
    ("GEMM", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_", re.IGNORECASE)),
    # fastlayers' own: the activation's backward pass with the bias-gradient sums
    # (dact_bias_kernel) and the forward fallback's elementwise pass (ActForward)
    ("activation pass, fastlayers (bwd; fwd fallback)", re.compile(r"dact_bias|ActForward")),
    ("GELU pass (fwd/bwd)", re.compile(r"gelu", re.IGNORECASE)),
    ("ReLU pass (fwd/bwd)", re.compile(r"relu|clamp_min|threshold", re.IGNORECASE)),
    ("dropout", re.compile(r"dropout", re.IGNORECASE)),
]


def family_of(kernel_name: str) -> str:
    return next((f for f, rx in FAMILIES if rx.search(kernel_name)), "other")


def make_batch(model_name: str, device: str) -> tuple[dict, int]:
    """Inputs with labels, and the tokens (or images) per step: for seq2seq, encoder plus
    decoder tokens, with the decoder's inputs given (its labels shifted right) so that
    inference, which drops the labels, gets them too."""
    spec = MODELS[model_name]
    g = torch.Generator(device=device).manual_seed(0)
    if spec.kind == "image":
        pixels = torch.randn(spec.batch, 3, 224, 224, device=device, generator=g)
        labels = torch.randint(0, 1000, (spec.batch,), device=device, generator=g)
        return {"pixel_values": pixels, "labels": labels}, spec.batch
    ids = torch.randint(0, 30000, (spec.batch, spec.seq), device=device, generator=g)
    if spec.kind == "seq2seq":
        labels = torch.randint(1, 30000, (spec.batch, spec.dec_seq), device=device, generator=g)
        start = torch.zeros(spec.batch, 1, dtype=labels.dtype, device=device)
        dec = torch.cat([start, labels[:, :-1]], dim=1)
        batch = {"input_ids": ids, "decoder_input_ids": dec, "labels": labels}
        return batch, spec.batch * (spec.seq + spec.dec_seq)
    return {"input_ids": ids, "labels": ids.clone()}, spec.batch * spec.seq


def build_native(model_name: str, training: bool) -> torch.nn.Module:
    """The native model with fixed random weights; bf16 for inference, fp32 for training."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        native = MODELS[model_name].build()
    if not training:
        native = native.to(torch.bfloat16)
    native.train(training)
    return native


# The rules patch() applies here (--layers; default: patch()'s own default).
PATCH_LAYERS: tuple[str, ...] = tuple(DEFAULT_LAYERS)


def liger_copy(name: str, native: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of ``native`` with Liger-Kernel's instance patch, its rotary embedding included and,
    for a model in training mode, its fused linear cross-entropy (bound to this instance's
    forward, as fastlayers' rule is; the cross-entropy-only patch is left off), or None where
    Liger is not importable or has no apply function for the model. Liger's rope replaces the
    model module's ``apply_rotary_pos_emb`` for the whole process: here the module's globals are
    put back at once, and Liger's function stands in the module only while the Liger copy runs
    (its forward; its backward needs no global), so the native and fastlayers rows run native
    rotary."""
    try:
        import liger_kernel.transformers as liger
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as err:
        print(f"{name}: no Liger row ({type(err).__name__}: {err})", flush=True)
        return None
    if name not in LIGER_APPLY:
        return None
    model = copy.deepcopy(native)
    module = sys.modules[type(native).__module__]
    saved = dict(module.__dict__)
    classes = {c: dict(c.__dict__) for c in vars(module).values() if isinstance(c, type)}
    try:
        getattr(liger, LIGER_APPLY[name])(
            rope=True,
            cross_entropy=False,
            # its fused head + loss in training (bound to this instance's forward)
            fused_linear_cross_entropy=native.training,
            model=model,
        )
    finally:
        for key, value in saved.items():
            if module.__dict__.get(key) is not value:
                setattr(module, key, value)
        for cls, attrs in classes.items():
            for key, value in attrs.items():
                if cls.__dict__.get(key) is not value and key not in ("__dict__", "__weakref__"):
                    setattr(cls, key, value)
    forward = model.forward

    def with_liger_rope(*args, **kwargs):
        original = module.apply_rotary_pos_emb
        module.apply_rotary_pos_emb = liger_rotary_pos_emb
        try:
            return forward(*args, **kwargs)
        finally:
            module.apply_rotary_pos_emb = original

    model.forward = with_liger_rope
    return model


def patched_copy(native: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, int]]:
    model = copy.deepcopy(native)
    return model, fastlayers.patch(model, layers=PATCH_LAYERS).counts()


def with_settings(fn: Callable[[], object], ln: str, rln: str) -> Callable[[], object]:
    """fn run with fastlayers.config's compile settings as given (read when dynamo traces)."""

    def run():
        with contextlib.ExitStack() as stack:
            stack.enter_context(fastlayers.config.compile_layer_norm_as(ln))
            stack.enter_context(fastlayers.config.compile_residual_layer_norm_as(rln))
            return fn()

    return run


def step_fn(model, batch: dict, mode: str, compiled=None) -> Callable[[], object]:
    run = compiled if compiled is not None else model
    if mode in ("infer", "compile_infer", "graphs", "replay"):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if mode == "replay" and getattr(model.config, "use_cache", False):
            inputs["use_cache"] = False  # a KV cache object cannot be replayed

        def infer():
            with torch.no_grad():
                return run(**inputs)

        return infer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    autocast = mode != "train_bf16"  # train_bf16: the weights are bf16, no autocast

    def train():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
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
    totals: dict[str, float] = defaultdict(float)
    for name, (_, us) in kernel_profile(fn, reps=steps, warmup=0).items():
        if us > 0:
            totals[family_of(name)] += us / 1e3
    return dict(totals)


def graphs_match(patched_out, eager_out) -> str:
    a = patched_out.logits.float()
    b = eager_out.logits.float()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    return f"graph vs eager rel err {err:.2g}"


def settle_attention(fns: dict, counts: dict, mode: str) -> int:
    """More warm-up steps of every model, until an eager patched model's attention has its
    steady backend: the patch keeps cuDNN's attention off a shape for its first
    CUDNN_AFTER_CALLS attention calls (runtime/varlen.py), so that a fixed-shape benchmark times
    what a long run gets (the first steps' kernels: benchmarks/bench_attention_backends.py).
    One step shows how many calls each shape gets a step; compiled and captured calls keep
    torch's choice. Returns the steps run."""
    if not counts.get("varlen_attention") or mode not in EAGER_MODES:
        return 0
    before = dict(varlen._SHAPE_CALLS)
    for fn in fns.values():
        fn()
    need = 0
    for shape, calls in dict(varlen._SHAPE_CALLS).items():
        per_step = calls - before.get(shape, 0)
        if per_step > 0 and calls < varlen.CUDNN_AFTER_CALLS:
            need = max(need, -(-(varlen.CUDNN_AFTER_CALLS - calls) // per_step) + 1)
    for _ in range(need):
        for fn in fns.values():
            fn()
    return need + 1


def models_for(name: str, mode: str, liger: bool) -> tuple[dict, dict[str, int]]:
    """The native model for ``mode`` (bf16 weights for train_bf16), its patched copy and, with
    ``liger`` in the eager modes, Liger's copy where it has one; and the patch's counts."""
    training = mode.endswith("train") or mode == "train_bf16"
    native = build_native(name, training)
    if mode == "train_bf16":
        native = native.to(torch.bfloat16)
    models = {"native": native}
    models[PATCHED], counts = patched_copy(native)
    if liger and mode in EAGER_MODES:
        liger_model = liger_copy(name, native)
        if liger_model is not None:
            models[LIGER] = liger_model
    return models, counts


def bench_mode(
    name, mode, variants, batch, items, steps, warmup, profile, host_ops, rounds=1, liger=False
) -> dict:
    """One mode of one model: native and patched models (and, under compile, the patched
    variants that change something in this model) built, warmed up (compiled), timed in
    alternation."""
    torch._dynamo.reset()
    models, counts = models_for(name, mode, liger)
    native = models["native"]
    print(f"{name} {mode}: patched {counts}", flush=True)
    if mode == "replay":  # both replayed from CUDA graphs: the fused kernels' own gain
        for model in models.values():
            fastlayers.patch(model, layers=(), replay=True)
    if mode.startswith("compile"):
        for label in variants:
            rule = VARIANTS[label][2]
            if rule in counts:
                models[label] = patched_copy(native)[0]
            else:
                print(f"{name} {mode}: {label} left out (no {rule} swaps)", flush=True)
    labels = list(models)
    fns = {}
    for label, model in models.items():
        fn = step_fn(model, batch, mode, compiled_for(model, mode))
        if label != "native" and mode not in EAGER_MODES:
            fn = with_settings(fn, *VARIANTS[label][:2])
        fns[label] = fn
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    settled = settle_attention(fns, counts, mode)
    if settled:
        print(f"{name} {mode}: {settled} more warm-up steps (attention count settled)", flush=True)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {label: [] for label in labels}
    host: dict[str, list[float]] = {label: [] for label in labels}
    round_speedups = []
    for _ in range(rounds):
        # one round: `steps` steps of each model, the order rotating step by step
        first = {label: len(times[label]) for label in labels}
        for i in range(steps):
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                device_ms, host_ms = event_and_host_ms(fns[label])
                times[label].append(device_ms)
                host[label].append(host_ms)
        medians = {label: statistics.median(times[label][first[label] :]) for label in labels}
        round_speedups.append(medians["native"] / medians[PATCHED])
    row = {label: statistics.median(t) for label, t in times.items()}
    row["patch_counts"] = counts
    # each model's step peak above what it holds between steps (weights, optimizer state)
    row["step_peak_mib"] = {}
    for label, fn in fns.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        row["step_peak_mib"][label] = (torch.cuda.max_memory_allocated() - base) / 2**20
    row["host"] = {label: statistics.median(t) for label, t in host.items()}
    row["speedup"] = row["native"] / row[PATCHED]
    row["round_speedups"] = round_speedups
    for label in labels[2:]:
        row[f"speedup_{label}"] = row["native"] / row[label]
    row["unit"] = "images" if MODELS[name].kind == "image" else "tokens"
    row["per_s"] = {k: items / (row[k] * 1e-3) for k in ("native", PATCHED)}
    if mode == "graphs":
        eager = step_fn(models[PATCHED], batch, "infer")()
        row["check"] = graphs_match(fns[PATCHED](), eager)
    if mode == "replay":
        stats = [dict(replay_forward(m).stats) for m in models.values()]
        row["check"] = f"replay stats native {stats[0]}, patched {stats[1]}"
    if profile and mode not in ("graphs", "replay"):
        row["families"] = {k: kernel_families_ms(fn) for k, fn in fns.items()}
    if profile and mode in EAGER_MODES:
        row["syncs"] = {k: syncs_per_step(fn) for k, fn in fns.items()}
        print(f"{name} {mode}: device synchronisations per step {row['syncs']}")
    if host_ops and mode in EAGER_MODES:
        row["host_ops"] = {k: host_top_ops(fn) for k, fn in fns.items()}
        for label, ops in row["host_ops"].items():
            print(f"{name} {mode} {label}: host time by op (ms per step, self):")
            for op, ms, calls in ops:
                print(f"    {ms:8.3f}  {calls:6d}  {op}")
    extra = "".join(
        f", {VARIANT_TITLES[label]} {row[label]:.2f} ms ({row[f'speedup_{label}']:.3f}x)"
        for label in labels[2:]
    )
    spread = ", ".join(f"{r:.3f}" for r in round_speedups)
    print(
        f"{name} {mode}: native {row['native']:.2f} ms (host {row['host']['native']:.2f}), "
        f"patched {row[PATCHED]:.2f} ms (host {row['host'][PATCHED]:.2f}), "
        f"{row['speedup']:.3f}x (rounds: {spread}){extra} {row.get('check', '')}; step peak MiB "
        + ", ".join(f"{k} {v:.0f}" for k, v in row["step_peak_mib"].items()),
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
    spec = MODELS[name]
    if spec.kind == "image":
        shape = f"batch {spec.batch}"
    elif spec.kind == "seq2seq":
        shape = f"batch {spec.batch}, seq {spec.seq} encoder + {spec.dec_seq} decoder"
    else:
        shape = f"batch {spec.batch}, seq {spec.seq}"
    extra = [v for v in VARIANT_TITLES if any(v in r for r in results.values())]
    lines = [f"### {name} ({shape})", ""]
    counts = next((r["patch_counts"] for r in results.values() if "patch_counts" in r), None)
    if counts is not None:
        lines += [f"patched: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}", ""]
    lines += [
        "| mode | native ms/step | patched ms/step | native per s | patched per s | speed-up "
        "| per round | host ms native / patched | GPU busy ms native / patched "
        "| step peak MiB (native / patched / others) |"
        + "".join(
            f" {VARIANT_TITLES[v]} (ms, native / it) |"
            if v == LIGER
            else f" patched, {VARIANT_TITLES[v]} under compile |"
            for v in extra
        ),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | failed: {r['error']} | | | | | | | | |" + " |" * len(extra))
            continue
        note = f" ({r['check']})" if "check" in r else ""
        cells = "".join(
            f" {r[v]:.2f} ms, {r[f'speedup_{v}']:.3f}x |" if v in r else " |" for v in extra
        )
        rounds = ", ".join(f"{x:.3f}" for x in r.get("round_speedups", []))
        fam = r.get("families", {})
        busy = (
            f"{sum(fam['native'].values()):.2f} / {sum(fam[PATCHED].values()):.2f}"
            if "native" in fam and PATCHED in fam
            else "-"
        )
        if LIGER in fam:
            busy += f" (Liger {sum(fam[LIGER].values()):.2f})"
        peak = " / ".join(f"{v:.0f}" for v in r.get("step_peak_mib", {}).values()) or "-"
        lines.append(
            f"| {mode}{note} | {r['native']:.2f} | {r[PATCHED]:.2f} | "
            f"{r['per_s']['native']:.0f} {r['unit']} | {r['per_s'][PATCHED]:.0f} {r['unit']} | "
            f"{r['speedup']:.3f}x | {rounds} | {r['host']['native']:.2f} / "
            f"{r['host'][PATCHED]:.2f} | {busy} | {peak} |" + cells
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default="infer,train,compile_infer,compile_train,graphs")
    parser.add_argument(
        "--compile-variants",
        default="rln_fused",
        help=f"patched variants beside native and patched under compile, of "
        f"{','.join(VARIANT_OPTIONS)} ('none': only those two)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of --steps timed steps (the spread shown)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--host-ops", action="store_true", help="host time by op, eager modes")
    parser.add_argument(
        "--layers", default=None, help="the rules patch() applies, comma-separated (default: all)"
    )
    parser.add_argument(
        "--liger", action="store_true", help="a Liger-Kernel row (eager modes, LLaMA-family models)"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.layers is not None:
        global PATCH_LAYERS
        PATCH_LAYERS = tuple(r for r in args.layers.split(",") if r)
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown {m!r}; choose from {', '.join(MODELS)}")
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: unknown {m!r}; choose from {', '.join(MODES)}")
    variants = []
    for v in args.compile_variants.split(","):
        if v in ("", "none"):
            continue
        if v not in VARIANT_OPTIONS:
            parser.error(
                f"--compile-variants: unknown {v!r}; choose from {', '.join(VARIANT_OPTIONS)}"
            )
        variants.append(VARIANT_OPTIONS[v])
    warm_up_gpu()
    print(f"GPU: {gpu_name()}, torch {torch.__version__}, transformers {tf.__version__}")
    batches = {name: make_batch(name, DEVICE) for name in models}
    results: dict[str, dict] = {name: {} for name in models}

    def save(name: str) -> None:
        if args.out:  # after every mode: a run cut short keeps what it measured
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"models_{name}.md"), "w") as f:
                f.write(table(name, results[name]) + "\n")
            with open(os.path.join(args.out, f"models_{name}.json"), "w") as f:
                payload = {"gpu": gpu_name(), "torch": torch.__version__}
                json.dump({**payload, "results": results[name]}, f, indent=1)

    for mode in modes:
        for name in models:
            batch, items = batches[name]
            try:
                results[name][mode] = bench_mode(
                    name,
                    mode,
                    variants,
                    batch,
                    items,
                    args.steps,
                    args.warmup,
                    args.profile,
                    args.host_ops,
                    args.rounds,
                    args.liger,
                )
            except Exception as err:  # keep the other modes' and models' numbers
                print(f"{name} {mode}: FAILED {type(err).__name__}: {err}", flush=True)
                results[name][mode] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            torch.cuda.empty_cache()
            save(name)
    for name in models:
        write_results(
            args.out, f"models_{name}", table(name, results[name]), {"results": results[name]}
        )


if __name__ == "__main__":
    main()
