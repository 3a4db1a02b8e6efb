"""Padding-free execution (``patch(model, unpad=True)``): outputs at the real positions equal the
padded model's, zeros at the padding, gradients, left and right padding, positions as each family
computes them, refusals with reasons, undo; on CUDA the flash path in half precision."""

from __future__ import annotations

import copy
import itertools
import types
import warnings

import pytest
import torch
import transformers as tf
from fastlayers.patching.fused import fused_loss_forward, rewritten_forward, unpad_forward
from fastlayers.patching.runtime import varlen
from tiny_models import DECODER, TINY
from torch import nn

import fastlayers

ENCODERS = {
    "bert": lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)),
    "roberta": lambda: tf.RobertaModel(tf.RobertaConfig(num_hidden_layers=2, **TINY)),
    "xlm_roberta": lambda: tf.XLMRobertaModel(tf.XLMRobertaConfig(num_hidden_layers=2, **TINY)),
    "electra": lambda: tf.ElectraModel(
        tf.ElectraConfig(num_hidden_layers=2, embedding_size=32, **TINY)
    ),
    "distilbert": lambda: tf.DistilBertModel(
        tf.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    ),
}
DECODERS = {
    "gpt2": lambda: tf.GPT2Model(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2)),
    "llama": lambda: tf.LlamaModel(tf.LlamaConfig(**DECODER)),
    "mistral": lambda: tf.MistralModel(tf.MistralConfig(**DECODER)),
    "qwen2": lambda: tf.Qwen2Model(tf.Qwen2Config(**DECODER)),
    "qwen3": lambda: tf.Qwen3Model(tf.Qwen3Config(**DECODER, head_dim=16)),
    "gemma": lambda: tf.GemmaModel(tf.GemmaConfig(**DECODER, head_dim=16)),
    "phi3": lambda: tf.Phi3Model(tf.Phi3Config(**DECODER, pad_token_id=0)),
}
FAMILIES = {**ENCODERS, **DECODERS}


