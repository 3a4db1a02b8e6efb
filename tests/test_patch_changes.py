"""A patch stays right when the model changes: modules reachable from two places or held by the
user, changes made after the patch (hooks, replaced children, attribute values), in-place
updates, forwards that return dataclasses (audio models), offloading after the patch, argument
structures without end, and look-alike classes. Each case compares a patched model with the
native one, computed the same way."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from fastlayers.patching import FusedAway
from fastlayers.patching.blocks import MAX_TRACES, rewritten_forward
from fastlayers.patching.rules import residual_layer_norm as residual_rule
from tiny_models import TINY, build, make_inputs, run
from torch import nn

import fastlayers

D = 16


def _randomise(model: nn.Module) -> nn.Module:
    """Random values in every Parameter (LayerNorm's ones and zeros hide a lost weight)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def _bert() -> nn.Module:
    return _randomise(tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)).eval())


def _patched_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    fastlayers.patch(twin)
    return twin


def _warnings_of(fn) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught]


# ---------------------------------------------------------------- 1. shared and held modules


def test_a_module_held_by_the_user_keeps_computing_after_the_patch():
    model = _bert()
    held = model.embeddings.LayerNorm
    x = torch.randn(2, 5, 32, requires_grad=True)
    expected = held(x)
    fastlayers.patch(model)
    assert model.embeddings.LayerNorm is not held  # swapped in the model ...
    out = held(x)  # ... and the native object still computes with its own Parameters
    assert torch.equal(out, expected)
    out.sum().backward()
    assert held.weight.grad is not None and held.weight is model.embeddings.LayerNorm.weight


class _Block(nn.Module):
    def __init__(self, ln: nn.LayerNorm) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.ln = ln

    def forward(self, x, r):
        return self.ln(self.drop(x) + r)


