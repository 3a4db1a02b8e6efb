"""The patcher rule linear_relu (a Linear / Conv1D whose only consumer is a ReLU child becomes a
FusedLinearReLU), Linear look-alikes (nn.Linear subclasses whose forward computes F.linear, as
Falcon's FalconLinear) for both pair rules, and pairs found by trace.py's tracer where plain
torch.fx fails (OPTDecoderLayer): on plain stacks and tiny random-weight HuggingFace models
(built from configs, no downloads)."""

import copy
import pickle
import types

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from fastlayers.patching import FusedAway, plan
from fastlayers.patching.discover import find_linear_act
from tiny_models import build, hf_reinitialised_state, make_inputs, run
from torch import nn

import fastlayers
from fastlayers import FusedLinearGELU, FusedLinearReLU, ReLUScale

# The default rules but mlp: Linear -> ReLU -> Linear (these stacks, OPT, T5) is rule mlp's
# (tests/test_mlp_rule.py); without it the pair rules fuse each Linear + ReLU as before.
PAIRS = tuple(rule for rule in fastlayers.patching.DEFAULT_LAYERS if rule != "mlp")


def _reasons(report) -> dict[str, str]:
    return {s.name: s.reason for s in report.skips}


def _chain():
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8)
    ).eval()


class LinearLookalike(nn.Linear):
    """Falcon's FalconLinear: an nn.Linear subclass whose forward is ``x @ W.T + b``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ScaledLinear(nn.Linear):
    """An nn.Linear subclass computing something else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 2.0


# -- plain stacks ---------------------------------------------------------------------------


