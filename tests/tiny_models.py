"""Tiny random-weight HuggingFace models (built from configs, no downloads) and a plain
nn.Sequential, with inputs: shared by the patcher and check tests."""

import torch
import transformers as tf
from torch import nn

TINY = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
# A two-layer decoder's shape (LLaMA-family configs: GQA, 16-wide heads), for the decoder tests.
DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)

# name -> (build the model, expected swaps per rule, input kind). Counts are read off each
# architecture: e.g. BERT, 2 layers: two dropout + add + LayerNorm blocks per layer
# (BertSelfOutput, BertOutput) = 4, the embeddings' LN = 1 (its forward does not trace), one
# intermediate dense + GELU per layer = 2 (the pooler's dense + Tanh is reported skipped; the
# second Linear lives in BertOutput, so no mlp). GPT-2 and ViT fuse one residual add per layer
# (ln_2 / layernorm_after: prenorm), DistilBERT two (no dropout: it lives inside attention /
# ffn), BART's decoder layer two (its encoder layer does not trace); OPT's sum reaches its
# LayerNorm through a reshape (not fused). mlp (Linear -> activation -> Linear, one per layer):
# GPT-2's GPT2MLP (Conv1D, tanh GELU), ViT's ViTMLP, DistilBERT's FFN, OPT's decoder layer
# (ReLU), T5's T5DenseActDense (ReLU, a Dropout child between; 1 encoder + 1 decoder block
# here), BART's decoder layer (its encoder layer does not trace: linear_gelu from the rule
# table); the Sequential's two Linear -> act -> Linear runs (its last Linear is the second
# Linear of one, so its GELU stays native). No ReLU is left for the one-for-one 'relu' rule.
# varlen_attention: one row per attention block whose forward calls transformers' attention
# function (T5 and BART: the encoder's, the decoder's self- and cross-attention).
MODELS = {
    "bert": (
        lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)),
        {
            "layer_norm": 1,
            "residual_layer_norm": 4,
            "linear_gelu": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
        },
        "ids",
    ),
    "roberta": (
        lambda: tf.RobertaModel(tf.RobertaConfig(num_hidden_layers=2, **TINY)),
        {
            "layer_norm": 1,
            "residual_layer_norm": 4,
            "linear_gelu": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
        },
        "ids",
    ),
    "distilbert": (
        lambda: tf.DistilBertModel(
            tf.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64)
        ),
        {
            "layer_norm": 1,
            "residual_layer_norm": 4,
            "mlp": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
        },
        "ids",
    ),
    "gpt2": (
        lambda: tf.GPT2Model(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2)),
        {"layer_norm": 3, "residual_layer_norm": 2, "mlp": 2, "varlen_attention": 2},
        "ids",
    ),
    "vit": (
        lambda: tf.ViTModel(
            tf.ViTConfig(num_hidden_layers=2, image_size=32, patch_size=8, **TINY),
            add_pooling_layer=False,
        ),
        {
            "layer_norm": 3,
            "residual_layer_norm": 2,
            "mlp": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
        },
        "pixels",
    ),
    "opt": (
        lambda: tf.OPTModel(
            tf.OPTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=64,
                word_embed_proj_dim=32,
            )
        ),
        {"layer_norm": 5, "mlp": 2, "varlen_attention": 2, "shared_input_linear": 6},
        "ids",
    ),
    "t5": (
        lambda: tf.T5Model(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)),
        {"mlp": 2, "rms_norm": 7, "varlen_attention": 3, "shared_input_linear": 6},
        "seq2seq",
    ),
    "bart": (
        lambda: tf.BartModel(
            tf.BartConfig(
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
            )
        ),
        {
            "layer_norm": 5,
            "residual_layer_norm": 2,
            "linear_gelu": 1,
            "mlp": 1,
            "varlen_attention": 3,
            "shared_input_linear": 6,
        },
        "seq2seq",
    ),
    "sequential": (
        lambda: nn.Sequential(
            nn.Linear(32, 64),
            nn.GELU(approximate="tanh"),
            nn.Linear(64, 32),
            nn.LayerNorm(32),
            nn.Linear(32, 48),
            nn.ReLU(),
            nn.Linear(48, 32),
            nn.GELU(),
        ),
        {"layer_norm": 1, "mlp": 2},
        "features",
    ),
}


# What the module-level rules alone swap (layers=MODULE_RULES_ONLY): today's counts before the
# residual_layer_norm and linear_relu rules existed, which must not change.
MODULE_RULES_ONLY = ("layer_norm", "linear_gelu", "relu")
MODULE_RULE_COUNTS = {
    "bert": {"layer_norm": 5, "linear_gelu": 2},
    "roberta": {"layer_norm": 5, "linear_gelu": 2},
    "distilbert": {"layer_norm": 5, "linear_gelu": 2},
    "gpt2": {"layer_norm": 5, "linear_gelu": 2},
    "vit": {"layer_norm": 5, "linear_gelu": 2},
    "opt": {"layer_norm": 5, "relu": 2},
    "t5": {"relu": 2},
    "bart": {"layer_norm": 7, "linear_gelu": 2},
    "sequential": {"layer_norm": 1, "linear_gelu": 2, "relu": 1},
}


def make_inputs(kind: str, device, batch: int = 2, seq: int = 7, dtype=torch.float32) -> dict:
    """Inputs for a model of MODELS; floating ones (features, pixels) in ``dtype``."""
    if kind == "ids":
        return {"input_ids": torch.randint(0, 90, (batch, seq), device=device)}
    if kind == "seq2seq":
        ids = torch.randint(0, 90, (batch, seq), device=device)
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    if kind == "pixels":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, device=device, dtype=dtype)}
    return {"input": torch.randn(batch, seq, 32, device=device, dtype=dtype)}


def first_output(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.last_hidden_state


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return first_output(model(**inputs) if "input" not in inputs else model(inputs["input"]))


def build(name: str, device="cpu", dtype=torch.float32) -> nn.Module:
    return MODELS[name][0]().to(device=device, dtype=dtype).eval()


class FakeLoraLinear(nn.Module):
    """PEFT's layout without peft: the wrapped Linear is ``base_layer`` (the patcher must leave
    it alone, or the adapter's weights would be dropped)."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.base_layer = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


def hf_reinitialised_state(model: nn.Module) -> dict:
    """The state_dict after HuggingFace's own initialisation, from a known start: every
    parameter set to 3.0, the seed reset, then ``model.apply(model._init_weights)``. Equal
    results for a native and a patched model mean the initialisation reached the fused
    layers' parameters as it reaches the native ones."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    torch.manual_seed(0)
    model.apply(model._init_weights)
    return model.state_dict()
