"""A patch stays right when the model changes after it, round two: a forward replaced on the
instance of a child that a fused layer or a rewritten block took over (a LayerNorm, an
activation, a Dropout), attributes of an activation fused into its Linear, parametrizations and
pruning added to fused or claimed layers, a ModuleList grown or shrunk after a rewritten forward
traced it, an attribute the forward reads with a default that appears later, and a block called
with ever new keyword values. Each case makes the change after the patch, on the patched model
and on its unpatched deep copy alike, and compares the two."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from fastlayers.patching import FusedAway
from fastlayers.patching.blocks import MAX_TRACES, rewritten_forward
from test_patch_changes import _AUDIO as AUDIO_CONFIG
from tiny_models import TINY, make_inputs
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

import fastlayers

D = 16


def _randomise(model: nn.Module) -> nn.Module:
    """Random values in every Parameter (LayerNorm's ones and zeros hide a lost weight); weight
    matrices and embeddings at 0.2 of a unit normal, so that gradients through the attention of
    the tiny transformers compare in float32 within 1e-4, whatever the seed."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    return model


def _bert() -> nn.Module:
    return _randomise(tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)).eval())


def _gpt2() -> nn.Module:
    return _randomise(tf.GPT2Model(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2)).eval())


def _patched_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    fastlayers.patch(twin)
    return twin


def _at(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).last_hidden_state


def _close(actual, expected) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# -------------------------------------------- 1. a forward set on a claimed child


def _plus_one(module: nn.Module) -> None:
    orig = module.forward  # the module's own bound forward
    module.forward = lambda t: orig(t) + 1.0


INSTANCE_FORWARDS = {
    "bert: a rewritten block's LayerNorm": (
        _bert,
        "encoder.layer.1.output.LayerNorm",
        _plus_one,
    ),
    "bert: a rewritten block's Dropout": (
        _bert,
        "encoder.layer.0.output.dropout",
        lambda m: setattr(m, "forward", lambda t: t * 2.0),
    ),
    "bert: a fused-away activation": (
        _bert,
        "encoder.layer.0.intermediate.intermediate_act_fn",
        lambda m: setattr(m, "forward", F.relu),
    ),
    "gpt2: an mlp block's activation": (
        _gpt2,
        "h.0.mlp.act",
        lambda m: setattr(m, "forward", F.relu),
    ),
}


@pytest.mark.parametrize("case", list(INSTANCE_FORWARDS))
def test_a_forward_set_on_a_taken_over_child_after_the_patch_is_called(case):
    """A forward replaced on the instance of a child a fused layer or a rewrite took over runs."""
    build, path, change = INSTANCE_FORWARDS[case]
    native = build()
    patched = _patched_twin(native)
    ids = make_inputs("ids", "cpu")["input_ids"]
    before = _hidden(native, ids)
    _close(_hidden(patched, ids), before)  # traced for this call, and right
    for model in (native, patched):
        change(_at(model, path))
    y_native = _hidden(native, ids)
    assert not torch.allclose(y_native, before)  # the change matters
    _close(_hidden(patched, ids), y_native)


# -------------------------------------------- 2. a fused-away activation changed


class _LinearGELU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


def _linear_gelu_pair() -> tuple[nn.Module, nn.Module, nn.GELU]:
    """(native, patched, the patched model's original GELU object, taken before the patch)."""
    native = _randomise(_LinearGELU().eval())
    patched = copy.deepcopy(native)
    held = patched.act
    report = fastlayers.patch(patched)
    assert report.counts() == {"linear_gelu": 1}, str(report)
    assert isinstance(patched.act, FusedAway) and type(patched.fc).__name__ == "FusedLinearGELU"
    return native, patched, held


ACTIVATION_CHANGES = {
    "approximate set through the model": lambda model, held: setattr(
        model.act, "approximate", "tanh"
    ),
    "approximate set on the original GELU object": lambda model, held: setattr(
        held, "approximate", "tanh"
    ),
    "forward set through the model": lambda model, held: setattr(model.act, "forward", F.relu),
}


