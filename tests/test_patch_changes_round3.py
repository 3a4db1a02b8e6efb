"""Rewrites stay right, round three: probes see a module as the model calls it (a gated norm
takes a second input, a group-wise norm shows at its own width and at twice it), probes do not
depend on the caller's modes (inference mode, autocast), HuggingFace initialisation after the
patch does what it does natively, patched forwards keep their signatures, ``layers=None`` and a
root norm, and fastlayers.check reporting FAIL where a patched forward raises. Each case failed
on the tree before it; each compares with the native model (an unpatched deep copy)."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import transformers as tf
from fastlayers.patching.rules import DEFAULT_LAYERS
from fastlayers.patching.rules import rotary as rotary_rule
from tiny_models import DECODER, TINY
from torch import nn

import fastlayers
from fastlayers.layers import recognise_rms_norm


def _randomise(model: nn.Module) -> nn.Module:
    """Random values in every Parameter (a re-initialised norm's ones show), as training or a
    loaded checkpoint leaves them."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    return model


def _ids(batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randint(0, 90, (batch, seq))


# ------------------------------------------------------------------ 1. gated norms


class GatedRMSNorm(nn.Module):
    """Mamba's gated norm: with ``gate=None`` a plain LLaMA-style RMSNorm (a probe with the
    defaults sees one); its mixer calls it with a gate."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class Mixer(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)
        self.norm = GatedRMSNorm(width)

    def forward(self, x):
        h, gate = self.proj(x).chunk(2, dim=-1)
        return self.norm(h, gate)


def test_a_norm_whose_forward_takes_a_gate_is_refused_with_the_reason():
    model = Mixer().eval()
    native = copy.deepcopy(model)
    report = fastlayers.patch(model)
    assert not report.swaps
    (skip,) = [s for s in report.skips if s.name == "norm"]
    assert skip.rule == "rms_norm" and "gate" in skip.reason
    x = torch.randn(2, 5, 32)
    assert torch.equal(model(x), native(x))


@pytest.mark.parametrize(
    "forward",
    [
        lambda self, x, *args: x,
        lambda self, x, **kwargs: x,
        lambda self, x, scale=1.0: x * scale,
    ],
    ids=["args", "kwargs", "default"],
)
def test_an_activation_or_linear_taking_more_than_its_input_is_refused(forward):
    from fastlayers.layers import linear_layout, recognise_activation

    act = type("Act", (nn.Module,), {"forward": forward})()
    kind, why = recognise_activation(act)
    assert kind is None and "more than its input" in why
    linear = type("Lin", (nn.Linear,), {"forward": forward})(4, 4)
    layout, why = linear_layout(linear)
    assert layout is None and "more than its input" in why


def _mamba2() -> nn.Module:
    config = tf.Mamba2Config(
        hidden_size=128,
        expand=2,
        n_groups=1,
        num_hidden_layers=2,
        vocab_size=100,
        num_heads=8,
        head_dim=32,
        state_size=16,
    )
    return tf.Mamba2ForCausalLM(config)


def _falcon_h1() -> nn.Module:
    config = tf.FalconH1Config(
        **DECODER,
        mamba_rms_norm=True,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        head_dim=16,
    )
    return tf.FalconH1ForCausalLM(config)


def _bamba() -> nn.Module:
    config = tf.BambaConfig(
        **DECODER,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_expand=2,
        attn_layer_indices=[1],
    )
    return tf.BambaForCausalLM(config)


def _granite_hybrid() -> nn.Module:
    config = tf.GraniteMoeHybridConfig(
        **DECODER,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_expand=2,
        layer_types=["mamba", "attention"],
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    return tf.GraniteMoeHybridForCausalLM(config)


def _zamba2() -> nn.Module:
    config = tf.Zamba2Config(
        **DECODER,
        mamba_d_state=16,
        mamba_headdim=16,
        n_mamba_heads=8,
        mamba_ngroups=1,
        num_mem_blocks=1,
        hybrid_layer_ids=[1],
        layers_block_type=["mamba", "hybrid"],
    )
    return tf.Zamba2ForCausalLM(config)


def _nemotron_h() -> nn.Module:
    config = tf.NemotronHConfig(
        **{k: v for k, v in DECODER.items() if k != "num_hidden_layers"},
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        hybrid_override_pattern="M*",
        num_hidden_layers=2,
        head_dim=16,
    )
    return tf.NemotronHForCausalLM(config)


@pytest.mark.parametrize(
    "build",
    [_mamba2, _falcon_h1, _bamba, _granite_hybrid, _zamba2, _nemotron_h],
    ids=["mamba2", "falcon_h1", "bamba", "granitemoehybrid", "zamba2", "nemotron_h"],
)
def test_ssm_hybrids_with_gated_norms_run_as_natively(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SSM kernels' fallback notices
        torch.manual_seed(0)
        model = _randomise(build().eval())
        native = copy.deepcopy(model)
        ids = _ids()
        report = fastlayers.patch(model)
        gated = [s for s in report.skips if "RMSNormGated" in s.native]
        assert gated and all("gate" in s.reason for s in gated)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, native(ids).logits, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ 2. group-wise norms


class GroupRMSNorm(nn.Module):
    """Qwen4-style: normalises each ``group_size``-wide group of the row, (1 + w) weight."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)
        self.group_size = group_size

    def forward(self, x):
        h = x.float().reshape(*x.shape[:-1], -1, self.group_size)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)


@pytest.mark.parametrize("dim", [512, 1024])
def test_a_group_wise_norm_is_not_taken_for_a_full_row_one(dim):
    model = nn.Sequential(GroupRMSNorm(dim, group_size=256)).eval()
    native = copy.deepcopy(model)
    report = fastlayers.patch(model)
    assert not report.swaps
    (skip,) = report.skips
    assert str(dim) in skip.reason
    x = torch.randn(3, dim)
    assert torch.equal(model(x), native(x))


def test_a_group_wise_norm_one_group_wide_is_refused_at_twice_its_width():
    # at its own width one group is the whole row (exact), but resized it would not be
    form, _, why = recognise_rms_norm(GroupRMSNorm(256, group_size=256))
    assert form is None and "512" in why and "groups" in why


def test_transformers_group_wise_norm_is_refused():
    qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    for dim in (256, 512, 1024):
        form, _, why = recognise_rms_norm(qwen4.Qwen4ExpTextRMSNorm(dim, group_size=256))
        assert form is None and "RMSNorm" in why, dim


def test_plain_norms_are_still_taken_at_their_widths():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for width in (8, 96, 4096):
        assert recognise_rms_norm(LlamaRMSNorm(width))[0] == "cast_first"
        assert recognise_rms_norm(GemmaRMSNorm(width))[0] == "gemma"


# ------------------------------------------------------------------ 3. initialisation


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert not changed, changed


@pytest.mark.parametrize(
    "build",
    [
        lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
        lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)),
        lambda: tf.T5Model(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)),
    ],
    ids=["llama", "bert", "t5"],
)
@pytest.mark.parametrize("call", ["post_init", "init_weights"])
def test_initialisation_after_the_patch_leaves_trained_weights(build, call):
    model = _randomise(build().eval())  # built from a config, then trained / loaded
    before = _weights(model)
    report = fastlayers.patch(model)
    assert report.swaps
    getattr(model, call)()
    _assert_same_weights(_weights(model), before)


