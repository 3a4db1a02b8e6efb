"""One autocast conversion shared by several Linears (fastlayers.ops.shared_cast): the same
values and gradients as each Linear converting its input itself, bit for bit; the gated MLP
rewrite under autocast converts its input once; calls where autocast converts nothing, traced
or transformed calls, and bad arguments."""

from __future__ import annotations

import copy
import weakref

import fastlayers.patching.rules.gated_mlp as gated_mlp_rule
import pytest
import torch
import torch.nn.functional as F
from numerics import DEVICES
from tiny_models import DECODER

import fastlayers
from fastlayers._extension import _C
from fastlayers.ops.shared_cast import autocast_dtype_for, autocast_shared_inputs

tf = pytest.importorskip("transformers")

# (input dtype, autocast dtype): float32 activations under either half autocast, and a half
# input autocast converts to the other half dtype
PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16),
]


def _mlp_step(x0, weights, upstream, device, dtype, share):
    """act(x W_g^T) * (x W_u^T) under autocast from a non-leaf x, and its gradients."""
    x = x0.clone().requires_grad_()
    h = x * 1.25  # x's producer: the gradients of both uses meet at its input
    with torch.autocast(device, dtype=dtype):
        a, b = autocast_shared_inputs(h, 2) if share else (h, h)
        y = F.silu(F.linear(a, weights[0])) * F.linear(b, weights[1])
    for w in weights:
        w.grad = None
    y.backward(upstream)
    return y, x.grad, *(w.grad for w in weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,dtype", PAIRS)
def test_shared_conversion_gives_per_use_values_and_gradients(device, x_dtype, dtype):
    if device == "cpu" and dtype == torch.float16 and x_dtype == torch.bfloat16:
        pytest.skip("CPU autocast converts to bfloat16 or float16; one pair is enough there")
    g = torch.Generator(device=device).manual_seed(7)
    x0 = torch.randn(3, 37, 96, device=device, generator=g).to(x_dtype)
    weights = [torch.randn(160, 96, device=device, generator=g).requires_grad_() for _ in "gu"]
    upstream = torch.randn(3, 37, 160, device=device, generator=g).to(dtype)
    native = _mlp_step(x0, weights, upstream, device, dtype, share=False)
    shared = _mlp_step(x0, weights, upstream, device, dtype, share=True)
    for name, n, s in zip(("y", "x.grad", "gate.grad", "up.grad"), native, shared, strict=True):
        assert s.dtype == n.dtype, name
        assert torch.equal(s, n), name


def test_outputs_share_one_storage_and_one_node():
    x = torch.randn(5, 8, requires_grad=True) * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = autocast_shared_inputs(x, 3)
    assert len(outs) == 3 and all(o.dtype == torch.bfloat16 for o in outs)
    assert len({o.data_ptr() for o in outs}) == 1
    assert len({id(o.grad_fn) for o in outs}) == 1
    assert [o.grad_fn.next_functions[0][0] for o in outs[:1]] == [x.grad_fn]
    assert torch.equal(outs[0], x.detach().to(torch.bfloat16))


def test_a_use_without_gradient_and_an_unused_output():
    x = torch.randn(4, 6, requires_grad=True)
    h = x * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, _unused = autocast_shared_inputs(h, 2)
    (a.float() * 2).sum().backward()  # b never used
    assert torch.equal(x.grad, torch.full_like(x, 6.0))


def test_in_place_change_of_a_use_is_caught_by_the_saved_inputs():
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True) * 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = autocast_shared_inputs(x, 2)
        y = F.linear(a, w)
        b.mul_(2)  # the same storage as a, which F.linear saved for w's gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_is_refused():
    x = torch.randn(4, 6, requires_grad=True) * 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = autocast_shared_inputs(x, 2)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((a.float() * b.float()).sum(), x, create_graph=True)


def test_nothing_to_share_where_autocast_converts_nothing():
    x = torch.randn(4, 6)
    assert autocast_shared_inputs(x, 2) is None  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype_for(x) is torch.bfloat16
        assert autocast_shared_inputs(x.double(), 2) is None  # autocast leaves float64
        assert autocast_shared_inputs(x.bfloat16(), 2) is None  # already the autocast dtype
        assert autocast_shared_inputs(torch.ones(3, dtype=torch.int64), 2) is None
        sub = x.as_subclass(_Sub)
        assert autocast_shared_inputs(sub, 2) is None  # a subclass: each Linear converts
        got = []
        torch.func.vmap(lambda t: got.append(autocast_shared_inputs(t, 2)) or t)(x)
        assert got == [None]  # under a torch.func transform


class _Sub(torch.Tensor):
    pass