def _randomise(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    return model


def _batch(batch: int, seq: int, left: bool, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (no padding id among the real ones) and a mask of random lengths, the first
    full and the last padded."""
    lengths = torch.randint(1, seq + 1, (batch,))
    lengths[0] = seq
    if batch > 1 and seq > 1:
        lengths[-1] = torch.randint(1, seq, ())  # one padded row at least
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        if left:
            mask[i, seq - n :] = 1
        else:
            mask[i, :n] = 1
    ids = torch.randint(3, 90, (batch, seq))
    return ids.to(device), mask.to(device)


def _patched(build, device="cpu", dtype=torch.float32):
    native = _randomise(build()).eval().to(device, dtype)
    model = copy.deepcopy(native)
    report = fastlayers.patch(model, unpad=True)
    return native, model, report


def _stats(model: nn.Module) -> dict:
    return dict(unpad_forward(model.base_model).stats)


def _assert_real_close(ours, theirs, mask, rtol=1e-5, atol=1e-5):
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=rtol, atol=atol)
    assert not ours[~real].any(), "padding positions are zeros"


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_outputs_at_real_positions_and_zeros_at_padding(name, left):
    native, model, report = _patched(FAMILIES[name])
    assert any(s.rule == "unpad" for s in report.swaps)
    assert any(s.rule == "varlen_attention" for s in report.swaps)
    ids, mask = _batch(4, 9, left)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        theirs = native(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    stats = _stats(model)
    if left and hasattr(native, "pooler") and native.pooler is not None:
        # the pooler reads the first token, padding here: the first check refuses, padded
        assert list(stats) == [next(k for k in stats if "pooler_output" in k)]
        torch.testing.assert_close(ours.pooler_output, theirs.pooler_output)
        return
    assert stats == {"padding-free": 1}
    _assert_real_close(ours.last_hidden_state, theirs.last_hidden_state, mask)
    for a, b in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        _assert_real_close(a, b, mask)
    if getattr(theirs, "pooler_output", None) is not None:
        torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, rtol=1e-5, atol=1e-5)


def test_many_calls_of_random_shapes_stay_padding_free():
    native, model, _ = _patched(DECODERS["llama"])
    for _ in range(6):
        batch, seq = torch.randint(1, 6, ()).item(), torch.randint(2, 12, ()).item()
        ids, mask = _batch(batch, seq, left=bool(torch.randint(0, 2, ()).item()))
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
            theirs = native(input_ids=ids, attention_mask=mask).last_hidden_state
        _assert_real_close(ours, theirs, mask)
    assert "padding-free" in _stats(model)


@pytest.mark.parametrize(
    ("build", "head"),
    [
        (
            lambda: tf.BertForSequenceClassification(tf.BertConfig(num_hidden_layers=2, **TINY)),
            "cls",
        ),
        (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)), "lm"),
        (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2)), "lm"),
    ],
    ids=["bert_cls", "llama_lm", "gpt2_lm"],
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_training_loss_and_every_gradient(build, head, checkpointing):
    native = _randomise(build()).train()
    for m in native.modules():  # dropout off: the packed and padded calls draw differently
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    if checkpointing:
        native.gradient_checkpointing_enable()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True)
    ids, mask = _batch(4, 9, left=False)
    labels = torch.randint(0, 2, (4,)) if head == "cls" else ids.masked_fill(mask == 0, -100)
    results = []
    for m in (model, native):
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
        results.append((out.loss, grads))
    (loss, grads), (native_loss, native_grads) = results
    torch.testing.assert_close(loss, native_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == native_grads.keys()
    for k, g in native_grads.items():
        scale = max(g.abs().max().item(), 1e-3)
        assert (grads[k] - g).abs().max().item() <= 1e-4 * scale + 1e-7, k
    assert _stats(model) == {"padding-free": 1}


def test_positions_follow_the_family_rule_with_left_padding():
    # RoBERTa counts positions from its padding id; pad ids at the padding, as tokenizers do
    native, model, _ = _patched(ENCODERS["roberta"])
    model.pooler = native.pooler = None
    ids, mask = _batch(3, 8, left=True)
    ids = ids.masked_fill(mask == 0, native.config.pad_token_id)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
        theirs = native(input_ids=ids, attention_mask=mask).last_hidden_state
    _assert_real_close(ours, theirs, mask)
    assert _stats(model) == {"padding-free": 1}


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"use_cache": True}, "use_cache=True"),
        ({"output_attentions": True}, "attention weights"),
        ({"attention_mask": None}, "no 2-D attention_mask"),
    ],
)
def test_calls_it_cannot_serve_run_padded_with_the_reason(kwargs, why):
    native, model, _ = _patched(DECODERS["llama"])
    ids, mask = _batch(3, 7, left=False)
    call = {"input_ids": ids, "attention_mask": mask, **kwargs}
    with torch.no_grad():
        ours, theirs = model(**call), native(**call)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)
    (reason,) = _stats(model)
    assert why in reason


def test_a_batch_without_padding_runs_as_it_is():
    native, model, _ = _patched(ENCODERS["bert"])
    ids = torch.randint(3, 90, (2, 6))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask).last_hidden_state,
            native(input_ids=ids, attention_mask=mask).last_hidden_state,
        )
    assert _stats(model) == {"padded: no padding in the attention mask": 1}


def test_generation_with_a_cache_is_unchanged():
    native = _randomise(tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER))).eval()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True)
    ids, mask = _batch(2, 6, left=True)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ours = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        theirs = native.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(ours, theirs)


def test_an_attention_the_rule_cannot_route_is_caught_by_the_first_check():
    native, model, _ = _patched(ENCODERS["bert"])
    # take the routes away: the packed call then attends across sequences
    for module in model.modules():
        if rewritten_forward(module) is not None and module is not model:
            del module.__dict__["forward"]
    ids, mask = _batch(4, 9, left=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=mask)
            theirs = native(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)
    (reason,) = _stats(model)
    assert "differs padding-free" in reason
    assert any("unpad runs BertModel padded" in str(w.message) for w in seen)


def test_report_unpatch_and_copies():
    native, model, report = _patched(ENCODERS["bert"])
    assert [s.name for s in report.swaps if s.rule == "unpad"] == ["(root)"]
    assert unpad_forward(model) is not None
    twin = copy.deepcopy(model)
    ids, mask = _batch(3, 7, left=False)
    with torch.no_grad():
        _assert_real_close(
            twin(input_ids=ids, attention_mask=mask).last_hidden_state,
            native(input_ids=ids, attention_mask=mask).last_hidden_state,
            mask,
        )
    assert _stats(twin) == {"padding-free": 1}
    fastlayers.unpatch(model)
    assert "forward" not in model.__dict__
    assert not any(rewritten_forward(m) for m in model.modules())


def test_unpad_refusals_at_patch_time():
    report = fastlayers.patch(nn.Sequential(nn.Linear(4, 4)), unpad=True)
    assert any(s.rule == "unpad" and "no transformers model" in s.reason for s in report.skips)
    t5 = tf.T5Model(tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    report = fastlayers.patch(t5, unpad=True)
    assert any(s.rule == "unpad" and "encoder-decoder" in s.reason for s in report.skips)
    with pytest.raises(TypeError, match="unpad"):
        fastlayers.patch(nn.Sequential(nn.Linear(4, 4)), unpad="yes")
    bert = ENCODERS["bert"]()
    report = fastlayers.patch(bert, unpad=True, replay=True)
    assert any(s.rule == "replay" and "packed" in s.reason for s in report.skips)
    (row,) = [s for s in report.swaps if s.rule == "unpad"]
    assert "replay per packed-size bucket" in row.fused


def test_packed_size_buckets():
    from fastlayers.patching.runtime import packed_replay
    from fastlayers.patching.runtime.varlen import Packing

    assert [varlen.token_bucket(n) for n in (1, 64, 65, 80, 81, 129, 4096, 4097)] == [
        64,
        64,
        80,
        80,
        96,
        160,
        4096,
        5120,
    ]
    for n in range(1, 20000, 37):  # at most 25% more tokens past 64
        assert n <= varlen.token_bucket(n) <= max(64, 1.25 * n)
    assert [varlen.sequence_bucket(n) for n in (1, 64, 65, 300)] == [64, 64, 128, 512]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ids = torch.tensor([[5, 6, 7, 1], [8, 9, 1, 1]])
    packing = Packing.of(mask, {"input_ids": ids})
    assert packing.total == 5 and packing.index.tolist() == [0, 1, 2, 4, 5]
    assert packing.cu_seqlens.tolist() == [0, 3, 5] and packing.max_length == 3
    # the gathered row: real tokens, then the padding tokens, then zeros
    assert packing.packed("input_ids").tolist() == [[5, 6, 7, 8, 9]]
    assert packing.packed("input_ids", 10).tolist() == [[5, 6, 7, 8, 9, 1, 1, 1, 0, 0]]
    # into given buffers: the gather into `out`, the lengths into `cu_out`, the total after
    out = {"input_ids": torch.full((8,), -1)}
    cu = torch.full((6,), -1, dtype=torch.int32)
    cu[0] = 0
    into = Packing.of(mask, {"input_ids": ids}, out, cu)
    assert out["input_ids"].tolist() == [5, 6, 7, 8, 9, 1, 1, 1]
    assert into.gathered["input_ids"].data_ptr() == out["input_ids"].data_ptr()
    assert cu.tolist() == [0, 3, 5, 5, 5, 5]
    # into buffers shorter than the padded batch: the rest gathered when asked for
    short = {"input_ids": torch.full((4,), -1)}
    cut = Packing.of(mask, {"input_ids": ids}, short)
    assert short["input_ids"].tolist() == [5, 6, 7, 8]
    assert cut.packed("input_ids").tolist() == [[5, 6, 7, 8, 9]]
    assert cut.packed("input_ids", 7).tolist() == [[5, 6, 7, 8, 9, 1, 1]]
    assert [packed_replay.packed_length(n) for n in (1, 512, 513, 2049)] == [512, 512, 2048, 8192]


def test_per_sequence_attention_groups_equal_lengths(monkeypatch):
    calls = []
    original = varlen._per_sequence

    def spy(fn, module, query, *rest):
        calls.append(query.shape)
        return original(fn, module, query, *rest)

    monkeypatch.setattr(varlen, "_per_sequence", spy)
    native, model, _ = _patched(DECODERS["llama"])
    mask = torch.tensor([[1] * 6, [1] * 6, [1, 1, 1, 0, 0, 0]])
    ids = torch.randint(3, 90, (3, 6))
    with torch.no_grad():
        _assert_real_close(
            model(input_ids=ids, attention_mask=mask).last_hidden_state,
            native(input_ids=ids, attention_mask=mask).last_hidden_state,
            mask,
        )
    assert calls, "the CPU path ran"


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert", "gpt2", "llama", "qwen3"])
def test_cuda_flash_path_within_the_check_bound(name, dtype, monkeypatch):
    from fastlayers.patching.checking.numerics import default_tolerance

    flash = []
    original = varlen._flash
    monkeypatch.setattr(varlen, "_flash", lambda *a: flash.append(1) or original(*a))
    native, model, _ = _patched(FAMILIES[name], "cuda", dtype)
    ids, mask = _batch(8, 67, left=False, device="cuda")
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
        theirs = native(input_ids=ids, attention_mask=mask).last_hidden_state
    rtol, atol = default_tolerance(dtype)
    real = mask.bool()
    err = (ours[real].float() - theirs[real].float()).abs().max().item()
    assert err <= atol + rtol * theirs[real].float().abs().max().item()
    assert not ours[~real].any()
    assert flash and _stats(model) == {"padding-free": 1}


@pytest.mark.cuda
def test_cuda_training_gradients_bf16():
    native = _randomise(tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER))).cuda().train()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True)
    ids, mask = _batch(6, 40, left=False, device="cuda")
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for m in (model, native):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
    assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[1])
    for (k, p), (_, q) in zip(model.named_parameters(), native.named_parameters(), strict=True):
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= 5e-2 * scale + 1e-6, k


@pytest.mark.cuda
def test_cuda_replay_of_packed_calls_keyed_by_packed_size():
    from fastlayers.patching.checking.numerics import default_tolerance

    native = _randomise(ENCODERS["bert"]()).cuda().to(torch.bfloat16).eval()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True, replay=True)
    unpadded = unpad_forward(model)
    rtol, atol = default_tolerance(torch.bfloat16)
    shapes = [(8, 40), (7, 33), (16, 20), (3, 64), (8, 40), (5, 12), (7, 33)]
    batches = {shape: _batch(*shape, left=False, device="cuda") for shape in set(shapes)}
    with torch.no_grad():
        for shape in shapes:  # the repeated calls replay the bucket the first one captured
            ids, mask = batches[shape]
            ours = model(input_ids=ids, attention_mask=mask)
            theirs = native(input_ids=ids, attention_mask=mask)
            real = mask.bool()
            # fastlayers.check's rule: |ours - native| <= atol + rtol * max|native|
            for a, b in (
                (ours.last_hidden_state[real], theirs.last_hidden_state[real]),
                (ours.pooler_output, theirs.pooler_output),
            ):
                a, b = a.float(), b.float()
                assert (a - b).abs().max().item() <= atol + rtol * b.abs().max().item()
            assert not ours.last_hidden_state[~real].any()
    inner = unpadded._replay.stats
    assert inner["replayed"] >= 2 and inner["captured"] >= 1, dict(inner)
    totals = {int(mask.sum()) for _, mask in batches.values()}
    assert unpadded.graph_count() <= len({varlen.token_bucket(t) for t in totals})
    assert unpadded.stats["padding-free"] == len(shapes)


@pytest.mark.cuda
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_cuda_packed_replay_shared_buffers_growth_inputs_and_guard(left):
    """Replayed packed calls read shared buffers: right at the real tokens through a growth of
    the buffers (graphs dropped), another set of inputs (token types given), left padding, and
    a module changed after the capture (captured again)."""
    from fastlayers.patching.checking.numerics import default_tolerance

    # no pooler: a pooler reads the first column, padding under left padding (runs padded)
    bert = tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY), add_pooling_layer=False)
    native = _randomise(bert).cuda().to(torch.bfloat16).eval()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True, replay=True)
    unpadded = unpad_forward(model)
    rtol, atol = default_tolerance(torch.bfloat16)

    def same(ids, mask, **extra):
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=mask, **extra)
            theirs = native(input_ids=ids, attention_mask=mask, **extra)
        real = mask.bool()
        a, b = ours.last_hidden_state[real].float(), theirs.last_hidden_state[real].float()
        assert torch.isfinite(a).all()
        assert (a - b).abs().max().item() <= atol + rtol * b.abs().max().item()
        assert not ours.last_hidden_state[~real].any()

    for shape in ((4, 30), (4, 30), (6, 20)):
        same(*_batch(*shape, left=left, device="cuda"))
    captured = unpadded._replay.stats["captured"]
    assert captured >= 1 and unpadded._replay.stats["replayed"] >= 1
    ids, mask = _batch(70, 128, left=left, device="cuda")
    if left:
        mask[:, -100:] = 1
    else:
        mask[:, :100] = 1  # 7000 real tokens and more: past the first buffers (4096 rows)
    same(ids, mask)  # runs eagerly packed, then the buffers grow (the graphs dropped)
    assert unpadded._replay.stats["eager: past the buffers (grown for the next calls)"] == 1
    same(ids, mask)
    assert unpadded._replay.stats["dropped: buffers grown"] >= 1
    ids, mask = _batch(5, 24, left=left, device="cuda")
    same(ids, mask, token_type_ids=torch.randint(0, 2, ids.shape, device="cuda"))
    same(ids, mask)
    before = unpadded._replay.stats["captured"]
    norm = model.embeddings.LayerNorm  # a forward set on the instance: the guard sees it
    norm.forward = types.MethodType(type(norm).forward, norm)
    same(ids, mask)
    assert unpadded._replay.stats["captured"] > before
    full = torch.ones_like(mask)  # no padding: replayed too (no eager forward to pay)
    same(ids, full)
    assert not any("no padding" in k for k in unpadded.stats), dict(unpadded.stats)
    assert unpadded.stats["padding-free"] >= 8, dict(unpadded.stats)


@pytest.mark.cuda
def test_cuda_replay_past_max_graphs_evicts_the_least_used():
    from fastlayers.patching import ReplayOptions
    from fastlayers.patching.runtime.replay import _BROKEN

    model = _randomise(ENCODERS["bert"]()).cuda().to(torch.bfloat16).eval()
    fastlayers.patch(model, unpad=True, replay=ReplayOptions(max_graphs=2))
    # real tokens 40, 100, 200, 300 (buckets 64, 112, 224, 320), then 40 again
    with torch.no_grad():
        for total in (40, 40, 100, 200, 300, 40):
            seq = total // 4 + 1
            ids = torch.randint(3, 90, (4, seq), device="cuda")
            mask = (
                torch.arange(seq, device="cuda")[None]
                < torch.full((4, 1), total // 4, device="cuda")
            ).long()
            model(input_ids=ids, attention_mask=mask)
    unpadded = unpad_forward(model)
    why = (dict(unpadded.stats), dict(unpadded._replay.stats), unpadded.checked, _BROKEN[0])
    assert unpadded.graph_count() <= 2, why
    assert unpadded._replay.stats["evicted"] >= 2, why


def test_an_attention_replaced_after_the_first_check_is_checked_again():
    native, model, _ = _patched(ENCODERS["bert"])
    ids, mask = _batch(4, 9, left=False)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # checked: padding-free
        # a user replaces an attention with a fresh (unrouted) copy of the native one
        for twin in (model, native):
            layer = twin.encoder.layer[1].attention
            fresh = type(layer.self)(twin.config)
            fresh.load_state_dict(layer.self.state_dict())
            layer.self = fresh.eval()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ours = model(input_ids=ids, attention_mask=mask)
        theirs = native(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)
    assert any("checked again" in str(w.message) for w in seen)
    assert any("differs padding-free" in k for k in _stats(model))


def test_without_cudnn_switches_cudnn_attention_off_for_the_call_only():
    seen = []

    def attention(x):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if x is None:
            raise ValueError("bad")
        return x

    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert varlen.without_cudnn(attention, 3) == 3
    with pytest.raises(ValueError):
        varlen.without_cudnn(attention, None)
    assert seen == [False, False] and torch.backends.cuda.cudnn_sdp_enabled()


def test_without_cudnn_leaves_a_callers_own_backend_choice():
    """Under sdpa_kernel(CUDNN_ATTENTION) (cuDNN alone) or without the math fallback, switching
    cuDNN off could leave a call no backend: the caller's choice stands."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention():
        return torch.backends.cuda.cudnn_sdp_enabled()

    for chosen in (
        [SDPBackend.CUDNN_ATTENTION],
        [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
    ):
        with sdpa_kernel(chosen):
            assert varlen.without_cudnn(attention) is True
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert varlen.without_cudnn(attention) is False


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_callers_own_packing_kwargs_run_as_natively(family):
    """The routed attention runs per sequence only for padding-free execution's own packings: a
    caller's cu_seq_lens_q (a collator's, for a flash-attention model) reaches the model's
    attention function as it does natively, which ignores it under SDPA."""
    model = FAMILIES[family]().eval()
    native = copy.deepcopy(model)
    fastlayers.patch(model)
    ids = torch.randint(3, 100, (1, 9))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    with torch.no_grad():
        ours, theirs = model(input_ids=ids, **packing), native(input_ids=ids, **packing)
        second = native(input_ids=ids[:, 4:]).last_hidden_state  # the second sequence alone
    assert torch.equal(ours.last_hidden_state, theirs.last_hidden_state)
    assert not torch.allclose(ours.last_hidden_state[:, 4:], second, atol=1e-3)  # not packed


def test_under_torch_compile_an_attention_only_routed_traces_its_own_forward():
    """A block routed by varlen_attention alone changes nothing in a compiled call: dynamo
    traces the class forward, not the route and its guard."""
    model = FAMILIES["bert"]().eval()
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    fastlayers.patch(model, layers="varlen_attention")
    routed = [rewritten_forward(m) for m in model.modules()]
    routed = [r for r in routed if r is not None]
    assert len(routed) == 2

    def guard(block):
        raise AssertionError("the route's guard ran under torch.compile")

    for forward in routed:
        forward._route.holds = guard
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).last_hidden_state, expected)


def test_a_cpu_call_of_an_attention_only_routed_runs_its_own_forward():
    """Off CUDA an unpacked call of a block routed by varlen_attention alone changes nothing, so
    it skips the route's guard (host time); a padding-free (packed) call still takes the route."""
    native = FAMILIES["bert"]().eval()
    ids = torch.randint(3, 100, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        expected = native(input_ids=ids, attention_mask=mask).last_hidden_state
    for unpad, guarded in ((False, 0), (True, 2)):
        model = copy.deepcopy(native)
        fastlayers.patch(model, layers="varlen_attention", unpad=unpad)
        routed = [r for r in map(rewritten_forward, model.modules()) if r is not None]
        assert len(routed) == 2
        guards = []
        for forward in routed:
            holds = forward._route.holds
            forward._route.holds = lambda b, holds=holds, seen=guards: seen.append(b) or holds(b)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)  # padding-free's first call is checked
            guards.clear()
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert len(guards) == guarded
        torch.testing.assert_close(out[0], expected[0])
        torch.testing.assert_close(out[1, :4], expected[1, :4])


def test_cudnn_plan_pays_once_a_shape_has_been_seen_often_enough(monkeypatch):
    """The count is per shape (operands, mask, dtype, whether autograd records the call): a new
    shape never goes to cuDNN; one seen more than CUDNN_AFTER_CALLS times may."""
    monkeypatch.setattr(varlen, "CUDNN_AFTER_CALLS", 2)
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    assert [varlen.cudnn_plan_pays(q, k, mask) for _ in range(4)] == [False, False, True, True]
    assert not varlen.cudnn_plan_pays(q, k, None)  # another mask: another shape
    assert not varlen.cudnn_plan_pays(q[:1], k[:1], mask[:1])
    assert not varlen.cudnn_plan_pays(q.half(), k.half(), mask)
    grad = q.clone().requires_grad_()
    assert not varlen.cudnn_plan_pays(grad, k, mask)  # recorded by autograd: its own plans
    with torch.no_grad():
        assert varlen.cudnn_plan_pays(grad, k, mask)  # the no-grad shape, seen enough


def _checkpointed(q: torch.Tensor, module: nn.Module, log: list, reentrant=False) -> torch.Tensor:
    """``q * q`` under gradient checkpointing, asking for the attention choice in the forward
    and again in its recomputation (inside backward), logged as (phase, choice)."""

    def layer(x):
        phase = "forward" if torch._C._current_graph_task_id() == -1 else "recompute"
        log.append((phase, varlen.cudnn_plan_pays(x, x, None, module)))
        return x * x  # saves x: backward recomputes

    return torch.utils.checkpoint.checkpoint(layer, q, use_reentrant=reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_recomputation_in_backward_makes_its_forwards_choice(monkeypatch, reentrant):
    """A gradient checkpoint recomputes an attention inside backward: it must take the backend
    its forward took (non-reentrant checkpointing refuses a recomputation that saves other
    tensors), though another layer's calls of the shape pass the bound in between. A reentrant
    checkpoint's forward runs without autograd: its recomputation counts in step with it."""
    monkeypatch.setattr(varlen, "CUDNN_AFTER_CALLS", 2)
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    module, other = nn.Linear(1, 1), nn.Linear(1, 1)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    log = []
    for _ in range(3):
        out = _checkpointed(q, module, log, reentrant) + _checkpointed(q, other, [], reentrant)
        out.sum().backward()
    choices = [choice for _, choice in log]
    assert [phase for phase, _ in log] == ["forward", "recompute"] * 3
    assert choices[0::2] == choices[1::2]  # each recomputation as its forward
    assert choices[0] is False and choices[-1] is True


@pytest.mark.parametrize("order", ["together", "first_forward_first", "last_forward_first"])
def test_forwards_awaiting_recomputation_keep_one_choice(monkeypatch, order):
    """Two forwards of one module and shape (a siamese loss) before their backward, on either
    side of the bound: the second keeps the first's choice while that one awaits its
    recomputation, so the recomputations pair right in whatever order backward runs them."""
    monkeypatch.setattr(varlen, "CUDNN_AFTER_CALLS", 1)
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    module = nn.Linear(1, 1)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    log = []
    first, second = _checkpointed(q, module, log), _checkpointed(q, module, log)
    if order == "together":
        (first + second).sum().backward()
    else:
        outs = [first, second] if order == "first_forward_first" else [second, first]
        for out in outs:
            out.sum().backward()
    assert log == [("forward", False)] * 2 + [("recompute", False)] * 2
    log.clear()
    _checkpointed(q, module, log).sum().backward()  # nothing awaits: the count decides
    assert log == [("forward", True), ("recompute", True)]


def test_calls_switching_cudnn_off_in_two_threads_switch_it_back_after_the_last():
    import threading

    inside, release = threading.Event(), threading.Event()

    def slow():
        inside.set()
        release.wait(10)
        return torch.backends.cuda.cudnn_sdp_enabled()

    result = {}
    other = threading.Thread(target=lambda: result.setdefault("a", varlen.without_cudnn(slow)))
    other.start()
    assert inside.wait(10)
    assert varlen.without_cudnn(torch.backends.cuda.cudnn_sdp_enabled) is False
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # the other call is still running
    release.set()
    other.join(10)
    assert result == {"a": False} and torch.backends.cuda.cudnn_sdp_enabled()


def test_a_rewritten_decoder_layer_serves_every_packed_length_with_one_trace(monkeypatch):
    """The packed length reaches the attention through a rewritten block (residual_rms_norm's
    decoder layer) as an input of its trace: twenty batches of new lengths, no retrace per
    length (the block's budget of 16 traces once ran out after 16 batches, and the layers then
    computed natively), and the attention sees the PackedLength."""
    seen = []
    is_packed = varlen.is_packed
    monkeypatch.setattr(
        varlen, "is_packed", lambda kw: seen.append(type(kw.get("max_length_q"))) or is_packed(kw)
    )
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).train()
    fastlayers.patch(model, unpad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "traced 16 times"
        for n in range(20):
            ids, mask = _batch(2, 6 + n, left=False)
            labels = ids.masked_fill(mask == 0, -100)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert varlen.PackedLength in seen
    assert len(rewritten_forward(model.model.layers[0])._graphs) <= 4


def test_a_packed_call_passing_the_mask_by_name_is_packed(monkeypatch):
    """Some models call the attention function with ``attention_mask=`` by name: a packed call
    of theirs still runs per sequence."""
    calls = []
    monkeypatch.setattr(varlen, "varlen_attention", lambda fn, m, q, k, v, kw: calls.append(kw))
    dispatch = varlen.varlen_dispatch(lambda *a, **k: "native")
    q = torch.randn(1, 2, 6, 4)
    packing = varlen.packing_kwargs(torch.tensor([0, 2, 6], dtype=torch.int32), 4)
    dispatch(None, q, q, q, attention_mask=None, scaling=0.5, **packing)
    assert len(calls) == 1 and "attention_mask" not in calls[0] and calls[0]["scaling"] == 0.5
    assert dispatch(None, q, q, q, attention_mask=None) == "native"  # not packed: as it is


def test_a_callers_backend_choice_in_another_thread_stands_while_ours_runs():
    """While one of our calls has cuDNN off, another thread's sdpa_kernel(CUDNN_ATTENTION) call
    through a patched attention keeps cuDNN (it would otherwise have no backend left)."""
    import threading

    from torch.nn.attention import SDPBackend, sdpa_kernel

    inside, release = threading.Event(), threading.Event()

    def slow():
        inside.set()
        release.wait(10)

    other = threading.Thread(target=lambda: varlen.without_cudnn(slow))
    other.start()
    assert inside.wait(10)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            assert varlen.without_cudnn(torch.backends.cuda.cudnn_sdp_enabled) is True
    finally:
        release.set()
        other.join(10)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_an_attention_function_called_otherwise_runs_as_it_is():
    """A model's own eager_attention_forward with another calling convention (a sixth
    positional argument) is called as it is, not broken by the route."""

    def attention(module, query, key, value, mask, scale, dropout=0.0):
        return (query, scale, dropout)

    dispatch = varlen.varlen_dispatch(attention)
    q = torch.randn(1, 2, 3, 4)
    out = dispatch(None, q, q, q, None, 0.5, dropout=0.1)
    assert out[0] is q and out[1:] == (0.5, 0.1)


def test_a_hook_copying_the_calls_tensors_keeps_the_packing():
    """A pre-hook that copies each layer's tensor arguments (accelerate moving inputs to a
    layer's device does): the attention calls are still packed, per sequence."""
    native, model, _ = _patched(FAMILIES["bert"])

    def copy_tensors(module, args, kwargs):
        return tuple(args), {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}

    for layer in model.encoder.layer:
        layer.register_forward_pre_hook(copy_tensors, with_kwargs=True)
    ids, mask = _batch(3, 9, left=False)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
        theirs = native(input_ids=ids, attention_mask=mask).last_hidden_state
    assert _stats(model) == {"padding-free": 1}  # packed, and its first check passed
    _assert_real_close(ours, theirs, mask)


def test_cudnn_shape_counts_are_forgotten_past_their_bound(monkeypatch):
    monkeypatch.setattr(varlen, "CUDNN_AFTER_CALLS", 1)
    monkeypatch.setattr(varlen, "_MAX_SHAPES", 3)
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    qs = [torch.randn(1, 2, n, 8) for n in range(1, 5)]
    for q in qs[:3]:
        varlen.cudnn_plan_pays(q, q, None)
    assert varlen.cudnn_plan_pays(qs[0], qs[0], None)  # seen twice: pays
    assert not varlen.cudnn_plan_pays(qs[3], qs[3], None)  # a fourth shape: the counts go
    assert len(varlen._SHAPE_CALLS) == 1
    assert not varlen.cudnn_plan_pays(qs[0], qs[0], None)


def _cudnn_spy() -> tuple[object, list[bool]]:
    """The routed dispatch around an attention that records whether cuDNN's attention was on."""
    seen: list[bool] = []

    def attention(module, q, k, v, mask, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return q, None

    return varlen.varlen_dispatch(attention), seen


@pytest.mark.cuda
def test_cuda_a_shape_seen_often_enough_goes_to_torchs_choice(monkeypatch):
    monkeypatch.setattr(varlen, "CUDNN_AFTER_CALLS", 2)
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    dispatch, seen = _cudnn_spy()
    q = torch.randn(1, 2, 4, 8, device="cuda")
    for _ in range(3):
        dispatch(None, q, q, q, None)
    dispatch(None, q[:, :1], q[:, :1], q[:, :1], None)  # a new shape
    assert seen == [False, False, True, False]
    token = varlen.TORCH_CHOICE.set(True)  # replay's warm-up and capture: torch's choice
    try:
        dispatch(None, q[:, :1], q[:, :1], q[:, :1], None)
    finally:
        varlen.TORCH_CHOICE.reset(token)
    assert seen[-1] is True


@pytest.mark.cuda
def test_cuda_non_reentrant_checkpointing_across_the_cudnn_bound(monkeypatch):
    """Training steps of one shape with non-reentrant gradient checkpointing while the count
    passes the bound: each recomputation takes its forward's backend (cuDNN saves other tensors
    than the memory-efficient kernel: a mismatch would raise in backward)."""
    monkeypatch.setattr(varlen, "CUDNN_AFTER_CALLS", 3)
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).cuda().train()
    fastlayers.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, 100, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0  # padded: a mask reaches the attention
    for _ in range(4):  # the two layers' counts pass 3 within the second step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
    assert max(varlen._SHAPE_CALLS.values()) == 3


@pytest.mark.cuda
def test_cuda_a_padded_masked_attention_skips_cudnn(monkeypatch):
    monkeypatch.setattr(varlen, "_SHAPE_CALLS", {})
    dispatch, seen = _cudnn_spy()
    q = torch.randn(1, 2, 4, 8, device="cuda")
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda")
    dispatch(None, q, q, q, mask)  # a padded call, with a mask or without: cuDNN off
    dispatch(None, q, q, q, None)
    dispatch(None, q.cpu(), q.cpu(), q.cpu(), None)  # CPU: as it is
    assert seen == [False, False, True]


def test_warm_up_refuses_what_it_cannot_capture_naming_the_argument():
    bert = ENCODERS["bert"]()
    ids, mask = _batch(2, 5, left=False)
    with pytest.raises(ValueError, match="unpad=True, replay=True"):
        fastlayers.warm_up(bert, {"input_ids": ids, "attention_mask": mask})
    fastlayers.patch(bert, unpad=True, replay=True)
    assert unpad_forward(bert).graph_memory() == 0  # nothing captured
    with pytest.raises(ValueError, match="CUDA tensor 'attention_mask'"):
        fastlayers.warm_up(bert, {"input_ids": ids, "attention_mask": mask})


def test_warm_up_synthetic_calls_have_the_asked_real_tokens():
    from fastlayers.patching.runtime.unpad import _synthetic

    ids, mask = _batch(3, 7, left=False)
    types_ = torch.randint(0, 2, ids.shape)
    call = _synthetic(
        {"input_ids": ids, "attention_mask": mask, "token_type_ids": types_, "return_dict": True},
        5,
        9,
        37,
    )
    assert call["attention_mask"].shape == (5, 9) and int(call["attention_mask"].sum()) == 37
    assert call["input_ids"].shape == (5, 9) and call["token_type_ids"].shape == (5, 9)
    assert set(call["input_ids"].flatten().tolist()) <= set(ids.flatten().tolist())
    assert call["return_dict"] is True and (call["attention_mask"][:, -1] == 0).all()


@pytest.mark.cuda
def test_cuda_warm_up_captures_ahead_and_a_stream_then_only_replays():
    from fastlayers.patching.checking.numerics import default_tolerance

    rtol, atol = default_tolerance(torch.bfloat16)
    native = _randomise(ENCODERS["bert"]()).cuda().to(torch.bfloat16).eval()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True, replay=True)
    ids, mask = _batch(4, 16, left=False, device="cuda")
    graphs = fastlayers.warm_up(model, {"input_ids": ids, "attention_mask": mask}, 16, 512)
    unpadded = unpad_forward(model)
    assert graphs == unpadded.graph_count() >= 10
    assert unpadded.graph_memory() > 0
    captured = unpadded._replay.stats["captured"]
    with torch.no_grad():
        for batch, seq in ((3, 20), (16, 30), (9, 11), (1, 40), (12, 25)):
            ids, mask = _batch(batch, seq, left=False, device="cuda")
            ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
            theirs = native(input_ids=ids, attention_mask=mask).last_hidden_state
            real = mask.bool()
            a, b = ours[real].float(), theirs[real].float()
            assert (a - b).abs().max().item() <= atol + rtol * b.abs().max().item()
    assert unpadded._replay.stats["captured"] == captured  # nothing new to capture


def _llama_lm() -> nn.Module:
    model = _randomise(tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER))).train()
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and theirs
    for k, g in theirs.items():
        scale = max(g.abs().max().item(), 1e-3)
        assert (ours[k] - g).abs().max().item() <= 1e-4 * scale + 1e-7, k


