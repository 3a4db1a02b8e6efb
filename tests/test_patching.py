"""The patcher on tiny random-weight HuggingFace models (built from configs, no downloads) and
plain nn.Sequential models: what is swapped, outputs, state_dict, unpatch, idempotence, hooks,
save/load, and the cases it must leave alone."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from fastlayers.patching import FusedAway, swap_children
from numerics import DEVICES, assert_close_to_reference
from tiny_models import (
    MODELS,
    MODULE_RULE_COUNTS,
    FakeLoraLinear,
    build,
    first_output,
    make_inputs,
    run,
)
from torch import nn

import fastlayers
from fastlayers import FusedLinearGELU, FusedLinearReLU, LayerNorm, ReLUScale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_patch_swaps_keeps_outputs_and_state_and_unpatches(name, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build(name, device, dtype)
    inputs = make_inputs(MODELS[name][2], device, dtype=dtype)
    reference = copy.deepcopy(model).double()
    ref_inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    y_ref = run(reference, ref_inputs)
    types_before = {n: type(m) for n, m in model.named_modules()}
    params_before = dict(model.named_parameters())
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    y_native = run(model, inputs)

    report = fastlayers.patch(model)
    assert report.counts() == MODELS[name][1], str(report)
    fused_types = {type(m) for m in model.modules()}
    assert (FusedLinearGELU in fused_types) == ("linear_gelu" in report.counts())
    assert (FusedLinearReLU in fused_types) == ("linear_relu" in report.counts())
    y = run(model, inputs)
    assert_close_to_reference(y, y_native, y_ref, dtype, f"{name} patched output")

    state = model.state_dict()
    assert list(state) == list(state_before)
    assert all(torch.equal(state[k], state_before[k]) for k in state)
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert fastlayers.patch(model).num_swapped == 0  # idempotent

    pairs = report.counts().get("linear_gelu", 0) + report.counts().get("linear_relu", 0)
    # a fused Linear + activation restores two modules
    assert fastlayers.unpatch(model) == sum(report.counts().values()) + pairs
    assert {n: type(m) for n, m in model.named_modules()} == types_before
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert torch.equal(run(model, inputs), y_native)


def test_dry_run_changes_nothing_and_apply_style_swaps_the_same():
    model = build("bert")
    before = [type(m) for m in model.modules()]
    dry = fastlayers.patch(model, dry_run=True)
    assert [type(m) for m in model.modules()] == before
    assert dry.dry_run and "would swap" in str(dry)
    model.apply(swap_children)
    assert sum(isinstance(m, LayerNorm) for m in model.modules()) == dry.counts()["layer_norm"]
    assert sum(isinstance(m, FusedLinearGELU) for m in model.modules()) == 2
    assert sum(isinstance(m, FusedAway) for m in model.modules()) == 2
    assert fastlayers.patch(model).num_swapped == 0


def test_layers_selects_rules_and_report_prints():
    model = build("gpt2")
    report = fastlayers.patch(model, layers=("linear_gelu",))
    assert report.counts() == {"linear_gelu": 2}
    fused = model.h[0].mlp.c_fc
    assert isinstance(fused, FusedLinearGELU) and fused.weight_transposed
    assert fused.approximate == "tanh"  # gelu_new
    text = str(report)  # grouped: one row for both layers' c_fc, the index folded
    assert "h.*.mlp.c_fc" in text and "FusedLinearGELU('tanh')" in text
    assert "h.0.mlp.c_fc" not in text
    details = report.format(details=True)  # one row per module
    assert "h.0.mlp.c_fc" in details and "h.1.mlp.c_fc" in details
    assert report.compile_note() is None and "torch.compile" not in text  # no LayerNorm swapped
    ln_report = fastlayers.patch(model)
    assert "aten.layer_norm" in str(ln_report) and ln_report.compile_note() in str(ln_report)
    with fastlayers.config.compile_layer_norm_as("fused"):
        with fastlayers.config.compile_residual_layer_norm_as("fused"):
            assert ln_report.compile_note() is None
    with pytest.raises(ValueError, match="unknown layers"):
        fastlayers.patch(model, layers=("softmax",))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fastlayers.patch("bert")


def test_hooks_follow_the_swap():
    model = build("sequential")
    calls = []
    model[3].register_forward_hook(lambda m, i, o: calls.append(("ln", o.shape)))
    model[5].register_forward_pre_hook(lambda m, i: calls.append(("relu pre", i[0].shape)))
    x = torch.randn(2, 32)
    fastlayers.patch(model, layers=fastlayers.patching.ALL_LAYERS)  # 'relu' only when named
    assert isinstance(model[3], LayerNorm) and isinstance(model[5], ReLUScale)
    model(x)
    assert [c[0] for c in calls] == ["ln", "relu pre"]
    fastlayers.unpatch(model)
    model(x)
    assert [c[0] for c in calls] == ["ln", "relu pre"] * 2


def test_leaves_alone_what_it_cannot_fuse_with_a_reason():
    class QuantLinear(nn.Linear):  # a Linear with its own forward (as bitsandbytes' are)
        def forward(self, x):  # weights rounded to bfloat16: not F.linear
            return F.linear(x, self.weight.to(torch.bfloat16).to(self.weight.dtype), self.bias)

    hooked = nn.Linear(8, 8)
    hooked.register_forward_hook(lambda m, i, o: None)
    model = nn.Sequential(
        QuantLinear(8, 8),
        nn.GELU(),
        FakeLoraLinear(),
        nn.GELU(),
        hooked,
        nn.GELU(),
        nn.Linear(8, 8),
        nn.SiLU(),
        nn.Linear(8, 8).to(torch.complex64),  # float64 is supported; complex is not
        nn.GELU(),
    )
    report = fastlayers.patch(model, layers=("linear_gelu",))
    assert report.num_swapped == 0
    reasons = {s.name: s.reason for s in report.skips}
    assert "own forward" in reasons["0"]
    assert "PEFT" in reasons["2"]
    assert "forward hooks" in reasons["4"]
    assert "not GELU" in reasons["6"]
    assert "complex64" in reasons["8"]


def test_activation_with_another_user_is_not_fused():
    class TwoUsers(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.GELU()

        def forward(self, x):
            h = self.fc(x)
            return self.act(h) + h  # the Linear's output is also used directly

    model = TwoUsers()
    assert fastlayers.patch(model).num_swapped == 0


def test_meta_model_patched_then_loaded_and_save_load_round_trip(tmp_path):
    from accelerate import init_empty_weights

    source = build("bert")
    source.save_pretrained(tmp_path / "native")
    with init_empty_weights():
        model = tf.BertModel(source.config)
    report = fastlayers.patch(model)
    assert report.counts() == MODELS["bert"][1]
    model.load_state_dict(source.state_dict(), assign=True)
    model.eval()
    inputs = make_inputs("ids", "cpu")
    y_src = run(source, inputs)
    torch.testing.assert_close(run(model, inputs), y_src, rtol=1e-4, atol=1e-5)
    # a patched model saves a native checkpoint, and loads one
    model.save_pretrained(tmp_path / "patched")
    reloaded = tf.BertModel.from_pretrained(tmp_path / "patched").eval()
    torch.testing.assert_close(run(reloaded, inputs), y_src, rtol=1e-4, atol=1e-5)
    fresh = build("bert")
    fastlayers.patch(fresh)
    fresh.load_state_dict(source.state_dict())
    torch.testing.assert_close(run(fresh, inputs), y_src, rtol=1e-4, atol=1e-5)
    # unpatch after loading re-binds the loaded Parameters to the native modules
    fastlayers.unpatch(model)
    assert not any(p.is_meta for p in model.parameters())
    torch.testing.assert_close(run(model, inputs), y_src, rtol=0, atol=0)


def test_training_state_survives_tied_weights_optimizer_and_compile():
    model = build("gpt2")
    model.train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = make_inputs("ids", "cpu")
    model(**inputs).last_hidden_state.sum().backward()
    opt.step()
    model.h[0].ln_1.weight.requires_grad_(False)
    fastlayers.patch(model)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert not model.h[0].ln_1.weight.requires_grad and model.h[0].ln_1.training
    assert all(p in opt.state for p in model.parameters() if p.requires_grad)
    model.gradient_checkpointing_enable()
    model(**inputs).last_hidden_state.sum().backward()
    opt.step()
    model.eval()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(
        first_output(compiled(**inputs)), run(model, inputs), rtol=1e-4, atol=1e-5
    )


def test_accelerate_offloaded_model_stays_runnable():
    from accelerate import cpu_offload

    model = build("bert")
    inputs = make_inputs("ids", "cpu")
    y_native = run(model, inputs)
    cpu_offload(model, execution_device=torch.device("cpu"))
    report = fastlayers.patch(model)
    # the LayerNorms load their offloaded weights in their own accelerate hook: not fused into
    # blocks, swapped one for one
    # the attentions' route, and their query / key / value
    expected = {**MODULE_RULE_COUNTS["bert"], "varlen_attention": 2, "shared_input_linear": 6}
    assert report.counts() == expected, str(report)
    assert any("accelerate hook" in s.reason for s in report.skips)
    fused = model.encoder.layer[0].intermediate.dense
    assert hasattr(fused, "_hf_hook")
    torch.testing.assert_close(run(model, inputs), y_native, rtol=1e-4, atol=1e-5)


def test_tied_weights_and_moving_after_the_patch():
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2)).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    inputs = make_inputs("ids", "cpu")
    with torch.no_grad():
        y_native = model(**inputs).logits
    fastlayers.patch(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    fused = model.transformer.h[0].mlp.c_fc
    model.to(torch.bfloat16)  # the fused layers' (shared) Parameters move with the model
    assert (
        fused.weight.dtype == torch.bfloat16
        and fused.weight is model.transformer.h[0].mlp.c_fc.weight
    )
    model.float()
    with torch.no_grad():
        y = model(**inputs).logits
    # bf16 round trip of the weights, then fp32 math: close to the native fp32 logits
    torch.testing.assert_close(y, y_native, rtol=0.05, atol=0.05)
    fastlayers.unpatch(model)
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32


def test_swapped_out_module_does_not_keep_parameters_alive():
    """FSDP2 (and to_empty, load_state_dict(assign=True)) replace a module's Parameters; the
    native module kept for unpatch must not hold the old ones (a whole unsharded model per
    rank under FSDP2)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16))
    old = [weakref.ref(p) for p in model.parameters()]
    fastlayers.patch(model)
    for module in model.modules():
        for name in list(module._parameters):  # what fully_shard does
            setattr(module, name, nn.Parameter(getattr(module, name).detach().clone()))
    gc.collect()
    assert all(ref() is None for ref in old)
    x = torch.randn(2, 8)
    y = model(x)
    fastlayers.unpatch(model)  # the native modules get the new Parameters back
    torch.testing.assert_close(model(x), y)