def test_bad_arguments_are_named():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="uses must be"):
        _C.shared_cast(x, torch.bfloat16, 0)
    with pytest.raises(RuntimeError, match="floating point"):
        _C.shared_cast(x, torch.int32, 2)
    with pytest.raises(RuntimeError, match="already"):
        _C.shared_cast(x, torch.float32, 2)


def _conversion_nodes(loss: torch.Tensor) -> dict[str, int]:
    """How many nodes of each conversion kind the backward graph of ``loss`` holds."""
    seen, stack, counts = set(), [loss.grad_fn], {"ToCopyBackward0": 0, "shared": 0}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node.name()
        if name == "ToCopyBackward0":
            counts[name] += 1
        elif "SharedCastBackward" in name:
            counts["shared"] += 1
        stack.extend(n for n, _ in node.next_functions)
    return counts


@pytest.mark.parametrize("device", DEVICES)
def test_gated_mlp_under_autocast_converts_its_input_once(device, monkeypatch):
    """fp32 weights under bf16 autocast, the whole-MLP rewrite alone: one conversion of each
    MLP's input where each projection made its own, loss and every gradient bit for bit those
    of the same patch converting per projection, and on CPU those of native (on CUDA the
    gated_act kernel's own backward is within bounds of native's, tests/test_gated_act.py)."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).to(device).train()
    native = copy.deepcopy(model)
    per_use = copy.deepcopy(model)
    for m in (model, per_use):
        assert fastlayers.patch(m, layers=("gated_mlp",)).counts() == {"gated_mlp": 2}
    ids = torch.randint(1, 100, (2, 9), device=device)
    real = gated_mlp_rule.autocast_shared_inputs
    runs = []
    for m in (native, per_use, model):
        share = real if m is model else (lambda x, n: None)
        monkeypatch.setattr(gated_mlp_rule, "autocast_shared_inputs", share)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        nodes = _conversion_nodes(loss)
        loss.backward()
        runs.append((loss, nodes, {n: p.grad for n, p in m.named_parameters()}))
    (loss_n, nodes_n, grads_n), (loss_u, nodes_u, grads_u), (loss_p, nodes_p, grads_p) = runs
    layers = DECODER["num_hidden_layers"]
    assert nodes_u == nodes_n
    assert nodes_p == {"ToCopyBackward0": nodes_n["ToCopyBackward0"] - 2 * layers, "shared": layers}
    assert torch.equal(loss_p, loss_u) and torch.equal(loss_p, loss_n)
    for name, grad in grads_u.items():
        assert torch.equal(grads_p[name], grad), name
        if device == "cpu":
            assert torch.equal(grads_p[name], grads_n[name]), name


def test_gated_mlp_without_autocast_does_not_share(monkeypatch):
    calls = []
    real = gated_mlp_rule.autocast_shared_inputs
    monkeypatch.setattr(
        gated_mlp_rule, "autocast_shared_inputs", lambda x, n: calls.append(n) or real(x, n)
    )
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).train()
    fastlayers.patch(model, layers=("gated_mlp",))
    ids = torch.randint(1, 100, (2, 9))
    loss = model(input_ids=ids, labels=ids).loss
    assert calls == [2, 2]
    assert _conversion_nodes(loss)["shared"] == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_gated_mlp_under_autocast_with_gradient_checkpointing_matches_native(reentrant):
    """The recomputation in backward converts once again (its own node): loss and every
    gradient equal native's, both checkpointing kinds."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).train()
    native = copy.deepcopy(model)
    fastlayers.patch(model, layers=("gated_mlp",))
    ids = torch.randint(1, 100, (2, 9))
    runs = []
    for m in (native, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    (loss_n, grads_n), (loss_p, grads_p) = runs
    assert torch.equal(loss_p, loss_n)
    for name, grad in grads_n.items():
        assert torch.equal(grads_p[name], grad), name


def test_the_converted_input_is_freed_before_the_down_projection(monkeypatch):
    """Where no gradient is recorded (inference under autocast) the one converted copy is gone
    when the down projection runs, as autocast's per-projection copies are."""
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).eval()
    fastlayers.patch(model, layers=("gated_mlp",))
    converted, alive_at_down = [], []
    share = gated_mlp_rule.autocast_shared_inputs

    def spy(x, uses):
        out = share(x, uses)
        converted.extend(weakref.ref(t) for t in out or ())
        return out

    linear = F.linear

    def down_watch(x, weight, bias=None):
        if weight.shape[0] == DECODER["hidden_size"]:  # the down projection
            alive_at_down.append([r() is not None for r in converted])
        return linear(x, weight, bias)

    monkeypatch.setattr(gated_mlp_rule, "autocast_shared_inputs", spy)
    monkeypatch.setattr(F, "linear", down_watch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.model.layers[0].mlp(torch.randn(2, 5, DECODER["hidden_size"]))
    assert len(converted) == 2 and alive_at_down == [[False, False]]