@pytest.mark.parametrize("order", ["patch_then_lora", "lora_then_patch"])
def test_training_with_peft_lora_matches_native(order):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    native = _llama_lm()
    model = copy.deepcopy(native)
    native = peft.get_peft_model(native, config)
    if order == "patch_then_lora":
        fastlayers.patch(model, unpad=True)
        model = peft.get_peft_model(model, config)
    else:
        model = peft.get_peft_model(model, config)
        fastlayers.patch(model, unpad=True)
    with torch.no_grad():  # the same LoRA weights, B random (not zero): gradients everywhere
        for k, p in native.named_parameters():
            if "lora_B" in k:
                p.normal_()
        model.load_state_dict(native.state_dict())
    ids, mask = _batch(4, 9, left=False)
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for m in (model, native):
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    _assert_grads_close(_grads(model), _grads(native))
    assert any("lora_B" in k for k in _grads(native))
    forward = next(f for m in model.modules() if (f := unpad_forward(m)) is not None)
    assert forward.stats["padding-free"] == 1, dict(forward.stats)
    loss = next(f for m in model.modules() if (f := fused_loss_forward(m)) is not None)
    assert loss.stats == {"fused": 1}, dict(loss.stats)  # the head + loss fused too


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_training_under_ddp_and_fsdp2_matches_native(tmp_path, wrapper):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    started = not dist.is_initialized()
    if started:  # one process, gloo on CPU: the wrappers' hooks and parameters as on GPUs
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
        )
    try:
        native = _llama_lm()
        model = copy.deepcopy(native)
        fastlayers.patch(model, unpad=True)
        if wrapper == "ddp":
            run = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            run = fully_shard(model)
        ids, mask = _batch(4, 9, left=False)
        labels = ids.masked_fill(mask == 0, -100)
        ours = run(input_ids=ids, attention_mask=mask, labels=labels).loss
        ours.backward()
        theirs = native(input_ids=ids, attention_mask=mask, labels=labels).loss
        theirs.backward()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        grads = {
            k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in _grads(model).items()
        }
        _assert_grads_close(grads, _grads(native))
        assert unpad_forward(model.model).stats["padding-free"] == 1
        assert fused_loss_forward(model).stats == {"fused": 1}
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_hf_trainer_with_dynamic_padding_matches_native(tmp_path, accumulation):
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset

    class Texts(Dataset):  # random lengths; the collator pads each batch to its longest
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1)
            self.rows = [
                torch.randint(3, 90, (int(n),), generator=g)
                for n in torch.randint(2, 12, (16,), generator=g)
            ]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.rows[i]}

    def collate(rows: list[dict]) -> dict:
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
            mask[i, : len(r["input_ids"])] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }

    native = _llama_lm()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True)
    losses = {}
    for name, m in (("ours", model), ("native", native)):
        args = tf.TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=4 // accumulation,
            gradient_accumulation_steps=accumulation,  # num_items_in_batch spans micro-batches
            max_steps=3,
            learning_rate=1e-2,
            optim="sgd",  # updates in proportion to the gradients (Adam's sign-like steps on
            # near-zero gradients would turn rounding into whole learning-rate steps)
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            data_seed=0,
        )
        trainer = tf.Trainer(model=m, args=args, train_dataset=Texts(), data_collator=collate)
        trainer.train()
        losses[name] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses["ours"]) == 3
    for a, b in zip(losses["ours"], losses["native"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), losses
    for (k, p), (_, q) in zip(model.named_parameters(), native.named_parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-4 * max(q.abs().max().item(), 1e-3), k
    stats = dict(unpad_forward(model.model).stats)
    if accumulation == 1:
        assert stats == {"padding-free": 3}, stats
    else:  # micro-batches of 2: some have no padding and run as they are
        assert stats["padding-free"] >= 3 and sum(stats.values()) == 6, stats
    # the head + loss fused, with the Trainer's num_items_in_batch
    assert fused_loss_forward(model).stats == {"fused": 3 * accumulation}


@pytest.mark.cuda
def test_cuda_a_call_inside_the_callers_graph_capture_runs_padded():
    model = _randomise(ENCODERS["bert"]()).cuda().eval()
    fastlayers.patch(model, unpad=True)
    ids, mask = _batch(4, 12, left=False, device="cuda")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # the first check, outside the capture
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(input_ids=ids, attention_mask=mask)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = model(input_ids=ids, attention_mask=mask)
        graph.replay()
        expected = model(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(
        out.last_hidden_state[real], expected.last_hidden_state[real], rtol=1e-4, atol=1e-4
    )
    assert any("graph capture" in k for k in unpad_forward(model).stats)


def test_a_row_without_real_tokens_runs_padded_and_does_not_refuse_the_model():
    native, model, _ = _patched(ENCODERS["bert"])
    ids, mask = _batch(3, 8, left=False)
    empty = mask.clone()
    empty[1] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=empty).pooler_output,
            native(input_ids=ids, attention_mask=empty).pooler_output,
        )
        model(input_ids=ids, attention_mask=mask)
    stats = _stats(model)
    assert stats == {
        "padded: a sequence without real tokens (a row of the mask all zeros)": 1,
        "padding-free": 1,
    }, stats


class _FakeGraph:
    """A CUDA graph stand-in for CPU tests of the packed replay's bookkeeping: replay() runs
    the captured call again and writes its outputs into the captured output tensors, as a
    graph's replay rewrites its static outputs."""

    def __init__(self, run, outputs) -> None:
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self) -> None:
        import torch.utils._pytree as pytree

        self.replays += 1
        fresh = pytree.tree_leaves(self.run())
        for static, new in zip(pytree.tree_leaves(self.outputs), fresh, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(new)


@pytest.fixture
def fake_graphs(monkeypatch):
    """The packed replay on CPU: captures recorded by _FakeGraph, CPU inputs allowed."""
    from fastlayers.patching.runtime import packed_replay

    recorded = []

    def record(run, device, pool, options, mask_free):
        out = run()
        graph = _FakeGraph(run, out)
        recorded.append(graph)
        return graph, out

    def why_eager(model, args, kwargs):
        if model.training or torch.is_grad_enabled():
            return "training or autograd"
        return None

    def flash(query, key, value, cu, max_len, causal, scaling):
        # the flash kernel's contract on CPU: each sequence attends to its own rows; rows in no
        # sequence are left unwritten (NaN here: they must never reach a real token)
        out = torch.full_like(query.transpose(1, 2), float("nan"))  # [1, T, H, D]
        bounds = cu.tolist()
        for start, end in itertools.pairwise(bounds):
            if end > start:
                q, k, v = (t[:, :, start:end] for t in (query, key, value))
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, scale=scaling
                )
                out[:, start:end] = o.transpose(1, 2)
        return out

    monkeypatch.setattr(varlen, "_flash_applies", lambda *a: True)
    monkeypatch.setattr(varlen, "_flash", flash)
    monkeypatch.setattr(packed_replay, "record", record)
    monkeypatch.setattr(packed_replay, "_why_eager", why_eager)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool",))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    return recorded


