"""Rule gated_mlp (and rms_norm beside it) on today's decoder families: what patch fuses, logits
equal to native, unpatch, changes after the patch, hooks, PEFT LoRA, gradient checkpointing,
torch.compile, save/load."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from fastlayers.patching.rules.gated_mlp import GatedMLPMatch
from tiny_models import DECODER
from torch import nn

import fastlayers

tf = pytest.importorskip("transformers")

SMALL = DECODER

# family -> (builder, expected counts, bit-identical logits on CPU in float32)
FAMILIES = {
    "llama": (
        lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)),
        {
            "rms_norm": 3,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "mistral": (
        lambda: tf.MistralForCausalLM(tf.MistralConfig(**SMALL)),
        {
            "rms_norm": 3,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "qwen2": (
        lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)),
        {
            "rms_norm": 3,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "qwen3": (
        lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=16)),
        {
            "rms_norm": 7,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "gemma": (
        lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, head_dim=16)),
        {
            "rms_norm": 3,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "gemma2": (
        lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=16)),
        {
            "rms_norm": 7,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "gemma3": (
        lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SMALL, head_dim=16)),
        {
            "rms_norm": 11,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "phi3": (
        lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, pad_token_id=0)),
        {
            "rms_norm": 3,
            "residual_rms_norm": 2,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    "olmo2": (
        lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL)),
        {
            "rms_norm": 9,
            "gated_mlp": 2,
            "rotary": 2,
            "varlen_attention": 2,
            "shared_input_linear": 6,
            "linear_cross_entropy": 1,
        },
        True,
    ),
    # T5 v1.1's gelu_new is a composite of rounded ops: within the bound, not bit for bit
    "t5v11": (
        lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(
                d_model=64,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                d_kv=16,
                vocab_size=100,
                feed_forward_proj="gated-gelu",
            )
        ),
        {"rms_norm": 12, "gated_mlp": 4, "varlen_attention": 6, "shared_input_linear": 20},
        False,
    ),
}


def _inputs(name, device="cpu"):
    ids = torch.randint(1, 100, (2, 9), device=device)
    return dict(input_ids=ids, decoder_input_ids=ids) if name == "t5v11" else dict(input_ids=ids)


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_patches_and_matches_native(name):
    build, counts, exact = FAMILIES[name]
    model = build().eval()
    inputs = _inputs(name)
    ref = _logits(model, inputs)
    report = fastlayers.patch(model)
    assert report.counts() == counts, str(report)
    out = _logits(model, inputs)
    if exact:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    fastlayers.unpatch(model)
    assert torch.equal(_logits(model, inputs), ref)
    assert not any(type(m).__module__.startswith("fastlayers") for m in model.modules())


def _tiny_llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))


def test_activation_changed_after_the_patch_is_followed():
    model = _tiny_llama().eval()
    inputs = _inputs("llama")
    fastlayers.patch(model)
    native = copy.deepcopy(model)
    fastlayers.unpatch(native)
    for m in (model, native):
        m.model.layers[0].mlp.act_fn = nn.GELU(approximate="tanh")
    assert torch.equal(_logits(model, inputs), _logits(native, inputs))


def test_hook_on_the_activation_runs_and_the_call_computes_natively():
    model = _tiny_llama().eval()
    fastlayers.patch(model)
    seen = []
    model.model.layers[1].mlp.act_fn.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _logits(model, _inputs("llama"))
    assert seen == [torch.Size([2, 9, 128])]


def test_peft_lora_on_gate_up_down_keeps_the_adapters():
    peft = pytest.importorskip("peft")
    model = _tiny_llama().eval()
    config = peft.LoraConfig(
        r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(model, config)
    inputs = _inputs("llama")
    ref = _logits(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = fastlayers.patch(model)
    assert report.counts().get("gated_mlp") == 2  # the Linears (LoRA-wrapped) stay called
    assert torch.equal(_logits(model, inputs), ref)


def test_training_with_gradient_checkpointing_matches_native():
    model = _tiny_llama().train()
    model.config.attention_dropout = 0.0
    native = copy.deepcopy(model)
    fastlayers.patch(model)
    inputs = _inputs("llama")
    grads = []
    for m in (native, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = m(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)


def test_torch_compile_fullgraph_of_a_patched_decoder_layer():
    model = _tiny_llama().eval()
    fastlayers.patch(model)
    inputs = _inputs("llama")
    ref = _logits(model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model.model.layers[0].mlp, fullgraph=True)
    x = torch.randn(2, 9, 64)
    torch.testing.assert_close(compiled(x), model.model.layers[0].mlp(x))
    assert torch.equal(_logits(model, inputs), ref)


def test_state_dict_and_reload_unchanged():
    model = _tiny_llama().eval()
    keys = list(model.state_dict())
    fastlayers.patch(model)
    assert list(model.state_dict()) == keys
    fresh = _tiny_llama().eval()
    fastlayers.patch(fresh)
    fresh.load_state_dict(model.state_dict())
    inputs = _inputs("llama")
    assert torch.equal(_logits(fresh, inputs), _logits(model, inputs))


class _Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 1), nn.Linear(16, 8)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


def test_a_broadcasting_product_computes_natively_with_a_warning():
    block = nn.Sequential(_Broadcast())
    x = torch.randn(3, 8)
    ref = block(x)
    report = fastlayers.patch(block, layers=("gated_mlp",))
    assert report.counts() == {"gated_mlp": 1}
    with pytest.warns(RuntimeWarning, match="broadcasts"):
        assert torch.equal(block(x), ref)


def test_match_claims_only_the_activation_child():
    match = GatedMLPMatch("act_fn", "child", "silu", "down_proj", "SiLU * up + Linear")
    assert match.claims() == {"act_fn"}
    assert GatedMLPMatch("F.silu", "F.silu", "silu", "down_proj", "x").claims() == set()


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "gemma", "qwen3", "phi3", "t5v11"])
def test_cuda_bf16_family_within_the_check(name):
    build = FAMILIES[name][0]
    model = build().eval().to("cuda", torch.bfloat16)
    inputs = _inputs(name, "cuda")
    result = fastlayers.check(model, inputs)
    assert result.passed, str(result)


def test_whole_mlp_follows_hooks_and_weights_changed_after_the_patch():
    model = _tiny_llama().eval()
    inputs = _inputs("llama")
    report = fastlayers.patch(model)
    assert any(s.fused == "gated_act (whole MLP)" for s in report.swaps)
    native = copy.deepcopy(model)
    fastlayers.unpatch(native)
    mlp, native_mlp = model.model.layers[0].mlp, native.model.layers[0].mlp
    new_up = torch.randn_like(mlp.up_proj.weight)
    for m in (mlp, native_mlp):  # a new Parameter, and a hook that changes the output
        m.up_proj.weight = nn.Parameter(new_up.clone())
        m.gate_proj.register_forward_hook(lambda mod, i, o: o * 2)
    torch.manual_seed(1)
    w = torch.randn_like(mlp.down_proj.weight)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(w)
        native_mlp.down_proj.weight.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(_logits(model, inputs), _logits(native, inputs))


def test_whole_patched_llama_compiles_and_runs_under_cpu_autocast():
    model = _tiny_llama().eval()
    inputs = _inputs("llama")
    native = copy.deepcopy(model)
    fastlayers.patch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = _logits(model, inputs), _logits(native, inputs)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    torch.testing.assert_close(_logits(compiled, inputs), _logits(native, inputs))


def _kept_storages(fn):
    """The storages (pointer: bytes) of the tensors autograd keeps for backward during fn()."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_training_recomputes_the_product_instead_of_keeping_it(autocast):
    """A recorded call: the down projection is one gated_act_down node that keeps gate(x), up(x)
    and the weight, not act * up (one [tokens, intermediate] tensor a layer less than native);
    a training step's loss and every gradient are native's bit for bit."""
    model = _tiny_llama().train()
    native = copy.deepcopy(model)
    fastlayers.patch(model, layers=["gated_mlp"])
    mlp, native_mlp = model.model.layers[0].mlp, native.model.layers[0].mlp
    x = torch.randn(2, 9, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, ours = _kept_storages(lambda: mlp(x))
        y_n, theirs = _kept_storages(lambda: native_forward(native_mlp, x))
    assert y.grad_fn.name() == "fastlayers::GatedActDownBackward"
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    activations = sorted(n for ptr, n in ours.items() if ptr not in params)
    # x's converted or own copy, gate(x), up(x) (and autocast's copies of the three weights);
    # native also keeps act(gate(x)) and the product
    hidden = 2 * 9 * SMALL["intermediate_size"] * y.element_size()
    casts = [64 * SMALL["intermediate_size"] * 2] * 3 if autocast else []
    assert activations == sorted([2 * 9 * 64 * y.element_size(), hidden, hidden, *casts])
    assert sum(theirs.values()) - sum(ours.values()) == 2 * hidden
    assert torch.equal(y, y_n)
    inputs = _inputs("llama")
    grads = []
    for m in (native, model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        grads.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for n, g in grads[0][1].items():
        assert torch.equal(grads[1][1][n], g), n


def test_training_with_a_subclass_down_weight_keeps_the_two_ops():
    """A down weight that is a tensor subclass (no rule for gated_act_down): act * up by
    gated_act and down's F.linear, as before, with native's values."""

    class Tagged(torch.Tensor):
        pass

    model = _tiny_llama().train()
    fastlayers.patch(model, layers=["gated_mlp"])
    mlp = model.model.layers[0].mlp
    native_w = mlp.down_proj.weight
    mlp.down_proj.weight = nn.Parameter(native_w.detach().clone().as_subclass(Tagged))
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = mlp(x)
    assert "GatedActDown" not in y.grad_fn.name()
    torch.testing.assert_close(y, native_forward(mlp, x), rtol=0, atol=0)


def _count_epilogue_calls(monkeypatch):
    """Counts the whole-MLP rewrite's calls of gated_act_linear (the up GEMM with the product)."""
    from fastlayers._extension import _C

    calls = []
    real = _C.gated_act_linear

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(_C, "gated_act_linear", spy)
    return calls


def test_inference_calls_run_up_and_the_product_in_one_op_with_native_bits(monkeypatch):
    """No gradient recorded: up's GEMM and act * up go to gated_act_linear (on CPU native's bits);
    a call that records gradients, an up projection with a bias, or the setting "cublas" keep
    F.linear and gated_act."""
    model = _tiny_llama().eval()
    inputs = _inputs("llama")
    ref = _logits(model, inputs)
    fastlayers.patch(model)
    calls = _count_epilogue_calls(monkeypatch)
    assert torch.equal(_logits(model, inputs), ref)
    assert len(calls) == SMALL["num_hidden_layers"]
    calls.clear()
    model(**inputs).logits.sum().backward()  # gradients recorded: up(x) is kept for the backward
    assert calls == []
    model.train()  # training mode, even without gradients (a reentrant checkpoint's forward)
    with torch.no_grad():
        model(**inputs)
    model.eval()
    assert calls == []
    with fastlayers.config.gated_mlp_epilogue_as("cublas"):
        assert torch.equal(_logits(model, inputs), ref)
    assert calls == []
    mlp = model.model.layers[0].mlp
    mlp.up_proj.bias = nn.Parameter(torch.randn(mlp.up_proj.out_features))
    _logits(model, inputs)
    assert len(calls) == SMALL["num_hidden_layers"] - 1


def test_gated_mlp_epilogue_setting_is_checked():
    with pytest.raises(ValueError, match="gated_mlp_epilogue must be one of"):
        fastlayers.config.set_gated_mlp_epilogue("cutlass")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [8, 4096], ids=["few-tokens", "many-tokens"])
def test_cuda_bf16_mlp_inference_epilogue_within_bounds_cublas_native_bits(tokens):
    """A patched LLaMA MLP on the GPU, bf16, inference: with the epilogue (taken on sm_90 at 4,096
    tokens) within the DESIGN bound of native's error against float64; with "cublas" F.linear's
    GEMMs and gated_act's pass, bit for bit."""
    from numerics import assert_close_to_reference

    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(**{**SMALL, "hidden_size": 512, "intermediate_size": 1408})
    )
    native = model.model.layers[0].mlp.eval().to("cuda", torch.bfloat16)
    wide = copy.deepcopy(native).double()
    fastlayers.patch(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, tokens // 2, 512, device="cuda", dtype=torch.bfloat16)
    from fastlayers.ops.gated_act import gated_act_linear_path

    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    with torch.inference_mode():
        ref, nat = wide(x.double()), native_forward(native, x)
        out = mlp(x)
        g = torch.nn.functional.linear(x, gate)
        path = gated_act_linear_path(g, x, up, "silu")
        with fastlayers.config.gated_mlp_epilogue_as("cublas"):
            plain = mlp(x)
        old = torch.nn.functional.linear(
            fastlayers.functional.gated_act(g, torch.nn.functional.linear(x, up), "silu"), down
        )
    if tokens == 4096 and "build has no" not in path and "not sm_90" not in path:
        assert path == "cutlass_sm90", path  # an sm_90 GPU and a build with its kernels
    assert_close_to_reference(out, nat, ref, torch.bfloat16, f"epilogue ({path})")
    assert torch.equal(plain, old)  # "cublas": F.linear's GEMMs and gated_act, as before


def native_forward(mlp, x):
    """The MLP's class forward on its own children: native's computation."""
    return type(mlp).forward(mlp, x)
