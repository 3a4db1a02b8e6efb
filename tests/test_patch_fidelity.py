"""Drop-in fidelity of the patcher (issue 21, items 1, 3, 4, 6, 7): activations recognised only
when proven equal, hooks never silently dropped, parametrized/pruned layers skipped, an
all-or-nothing patch, HuggingFace weight initialisation reaching fused layers, and the order of
PEFT/quantization vs patching."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from fastlayers.patching import FusedAway, records
from tiny_models import MODULE_RULES_ONLY, FakeLoraLinear, build, make_inputs, run
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

import fastlayers
from fastlayers import FusedLinearGELU, LayerNorm, ReLUScale


def _skip_reasons(report) -> dict[str, str]:
    return {s.name: s.reason for s in report.skips}


# -- item 1: activations are recognised only when what they compute is proven equal ----------


class GELUDrop(nn.GELU):
    """GELU, then dropout in train mode: equal to GELU only in eval mode."""

    def forward(self, x):
        return F.dropout(super().forward(x), 0.5, self.training)


class RareDropGELU(nn.Module):
    """A parameter-free activation with a dropout child that rarely drops."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.002)

    def forward(self, x):
        return self.drop(F.gelu(x))


@pytest.mark.parametrize("act_cls", [GELUDrop, RareDropGELU])
@pytest.mark.parametrize("training", [False, True])
def test_activation_that_differs_in_train_mode_is_not_fused(act_cls, training):
    model = nn.Sequential(nn.Linear(8, 16), act_cls(), nn.Linear(16, 4)).train(training)
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    report = fastlayers.patch(model)
    assert report.num_swapped == 0, str(report)
    assert "train mode" in _skip_reasons(report)["0"]
    assert isinstance(model[0], nn.Linear) and type(model[1]) is act_cls
    assert [m.training for m in model.modules()] == modes  # the probe put the modes back
    assert torch.equal(torch.get_rng_state(), rng)  # and left the user's random stream alone


def test_gelu_subclass_without_its_own_forward_is_still_fused():
    class NamedGELU(nn.GELU):
        pass

    model = nn.Sequential(nn.Linear(8, 16), NamedGELU(approximate="tanh"))
    report = fastlayers.patch(model)
    assert report.counts() == {"linear_gelu": 1}
    assert model[0].approximate == "tanh"


def test_relu_and_layer_norm_subclasses_with_their_own_forward_are_not_swapped():
    class LeakyishReLU(nn.ReLU):
        def forward(self, x):
            return F.relu(x) - 0.01 * F.relu(-x)

    class ShiftedLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) + 1.0

    model = nn.Sequential(nn.Linear(8, 8), LeakyishReLU(), ShiftedLayerNorm(8))
    x = torch.randn(3, 8)
    y = model(x)
    # the module and pair rules (a block rule may still rewrite F.relu(-x) * 0.01 inside)
    report = fastlayers.patch(model, layers=(*MODULE_RULES_ONLY, "linear_relu"))
    assert report.num_swapped == 0
    reasons = _skip_reasons(report)
    assert "subclass of ReLU" in reasons["1"] and "subclass of LayerNorm" in reasons["2"]
    assert "LeakyishReLU is not GELU (erf or tanh form) or ReLU" in reasons["0"]
    torch.testing.assert_close(model(x), y, rtol=0, atol=0)


# -- item 3: hooks on a module a rewrite removes, or whose meaning it changes, mean skip ------


def _noop(*args, **kwargs):
    return None


ACTIVATION_HOOKS = {
    "forward pre-hooks": lambda m: m.register_forward_pre_hook(_noop),
    "forward pre-hooks (with kwargs)": lambda m: m.register_forward_pre_hook(
        _noop, with_kwargs=True
    ),
    "forward hooks": lambda m: m.register_forward_hook(_noop),
    "forward hooks (with kwargs)": lambda m: m.register_forward_hook(_noop, with_kwargs=True),
    "forward hooks (always called)": lambda m: m.register_forward_hook(_noop, always_call=True),
    "backward hooks": lambda m: m.register_full_backward_hook(_noop),
    "backward pre-hooks": lambda m: m.register_full_backward_pre_hook(_noop),
    "state_dict hooks": lambda m: m.register_state_dict_post_hook(_noop),
    "state_dict pre-hooks": lambda m: m.register_state_dict_pre_hook(_noop),
    "load_state_dict pre-hooks": lambda m: m.register_load_state_dict_pre_hook(_noop),
    "load_state_dict post-hooks": lambda m: m.register_load_state_dict_post_hook(_noop),
}


