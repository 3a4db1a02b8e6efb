"""Block rewrites (rule residual_layer_norm): a block's own forward traced and rewritten so that
``layer_norm(dropout(x) + residual)`` calls the fused op. What is found in which architecture,
what the rewritten block keeps (class, children, Parameters, state_dict, hooks), unpatch,
idempotence, the call-key traces, wrappers (gradient checkpointing, accelerate), copies, the
runtime fallback and what is refused with a reason."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from fastlayers.patching import swap_children
from fastlayers.patching.blocks import RewrittenForward, rewritten_forward
from numerics import assert_close_to_reference
from tiny_models import (
    MODELS,
    MODULE_RULE_COUNTS,
    MODULE_RULES_ONLY,
    build,
    make_inputs,
    run,
)
from torch import nn

import fastlayers

RULE = "residual_layer_norm"


class PostNorm(nn.Module):
    """BertOutput's shape: LayerNorm(dropout(dense(h)) + residual)."""

    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.dropout = nn.Dropout(p)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dropout(self.dense(h)) + residual)


class PreNorm(nn.Module):
    """ViT's shape: the sum is the next residual (prenorm)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = h + self.dropout(self.dense(h))
        return s + self.out(self.norm(s))


class Functional(nn.Module):
    """BART's shape: F.dropout reading self.training, an optional mask argument."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.dense(h)
        if mask is not None:
            x = x * mask
        x = F.dropout(x, p=0.25, training=self.training)
        return self.norm(h + x)


def _rows(report, rule=RULE):
    return [s.name for s in report.swaps if s.rule == rule]


@pytest.mark.parametrize("name", list(MODELS))
def test_module_rules_alone_swap_what_they_swapped_before(name):
    report = fastlayers.patch(build(name), layers=MODULE_RULES_ONLY, dry_run=True)
    assert report.counts() == MODULE_RULE_COUNTS[name], str(report)


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "bert",
            [
                "encoder.layer.0.attention.output.LayerNorm",
                "encoder.layer.0.output.LayerNorm",
                "encoder.layer.1.attention.output.LayerNorm",
                "encoder.layer.1.output.LayerNorm",
            ],
        ),
        ("gpt2", ["h.0.ln_2", "h.1.ln_2"]),
        ("vit", ["layers.0.layernorm_after", "layers.1.layernorm_after"]),  # dropout called twice
        (
            "distilbert",
            [
                "transformer.layer.0.sa_layer_norm",
                "transformer.layer.0.output_layer_norm",
                "transformer.layer.1.sa_layer_norm",
                "transformer.layer.1.output_layer_norm",
            ],
        ),
        ("bart", ["decoder.layers.0.self_attn_layer_norm", "decoder.layers.0.final_layer_norm"]),
        ("opt", []),
    ],
)
def test_what_each_architecture_gets(name, expected):
    report = fastlayers.patch(build(name), dry_run=True)
    assert _rows(report) == expected, str(report)
    if name == "bart":  # the encoder layer's forward branches on a tensor's dtype
        assert any(
            s.rule == RULE and s.name == "encoder.layers.0" and "trace" in s.reason
            for s in report.skips
        ), str(report)


@pytest.mark.parametrize("training", [False, True])
def test_rewritten_block_keeps_everything_and_unpatches(training):
    torch.manual_seed(0)
    block = PostNorm().train(training)
    hook_calls = []
    block.register_forward_hook(lambda m, a, o: hook_calls.append(o.shape))
    params = dict(block.named_parameters())
    keys = list(block.state_dict())
    children = dict(block.named_children())
    h, r = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    with torch.no_grad():
        native = block.eval()(h, r)
    block.train(training)

    report = fastlayers.patch(block)
    assert report.counts() == {RULE: 1}, str(report)
    assert type(block) is PostNorm and isinstance(block.__dict__["forward"], RewrittenForward)
    assert dict(block.named_children()) == children  # the LayerNorm was claimed, not swapped
    assert all(p is params[n] for n, p in block.named_parameters())
    assert list(block.state_dict()) == keys
    assert fastlayers.patch(block).num_swapped == 0  # a second patch changes nothing

    block.eval()
    with torch.no_grad():
        fused = block(h, r)
    assert hook_calls, "the block's own forward hook did not run"
    torch.testing.assert_close(fused, native, rtol=1e-5, atol=1e-5)

    assert fastlayers.unpatch(block) == 1
    assert "forward" not in block.__dict__
    with torch.no_grad():
        assert torch.equal(block(h, r), native)