def test_sequential_chain_gets_every_pair_with_identical_outputs_and_gradients():
    model = _chain()
    weight, bias = model[0].weight, model[2].bias
    x = torch.randn(5, 16)
    y = model(x)
    report = fastlayers.patch(model, layers=PAIRS)
    assert report.counts() == {"linear_relu": 2}, str(report)
    assert [type(m) for m in model] == [FusedLinearReLU, FusedAway] * 2 + [nn.Linear]
    assert model[0].weight is weight and model[2].bias is bias  # no copy
    assert {s.name: s.fused for s in report.swaps} == {
        "0": "FusedLinearReLU",
        "2": "FusedLinearReLU",
    }
    assert "Linear + ReLU (1)" in str(report)
    # the CPU op is F.relu(F.linear(...)): bit-identical in float32
    assert torch.equal(model(x), y)

    native = _chain()
    native.load_state_dict(model.state_dict())
    x = torch.randn(5, 16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for m, xi in zip((model, native), xs, strict=True):
        m(xi).pow(2).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)
    # the fused backward sums the bias gradient in its own (deterministic) order: an ulp apart
    for (name, p), q in zip(model.named_parameters(), native.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_inplace_relu_is_fused_the_same_way():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    y = model(x)
    assert fastlayers.patch(model, layers=PAIRS).counts() == {"linear_relu": 1}
    assert isinstance(model[0], FusedLinearReLU) and isinstance(model[1], FusedAway)
    assert torch.equal(model(x), y)
    fastlayers.unpatch(model)
    assert type(model[1]) is nn.ReLU and model[1].inplace


def test_a_module_computing_relu_is_recognised_by_what_it_computes():
    class ClampReLU(nn.Module):
        def forward(self, x):
            return torch.clamp(x, min=0)

    model = nn.Sequential(nn.Linear(8, 16), ClampReLU())
    assert fastlayers.patch(model).counts() == {"linear_relu": 1}

    class LeakyReLUish(nn.Module):
        def forward(self, x):
            return F.leaky_relu(x, 0.01)

    model = nn.Sequential(nn.Linear(8, 16), LeakyReLUish())
    report = fastlayers.patch(model)
    assert report.num_swapped == 0 and "LeakyReLUish" in _reasons(report)["0"]


def test_bare_relu_stays_native_by_default():
    """Rule 'relu' (ReLUScale(1) for a bare nn.ReLU) measured no faster: only when named."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.ReLU())
    report = fastlayers.patch(model)
    assert report.counts() == {"linear_relu": 1}, str(report)
    assert type(model[2]) is nn.ReLU
    assert "relu" not in fastlayers.patching.DEFAULT_LAYERS


def test_relu_claimed_by_the_pair_is_not_swapped_by_the_relu_rule():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.ReLU())
    report = fastlayers.patch(model, layers=fastlayers.patching.ALL_LAYERS)
    # the fused pair's ReLU is gone; the second ReLU (fed by a ReLU) is swapped one for one
    assert report.counts() == {"linear_relu": 1, "relu": 1}, str(report)
    assert isinstance(model[1], FusedAway) and isinstance(model[2], ReLUScale)


def test_hooked_relu_is_skipped_and_swapped_one_for_one():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    report = fastlayers.patch(model, layers=fastlayers.patching.ALL_LAYERS)
    assert "activation has forward hooks" in _reasons(report)["0"]
    assert report.counts() == {"relu": 1}  # the relu rule keeps the hook running
    assert type(model[0]) is nn.Linear and isinstance(model[1], ReLUScale)
    model(torch.randn(2, 8))
    assert seen == [torch.Size([2, 16])]


def test_hooked_linear_is_skipped_with_the_reason():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model[0].register_forward_hook(lambda m, i, o: None)
    report = fastlayers.patch(model, layers=("linear_relu",))
    assert report.num_swapped == 0
    reason = _reasons(report)["0"]
    assert "Linear has forward hooks" in reason and "activation's output" in reason
    assert report.skips[0].rule == "linear_relu"


def test_relu_used_twice_or_linear_output_used_twice_is_not_fused():
    class SharedReLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            return self.act(self.fc1(x)) + self.act(self.fc2(x))

    class PreActivationUsed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            h = self.fc(x)
            return self.act(h) + h

    for model in (SharedReLU(), PreActivationUsed()):
        x = torch.randn(3, 8)
        y = model(x)
        report = fastlayers.patch(model, layers=("linear_relu",))
        assert report.num_swapped == 0, str(report)
        assert not any(isinstance(m, (FusedLinearReLU, FusedAway)) for m in model.modules())
        assert torch.equal(model(x), y)


def test_layers_select_between_the_two_pair_rules():
    def stack():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.GELU())

    only_gelu = stack()
    report = fastlayers.patch(only_gelu, layers=("linear_gelu",))
    assert report.counts() == {"linear_gelu": 1}
    assert type(only_gelu[0]) is nn.Linear and type(only_gelu[1]) is nn.ReLU  # as before
    reason = _reasons(report)["0"]
    assert "not GELU" in reason and "'linear_relu' is not in layers" in reason
    # with the one-for-one relu rule (the pre-linear_relu rule set), the ReLU is swapped alone
    report = fastlayers.patch(stack(), layers=("linear_gelu", "relu"))
    assert report.counts() == {"linear_gelu": 1, "relu": 1}

    only_relu = stack()
    report = fastlayers.patch(only_relu, layers=("linear_relu",))
    assert report.counts() == {"linear_relu": 1}
    reason = _reasons(report)["2"]
    assert "not ReLU" in reason and "'linear_gelu' is not in layers" in reason
    assert type(only_relu[2]) is nn.Linear and type(only_relu[3]) is nn.GELU


def test_dry_run_unpatch_double_patch_deepcopy_and_pickle():
    model = _chain()
    natives = {name: m for name, m in model.named_children()}
    before = [type(m) for m in model.modules()]
    x = torch.randn(4, 16)
    y = model(x)
    dry = fastlayers.patch(model, dry_run=True, layers=PAIRS)
    assert dry.counts() == {"linear_relu": 2} and [type(m) for m in model.modules()] == before
    fastlayers.patch(model, layers=PAIRS)
    assert fastlayers.patch(model).num_swapped == 0  # idempotent (with mlp too: pairs fused)

    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(clone[0], FusedLinearReLU) and torch.equal(clone(x), y)
        assert fastlayers.patch(clone).num_swapped == 0
        # the records found on the copy again: what check and unpatch iterate
        assert [r.rule for r in plan.applied_rewrites(clone)] == ["linear_relu"] * 2
        assert fastlayers.unpatch(clone) == 4
        assert [type(m) for m in clone.modules()] == before and torch.equal(clone(x), y)

    assert fastlayers.unpatch(model) == 4  # two Linears, two ReLUs
    assert all(m is natives[name] for name, m in model.named_children())
    assert torch.equal(model(x), y)


def test_check_passes_and_compares_each_fused_pair():
    model = _chain()
    report = fastlayers.check(model, torch.randn(6, 16), layers=PAIRS, runs=1, warmup=0)
    assert report.passed, str(report)
    assert report.patch.counts() == {"linear_relu": 2}
    assert sorted(layer.name for layer in report.layers) == ["0", "2"], str(report)
    assert all(layer.fused == "FusedLinearReLU" and layer.passed for layer in report.layers)


# -- Linear look-alikes ---------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_linear_lookalike_is_fused_and_unpatched_to_itself(act, bias):
    lookalike = LinearLookalike(8, 16, bias=bias)
    weight = lookalike.weight
    model = nn.Sequential(lookalike, nn.ReLU() if act == "relu" else nn.GELU()).eval()
    x = torch.randn(3, 8, requires_grad=True)
    y = model(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    report = fastlayers.patch(model)
    rule, fused_type = (
        ("linear_relu", FusedLinearReLU) if act == "relu" else ("linear_gelu", FusedLinearGELU)
    )
    assert report.counts() == {rule: 1}, str(report)
    assert isinstance(model[0], fused_type) and not model[0].weight_transposed
    assert model[0].weight is weight
    assert report.swaps[0].native.startswith("LinearLookalike + ")
    y2 = model(x)
    torch.testing.assert_close(y2, y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(y2.sum(), x)[0], gx, rtol=1e-6, atol=1e-6)
    fastlayers.unpatch(model)
    assert model[0] is lookalike


def test_linear_subclass_computing_something_else_is_refused():
    for act in (nn.ReLU(), nn.GELU()):
        model = nn.Sequential(ScaledLinear(8, 16), act)
        x = torch.randn(3, 8)
        y = model(x)
        report = fastlayers.patch(model, layers=("linear_gelu", "linear_relu"))
        assert report.num_swapped == 0, str(report)
        assert "ScaledLinear has its own forward" in _reasons(report)["0"]
        assert torch.equal(model(x), y)


def test_falcon_mlp_linear_lookalike_is_fused():
    config = tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = tf.FalconModel(config).eval()
    inputs = make_inputs("ids", "cpu")
    y = run(model, inputs)
    natives = [layer.mlp.dense_h_to_4h for layer in model.h]
    weights = [native.weight for native in natives]
    mlps = fastlayers.patch(copy.deepcopy(model), dry_run=True)  # FalconMLP: rule mlp's
    assert [s.native for s in mlps.swaps if s.rule == "mlp"] == [
        "FalconLinear + GELUActivation + FalconLinear"
    ] * 2, str(mlps)
    report = fastlayers.patch(model, layers=PAIRS)
    assert report.counts().get("linear_gelu") == 2, str(report)
    for layer, weight in zip(model.h, weights, strict=True):
        assert isinstance(layer.mlp.dense_h_to_4h, FusedLinearGELU)
        assert layer.mlp.dense_h_to_4h.weight is weight
    torch.testing.assert_close(run(model, inputs), y, rtol=1e-4, atol=1e-5)
    fastlayers.unpatch(model)
    assert [layer.mlp.dense_h_to_4h for layer in model.h] == natives


# -- tiny HuggingFace models ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["opt", "t5"])
def test_hf_relu_models_fuse_each_ffn_with_identical_outputs_and_gradients(name):
    model = build(name)
    native = copy.deepcopy(model)
    inputs = make_inputs("seq2seq" if name == "t5" else "ids", "cpu")
    report = fastlayers.patch(model, layers=("linear_relu",))
    assert report.counts() == {"linear_relu": 2}, str(report)
    fused = [m for m in model.modules() if isinstance(m, FusedLinearReLU)]
    assert len(fused) == 2 and not any(isinstance(m, nn.ReLU) for m in model.modules())
    assert torch.equal(run(model, inputs), run(native, inputs))

    outs = []
    for m in (model, native):
        out = m(**inputs).last_hidden_state
        out.pow(2).sum().backward()
        outs.append(dict(m.named_parameters()))
    for key, p in outs[1].items():  # bias gradients summed in another order: ulps apart
        torch.testing.assert_close(outs[0][key].grad, p.grad, rtol=1e-5, atol=1e-7, msg=key)


def test_opt_decoder_layer_pairs_are_found_by_the_tracer():
    layer = build("opt").decoder.layers[0]
    pairs, why = find_linear_act(layer)
    assert why is None and [(p.linear, p.activation, p.unproven) for p in pairs] == [
        ("fc1", "activation_fn", None)
    ]
    assert pairs[0].how == "traced (default call)"


def test_gpt2_with_relu_fuses_conv1d_and_relu():
    model = tf.GPT2Model(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, activation_function="relu"))
    model.eval()
    inputs = make_inputs("ids", "cpu")
    y = run(model, inputs)
    report = fastlayers.patch(model, layers=PAIRS)
    assert report.counts()["linear_relu"] == 2, str(report)
    fused = model.h[0].mlp.c_fc
    assert isinstance(fused, FusedLinearReLU) and fused.weight_transposed
    torch.testing.assert_close(run(model, inputs), y, rtol=1e-5, atol=1e-5)


def test_hf_initialisation_reaches_fused_linear_relu():
    native = build("opt")
    patched = copy.deepcopy(native)
    assert fastlayers.patch(patched, layers=PAIRS).counts()["linear_relu"] == 2
    expected, got = hf_reinitialised_state(native), hf_reinitialised_state(patched)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    fc1 = patched.decoder.layers[0].fc1
    assert isinstance(fc1, FusedLinearReLU) and not torch.all(fc1.weight == 3.0)


# -- pairs found by the tracer of one call: proven from the source, or skipped ---------------


class FlagProven(nn.Module):
    """Plain fx cannot trace ``if scale:``; the pre-activation value is gone after the ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)

    def forward(self, x, scale=False):
        h = self.fc1(x)
        h = self.act(h)
        if scale:
            h = h * 2.0
        return self.fc2(h)


