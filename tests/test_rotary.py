"""The rotary embedding op (CPU: the models' own op sequences, bit for bit, forward and backward)
and rule rotary: each family's apply_rotary_pos_emb recognised by probes and routed per model
instance, generation with a KV cache, padding and packed sequences, training, changes after the
patch, unpatch, copies, torch.compile. The CUDA kernels' tests are test_rotary_cuda.py."""

from __future__ import annotations

import copy
import importlib
import pickle
import warnings

import pytest
import torch
from fastlayers.patching.routes import RoutedForward
from fastlayers.patching.rules import rotary as rule
from tiny_models import DECODER

import fastlayers
from fastlayers.ops import rotary as R

tf = pytest.importorskip("transformers")

# family module -> the form its apply_rotary_pos_emb computes
FORMS = {
    "llama": 0,
    "mistral": 0,
    "qwen2": 0,
    "qwen3": 0,
    "gemma": 0,
    "gemma2": 0,
    "gemma3": 0,
    "granite": 0,
    "phi3": R.PARTIAL,
    "gpt_neox": R.PARTIAL,
    "olmo2": R.CAST_BACK,
    "cohere": R.INTERLEAVED | R.UPCAST | R.CAST_BACK,
    "modernbert": R.UPCAST | R.UPCAST_EACH | R.CAST_BACK,
}

PAIRINGS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float64, torch.float64),
]


def _function(family: str, name: str = "apply_rotary_pos_emb"):
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


def _qkcs(q_dtype, cos_dtype, b=2, s=5, h=4, hk=2, d=16, rotary=None, batch_cos=True):
    q = torch.randn(b, s, h * d, dtype=q_dtype).view(b, s, h, d).transpose(1, 2)
    k = torch.randn(b, s, hk * d, dtype=q_dtype).view(b, s, hk, d).transpose(1, 2)
    rotary = rotary or d
    cos = torch.randn(b if batch_cos else 1, s, rotary, dtype=cos_dtype)
    sin = torch.randn(b if batch_cos else 1, s, rotary, dtype=cos_dtype)
    return q.requires_grad_(), k.requires_grad_(), cos, sin


def _grads(outputs, inputs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gs = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, inputs, gs, allow_unused=True)


# ------------------------------------------------------------------ the op