@pytest.mark.parametrize("kind", list(ACTIVATION_HOOKS))
def test_any_hook_on_the_removed_activation_means_skip(kind):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    ACTIVATION_HOOKS[kind](model[1])
    report = fastlayers.patch(model)
    assert report.num_swapped == 0, str(report)
    reason = _skip_reasons(report)["0"]
    assert "activation" in reason and kind in reason, reason
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.GELU


LINEAR_HOOKS = {
    "forward hooks": lambda m: m.register_forward_hook(_noop),
    "forward hooks (with kwargs)": lambda m: m.register_forward_hook(_noop, with_kwargs=True),
    "backward hooks": lambda m: m.register_full_backward_hook(_noop),
    "backward pre-hooks": lambda m: m.register_full_backward_pre_hook(_noop),
}


@pytest.mark.parametrize("kind", list(LINEAR_HOOKS))
def test_hooks_that_would_see_the_gelu_output_on_the_linear_mean_skip(kind):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    LINEAR_HOOKS[kind](model[0])
    report = fastlayers.patch(model)
    assert report.num_swapped == 0, str(report)
    reason = _skip_reasons(report)["0"]
    assert "Linear" in reason and kind in reason, reason


def test_pre_hooks_on_the_linear_are_carried_by_the_fused_layer():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU())
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    model[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append(1), with_kwargs=True)
    x = torch.randn(3, 8)
    y = model(x)
    assert fastlayers.patch(model).counts() == {"linear_gelu": 1}
    assert isinstance(model[0], FusedLinearGELU)
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-6)  # input still doubled
    assert len(seen) == 2