@pytest.mark.parametrize("change", list(ACTIVATION_CHANGES))
def test_a_fused_away_activation_changed_after_the_patch(change):
    """Attributes and forwards of an activation fused into its Linear, set after the patch."""
    native, patched, held = _linear_gelu_pair()
    x = torch.randn(3, 5, D)
    _close(patched(x), native(x))
    ACTIVATION_CHANGES[change](native, native.act)
    ACTIVATION_CHANGES[change](patched, held)
    y_native = native(x)
    assert not torch.allclose(y_native, F.gelu(native.fc(x)))  # the change matters
    _close(patched(x), y_native)


# -------------------------------------------- 3. parametrizations and pruning


class _Double(nn.Module):
    def forward(self, weight):
        return weight * 2


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _mlp() -> nn.Module:
    return _randomise(_MLP().eval())


# target -> (build the native model, its rule, path of the module changed, the model's input)
TARGETS = {
    "mlp block's first Linear": (_mlp, "mlp", "fc1", lambda: torch.randn(3, 5, D)),
    "gpt2 mlp's Conv1D": (_gpt2, "mlp", "h.0.mlp.c_fc", None),
    "fused LayerNorm": (_bert, "layer_norm", "embeddings.LayerNorm", None),
    "FusedLinearGELU": (_bert, "linear_gelu", "encoder.layer.0.intermediate.dense", None),
}

OPERATIONS = {
    "register_parametrization": lambda m: parametrize.register_parametrization(
        m, "weight", _Double()
    ),
    "weight_norm": lambda m: parametrizations.weight_norm(m),
    "l1_unstructured": lambda m: prune.l1_unstructured(m, "weight", amount=0.3),
}

# pruning an mlp block's Linear is left out: its forward pre-hook already sends the block to its
# original forward
PARAMETRIZED = [
    (target, op)
    for target in TARGETS
    for op in OPERATIONS
    if not (op == "l1_unstructured" and "mlp" in target)
]


def _run_target(model: nn.Module, target: str, inputs) -> torch.Tensor:
    if TARGETS[target][3] is not None:
        return model(inputs)
    return _hidden(model, inputs)


@pytest.mark.parametrize("target, op", PARAMETRIZED)
def test_a_parametrization_or_pruning_added_after_the_patch(target, op):
    """A parametrization or pruning of a fused or claimed layer's weight, added after the patch."""
    build, rule, path, make = TARGETS[target]
    native = build()
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    assert any((s.rule, s.name) == (rule, path) for s in report.swaps), str(report)
    inputs = make() if make is not None else make_inputs("ids", "cpu")["input_ids"]
    _close(_run_target(patched, target, inputs), _run_target(native, target, inputs))
    for model in (native, patched):
        OPERATIONS[op](_at(model, path))
    y_native = _run_target(native, target, inputs)
    y = _run_target(patched, target, inputs)
    _close(y, y_native)
    y_native.square().sum().backward()
    y.square().sum().backward()
    grads_native = {n: p.grad for n, p in native.named_parameters()}
    grads = {n: p.grad for n, p in patched.named_parameters()}
    assert grads.keys() == grads_native.keys()
    original = {
        "register_parametrization": "parametrizations.weight.original",
        "weight_norm": "parametrizations.weight.original1",
        "l1_unstructured": "weight_orig",
    }[op]
    assert grads[f"{path}.{original}"] is not None
    for name, grad in grads_native.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


# -------------------------------------------- 4. a ModuleList changed after a trace

_AUDIO = {
    **AUDIO_CONFIG,
    # training calls without randomness: no dropout, LayerDrop or SpecAugment masks
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "feat_proj_dropout": 0.0,
    "layerdrop": 0.0,
    "mask_time_prob": 0.0,
}