def test_outputs_and_gradients_match_native_in_float64_terms():
    torch.manual_seed(0)
    for cls, args in ((PostNorm, 2), (PreNorm, 1), (Functional, 1)):
        block = cls().eval()
        inputs = [torch.randn(4, 7, 16, requires_grad=True) for _ in range(args)]
        reference = copy.deepcopy(block).double()
        ref = reference(*[x.detach().double() for x in inputs])
        native = block(*inputs)
        native_grads = torch.autograd.grad(native.sum(), [*inputs, *block.parameters()])
        fastlayers.patch(block)
        assert rewritten_forward(block) is not None, cls.__name__
        fused = block(*inputs)
        grads = torch.autograd.grad(fused.sum(), [*inputs, *block.parameters()])
        assert_close_to_reference(fused, native, ref, torch.float32, cls.__name__)
        for g, n in zip(grads, native_grads, strict=True):
            torch.testing.assert_close(g, n, rtol=1e-4, atol=1e-5)


def test_training_draws_a_mask_and_eval_does_not():
    block = Functional().train()
    fastlayers.patch(block)
    h = torch.randn(64, 16)
    with torch.no_grad():
        torch.manual_seed(3)
        a = block(h)
        torch.manual_seed(3)
        b = block(h)
        c = block(h)
        block.eval()
        state = torch.get_rng_state()
        e = block(h)
        assert torch.equal(torch.get_rng_state(), state)  # eval draws nothing
    assert torch.equal(a, b) and not torch.equal(b, c)  # seeded, and a fresh mask per call
    with torch.no_grad():
        ref = F.layer_norm(h + block.dense(h), (16,), block.norm.weight, block.norm.bias)
    torch.testing.assert_close(e, ref)
    keys = {k[0] for k in rewritten_forward(block)._graphs}
    assert keys == {False, True}  # one trace per self.training


def test_call_keys_trace_each_argument_structure():
    block = Functional().eval()
    fastlayers.patch(block)
    h, mask = torch.randn(2, 3, 16), torch.rand(2, 3, 16)
    native = copy.deepcopy(block)
    fastlayers.unpatch(native)
    with torch.no_grad():
        torch.testing.assert_close(block(h), native(h))
        torch.testing.assert_close(block(h, mask), native(h, mask))
        torch.testing.assert_close(block(h, mask=mask), native(h, mask=mask))
    graphs = rewritten_forward(block)._graphs
    assert len(graphs) == 3 and all(fn is not None for fn in graphs.values())


def test_model_apply_swap_children_rewrites_blocks():
    model = build("bert")
    inputs = make_inputs("ids", "cpu")
    native = run(model, inputs)
    model.apply(swap_children)
    # four residual LayerNorm blocks, two attentions routed (varlen_attention)
    assert sum(rewritten_forward(m) is not None for m in model.modules()) == 6
    torch.testing.assert_close(run(model, inputs), native, rtol=1e-5, atol=1e-5)
    assert fastlayers.unpatch(model) >= 6
    assert not any(rewritten_forward(m) for m in model.modules())


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "distilbert", "bart"])
def test_patched_models_match_native(name):
    model = build(name)
    inputs = make_inputs(MODELS[name][2], "cpu")
    reference = copy.deepcopy(model).double()
    ref_inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    y_ref, y_native = run(reference, ref_inputs), run(model, inputs)
    fastlayers.patch(model)
    assert_close_to_reference(run(model, inputs), y_native, y_ref, torch.float32, name)