class FlagLeaks(FlagProven):
    """Another call (``return_pre=True``) also returns the Linear's output: not fusable."""

    def forward(self, x, return_pre=False):
        h = self.fc1(x)
        out = self.act(h)
        if return_pre:
            return out, h
        return out


def test_pair_traced_for_one_call_is_fused_only_when_the_source_proves_it():
    proven = FlagProven()
    x = torch.randn(3, 8)
    expected = [proven(x), proven(x, scale=True)]
    report = fastlayers.patch(proven, layers=PAIRS)
    assert report.counts() == {"linear_relu": 1}, str(report)
    assert find_linear_act(FlagProven())[0][0].how == "traced (default call)"
    assert torch.equal(proven(x), expected[0]) and torch.equal(proven(x, True), expected[1])

    leaks = FlagLeaks()
    out, pre = leaks(x, return_pre=True)
    report = fastlayers.patch(leaks, layers=("linear_relu",))
    assert report.num_swapped == 0, str(report)
    assert "default call only" in _reasons(report)["fc1"]
    out2, pre2 = leaks(x, return_pre=True)
    assert torch.equal(pre2, pre) and torch.equal(out2, out)


def test_module_whose_forward_was_replaced_on_the_instance_is_left_alone():
    model = FlagProven()

    def forward(self, x):
        h = self.fc1(x)
        return self.act(h) - h  # not what the class forward computes

    model.forward = types.MethodType(forward, model)
    x = torch.randn(3, 8)
    y = model(x)
    report = fastlayers.patch(model, layers=("linear_relu",))
    assert report.num_swapped == 0
    assert "replaced on the instance" in _reasons(report)["(root)"]
    assert torch.equal(model(x), y)