class _SharedLayerNorm(nn.Module):
    """One LayerNorm used by a block (a residual_layer_norm pattern) and by its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.block = _Block(self.ln)

    def forward(self, x, r):
        return self.ln(self.block(x, r))


def test_a_layer_norm_shared_by_a_block_and_its_parent():
    native = _randomise(_SharedLayerNorm().eval())
    patched = _patched_twin(native)
    assert rewritten_forward(patched.block) is not None  # both rules took it
    x, r = torch.randn(3, D), torch.randn(3, D)
    y_native, y = native(x, r), patched(x, r)
    torch.testing.assert_close(y, y_native, rtol=1e-5, atol=1e-5)
    y_native.square().sum().backward()
    y.square().sum().backward()
    torch.testing.assert_close(patched.ln.weight.grad, native.ln.weight.grad, rtol=1e-4, atol=1e-5)


class _SharedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        linear = nn.Linear(8, 8)
        self.seq = nn.Sequential(linear, nn.GELU())
        self.other = linear

    def forward(self, x):
        return self.seq(x) + self.other(x)


def test_a_linear_shared_by_a_fused_pair_and_another_parent():
    native = _SharedLinear().eval()
    patched = _patched_twin(native)
    assert type(patched.seq[0]).__name__ == "FusedLinearGELU"
    assert isinstance(patched.other, nn.Linear)  # the other parent keeps the native Linear
    x = torch.randn(3, 8)
    torch.testing.assert_close(patched(x), native(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- 2. a fused pair changed later


def _intermediate(model):
    return model.encoder.layer[0].intermediate


CHANGES = {
    "forward hook on the Linear": lambda i: i.dense.register_forward_hook(
        lambda m, a, out: out * 1.5
    ),
    "forward pre-hook on the activation": lambda i: i.intermediate_act_fn.register_forward_pre_hook(
        lambda m, a: (a[0] * 1.5,)
    ),
    "forward hook on the activation": lambda i: i.intermediate_act_fn.register_forward_hook(
        lambda m, a, out: a[0]  # returns its input: sees the activation's input
    ),
    "Linear replaced": lambda i: setattr(i, "dense", _seeded(lambda: nn.Linear(32, 64))),
    "activation replaced by ReLU": lambda i: setattr(i, "intermediate_act_fn", nn.ReLU()),
    "activation replaced by Identity": lambda i: setattr(i, "intermediate_act_fn", nn.Identity()),
}


def _seeded(make):
    torch.manual_seed(7)
    return make()


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_fused_pair_changed_after_the_patch_computes_as_the_native_modules(change):
    native = _bert()
    patched = _patched_twin(native)
    ids = make_inputs("ids", "cpu")["input_ids"]
    for model in (native, patched):
        CHANGES[change](_intermediate(model))
    y_native = native(ids).last_hidden_state
    y, messages = _warnings_of(lambda: patched(ids).last_hidden_state)
    torch.testing.assert_close(y, y_native, rtol=1e-5, atol=1e-5)
    assert any("computes them apart" in m for m in messages), messages


def test_a_full_backward_hook_on_the_fused_linear_sees_the_linears_gradient():
    native = _bert().train()
    patched = _patched_twin(native).train()
    seen = {}
    for name, model in (("native", native), ("patched", patched)):
        _intermediate(model).dense.register_full_backward_hook(
            lambda m, gi, go, name=name: seen.__setitem__(name, go[0].clone())
        )
    ids = make_inputs("ids", "cpu")["input_ids"]
    for model in (native, patched):
        torch.manual_seed(0)
        with torch.no_grad():  # dropout off: the residual rewrites draw other masks
            model.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)
        model(ids).last_hidden_state.square().sum().backward()
    torch.testing.assert_close(seen["patched"], seen["native"], rtol=1e-4, atol=1e-5)


def test_the_pair_fuses_again_once_the_hook_is_gone_and_unpatch_restores_it():
    model = _patched_twin(_bert())
    dense = _intermediate(model).dense
    handle = dense.register_forward_hook(lambda m, a, out: None)
    assert dense._pairing.broken()
    handle.remove()
    assert not dense._pairing.broken()
    fastlayers.unpatch(model)
    assert isinstance(_intermediate(model).dense, nn.Linear)
    assert dense._pairing is None  # a fused layer out of the model is a plain FusedLinearGELU


def test_the_check_probes_do_not_break_a_fused_pair():
    model = _bert()
    inputs = make_inputs("ids", "cpu")
    report, messages = _warnings_of(lambda: fastlayers.check(model, inputs, runs=1, warmup=0))
    assert report.passed, str(report)
    assert not any("computes them apart" in m for m in messages), messages
    assert any(layer.fused == "FusedLinearGELU" for layer in report.layers)


# ---------------------------------------------------------------- 3. values read at call time


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.scale = 1.0

    def forward(self, x, r):
        return self.ln(x + r) * self.scale


class _ReLUTimesC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.c = 2

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.c


def test_attribute_values_are_read_when_the_forward_reads_them():
    block = _randomise(_Scaled().eval())
    fastlayers.patch(block)
    assert rewritten_forward(block) is not None
    x, r = torch.randn(3, D), torch.randn(3, D)
    block(x, r)
    block.scale = 5.0
    expected = F.layer_norm(x + r, (D,), block.ln.weight, block.ln.bias) * 5.0
    torch.testing.assert_close(block(x, r), expected, rtol=1e-5, atol=1e-5)

    scaled = _ReLUTimesC().eval()
    fastlayers.patch(scaled)
    assert rewritten_forward(scaled) is not None
    x = torch.randn(4, D)
    scaled(x)
    scaled.c = 3
    assert torch.equal(scaled(x), torch.relu(scaled.fc(x)) * 3)


def test_opt_dropout_set_to_zero_after_a_training_call_is_seen():
    native = build("opt").train()
    patched = _patched_twin(native).train()
    ids = make_inputs("ids", "cpu")
    patched(**ids)  # traced for training with the configured p
    for model in (native, patched):
        for layer in model.decoder.layers:
            layer.dropout = 0.0
        model.decoder.dropout = 0.0
    torch.testing.assert_close(run(patched, ids), run(native, ids), rtol=1e-5, atol=1e-5)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.calls = 0

    def forward(self, x, r):
        self.calls += 1
        return self.ln(x + r)


def test_a_forward_that_assigns_its_attributes_is_not_rewritten():
    block = _Counting()
    report = fastlayers.patch(block)
    assert rewritten_forward(block) is None and report.counts() == {"layer_norm": 1}
    assert any("assigns attributes" in s.reason and "calls" in s.reason for s in report.skips)
    block(torch.randn(2, D), torch.randn(2, D))
    assert block.calls == 1  # the trace's own call left no count behind


# ---------------------------------------------------------------- 4. in-place updates


class _InPlaceResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(D)

    def forward(self, x, r):
        r += self.drop(x)
        return self.ln(r)


class _ModifiesSaved(nn.Module):
    """Updates in place the sum that the native LayerNorm saved for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(D)

    def forward(self, x, r):
        s = self.drop(x) + r
        y = self.ln(s)
        s += 1
        return y + s