def test_deepcopy_and_pickle_carry_the_rewrite_to_the_copy():
    block = PostNorm().eval()
    fastlayers.patch(block)
    h, r = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        expected = block(h, r)
    for twin in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
        forward = rewritten_forward(twin)
        assert forward is not None and forward.block is twin
        with torch.no_grad():
            twin.dense.weight.mul_(2)  # the copy computes with its own Parameters
            assert not torch.allclose(twin(h, r), expected)
            twin.dense.weight.div_(2)
            torch.testing.assert_close(twin(h, r), expected)
        assert fastlayers.unpatch(twin) == 1 and "forward" not in twin.__dict__


def test_gradient_checkpointing_wrapper_keeps_working():
    model = build("vit").train()
    model.gradient_checkpointing_enable()
    fastlayers.patch(model)
    layer = next(m for m in model.modules() if type(m).__name__ == "ViTLayer")
    assert rewritten_forward(layer) is not None
    pixels = make_inputs("pixels", "cpu")["pixel_values"].requires_grad_()
    calls = []
    layer._gradient_checkpointing_func = lambda fn, *a: calls.append(1) or fn(*a)
    model(pixel_values=pixels).last_hidden_state.sum().backward()
    assert calls, "the checkpointing wrapper did not run around the rewritten forward"
    assert pixels.grad is not None and torch.isfinite(pixels.grad).all()


def test_accelerate_hook_wraps_the_rewritten_forward():
    from accelerate.hooks import ModelHook, add_hook_to_module

    seen = []

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(1)
            return args, kwargs

    block = PostNorm().eval()
    add_hook_to_module(block, Count())
    h, r = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        native = block(h, r)
    fastlayers.patch(block)
    assert isinstance(block.__dict__["_old_forward"], RewrittenForward)
    with torch.no_grad():
        torch.testing.assert_close(block(h, r), native)
    assert len(seen) == 2
    fastlayers.unpatch(block)
    assert not isinstance(block.__dict__["_old_forward"], RewrittenForward)
    with torch.no_grad():
        assert torch.equal(block(h, r), native)


def test_later_swap_of_a_child_is_seen_by_the_rewritten_forward():
    block = PostNorm().eval()
    fastlayers.patch(block)
    h, r = torch.randn(2, 16), torch.randn(2, 16)
    block.dense = nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(block(h, r), block.norm(h + r))


def test_runtime_fallback_is_native_and_warned():
    block = PostNorm().eval()
    fastlayers.patch(block)
    h, r = torch.randn(2, 3, 16), torch.randn(16)  # a broadcasting residual
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = block(h, r)
        expected = block.norm(block.dense(h) + r)
    assert torch.equal(out, expected)
    assert any("broadcast" in str(w.message) for w in caught)


class UsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x, r):
        return self.norm(x + r) + self.norm(r)


class SumUsedFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x, r):
        s = x + r
        t = s * 2
        return self.norm(s) + t


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x, r):
        s = x + r
        y = self.norm(s)
        s.mul_(2)
        return y + s


@pytest.mark.parametrize(
    "make, reason",
    [
        (UsedTwice, "called more than once"),
        (SumUsedFirst, "used before the LayerNorm"),
        (InPlace, "modified in place"),
    ],
)
def test_unsafe_patterns_are_skipped_with_the_reason(make, reason):
    report = fastlayers.patch(make(), dry_run=True)
    assert RULE not in report.counts()
    assert any(s.rule == RULE and reason in s.reason for s in report.skips), str(report)


