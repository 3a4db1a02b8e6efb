"""Training with patched models: a short fine-tuning run (tiny GPT-2 and BERT, fixed seed, the
same dropout masks) native vs patched, with every rule on (BERT's dropout + add + LayerNorm blocks
and GPT-2's MLPs included). The loss curves agree within the dtype's noise, the
final parameters are close, the loss goes down, and gradient checkpointing gives the same
run. CPU in fp32 (CI); on the GPU in bf16 autocast."""

import copy

import pytest
import torch
import transformers as tf
from tiny_models import TINY

import fastlayers

STEPS = 200


def tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
        return tf.GPT2LMHeadModel(config)
    config = tf.BertConfig(num_hidden_layers=2, vocab_size=64, max_position_embeddings=32, **TINY)
    return tf.BertForMaskedLM(config)


def fine_tune(model, device: str, autocast: bool, steps: int = STEPS) -> list[float]:
    """AdamW on a fixed set of 8 random sequences (the model memorises them); dropout on, its
    masks drawn from a per-step seed so two models see the same ones."""
    model.to(device).train()
    data = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        batch = data[(step * 4) % 8 : (step * 4) % 8 + 4]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class PhiloxDropout(torch.nn.Module):
    """nn.Dropout whose mask is the one fastlayers' fused op draws (same generator, same
    consumption, same Philox stream): put in the native model where the patched one fuses a
    dropout, it makes the two runs see the same masks, so their loss curves can be compared
    tightly. The arithmetic stays native: x * (1 / (1 - p)) where kept."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        ones = torch.ones_like(x)
        kept = fastlayers.functional.dropout_add_layer_norm(
            ones, None, x.shape[-1:], p=self.p, training=True, prenorm=True
        )[1]
        return torch.where(kept != 0, x * (1.0 / (1.0 - self.p)), torch.zeros_like(x))


# The blocks whose dropout child the residual_layer_norm rule fuses (tiny_models' BERT).
FUSED_DROPOUT_PARENTS = ("BertSelfOutput", "BertOutput")


def run_pair(kind: str, device: str, autocast: bool):
    native = tiny_model(kind)
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    counts = report.counts()
    # BERT: dense + GELU pairs (the second Linear is in BertOutput); GPT-2: GPT2MLP's mlp
    fused_mlps = counts.get("linear_gelu", 0) if kind == "bert" else counts.get("mlp", 0)
    assert fused_mlps >= 2 and counts["residual_layer_norm"] >= 2, str(report)
    for module in native.modules():
        if type(module).__name__ in FUSED_DROPOUT_PARENTS:
            module.dropout = PhiloxDropout(module.dropout.p)
    return (
        native,
        patched,
        fine_tune(native, device, autocast),
        fine_tune(patched, device, autocast),
    )


def comparable_params(model: torch.nn.Module):
    """(name, tensor) of the parameters, less the attention key biases: softmax is invariant to
    them, so their true gradient is zero, and Adam turns the rounding noise left in it into
    full-size random steps in any two runs (native vs native in another summation order too)."""
    for name, p in model.named_parameters():
        p = p.detach()
        if name.endswith("key.bias"):
            continue
        if name.endswith("c_attn.bias"):  # GPT-2: [query | key | value]
            third = p.numel() // 3
            p = torch.cat([p[:third], p[2 * third :]])
        yield name, p


def max_param_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest difference between corresponding parameters, relative to each tensor's largest
    value."""
    worst = 0.0
    for (_, p), (_, q) in zip(comparable_params(a), comparable_params(b), strict=True):
        scale = p.abs().max().item() or 1.0
        worst = max(worst, (p - q).abs().max().item() / scale)
    return worst


def max_loss_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fine_tuning_native_and_patched_agree(kind, device):
    """CPU, fp32: only summation order differs; within 1e-4. GPU, bf16 autocast: the DESIGN
    rule over a whole run: native vs patched within 2x the native bf16 run's own distance from
    the same run in fp32 (bf16's noise, carried forward by 200 Adam steps), plus 1e-3."""
    autocast = device == "cuda"
    native, patched, loss_n, loss_p = run_pair(kind, device, autocast)
    assert loss_n[-1] < 0.5 * loss_n[0], "the run must learn something to be a test"
    loss_tol = param_tol = 1e-4
    if autocast:
        fp32 = tiny_model(kind)
        loss_32 = fine_tune(fp32, device, autocast=False)
        loss_tol = 2 * max_loss_rel_diff(loss_32, loss_n) + 1e-3
        param_tol = 2 * max_param_rel_diff(fp32, native) + 1e-3
    worst = max_loss_rel_diff(loss_n, loss_p)
    assert worst <= loss_tol, f"loss curves differ by {worst:.3g} (relative), bound {loss_tol:.3g}"
    params = max_param_rel_diff(native, patched)
    assert params <= param_tol, f"parameters differ by {params:.3g}, bound {param_tol:.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradient_checkpointing_gives_the_same_run(device):
    steps = 30
    native = tiny_model("gpt2")
    patched = copy.deepcopy(native)
    fastlayers.patch(patched)
    checkpointed = copy.deepcopy(patched)
    checkpointed.gradient_checkpointing_enable()
    autocast = device == "cuda"
    loss_p = fine_tune(patched, device, autocast, steps)
    loss_c = fine_tune(checkpointed, device, autocast, steps)
    assert checkpointed.transformer.gradient_checkpointing
    # Recomputation runs the same kernels on the same inputs: the same run, bit for bit.
    assert loss_p == loss_c
    assert max_param_rel_diff(patched, checkpointed) == 0.0


@pytest.mark.cuda
def test_cuda_graphs_reduce_overhead_on_a_patched_model():
    """torch.compile(mode="reduce-overhead") captures the patched model in CUDA graphs; the
    replays give the eager patched model's output."""
    model = tiny_model("bert").to("cuda", torch.bfloat16).eval()
    fastlayers.patch(model)
    ids = torch.randint(0, 64, (4, 16), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=ids).logits.float()
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            out = compiled(input_ids=ids).logits.float()
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
