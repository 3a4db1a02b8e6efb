"""Host time per call, native against patched: every fused module (as a patch leaves it in a
model), every functional op entry, every kind of rewritten block and whole tiny models of five
families, in three modes (inference forward; train-mode forward with autograd recording;
forward + backward), on CPU and on CUDA. Shapes are tiny, so the time is the Python, dispatcher,
autograd, launch and allocation layers, not the math (on CUDA the GPU waits for the host).

Native and patched run in interleaved rounds (the order alternating round by round), each round
a batch of calls timed by the process's CPU time; the statistic is the median over rounds of the
per-round ratio patched / native, with its quartiles beside it.

    python benchmarks/bench_host.py [--device cpu|cuda] [--rounds R] [--only SUBSTRING]
        [--modes infer,train,fwdbwd] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers as tf
from common import write_results
from torch import nn

import fastlayers
from fastlayers import functional

MODES = ("infer", "train", "fwdbwd")
# Targets of the host-cost issue: patched / native host time per call.
TARGET = {"module": 1.00, "op": 1.00, "block": 1.00, "model": 0.95}
D, FF, ROWS = 32, 64, 8


@dataclass
class Case:
    """One comparison: ``native(x...)`` against ``patched(x...)`` on the same inputs."""

    kind: str  # module, op, block, model
    name: str
    native: Callable[..., object]
    patched: Callable[..., object]
    inputs: Callable[[torch.device, bool], tuple]  # (device, requires_grad) -> args
    modes: tuple[str, ...] = MODES


def _x(device, grad, *shape):
    return torch.randn(*shape, device=device).requires_grad_(grad)


def _patched(module: nn.Module) -> nn.Module:
    twin = copy.deepcopy(module)
    fastlayers.patch(twin)
    return twin


# ---------------------------------------------------------------- fused modules, as patched


def module_cases() -> list[Case]:
    cases = []
    ln = nn.LayerNorm(D)
    cases.append(
        Case("module", "LayerNorm", ln, fastlayers.LayerNorm.from_native(copy.deepcopy(ln)), _rows)
    )
    for act, name in ((nn.GELU(), "Linear + GELU"), (nn.ReLU(), "Linear + ReLU")):
        native = nn.Sequential(nn.Linear(D, FF), act)
        patched = _patched(native)  # the fused layer and the FusedAway it leaves
        cases.append(
            Case("module", name, _chain(native), _chain(patched), _rows, ("infer", "fwdbwd"))
        )
    for name, norm in (
        ("RMSNorm (nn.RMSNorm)", nn.RMSNorm(D, eps=1e-6)),
        ("RMSNorm (LlamaRMSNorm)", tf.models.llama.modeling_llama.LlamaRMSNorm(D)),
        ("RMSNorm (GemmaRMSNorm)", tf.models.gemma.modeling_gemma.GemmaRMSNorm(D)),
    ):
        cases.append(
            Case("module", name, norm, fastlayers.RMSNorm.from_native(copy.deepcopy(norm)), _rows)
        )
    relu = nn.Sequential(nn.ReLU())
    relu_patched = copy.deepcopy(relu)
    fastlayers.patch(relu_patched, layers="relu")
    cases.append(Case("module", "ReLU (rule relu)", relu, relu_patched, _rows))
    return cases


def _chain(seq: nn.Sequential) -> Callable[[torch.Tensor], object]:
    """The Sequential's two modules called in turn (not through Sequential.forward)."""
    first, second = seq[0], seq[1]
    fn = lambda x: second(first(x))  # noqa: E731
    fn.module = seq
    return fn


def _rows(device, grad):
    return (_x(device, grad, ROWS, D),)


# ---------------------------------------------------------------- functional op entries