@pytest.mark.parametrize(
    "build",
    [
        lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
        lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)),
        lambda: tf.T5Model(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)),
    ],
    ids=["llama", "bert", "t5"],
)
def test_initialisation_of_unflagged_modules_does_what_native_does(build):
    # flags cleared (a model whose modules were never initialised): native init_weights draws
    # every module again; the patched model must draw exactly the same values
    model = _randomise(build().eval())
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                t.__dict__.pop("_is_hf_initialized", None)
    native = copy.deepcopy(model)
    before = _weights(model)
    fastlayers.patch(model)
    torch.manual_seed(7)
    native.init_weights()
    torch.manual_seed(7)
    model.init_weights()
    _assert_same_weights(_weights(model), _weights(native))
    assert any(not torch.equal(v, before[k]) for k, v in _weights(native).items())


def test_unpatch_keeps_the_initialisation_flags():
    model = _randomise(tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).eval())
    before = _weights(model)
    fastlayers.patch(model)
    fastlayers.unpatch(model)
    model.post_init()
    _assert_same_weights(_weights(model), before)


# ------------------------------------------------------------------ 4. signatures


def _signature(model: nn.Module, path: str = "") -> inspect.Signature:
    return inspect.signature(model.get_submodule(path).forward)


@pytest.mark.parametrize(
    ("build", "paths"),
    [
        (
            lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=1, **TINY)),
            ["", "encoder.layer.0.output"],
        ),
        (
            lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
            ["", "model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp"],
        ),
    ],
    ids=["bert", "llama"],
)
def test_patched_forwards_keep_their_signatures(build, paths):
    model = build().eval()
    native = copy.deepcopy(model)
    fastlayers.patch(model, replay=True)
    assert "forward" in model.__dict__  # replay wraps the root
    for path in paths:
        assert _signature(model, path) == _signature(native, path), path
    # what the HF Trainer keeps of a batch (its column filter reads these names)
    assert "input_ids" in inspect.signature(model.forward).parameters