def test_packed_replay_bookkeeping_on_cpu(fake_graphs):
    """Buckets, eviction past max_graphs, growth of the shared buffers, other inputs and the
    outputs at the real tokens, with graphs faked on CPU (the real ones are the cuda tests')."""
    from fastlayers.patching import ReplayOptions

    native = _randomise(ENCODERS["bert"]()).eval()
    model = copy.deepcopy(native)
    fastlayers.patch(model, unpad=True, replay=ReplayOptions(max_graphs=2))
    unpadded = unpad_forward(model)

    def call(total: int, rows: int = 4, types: bool = False) -> None:
        seq = -(-total // rows) + 1
        ids = torch.randint(3, 90, (rows, seq))
        lengths = torch.full((rows,), total // rows)
        lengths[: total % rows] += 1
        mask = (torch.arange(seq)[None] < lengths[:, None]).long()
        extra = {"token_type_ids": torch.randint(0, 2, ids.shape)} if types else {}
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=mask, **extra)
            theirs = native(input_ids=ids, attention_mask=mask, **extra)
        _assert_real_close(ours.last_hidden_state, theirs.last_hidden_state, mask)
        torch.testing.assert_close(ours.pooler_output, theirs.pooler_output)

    # buckets 64, 64, 112, 224, 320, 64: the least used goes past two graphs; 64 (used most)
    # stays and replays at the end
    for total in (40, 40, 100, 200, 300, 40):
        call(total)
    stats = unpadded._replay.stats
    why = (dict(unpadded.stats), dict(stats))
    assert unpadded.graph_count() == 2, why
    assert stats["captured"] == 4 and stats["evicted"] == 2 and stats["replayed"] == 3, why
    # past the first buffers (4096 rows): eager once, then grown (graphs dropped), then replayed
    call(5000, rows=40)
    assert stats["eager: past the buffers (grown for the next calls)"] == 1, dict(stats)
    call(5000, rows=40)
    call(5000, rows=40)
    assert stats["dropped: buffers grown"] == 2 and stats["replayed"] == 4, dict(stats)
    call(40, types=True)  # token types given: the same inputs, other values
    assert unpadded.stats["padding-free"] == 10, dict(unpadded.stats)
    # every replay went through a graph: one at each capture (its check), then one per call
    assert sum(g.replays for g in fake_graphs) == stats["captured"] + stats["replayed"]


def test_a_tuple_asked_for_is_made_from_the_packed_outputs():
    """return_dict=False (BERT's tuple holds its pooler's output): the call stays padding-free,
    and so do the calls after it."""
    native, model, _ = _patched(ENCODERS["bert"])
    ids, mask = _batch(3, 8, left=False)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, return_dict=False)
        theirs = native(input_ids=ids, attention_mask=mask, return_dict=False)
        model(input_ids=ids, attention_mask=mask)
    assert isinstance(ours, tuple) and len(ours) == len(theirs) == 2
    _assert_real_close(ours[0], theirs[0], mask)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    assert _stats(model) == {"padding-free": 2}