def op_cases(device: torch.device) -> list[Case]:
    g = lambda *s: torch.randn(*s, device=device, requires_grad=True)  # noqa: E731
    w, b, w1, b1, w2, b2 = g(D), g(D), g(FF, D), g(FF), g(D, FF), g(D)
    shape = (D,)
    return [
        Case(
            "op",
            "layer_norm",
            lambda x: F.layer_norm(x, shape, w, b, 1e-5),
            lambda x: functional.layer_norm(x, shape, w, b, 1e-5),
            _rows,
        ),
        Case(
            "op",
            "dropout_add_layer_norm",
            lambda x, r: F.layer_norm(F.dropout(x, 0.1, False) + r, shape, w, b, 1e-5),
            lambda x, r: functional.dropout_add_layer_norm(x, r, shape, w, b, 1e-5, p=0.1),
            lambda device, grad: (*_rows(device, grad), *_rows(device, grad)),
        ),
        Case(
            "op",
            "linear_gelu",
            lambda x: F.gelu(F.linear(x, w1, b1)),
            lambda x: functional.linear_gelu(x, w1, b1),
            _rows,
        ),
        Case(
            "op",
            "linear_relu",
            lambda x: F.relu(F.linear(x, w1, b1)),
            lambda x: functional.linear_relu(x, w1, b1),
            _rows,
        ),
        Case(
            "op",
            "linear_act_linear",
            lambda x: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
            lambda x: functional.linear_act_linear(x, w1, b1, w2, b2, "gelu"),
            _rows,
        ),
        Case(
            "op",
            "relu_scale",
            lambda x: torch.relu(x) * 0.5,
            lambda x: functional.relu_scale(x, 0.5),
            _rows,
        ),
    ]


# ---------------------------------------------------------------- rewritten blocks and models

TINY = {"hidden_size": D, "num_attention_heads": 2, "intermediate_size": FF}
BART = {
    "d_model": D,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": FF,
    "decoder_ffn_dim": FF,
}


def _bert():
    return tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY))


def _gpt2():
    return tf.GPT2Model(tf.GPT2Config(n_embd=D, n_layer=2, n_head=2, n_inner=FF))


def _vit():
    config = tf.ViTConfig(num_hidden_layers=2, image_size=32, patch_size=8, **TINY)
    return tf.ViTModel(config, add_pooling_layer=False)


def _opt():
    config = tf.OPTConfig(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=2, ffn_dim=FF, word_embed_proj_dim=D
    )
    return tf.OPTModel(config)


def _t5(**extra):
    config = tf.T5Config(d_model=D, d_ff=FF, num_layers=2, num_heads=2, d_kv=16, **extra)
    return tf.T5Model(config)


def _llama():
    config = tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, vocab_size=100, **TINY)
    return tf.LlamaModel(config)


def _gemma():
    config = tf.GemmaConfig(
        num_hidden_layers=2, num_key_value_heads=1, head_dim=16, vocab_size=100, **TINY
    )
    return tf.GemmaModel(config)


def _distilbert():
    return tf.DistilBertModel(tf.DistilBertConfig(dim=D, n_layers=2, n_heads=2, hidden_dim=FF))


def _bart():
    return tf.BartModel(tf.BartConfig(**BART))


def _seq(device, grad):
    return (_x(device, grad, 2, 4, D),)


def block_cases() -> list[Case]:
    bert, distil, gpt2, vit = _bert(), _distilbert(), _gpt2(), _vit()
    opt, bart, t5 = _opt(), _bart(), _t5()
    llama, gemma, t5_gated = _llama(), _gemma(), _t5(feed_forward_proj="gated-gelu")
    blocks = [
        ("BertSelfOutput", bert.encoder.layer[0].attention.output, _two(D, D)),
        ("BertOutput", bert.encoder.layer[0].output, _two(FF, D)),
        ("BertLayer", bert.encoder.layer[0], _seq),
        ("DistilBERT TransformerBlock", distil.transformer.layer[0], _seq),
        ("DistilBERT FFN", distil.transformer.layer[0].ffn, _seq),
        ("GPT2Block", gpt2.h[0], _seq),
        ("GPT2MLP", gpt2.h[0].mlp, _seq),
        ("ViTLayer", vit.layers[0], _seq),
        ("OPTDecoderLayer", opt.decoder.layers[0], _seq),
        ("BartEncoderLayer", bart.encoder.layers[0], _with_mask),
        ("BartDecoderLayer", bart.decoder.layers[0], _seq),
        ("T5LayerFF", t5.encoder.block[0].layer[1], _seq),
        ("LlamaMLP", llama.layers[0].mlp, _seq),
        ("LlamaAttention", llama.layers[0].self_attn, _llama_attention_inputs(llama)),
        ("LlamaDecoderLayer", llama.layers[0], _llama_layer_inputs(llama)),
        ("GemmaMLP", gemma.layers[0].mlp, _seq),
        ("T5DenseGatedActDense", t5_gated.encoder.block[0].layer[1].DenseReluDense, _seq),
    ]
    return [
        Case("block", name, _first(block), _first(_patched(block)), inputs)
        for name, block, inputs in blocks
    ]