def test_hooks_on_the_layer_norm_or_dropout_mean_skip():
    for attr in ("norm", "dropout"):
        block = PostNorm()
        getattr(block, attr).register_forward_hook(lambda *a: None)
        report = fastlayers.patch(block, dry_run=True)
        if attr == "norm":
            assert RULE not in report.counts()
            assert any("hooks" in s.reason for s in report.skips if s.rule == RULE)
        else:  # the dropout stays a module call; add + LayerNorm still fuse
            fastlayers.patch(block)
            assert rewritten_forward(block) is not None


def test_layers_selects_the_rule_and_the_layer_norm_is_swapped_without_it():
    model = build("bert")
    only = fastlayers.patch(copy.deepcopy(model), layers=[RULE], dry_run=True)
    assert only.counts() == {RULE: 4}
    without = fastlayers.patch(model, layers=MODULE_RULES_ONLY)
    assert without.counts()["layer_norm"] == 5 and RULE not in without.counts()


def test_check_compares_each_rewritten_block():
    model = build("bert")
    report = fastlayers.check(model, make_inputs("ids", "cpu"), runs=1, warmup=0)
    blocks = [layer for layer in report.layers if layer.fused == "dropout_add_layer_norm"]
    assert len(blocks) == 4 and all(layer.passed for layer in blocks), str(report)
    assert report.passed, str(report)


@pytest.mark.parametrize("mode", ["inductor", "fused"])
def test_compiles_without_graph_breaks(mode):
    block = PreNorm().eval()
    fastlayers.patch(block)
    h = torch.randn(4, 16)
    with torch.no_grad():
        expected = block(h)
    with fastlayers.config.compile_residual_layer_norm_as(mode):
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(h), expected, rtol=1e-5, atol=1e-5)


def test_compiled_block_traces_the_class_forward_as_it_is_now():
    """Under torch.compile (the default "inductor" setting) a rewritten block compiles its class
    forward, called as native's module call calls it: a forward the class was given after the
    patch and after eager calls (which built the rewrite's chain) is what gets compiled, as for
    an unpatched module; the eager calls keep their guard (the rewrite is rebuilt)."""

    class Decorated(PreNorm):
        pass

    block = Decorated().eval()
    fastlayers.patch(block)
    h = torch.randn(4, 16)
    with torch.no_grad():
        block(h)  # eager: the chain around the rewrite is built
    seen = []

    def changed(self, x):
        seen.append(torch.compiler.is_compiling())
        return PreNorm.forward(self, x) * 2

    Decorated.forward = changed
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(h)
        torch.testing.assert_close(out, changed(block, h), rtol=1e-6, atol=1e-6)
    assert seen[0] is True  # traced by dynamo, not run eagerly


def test_a_rewritten_root_module_exports_and_is_checked_as_the_root():
    """The root module's own forward rewritten: torch.export reads its forward's __code__ (the
    class forward's), and fastlayers.check names the block '(root)'."""
    block = PostNorm().eval()
    assert fastlayers.patch(block).counts() == {RULE: 1}
    h, r = torch.randn(3, 16), torch.randn(3, 16)
    program = torch.export.export(block, (h, r))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(h, r), block(h, r), rtol=1e-5, atol=1e-5)
    report = fastlayers.check(PostNorm(), (h, r), runs=1, warmup=0)
    assert [layer.name for layer in report.layers] == ["(root)"], str(report)
    assert report.passed, str(report)


# ------------------------------------------------------------------ object arguments (caches)