@pytest.mark.parametrize("family", list(FORMS))
@pytest.mark.parametrize("pairing", PAIRINGS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("batch_cos", [True, False])
def test_op_is_the_family_function_bit_for_bit(family, pairing, batch_cos):
    form, fn = FORMS[family], _function(family)
    rotary = 8 if form & R.PARTIAL else None
    q, k, cos, sin = _qkcs(*pairing, rotary=rotary, batch_cos=batch_cos)
    native = fn(q, k, cos, sin)
    fused = R.rotary_embedding(q, k, cos, sin, 1, form)
    for n, f in zip(native, fused, strict=True):
        assert f.dtype == n.dtype and f.shape == n.shape and f.stride() == n.stride()
        assert torch.equal(f, n)
    for n, f in zip(_grads(native, (q, k)), _grads(fused, (q, k)), strict=True):
        assert f.dtype == n.dtype and torch.equal(f, n)


def test_op_heads_third_layout_and_odd_sizes():
    fn = _function("llama")
    for s, d in ((1, 8), (7, 24), (33, 64)):
        q = torch.randn(2, s, 3, d, requires_grad=True)
        k = torch.randn(2, s, 1, d, requires_grad=True)
        cos, sin = torch.randn(2, s, d), torch.randn(2, s, d)
        native, fused = fn(q, k, cos, sin, unsqueeze_dim=2), R.rotary_embedding(q, k, cos, sin, 2)
        assert all(torch.equal(a, b) for a, b in zip(native, fused, strict=True))
        gn, gf = _grads(native, (q, k)), _grads(fused, (q, k))
        assert all(torch.equal(a, b) for a, b in zip(gn, gf, strict=True))


def test_op_empty_and_inputs_left_unwritten():
    q, k, cos, sin = _qkcs(torch.float32, torch.float32, s=0)
    a, b = R.rotary_embedding(q, k, cos, sin)
    assert a.shape == q.shape and b.shape == k.shape
    q, k, cos, sin = _qkcs(torch.bfloat16, torch.bfloat16)
    before = q.detach().clone(), k.detach().clone()
    R.rotary_embedding(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_calls_the_node_does_not_cover_compute_natively():
    fn = _function("llama")
    # cos and sin requiring grad: native autograd, their grads included
    q, k, cos, sin = _qkcs(torch.float32, torch.float32)
    cos.requires_grad_(), sin.requires_grad_()
    gn = _grads(fn(q, k, cos, sin), (q, k, cos, sin))
    gf = _grads(R.rotary_embedding(q, k, cos, sin), (q, k, cos, sin))
    assert all(torch.equal(a, b) for a, b in zip(gn, gf, strict=True))
    # q and k of two dtypes, cos and sin of two dtypes: promoted as the model's ops promote
    q, k, cos, sin = _qkcs(torch.float32, torch.float32)
    k2, sin2 = k.detach().bfloat16(), sin.double()
    for args in ((q, k2, cos, sin), (q, k, cos, sin2)):
        native, fused = fn(*args), R.rotary_embedding(*args)
        assert all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(native, fused, strict=True)
        )


def test_bad_arguments_are_named():
    q, k, cos, sin = (t.detach() for t in _qkcs(torch.float32, torch.float32))
    with pytest.raises(ValueError, match="form must be"):
        R.rotary_fwd(q, k, cos, sin, 1, 99)
    with pytest.raises(IndexError, match="unsqueeze_dim must be"):
        R.rotary_fwd(q, k, cos, sin, 7, 0)
    with pytest.raises(RuntimeError, match="q must be float32"):
        R.rotary_fwd(q.int(), k.int(), cos, sin, 1, 0)
    with pytest.raises(RuntimeError, match="cos must be float32"):
        R.rotary_fwd(q, k, cos.int(), sin.int(), 1, 0)
    with pytest.raises(RuntimeError, match="cos must have at least one dimension"):
        R.rotary_fwd(q, k, cos[0, 0, 0], sin[0, 0, 0], 0, 0)
    g = torch.randn(q.shape)
    with pytest.raises(ValueError, match="q_dtype must be"):
        R.rotary_bwd(g, None, cos, sin, 1, 0, torch.int32)
    with pytest.raises(ValueError, match="form must be"):
        R.rotary_bwd(g, None, cos, sin, 1, 99, q.dtype)
    with pytest.raises(IndexError, match="unsqueeze_dim must be"):
        R.rotary_bwd(g, None, cos, sin, 9, 0, q.dtype)
    with pytest.raises(RuntimeError, match="sin has dtype"):
        R.rotary_bwd(g, None, cos, sin.double(), 1, 0, q.dtype)


@pytest.mark.parametrize(
    "form", [0, R.PARTIAL, R.CAST_BACK, R.INTERLEAVED | R.UPCAST | R.CAST_BACK]
)
def test_opcheck(form):
    rotary = 8 if form & R.PARTIAL else None
    q, k, cos, sin = _qkcs(torch.bfloat16, torch.float32, rotary=rotary)
    torch.library.opcheck(R.rotary_fwd, (q, k, cos, sin, 1, form))
    g = torch.randn(q.shape, dtype=R.rotary_out_dtype(form, q.dtype, cos.dtype))
    torch.library.opcheck(R.rotary_bwd, (g, None, cos, sin, 1, form, q.dtype))


def test_torch_func_computes_the_composite():
    q, k, cos, sin = (t.detach() for t in _qkcs(torch.float64, torch.float64))

    def loss(q):
        a, b = R.rotary_embedding(q, k, cos, sin)
        return a.sum() + b.sum()

    def native(q):
        a, b = _function("llama")(q, k, cos, sin)
        return a.sum() + b.sum()

    assert torch.equal(torch.func.grad(loss)(q), torch.func.grad(native)(q))


def test_double_backward_is_refused_with_the_native_named():
    q, k, cos, sin = _qkcs(torch.float64, torch.float64)
    a, _ = R.rotary_embedding(q, k, cos, sin)
    with pytest.raises(RuntimeError, match=r"double backward.*apply_rotary_pos_emb"):
        torch.autograd.grad(a.sum(), q, create_graph=True)


# ------------------------------------------------------------------ recognition


@pytest.mark.parametrize("family", list(FORMS))
def test_each_family_function_is_recognised_in_its_form(family):
    assert rule.recognise_rotary(_function(family)) == (FORMS[family], "")


@pytest.mark.parametrize(
    "family, name, why",
    [
        ("deepseek_v3", "apply_rotary_pos_emb_interleave", "computes otherwise"),
        ("glm", "apply_rotary_pos_emb", "computes otherwise"),
        ("helium", "apply_rotary_pos_emb", "computes otherwise"),
    ],
)
def test_functions_computing_otherwise_are_refused(family, name, why):
    form, reason = rule.recognise_rotary(_function(family, name))
    assert form is None and why in reason


def test_a_lookalike_with_the_name_is_refused():
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        c = cos.unsqueeze(unsqueeze_dim)
        return q * c, k * c  # no rotation

    assert rule.recognise_rotary(apply_rotary_pos_emb)[0] is None


# ------------------------------------------------------------------ the rule on whole models

SMALL = dict(DECODER, pad_token_id=0)
ENCODER = dict(bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)

MODELS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**SMALL)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=16)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, head_dim=16)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=16)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SMALL, head_dim=16)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, partial_rotary_factor=0.5)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL)),
    "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**SMALL)),
    "modernbert": lambda: tf.ModernBertModel(tf.ModernBertConfig(**SMALL, **ENCODER)),
}
DECODERS = [name for name in MODELS if name != "modernbert"]