def _llama_layer_inputs(llama):
    """A decoder layer's positional arguments: hidden states, no mask, position ids, no cache,
    use_cache False, and the rotary (cos, sin)."""

    def inputs(device, grad):
        x = _x(device, grad, 2, 4, D)
        ids = torch.arange(4, device=device)[None].expand(2, 4)
        llama.rotary_emb.to(device)
        return (x, None, ids, None, False, llama.rotary_emb(x, ids))

    return inputs


def _llama_attention_inputs(llama):
    """An attention's positional arguments: hidden states, the rotary (cos, sin), no mask."""

    def inputs(device, grad):
        x = _x(device, grad, 2, 4, D)
        ids = torch.arange(4, device=device)[None].expand(2, 4)
        llama.rotary_emb.to(device)
        return (x, llama.rotary_emb(x, ids), None)

    return inputs


def _two(d_in, d_out):
    return lambda device, grad: (_x(device, grad, 2, 4, d_in), _x(device, grad, 2, 4, d_out))


def _with_mask(device, grad):
    return (*_seq(device, grad), None)


def _first(module: nn.Module) -> Callable[..., object]:
    """Calls the module and returns its first tensor output (a block returns a tuple)."""

    def call(*args):
        out = module(*args)
        return out if isinstance(out, torch.Tensor) else out[0]

    call.module = module  # type: ignore[attr-defined]
    return call


def model_cases() -> list[Case]:
    ids = lambda device, grad: (torch.randint(0, 90, (2, 8), device=device),)  # noqa: E731
    pixels = lambda device, grad: (_x(device, grad, 2, 3, 32, 32),)  # noqa: E731

    def seq2seq(device, grad):
        x = torch.randint(0, 90, (2, 8), device=device)
        return (x, x[:, :4])

    models = [
        ("BERT", _bert(), ids, lambda m, x: m(input_ids=x).last_hidden_state),
        ("GPT-2", _gpt2(), ids, lambda m, x: m(input_ids=x, use_cache=False).last_hidden_state),
        ("ViT", _vit(), pixels, lambda m, x: m(pixel_values=x).last_hidden_state),
        ("OPT", _opt(), ids, lambda m, x: m(input_ids=x, use_cache=False).last_hidden_state),
        (
            "LLaMA",
            _llama(),
            ids,
            lambda m, x: m(input_ids=x, use_cache=False).last_hidden_state,
        ),
        (
            "T5",
            _t5(),
            seq2seq,
            lambda m, x, d: m(input_ids=x, decoder_input_ids=d, use_cache=False).last_hidden_state,
        ),
    ]
    cases = []
    for name, model, inputs, call in models:
        patched = _patched(model)
        cases.append(
            Case(
                "model",
                name,
                _bound(call, model),
                _bound(call, patched),
                inputs,
            )
        )
    return cases


def _bound(call, model):
    fn = lambda *args: call(model, *args)  # noqa: E731
    fn.module = model
    return fn


# ---------------------------------------------------------------- timing


def _step(fn: Callable[..., object], args: tuple, mode: str) -> Callable[[], object]:
    module = getattr(fn, "module", None)

    def infer():
        with torch.no_grad():
            return fn(*args)

    def train():
        return fn(*args)

    def fwdbwd():
        out = fn(*args)
        out.float().sum().backward()

    if module is not None:
        module.train(mode != "infer")
        for m in module.modules():  # dropout off: the host path, not random masks
            if isinstance(m, nn.Dropout):
                m.eval()
    return {"infer": infer, "train": train, "fwdbwd": fwdbwd}[mode]