class NestedGELU(nn.Module):
    """GELU in every mode, through a submodule (which the fused layer would remove too)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(F.gelu(x))


def test_hooks_on_a_submodule_of_the_removed_activation_mean_skip():
    model = nn.Sequential(nn.Linear(8, 16), NestedGELU(), nn.Linear(16, 4))
    seen = []
    model[1].drop.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    report = fastlayers.patch(model)
    assert report.num_swapped == 0, str(report)
    assert "submodule 'drop' has forward hooks" in _skip_reasons(report)["0"]
    assert seen == []  # the probe did not run the user's hook either
    model(torch.randn(3, 8))
    assert seen == [torch.Size([3, 16])]
    assert fastlayers.patch(nn.Sequential(nn.Linear(8, 16), NestedGELU())).counts() == {
        "linear_gelu": 1
    }  # without the hook it is fused


def test_global_module_hooks_mean_skip_for_linear_gelu():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16))
    handle = nn.modules.module.register_module_forward_hook(_noop)
    try:
        report = fastlayers.patch(model)
    finally:
        handle.remove()
    assert report.counts() == {"layer_norm": 1}
    assert "global" in _skip_reasons(report)["0"]


def test_one_for_one_swaps_keep_global_and_backward_hooks():
    """A one-for-one swap computes the same function: global forward hooks see the same
    outputs, and full backward hooks on the swapped module see the same gradients."""

    def run_hooked(model, x):
        outs, grads = [], []
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, i, o: outs.append((type(m).__name__, o.detach().clone()))
        )
        bw = model[1].register_full_backward_hook(
            lambda m, gin, gout: grads.append((gin[0].clone(), gout[0].clone()))
        )
        try:
            model(x).pow(2).sum().backward()
        finally:
            handle.remove()
            bw.remove()
        return outs, grads

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU())
    x = torch.randn(4, 8)
    outs_native, grads_native = run_hooked(model, x)
    fastlayers.patch(model, layers=("layer_norm", "relu"))  # the one-for-one rules, relu named
    assert isinstance(model[1], LayerNorm) and isinstance(model[2], ReLUScale)
    outs, grads = run_hooked(model, x)
    assert len(outs) == len(outs_native) == 4 and len(grads) == len(grads_native) == 1
    for (_, a), (_, b) in zip(outs, outs_native, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads[0], grads_native[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- item 4: parametrized / pruned layers, and an all-or-nothing patch -----------------------


class _Double(nn.Module):
    def forward(self, w):
        return w * 2.0


REPARAMETRIZE = {
    "pruned": lambda m: prune.l1_unstructured(m, "weight", amount=0.3),
    "weight_norm": lambda m: parametrizations.weight_norm(m),
    "spectral_norm": lambda m: parametrizations.spectral_norm(m),
    "register_parametrization": lambda m: parametrize.register_parametrization(
        m, "weight", _Double()
    ),
}


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("how", list(REPARAMETRIZE))
def test_parametrized_or_pruned_layers_are_skipped(how, dry_run):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    REPARAMETRIZE[how](model[0])
    if how != "spectral_norm":  # spectral_norm needs a 2-D weight
        REPARAMETRIZE[how](model[2])
    model.eval()
    x = torch.randn(3, 8)
    y = model(x)
    types = [type(m) for m in model.modules()]
    report = fastlayers.patch(model, dry_run=dry_run)
    reasons = _skip_reasons(report)
    word = "pruned" if how == "pruned" else "parametrized"
    assert word in reasons["0"], reasons
    if how == "spectral_norm":  # the LayerNorm is left plain (spectral_norm needs 2-D)
        assert report.counts() == {"layer_norm": 1}
    else:
        assert word in reasons["2"], reasons
        assert report.num_swapped == 0
        assert [type(m) for m in model.modules()] == types
    if dry_run:
        assert [type(m) for m in model.modules()] == types
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-6)


def _snapshot(model):
    return {
        "modules": [(n, id(m)) for n, m in model.named_modules()],
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "hooks": [
            (n, attr, tuple(getattr(m, attr)))
            for n, m in model.named_modules()
            for attr in records._HOOK_DICTS
        ],
        "modes": [m.training for m in model.modules()],
        "init": [m.__dict__.get("_init_weights") for m in model.modules()],
    }


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_patch_is_all_or_nothing(monkeypatch, fail_at):
    model = build("bert")
    model.encoder.layer[0].intermediate.dense.register_forward_pre_hook(_noop)
    model.encoder.layer[1].output.LayerNorm.register_forward_hook(_noop)
    inputs = make_inputs("ids", "cpu")
    y = run(model, inputs)
    before = _snapshot(model)
    adopt, calls = records._adopt, []

    def failing_adopt(fused, native):
        calls.append(native)
        if len(calls) == fail_at:
            raise RuntimeError("injected failure")
        return adopt(fused, native)

    monkeypatch.setattr(records, "_adopt", failing_adopt)
    with pytest.raises(RuntimeError, match="injected failure"):
        fastlayers.patch(model, layers=MODULE_RULES_ONLY)  # the rules that adopt modules
    assert len(calls) == fail_at
    after = _snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["params"] == before["params"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert after["hooks"] == before["hooks"] and after["modes"] == before["modes"]
    assert after["init"] == before["init"]
    assert not any(isinstance(m, (FusedAway, FusedLinearGELU, LayerNorm)) for m in model.modules())
    assert torch.equal(run(model, inputs), y)
    monkeypatch.undo()
    assert fastlayers.patch(model, layers=MODULE_RULES_ONLY).counts() == {
        "layer_norm": 5,
        "linear_gelu": 2,
    }


# -- item 6: HuggingFace weight initialisation reaches fused layers --------------------------


def _clear_init_flags(model):
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    for p in model.parameters():
        p.__dict__.pop("_is_hf_initialized", None)


INIT_FLOWS = {
    "apply(_init_weights)": lambda m: m.apply(m._init_weights),
    "init_weights()": lambda m: (_clear_init_flags(m), m.init_weights()),
    "initialize_weights()": lambda m: (_clear_init_flags(m), m.initialize_weights()),
}


@pytest.mark.parametrize("flow", list(INIT_FLOWS))
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_initialisation_reaches_fused_layers_as_native_ones(name, flow):
    native = build(name)
    patched = copy.deepcopy(native)
    # GPT-2's MLP is rule mlp's (its Conv1Ds stay native): the pair rule makes fused layers
    layers = [rule for rule in fastlayers.patching.DEFAULT_LAYERS if rule != "mlp"]
    report = fastlayers.patch(patched, layers=layers)
    assert report.counts()["linear_gelu"] == 2
    results = []
    for model in (native, patched):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(3.0)
        torch.manual_seed(0)
        INIT_FLOWS[flow](model)
        results.append(model.state_dict())
    assert results[0].keys() == results[1].keys()
    for key, value in results[0].items():
        assert torch.equal(results[1][key], value), key
    fused = [m for m in patched.modules() if isinstance(m, FusedLinearGELU)]
    std = native.config.initializer_range
    for m in fused:
        assert abs(m.weight.std().item() - std) < 0.25 * std and not m.bias.any()
    fastlayers.unpatch(patched)
    assert "_init_weights" not in patched.__dict__


def test_from_pretrained_initialises_a_missing_fused_weight(tmp_path):
    class PatchedBert(tf.BertModel):
        """Patches itself when built (as a model class a user writes might)."""

        def __init__(self, config):
            super().__init__(config)
            fastlayers.patch(self)

    source = build("bert")
    state = source.state_dict()
    del state["encoder.layer.0.intermediate.dense.weight"]
    source.save_pretrained(tmp_path, state_dict=state)
    loaded = []
    for cls in (tf.BertModel, PatchedBert):
        torch.manual_seed(0)
        loaded.append(cls.from_pretrained(tmp_path).state_dict())
    weight = loaded[1]["encoder.layer.0.intermediate.dense.weight"]
    assert torch.isfinite(weight).all()
    assert abs(weight.std().item() - source.config.initializer_range) < 0.005
    assert torch.equal(weight, loaded[0]["encoder.layer.0.intermediate.dense.weight"])


# -- item 7: PEFT / quantization before patching ---------------------------------------------


def test_patch_warns_about_adapters_and_quantized_modules():
    model = nn.Sequential(FakeLoraLinear(), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    with pytest.warns(UserWarning, match=r"fastlayers.patch: .*adapter.*'0'.*before"):
        report = fastlayers.patch(model)
    assert report.counts() == {"linear_gelu": 1, "layer_norm": 1}
    assert "PEFT" in _skip_reasons(report)["0"]

    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU()), {nn.Linear}
        )
    with pytest.warns(UserWarning, match=r"quantized.*'0'"):
        fastlayers.patch(quantized)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastlayers.patch(build("sequential"))  # nothing foreign: no warning


def test_lora_before_patch_keeps_outputs_and_skips_the_adapters():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = build("bert")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():  # lora_B starts at zero; make the adapters change the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    inputs = make_inputs("ids", "cpu")
    y = run(model, inputs)
    with pytest.warns(UserWarning, match="adapter"):
        report = fastlayers.patch(model)
    intermediate = model.base_model.model.encoder.layer[0].intermediate
    assert type(intermediate.dense).__module__.startswith("peft")
    assert type(intermediate.intermediate_act_fn).__name__ == "GELUActivation"
    assert report.counts() == {"layer_norm": 1, "residual_layer_norm": 4, "varlen_attention": 2}
    assert any("PEFT" in s.reason and "intermediate.dense" in s.name for s in report.skips)
    torch.testing.assert_close(run(model, inputs), y, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_layers_on_a_gpu_without_kernels_are_skipped_with_the_reason(monkeypatch):
    """A GPU the build has no kernels for (faked: cuda:0 marked so) gets no fused layer with
    parameters; the report names the GPU and the rebuild command (fastlayers.ops._native)."""
    from fastlayers.ops import _native

    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(_native, "_NO_KERNEL_DEVICES", {device})
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32)).to(device)
    report = fastlayers.patch(model)
    assert not [s for s in report.swaps if s.rule in ("layer_norm", "linear_gelu")]
    reasons = {s.rule: s.reason for s in report.skips}
    for rule in ("layer_norm", "linear_gelu"):
        assert "no CUDA kernels for this GPU" in reasons[rule]
        assert "TORCH_CUDA_ARCH_LIST" in reasons[rule]
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.LayerNorm