def test_a_rewritten_block_keeps_its_signature_under_replay_of_a_rewritten_root():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    native = copy.deepcopy(model)
    fastlayers.patch(model, replay=True)
    assert inspect.signature(model.forward) == inspect.signature(native.forward)


# ------------------------------------------------------------------ 5. probes and modes


def _rotary_rows(report) -> int:
    return sum(1 for s in report.swaps if s.rule == "rotary")


@pytest.mark.parametrize(
    "mode",
    [torch.inference_mode, torch.no_grad, lambda: torch.autocast("cpu", dtype=torch.bfloat16)],
    ids=["inference_mode", "no_grad", "autocast"],
)
def test_patch_in_any_mode_proves_what_it_proves_outside(mode):
    rotary_rule._RECOGNISED.clear()
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).eval()
    outside = fastlayers.patch(copy.deepcopy(model), dry_run=True)
    rotary_rule._RECOGNISED.clear()
    with mode():
        inside = fastlayers.patch(copy.deepcopy(model))
    assert _rotary_rows(inside) == _rotary_rows(outside) == DECODER["num_hidden_layers"]
    assert [(s.name, s.rule) for s in inside.swaps] == [(s.name, s.rule) for s in outside.swaps]
    # and a later patch outside is not handed a verdict made inside
    assert _rotary_rows(fastlayers.patch(model)) == DECODER["num_hidden_layers"]


def test_a_probe_that_raised_is_asked_again(monkeypatch):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary_rule._RECOGNISED.clear()
    original = rotary_rule._native_run
    monkeypatch.setattr(rotary_rule, "_native_run", lambda *a: None)  # e.g. out of memory
    form, why = rotary_rule.recognise_rotary(apply_rotary_pos_emb)
    assert form is None and "raised" in why
    monkeypatch.setattr(rotary_rule, "_native_run", original)
    form, why = rotary_rule.recognise_rotary(apply_rotary_pos_emb)
    assert form is not None, why


def test_norm_probes_in_inference_mode_and_autocast():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with torch.inference_mode():
        assert recognise_rms_norm(LlamaRMSNorm(64))[0] == "cast_first"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert recognise_rms_norm(LlamaRMSNorm(64))[0] == "cast_first"


# ------------------------------------------------------------------ 6. arguments, the root


def test_layers_none_is_the_default_set():
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).eval()
    default = fastlayers.patch(copy.deepcopy(model), dry_run=True)
    none = fastlayers.patch(model, layers=None)
    assert [(s.name, s.rule) for s in none.swaps] == [(s.name, s.rule) for s in default.swaps]
    assert {s.rule for s in none.swaps} <= set(DEFAULT_LAYERS)


def test_layers_of_another_type_names_the_argument():
    with pytest.raises(TypeError, match="layers"):
        fastlayers.patch(nn.Sequential(nn.LayerNorm(4)), layers=5)


def test_a_root_rms_norm_gets_a_reason():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    report = fastlayers.patch(LlamaRMSNorm(16))
    (skip,) = report.skips
    assert skip.name == "(root)" and skip.rule == "rms_norm" and "the model itself" in skip.reason
    report = fastlayers.patch(GatedRMSNorm(16))
    (skip,) = report.skips
    assert skip.name == "(root)" and "gate" in skip.reason


# ------------------------------------------------------------------ check


class ClassCheckingBlock(nn.Module):
    """A model whose code asserts its child's class: the patched model raises there."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        if type(self.norm) is not nn.LayerNorm:
            raise TypeError(f"expected an nn.LayerNorm, got {type(self.norm).__name__}")
        return self.norm(x)


def test_check_reports_fail_where_the_patched_model_raises():
    model = ClassCheckingBlock()
    report = fastlayers.check(model, torch.randn(2, 16), runs=1, warmup=0)
    assert not report.passed
    assert report.error is not None and "TypeError" in report.error
    assert report.verdict().startswith("FAIL: the patched model raised TypeError")
    assert report.to_dict()["error"] == report.error
    assert type(model.norm) is nn.LayerNorm  # the patch was undone
    assert "FAIL" in str(report)


def test_check_propagates_what_the_native_model_raises():
    model = nn.Sequential(nn.LayerNorm(16))
    with pytest.raises(RuntimeError):
        fastlayers.check(model, torch.randn(2, 8), runs=1, warmup=0)