class _Stack(nn.Module):
    """Iterates a ModuleList, then a dropout + add + LayerNorm (residual_layer_norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2))
        self.drop = nn.Dropout(0.0)  # training calls without randomness
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        r = x
        for layer in self.layers:
            x = layer(x)
        return self.ln(self.drop(x) + r)


def _wav2vec2() -> tuple[nn.Module, str, torch.Tensor]:
    model = _randomise(tf.Wav2Vec2Model(tf.Wav2Vec2Config(**_AUDIO)).train())
    return model, "encoder", torch.randn(2, 800)


def _stack() -> tuple[nn.Module, str, torch.Tensor]:
    return _randomise(_Stack().train()), "", torch.randn(3, 5, D)


def _first(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def _append_copy(layers: nn.ModuleList) -> None:
    layers.append(copy.deepcopy(layers[0]))


def _delete_second(layers: nn.ModuleList) -> None:
    del layers[1]


@pytest.mark.parametrize("build", [_wav2vec2, _stack], ids=["wav2vec2 encoder", "custom block"])
@pytest.mark.parametrize("change", [_append_copy, _delete_second], ids=["appended", "deleted"])
def test_a_module_list_changed_after_the_rewritten_forward_traced_it(build, change):
    """Layers appended to or deleted from a ModuleList a rewritten forward iterates (training)."""
    native, path, x = build()
    patched = _patched_twin(native)
    block = _at(patched, path)
    assert rewritten_forward(block) is not None
    _close(_first(patched(x)), _first(native(x)))  # traced for this (training) call
    for model in (native, patched):
        change(_at(model, path).layers)
    assert len(block.layers) == len(_at(native, path).layers)
    y_native, y = _first(native(x)), _first(patched(x))
    _close(y, y_native)
    y_native.square().sum().backward()
    y.square().sum().backward()
    last = f"{path}.layers.{len(block.layers) - 1}".lstrip(".")
    for name, p in _at(native, last).named_parameters():
        grad = _at(patched, last).get_parameter(name).grad
        assert grad is not None, name
        torch.testing.assert_close(
            grad, p.grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


# -------------------------------------------- 5. an attribute read with a default


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(D)

    def forward(self, x, r):
        y = self.ln(self.drop(x) + r)
        return y * getattr(self, "gain", 1.0)


@pytest.mark.parametrize("gain", [3.0, 2], ids=["float", "int"])
def test_an_attribute_absent_at_the_trace_and_read_with_a_default_is_seen(gain):
    """An attribute the forward reads through getattr with a default, set after a call."""
    native = _randomise(_Gain().eval())
    patched = _patched_twin(native)
    assert rewritten_forward(patched) is not None
    x, r = torch.randn(3, D), torch.randn(3, D)
    _close(patched(x, r), native(x, r))
    for model in (native, patched):
        model.gain = gain
    y_native = native(x, r)
    _close(patched(x, r), y_native)
    del native.gain, patched.gain
    _close(patched(x, r), native(x, r))


# -------------------------------------------- 6. keys without end


class _Keyed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(D)

    def forward(self, x, r, k: int = 0):
        return self.ln(self.drop(x) + r) * (k % 3 + 1)


def test_a_block_called_with_ever_new_keyword_values_keeps_a_bounded_table():
    """Calls with a distinct int keyword each time leave a bounded key table, and stay right."""
    native = _randomise(_Keyed().eval())
    patched = _patched_twin(native)
    forward = rewritten_forward(patched)
    assert forward is not None
    x, r = torch.randn(2, D), torch.randn(2, D)
    with torch.no_grad():
        expected = [native(x, r, k=k) for k in range(3)]
        for k in range(3000):
            torch.testing.assert_close(
                patched(x, r, k=k), expected[k % 3], rtol=1e-5, atol=1e-5, msg=f"k={k}"
            )
    # the bound is small and fixed (not a constant of the package): a few times MAX_TRACES
    assert len(forward._graphs) <= 4 * MAX_TRACES, len(forward._graphs)
    _close(patched(x, r, k=4000), native(x, r, k=4000))