def _pair(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    return model, copy.deepcopy(model)


def _out(model, **inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", list(MODELS))
def test_family_attention_is_routed_and_outputs_are_native_bit_for_bit(name):
    model, native = _pair(name)
    report = fastlayers.patch(model)
    rows = [s for s in report.swaps if s.rule == "rotary"]
    assert len(rows) == 2, str(report)
    assert not [s for s in report.skips if s.rule == "rotary"]
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        assert torch.equal(_out(model, input_ids=ids), _out(native, input_ids=ids))
    fastlayers.unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generation_with_a_kv_cache_and_left_padding_is_native(name):
    model, native = _pair(name)
    fastlayers.patch(model)
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding: positions from the mask
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(model.generate(ids, **kwargs), native.generate(ids, **kwargs))


def test_packed_sequences_with_position_ids_are_native():
    model, native = _pair("llama")
    fastlayers.patch(model)
    ids = torch.randint(3, 100, (1, 12))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        a = _out(model, input_ids=ids, position_ids=position_ids)
        b = _out(native, input_ids=ids, position_ids=position_ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["llama", "phi3", "cohere", "modernbert"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_gradients_are_native(name, checkpointing):
    model, native = _pair(name)
    fastlayers.patch(model, layers=("rotary",))  # the RMSNorms' backward: within the bound
    for m in (model, native):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable()
    ids = torch.randint(3, 100, (2, 9))
    for m in (model, native):
        _out(m, input_ids=ids).float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), native.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_cpu_bf16_autocast_is_native():
    model, native = _pair("llama")
    fastlayers.patch(model)
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(_out(model, input_ids=ids), _out(native, input_ids=ids))


def _count_fused(monkeypatch):
    calls = []
    real = rule.rotary_forward

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(rule, "rotary_forward", counting)
    return calls


def test_per_instance_another_model_and_the_module_are_untouched(monkeypatch):
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    original = modeling.apply_rotary_pos_emb
    model, other = _pair("llama")
    fastlayers.patch(model)
    assert modeling.apply_rotary_pos_emb is original
    assert not any("forward" in m.__dict__ for m in other.modules())
    calls = _count_fused(monkeypatch)
    ids = torch.randint(3, 100, (1, 5))
    with torch.no_grad():
        other(input_ids=ids)
        assert not calls
        model(input_ids=ids)
        assert len(calls) == 2  # one per layer


def test_a_function_replaced_in_the_module_after_the_patch_is_called(monkeypatch):
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    original = modeling.apply_rotary_pos_emb
    model, _ = _pair("llama")
    fastlayers.patch(model)
    calls = _count_fused(monkeypatch)
    seen = []

    def spy(*args, **kwargs):  # what another library's patch would put there
        seen.append(1)
        return original(*args, **kwargs)

    ids = torch.randint(3, 100, (1, 5))
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", spy)
    # the attention function stays routed (rule varlen_attention); the rotary call is the spy's
    held = "calls apply_rotary_pos_emb as the model's module now holds it"
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=held):
        model(input_ids=ids)
    assert len(seen) == 2 and not calls
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", original)
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 2  # routed again once the original is back


def test_rotate_half_changed_after_the_patch_is_followed(monkeypatch):
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    model, native = _pair("llama")
    fastlayers.patch(model)
    monkeypatch.setattr(modeling, "rotate_half", lambda x: -x)
    ids = torch.randint(3, 100, (1, 5))
    held = "calls apply_rotary_pos_emb as the model's module now holds it"
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=held):
        assert torch.equal(_out(model, input_ids=ids), _out(native, input_ids=ids))


def test_a_wrapper_installed_before_the_patch_is_left_to_run_unprobed(monkeypatch):
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    original = modeling.apply_rotary_pos_emb
    state = {"scale": 1.0, "calls": 0}

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # a user's stateful wrapper
        state["calls"] += 1
        return original(q * state["scale"], k, cos, sin, unsqueeze_dim)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    model, native = _pair("llama")
    report = fastlayers.patch(model, layers=("rotary",))
    assert state["calls"] == 0  # never probed
    (skip,) = {s.reason for s in report.skips if s.rule == "rotary"}
    assert "defined outside the model's code" in skip and not report.swaps
    state["scale"] = 0.5
    ids = torch.randint(3, 100, (1, 5))
    with torch.no_grad():
        assert torch.equal(_out(model, input_ids=ids), _out(native, input_ids=ids))
    assert state["calls"] == 4


def test_a_dependency_put_back_routes_again(monkeypatch):
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    original = modeling.rotate_half
    model, native = _pair("llama")
    fastlayers.patch(model, layers=("rotary",))
    calls = _count_fused(monkeypatch)
    ids = torch.randint(3, 100, (1, 5))
    monkeypatch.setattr(modeling, "rotate_half", lambda x: -x)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="runs its original forward"):
        model(input_ids=ids)
    assert not calls
    monkeypatch.setattr(modeling, "rotate_half", original)
    with torch.no_grad():
        assert torch.equal(_out(model, input_ids=ids), _out(native, input_ids=ids))
    assert len(calls) == 2