class _InPlaceBeside(nn.Module):
    """A residual_layer_norm pattern, and an in-place update of an argument beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(D)

    def forward(self, x, r):
        r.mul_(2)
        return self.ln(self.drop(x) + r)


@pytest.mark.parametrize("block_cls", [_InPlaceResidual, _InPlaceBeside])
def test_a_block_updating_its_argument_in_place_keeps_the_update(block_cls):
    native = block_cls().eval()
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    assert rewritten_forward(patched) is None
    if block_cls is _InPlaceBeside:  # a pattern was found, and refused for the update
        assert any("in place (mul_)" in s.reason for s in report.skips), str(report)
    x, r = torch.randn(3, D), torch.randn(3, D)
    r_native, r_patched = r.clone(), r.clone()
    torch.testing.assert_close(patched(x, r_patched), native(x, r_native))
    assert torch.equal(r_patched, r_native) and not torch.equal(r_native, r)


def test_a_block_updating_a_saved_tensor_raises_in_backward_as_native():
    native = _ModifiesSaved().train()
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    assert any("modified in place" in s.reason for s in report.skips), str(report)
    for model in (native, patched):
        x = torch.randn(3, D, requires_grad=True)
        y = model(x, torch.randn(3, D))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


# ---------------------------------------------------------------- 5. a class's name is no proof


class BartEncoderLayer(nn.Module):
    """A user's class with the name of a transformers layer, computing something else: fc1's
    output is used twice, and a data-dependent branch keeps fx from tracing it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.activation_fn = nn.GELU()
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        h = self.fc1(x)
        if x.sum() > 0:
            x = x * 2
        return self.fc2(self.activation_fn(h)) + h[..., :D] + x


def test_a_look_alike_class_is_not_fused_by_its_name():
    native = BartEncoderLayer().eval()
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    assert report.num_swapped == 0, str(report)
    x = torch.randn(3, D)
    assert torch.equal(patched(x), native(x))


def test_bart_encoder_layers_are_fused_from_their_source():
    report = fastlayers.patch(build("bart"), dry_run=True)
    rows = [s.name for s in report.swaps if s.rule == "linear_gelu"]
    assert rows == ["encoder.layers.0.fc1"], str(report)


# ---------------------------------------------------------------- 6. forwards returning dataclasses

_AUDIO = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 37,
    "conv_dim": (8, 8),
    "conv_stride": (5, 4),
    "conv_kernel": (10, 4),
    "num_conv_pos_embeddings": 16,
}


@pytest.mark.parametrize(
    "model_cls, config_cls",
    [
        (tf.Wav2Vec2Model, tf.Wav2Vec2Config),
        (tf.HubertModel, tf.HubertConfig),
        (tf.WavLMModel, tf.WavLMConfig),
        (tf.Data2VecAudioModel, tf.Data2VecAudioConfig),
    ],
)
def test_audio_models_keep_their_output_types(model_cls, config_cls):
    config = dict(_AUDIO)
    if config_cls is not tf.Data2VecAudioConfig:
        config["num_conv_pos_embedding_groups"] = 2
    native = model_cls(config_cls(**config)).eval()
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    assert report.counts().get("residual_layer_norm"), str(report)
    waves = torch.randn(2, 800)
    with torch.no_grad():
        y_native, y = native(waves), patched(waves)
    assert type(y) is type(y_native)
    torch.testing.assert_close(y.last_hidden_state, y_native.last_hidden_state)
    torch.testing.assert_close(y[0], y_native[0])