def _per_call_us(step: Callable[[], object], calls: int, device: torch.device) -> float:
    """CPU time of the process per call (every thread: on CUDA the autograd engine runs the
    backward on a thread of its own), not wall time: time this process spent descheduled, which
    on a shared machine varies by tens of percent from one round to the next, is not its cost."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.process_time()
    for _ in range(calls):
        step()
    t1 = time.process_time()
    sync()
    return (t1 - t0) / calls * 1e6


def measure(case: Case, mode: str, device: torch.device, rounds: int, budget_ms: float) -> dict:
    grad = mode != "infer"
    args = case.inputs(device, grad)
    native, patched = _step(case.native, args, mode), _step(case.patched, args, mode)
    for _ in range(5):
        native(), patched()
    # calls per round: about budget_ms of the native's time
    probe = _per_call_us(native, 20, device)
    calls = max(10, int(budget_ms * 1e3 / max(probe, 1.0)))
    n_us, p_us, ratios = [], [], []
    for r in range(rounds):
        pair = [(native, n_us), (patched, p_us)]
        for step, out in pair if r % 2 == 0 else reversed(pair):
            out.append(_per_call_us(step, calls, device))
        ratios.append(p_us[-1] / n_us[-1])
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "kind": case.kind,
        "name": case.name,
        "mode": mode,
        "native_us": statistics.median(n_us),
        "patched_us": statistics.median(p_us),
        # the per-round ratio: each round times both back to back, so a slower stretch of the
        # machine weighs on both (their medians alone, or their minima, move more run to run)
        "ratio": statistics.median(ratios),
        "ratio_q1": quartiles[0],
        "ratio_q3": quartiles[2],
        "target": TARGET[case.kind],
    }


def table(rows: list[dict], device: str) -> str:
    lines = [
        f"Host time per call, {device}: native vs patched (CPU time of the process per call, "
        "medians over interleaved rounds; ratio = the median of the per-round ratios patched / "
        "native, with their quartiles)",
        "",
        "| kind | case | mode | native us | patched us | ratio | quartiles | target |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        mark = "" if r["ratio"] <= r["target"] else " **over**"
        lines.append(
            f"| {r['kind']} | {r['name']} | {r['mode']} | {r['native_us']:.1f} | "
            f"{r['patched_us']:.1f} | {r['ratio']:.3f}{mark} | "
            f"{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} | {r['target']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--budget-ms", type=float, default=10.0, help="native time per round")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--kinds", default="module,op,block,model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one thread: the per-call layers, not the parallel runtime
    kinds = args.kinds.split(",")
    cases = []
    if "module" in kinds:
        cases += module_cases()
    if "op" in kinds:
        cases += op_cases(device)
    if "block" in kinds:
        cases += block_cases()
    if "model" in kinds:
        cases += model_cases()
    rows = []
    for case in cases:
        if args.only and args.only not in case.name:
            continue
        for fn in (case.native, case.patched):
            if getattr(fn, "module", None) is not None:
                fn.module.to(device)
            elif isinstance(fn, nn.Module):
                fn.to(device)
        if isinstance(case.native, nn.Module):
            case.native, case.patched = _first(case.native), _first(case.patched)
        for mode in args.modes.split(","):
            if mode not in case.modes:
                continue
            row = measure(case, mode, device, args.rounds, args.budget_ms)
            rows.append(row)
            print(
                f"{row['kind']:6} {row['name']:28} {mode:6} native {row['native_us']:8.1f} us  "
                f"patched {row['patched_us']:8.1f} us  ratio {row['ratio']:.3f} "
                f"({row['ratio_q1']:.3f}-{row['ratio_q3']:.3f})",
                flush=True,
            )
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    payload = {
        "device": args.device,
        "where": where or platform.machine(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "rows": rows,
    }
    write_results(args.out, f"bench_host_{device.type}", table(rows, args.device), payload)


if __name__ == "__main__":
    main()