class Cache:
    """Stands for a transformers Cache: an object passed to a block on every call."""

    def __init__(self) -> None:
        self.seen = 0

    def update(self, t: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return t * 2.0


class OtherCache(Cache):
    pass


class CacheBlock(nn.Module):
    """A decoder layer's shape: a cache object handed to the block, used by its own code."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        x = self.dense(h)
        if isinstance(cache, OtherCache):  # taken only for that class: traced per class
            x = x * -1.0
        if cache is not None:
            x = cache.update(x)
        return self.norm(x + h)


class TruthyCacheBlock(CacheBlock):
    def forward(self, h: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        x = self.dense(h)
        if cache:  # needs the object's value: cannot be traced
            x = x + 1.0
        return self.norm(x + h)


def _fused_calls(monkeypatch) -> list:
    from fastlayers.patching.rules import residual_layer_norm as block

    calls = []
    original = block.dropout_add_layer_norm_forward

    def spy(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(block, "dropout_add_layer_norm_forward", spy)
    return calls


def test_object_arguments_are_passed_through_and_traced_per_class(monkeypatch):
    """A cache object argument no longer sends the call to the original forward: the trace
    takes it as an input whose class isinstance sees, the block's calls on it run on the real
    object, and each class gets its own trace."""
    torch.manual_seed(0)
    native = CacheBlock().eval()
    patched = copy.deepcopy(native)
    assert fastlayers.patch(patched, layers=(RULE,)).counts() == {RULE: 1}
    calls = _fused_calls(monkeypatch)
    h = torch.randn(3, 16)
    for cache_cls in (Cache, OtherCache, Cache):
        c_native, c_patched = cache_cls(), cache_cls()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no native fallback
            want, got = native(h, c_native), patched(h, c_patched)
        assert torch.equal(got, want), cache_cls.__name__
        assert c_patched.seen == c_native.seen == 1
    assert len(calls) == 3
    keys = rewritten_forward(patched)._graphs
    assert len([k for k in keys if k is not None]) >= 3  # default key, Cache, OtherCache


def test_object_needing_its_value_runs_the_original_forward(monkeypatch):
    torch.manual_seed(0)
    native = TruthyCacheBlock().eval()
    patched = copy.deepcopy(native)
    fastlayers.patch(patched, layers=(RULE,))
    calls = _fused_calls(monkeypatch)
    h = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(patched(h, Cache()), native(h, Cache()))
        assert calls == []  # untraceable with an object: the original forward ran
        assert torch.equal(patched(h), native(h))
    assert calls == [1]


def test_gpt2_with_its_cache_runs_the_fused_op(monkeypatch):
    """GPT-2 passes a DynamicCache to every block whenever use_cache is on (its default, in
    training too): those calls take the fused op, and cached generation matches native."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=90, n_positions=32)
    native = tf.GPT2LMHeadModel(config).eval()
    patched = copy.deepcopy(native)
    fastlayers.patch(patched, layers=(RULE,))
    calls = _fused_calls(monkeypatch)
    ids = torch.randint(0, 90, (2, 7))
    with torch.no_grad():
        want = native(input_ids=ids, use_cache=True).logits
        got = patched(input_ids=ids, use_cache=True).logits
    assert torch.equal(got, want)
    assert len(calls) == 2  # one fused LayerNorm per block, two blocks
    gen = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids, **gen), native.generate(ids, **gen))


def test_first_call_trace_keeps_nothing_of_the_caller_alive(monkeypatch):
    """The first call of a new call key traces the forward; torch.fx's tuple unpacking of a
    proxy keeps its stack in a reference cycle, which held the caller's cache and tensors until
    the cyclic collector ran (a step later on an H100). Traced on its own thread, nothing of the
    call outlives it: with the collector off, the cache and the input die with their last
    reference."""
    import gc
    import weakref

    import transformers as tf
    import transformers.cache_utils as cache_utils

    caches = []
    original_init = cache_utils.DynamicCache.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", tracking_init)
    torch.manual_seed(0)
    config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=90, n_positions=32)
    model = tf.GPT2LMHeadModel(config).eval()
    fastlayers.patch(model, layers=(RULE,))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(2):  # the first call traces, the second reuses the trace
            caches.clear()
            ids = torch.randint(0, 90, (2, 7))
            ids_ref = weakref.ref(ids)
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
            del out, ids
            assert len(caches) == 1 and caches[0]() is None
            assert ids_ref() is None
    finally:
        if was_enabled:
            gc.enable()