def test_check_puts_the_model_back_when_the_patched_run_fails(monkeypatch):
    model = build("bert")
    inputs = make_inputs("ids", "cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("the patched forward failed")

    monkeypatch.setattr(residual_rule, "dropout_add_layer_norm_forward", broken)
    report = fastlayers.check(model, inputs, runs=1, warmup=0)  # FAIL, not an exception
    assert not report.passed and "the patched forward failed" in report.error
    assert not any(rewritten_forward(m) for m in model.modules())
    assert not any(type(m).__module__.startswith("fastlayers") for m in model.modules())


# ---------------------------------------------------------------- 7. unpatch after offloading


def test_unpatch_after_cpu_offload_hands_back_a_working_model():
    from accelerate import cpu_offload

    native = build("bert")
    patched = _patched_twin(native)
    inputs = make_inputs("ids", "cpu")
    expected = run(native, inputs)
    cpu_offload(patched, execution_device="cpu")
    torch.testing.assert_close(run(patched, inputs), expected, rtol=1e-5, atol=1e-5)
    fastlayers.unpatch(patched)
    assert type(_intermediate(patched).dense) is nn.Linear
    torch.testing.assert_close(run(patched, inputs), expected, rtol=1e-5, atol=1e-5)


def test_unpatch_refuses_when_a_wrapper_changed_a_fused_modules_class():
    model = _patched_twin(_bert())
    fused = model.embeddings.LayerNorm
    fused.__class__ = type("FSDPLayerNorm", (type(fused),), {"__module__": "wrapper"})
    with pytest.raises(ValueError, match=r"embeddings\.LayerNorm is now a FSDPLayerNorm"):
        fastlayers.unpatch(model)
    assert model.embeddings.LayerNorm is fused  # nothing was undone


# ---------------------------------------------------------------- 8. traces are bounded


class _ScaledArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)

    def forward(self, x, r, scale=1.0, mode=0):
        return self.ln(x + r) * scale + mode


def test_float_arguments_run_the_original_forward_and_traces_are_bounded():
    block = _ScaledArg().eval()
    fastlayers.patch(block)
    forward = rewritten_forward(block)
    x, r = torch.randn(2, D), torch.randn(2, D)
    for i in range(50):
        scale = 1 + i * 1e-3
        expected = F.layer_norm(x + r, (D,), block.ln.weight, block.ln.bias) * scale
        torch.testing.assert_close(block(x, r, scale=scale), expected)
    assert forward._traces == 1  # the patch's own trace; float calls are not traced
    _, messages = _warnings_of(lambda: [block(x, r, mode=i) for i in range(3 * MAX_TRACES)])
    assert forward._traces == MAX_TRACES
    assert any(f"traced {MAX_TRACES} times" in m for m in messages), messages
    expected = F.layer_norm(x + r, (D,), block.ln.weight, block.ln.bias) + 40
    torch.testing.assert_close(block(x, r, mode=40), expected)


# ---------------------------------------------------------------- 10. layers and the root


def test_one_rule_name_is_taken_as_that_rule():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    report = fastlayers.patch(model, layers="layer_norm")
    assert report.counts() == {"layer_norm": 1}
    with pytest.raises(ValueError, match="layers is a rule name or a sequence of them"):
        fastlayers.patch(model, layers=["layer_norm", "lay"])


def test_the_root_module_itself_is_reported_as_skipped():
    report = fastlayers.patch(nn.LayerNorm(8))
    assert report.num_swapped == 0
    (skip,) = report.skips
    assert skip.name == "(root)" and "LayerNorm.from_native" in skip.reason
    assert "(root)" in str(report)


# ---------------------------------------------------------------- 11. reports grouped


def test_reports_group_layers_and_keep_details_behind_a_flag():
    model = tf.BertModel(tf.BertConfig(num_hidden_layers=6, **TINY)).eval()
    report = fastlayers.check(model, make_inputs("ids", "cpu"), runs=1, warmup=0)
    assert report.passed, str(report)
    text, details = str(report), report.format(details=True)
    assert "encoder.layer.*.intermediate.dense" in text and "encoder.layer.3." not in text
    assert all(f"encoder.layer.{i}.intermediate.dense" in details for i in range(6))
    assert len(text.splitlines()) < 45 < len(details.splitlines())
    assert "encoder.layer.*.attention.self.{query,key,value}" in text  # siblings in one row
    data = report.to_dict()
    # 6 attention rows, 18 query / key / value
    assert len(data["patch"]["swaps"]) == 43 and len(data["layers"]) == 43


def test_fused_away_is_an_identity_while_its_pair_stands():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    fastlayers.patch(model)
    assert isinstance(model[1], FusedAway) and not model[1].pairing.broken()
    x = torch.randn(3, 8)
    assert model[1](x) is x