def test_class_forward_replaced_after_the_patch_runs(monkeypatch):
    model, _ = _pair("llama")
    fastlayers.patch(model)
    cls = type(model.model.layers[0].self_attn)
    seen = []
    original = cls.forward

    def forward(self, *args, **kwargs):
        seen.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 5)))
    assert len(seen) == 2


def test_hooks_on_the_attention_still_run():
    model, _ = _pair("llama")
    fastlayers.patch(model)
    seen = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 5)))
    assert seen == [1]


def test_patch_twice_deepcopy_pickle_and_unpatch():
    model, native = _pair("llama")
    fastlayers.patch(model)
    again = fastlayers.patch(model)
    assert not [s for s in again.swaps if s.rule == "rotary"]
    ids = torch.randint(3, 100, (1, 5))
    with torch.no_grad():
        ref = _out(native, input_ids=ids)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            attn = twin.model.layers[0].self_attn
            assert isinstance(attn.__dict__["forward"], RoutedForward)
            assert attn.__dict__["forward"].block is attn
            assert torch.equal(_out(twin, input_ids=ids), ref)
    assert fastlayers.unpatch(model) > 0
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_layers_without_rotary_leave_attention_native():
    model, _ = _pair("llama")
    report = fastlayers.patch(model, layers=("rms_norm",))
    assert "rotary" not in report.counts()
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("mode", ["inductor", "fused"])
def test_torch_compile_fullgraph_of_a_patched_model(mode):
    model, native = _pair("llama")
    fastlayers.patch(model)
    ids = torch.randint(3, 100, (1, 5))
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with fastlayers.config.compile_rotary_as(mode), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        torch.testing.assert_close(_out(compiled, input_ids=ids), _out(native, input_ids=ids))
    fused = [n for g in graphs for n in g.graph.nodes if n.target is R.rotary_fwd]
    assert len(fused) == (2 if mode == "fused" else 0)
