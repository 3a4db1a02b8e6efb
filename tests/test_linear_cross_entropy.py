"""The fused head + loss: the op (fastlayers.functional.linear_cross_entropy) against F.linear +
F.cross_entropy and a float64 reference, and the rule 'linear_cross_entropy' on causal LMs of
every family (loss and every gradient against native, logits None only in training with labels,
refusals with reasons, changes after the patch, undo)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from fastlayers.patching.fused import fused_loss_forward
from tiny_models import DECODER
from torch import nn

import fastlayers
from fastlayers.functional import linear_cross_entropy

V, H = 97, 32


def native_loss(hidden, weight, target, bias=None, ignore_index=-100, num=None, softcap=None):
    """What a causal LM computes: F.linear, the soft-cap, .float(), F.cross_entropy."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
    logits = logits.reshape(-1, weight.shape[0])
    if num is None:
        return F.cross_entropy(logits, target.reshape(-1), ignore_index=ignore_index)
    loss = F.cross_entropy(logits, target.reshape(-1), ignore_index=ignore_index, reduction="sum")
    return loss / num


def _inputs(rows=(3, 11), device="cpu", bias=True, seed=0, ignored=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*rows, H, generator=g).to(device).requires_grad_()
    weight = (0.3 * torch.randn(V, H, generator=g)).to(device).requires_grad_()
    b = torch.randn(V, generator=g).to(device).requires_grad_() if bias else None
    target = torch.randint(0, V, rows, generator=g).to(device)
    if ignored:  # else every row real: the op's chunks are slices, nothing gathered
        target[0, :4] = -100
    return hidden, weight, b, target


def _run(fn, hidden, weight, bias, target, **kw):
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    loss = fn(hidden, weight, target, bias, **kw)
    loss.backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    return [loss.detach(), *grads]


def _ours(hidden, weight, target, bias, num=None, **kw):
    return linear_cross_entropy(hidden, weight, target, bias, num_items_in_batch=num, **kw)


def _theirs(hidden, weight, target, bias, rows_per_chunk=None, **kw):
    return native_loss(hidden, weight, target, bias, **kw)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_targets_are_compared_as_classes_not_wrapped(dtype):
    """A target in a narrow integer dtype is a class index as F.cross_entropy reads it: the
    vocabulary bound and ignore_index must not wrap in that dtype (a uint8 156 is not -100, and
    300 words do not overflow a uint8 comparison)."""
    vocab = 300 if dtype == torch.uint8 else 40000
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g)
    weight = 0.3 * torch.randn(vocab, 16, generator=g)
    high = torch.iinfo(dtype).max if dtype != torch.int32 else vocab - 1
    target = torch.randint(0, min(high, vocab - 1) + 1, (2, 9), generator=g).to(dtype)
    target[0, 0] = 156  # a uint8 156 wraps to -100 in int8 arithmetic; natively a class
    ours = linear_cross_entropy(hidden, weight, target)
    theirs = native_loss(hidden, weight, target.long())
    torch.testing.assert_close(ours, theirs)


def test_chunks_are_bounded_by_memory_down_to_a_floor_of_rows():
    """A chunk's logits stay under CHUNK_LOGITS where that leaves MIN_CHUNK_ROWS rows or more (a
    small vocabulary: llama-1b's 32,000 words get 2,048-row chunks, not one of every token), and
    never go below that floor (a large vocabulary, where each chunk's round trip of the float32
    weight gradient costs time)."""
    from fastlayers.ops import linear_cross_entropy as lce

    for vocab in (32000, 50257, 128256, 256000):
        rows = lce.chunk_rows(vocab, 8192)
        assert rows % 64 == 0 and rows >= lce.MIN_CHUNK_ROWS
        assert rows * vocab <= lce.CHUNK_LOGITS or rows == lce.MIN_CHUNK_ROWS
        assert (rows + 64) * vocab > lce.CHUNK_LOGITS  # as many as fit
    assert lce.chunk_rows(32000, 8192) < 8192
    assert lce.chunk_rows(32000, 100) == 100 and lce.chunk_rows(32000, 0) == 1


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("num", [None, 37, "tensor"])
@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("ignored", [True, False])
def test_op_float32_matches_native_and_float64(softcap, num, chunk, ignored):
    hidden, weight, bias, target = _inputs(ignored=ignored)
    if num == "tensor":
        num = torch.tensor(29)
    kw = dict(softcap=softcap, num=num, rows_per_chunk=chunk)
    ours = _run(_ours, hidden, weight, bias, target, **kw)
    theirs = _run(_theirs, hidden, weight, bias, target, **kw)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    ref = _run(_theirs, h64, w64, b64, target, **kw)
    for a, b, r in zip(ours, theirs, ref, strict=True):
        native_err = (b.double() - r).abs().max().item()
        floor = 4 * torch.finfo(torch.float32).eps * r.abs().max().item()
        assert (a.double() - r).abs().max().item() <= 2 * native_err + floor


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("ignored", [True, False])
@pytest.mark.parametrize("chunk", [5, None])
def test_op_under_bfloat16_autocast_rounds_as_native(softcap, ignored, chunk):
    """float32 hidden states and weights under autocast: each chunk's rows cast inside, the
    hidden states' gradient widened to float32 as autocast's cast gives it back."""
    hidden, weight, bias, target = _inputs(rows=(4, 16), ignored=ignored)
    results = []
    for fn in (_ours, _theirs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kw = dict(softcap=softcap, num=None, rows_per_chunk=chunk)
            results.append(_run(fn, hidden, weight, bias, target, **kw))
    (loss, d_hidden, *d_params), (loss_n, d_hidden_n, *d_params_n) = results
    # the same rounding points: the loss (float32 over the same bfloat16 logits) and the hidden
    # states' gradient (one bfloat16 GEMM of the same rounded gradient) equal native's; the
    # weight's and bias's sums over chunks differ from native's one sum by accumulation order
    torch.testing.assert_close(loss, loss_n, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(d_hidden, d_hidden_n, rtol=1e-6, atol=1e-7)
    for a, b in zip(d_params, d_params_n, strict=True):
        assert a.dtype == b.dtype
        ulp = torch.finfo(torch.bfloat16).eps * b.abs().max().item()
        assert (a - b).abs().max().item() <= ulp


def test_op_edge_cases():
    hidden, weight, bias, target = _inputs()
    ignored = torch.full_like(target, 7)
    loss = linear_cross_entropy(hidden, weight, ignored, bias, ignore_index=7)
    assert torch.isnan(loss)  # as F.cross_entropy's mean over no target
    loss = linear_cross_entropy(hidden, weight, ignored, bias, ignore_index=7, num_items_in_batch=3)
    loss.backward()
    assert loss.item() == 0 and hidden.grad.abs().max() == 0
    target = torch.where(target == -100, 5, target)
    torch.testing.assert_close(
        linear_cross_entropy(hidden, weight, target, bias, ignore_index=5),
        native_loss(hidden, weight, target, bias, ignore_index=5),
    )
    with torch.no_grad():  # no gradient wanted: the loss alone
        torch.testing.assert_close(
            linear_cross_entropy(hidden.transpose(0, 1), weight, target.t(), bias),
            native_loss(hidden.transpose(0, 1), weight, target.t(), bias),
        )
    frozen = weight.detach()  # only the hidden states learn (LoRA below the head)
    hidden.grad = None
    linear_cross_entropy(hidden, frozen, target).backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    native_loss(hidden, frozen, target).backward()
    torch.testing.assert_close(expected, hidden.grad)


@pytest.mark.parametrize(
    "change, error, name",
    [
        (lambda h, w, t, b: (h.long(), w, t, b), TypeError, "hidden"),
        (lambda h, w, t, b: (h, w[:, :-1], t, b), ValueError, "weight"),
        (lambda h, w, t, b: (h, w, t.float(), b), TypeError, "target"),
        (lambda h, w, t, b: (h, w, t[:, :-1], b), ValueError, "target"),
        (lambda h, w, t, b: (h, w, t, b[:-1]), ValueError, "bias"),
        (lambda h, w, t, b: (h, w.double(), t, b), TypeError, "weight"),
        (lambda h, w, t, b: (h, w, torch.full_like(t, V), b), ValueError, "target"),
        (lambda h, w, t, b: (h, w, torch.full_like(t, -3), b), ValueError, "target"),
    ],
)
def test_op_bad_inputs_name_the_argument(change, error, name):
    hidden, weight, bias, target = _inputs()
    args = change(hidden, weight, target, bias)
    with pytest.raises(error, match=f"`{name}`"):
        linear_cross_entropy(args[0], args[1], args[2], args[3])


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"ignore_index": 1.5}, "ignore_index"),
        ({"softcap": 0}, "softcap"),
        ({"rows_per_chunk": 0}, "rows_per_chunk"),
    ],
)
def test_op_bad_options_name_the_argument(kw, name):
    hidden, weight, bias, target = _inputs()
    with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
        linear_cross_entropy(hidden, weight, target, bias, **kw)


# ------------------------------------------------------------------ the rule

LMS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**DECODER)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**DECODER)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**DECODER, head_dim=16)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**DECODER, head_dim=16)),
    "gemma2_softcap": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(**DECODER, head_dim=16, final_logit_softcapping=2.0)
    ),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**DECODER, pad_token_id=0)),
    "gpt2_tied": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    ),
    "opt": lambda: tf.OPTForCausalLM(
        tf.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=32,
            dropout=0.0,
        )
    ),
}


def _lm(name: str) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LMS[name]()
    with torch.no_grad():  # weights well away from an init that hides mistakes (zero biases)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def _batch(batch=3, seq=10, vocab=90):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    mask[2, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :3] = -100  # a prompt
    return ids, mask, labels


def _grads(model):
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _assert_close_grads(ours, theirs):
    assert ours.keys() == theirs.keys() and theirs
    for k, g in theirs.items():
        scale = max(g.abs().max().item(), 1e-3)
        assert (ours[k] - g).abs().max().item() <= 1e-5 * scale + 1e-7, k


def _step(model, **call):
    out = model(**call)
    out.loss.backward()
    return out


@pytest.mark.parametrize("name", list(LMS))
def test_every_family_loss_and_gradients_equal_native(name):
    native = _lm(name)
    model = copy.deepcopy(native)
    report = fastlayers.patch(model)
    assert [s.rule for s in report.swaps].count("linear_cross_entropy") == 1
    ids, mask, labels = _batch()
    ours = _step(model, input_ids=ids, attention_mask=mask, labels=labels)
    theirs = _step(native, input_ids=ids, attention_mask=mask, labels=labels)
    assert ours.logits is None and theirs.logits is not None
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    _assert_close_grads(_grads(model), _grads(native))
    assert fused_loss_forward(model).stats == {"fused": 1}
    model.eval()  # eval mode, or no labels: logits as natively
    native.eval()
    with torch.no_grad():
        for call in ({"labels": labels}, {}):
            a = model(input_ids=ids, attention_mask=mask, **call)
            b = native(input_ids=ids, attention_mask=mask, **call)
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        {"num_items_in_batch": torch.tensor(11)},
        {"num_items_in_batch": 7},
        {"ignore_index": 5},
        {"shift_labels": "shifted"},
    ],
)
def test_the_loss_functions_arguments_are_honoured(extra):
    native = _lm("llama")
    model = copy.deepcopy(native)
    fastlayers.patch(model)
    ids, mask, labels = _batch()
    if "shift_labels" in extra:
        extra = {"shift_labels": torch.roll(labels, -1, dims=1)}
    if "ignore_index" in extra:
        labels = labels.masked_fill(labels == -100, 5)
    ours = _step(model, input_ids=ids, attention_mask=mask, labels=labels, **extra)
    theirs = _step(native, input_ids=ids, attention_mask=mask, labels=labels, **extra)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    _assert_close_grads(_grads(model), _grads(native))
    assert fused_loss_forward(model).stats == {"fused": 1}


def test_a_tuple_asked_for_has_the_loss_first_and_no_logits():
    native = _lm("llama")
    model = copy.deepcopy(native)
    fastlayers.patch(model)
    ids, mask, labels = _batch()
    ours = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    theirs = native(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(ours, tuple)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    assert len(ours) == len(theirs) - 1  # the logits left out


def test_gradient_checkpointing_and_unpad_together():
    native = _lm("llama")
    model = copy.deepcopy(native)
    for m in (native, model):
        m.gradient_checkpointing_enable()
    fastlayers.patch(model, unpad=True)
    ids, mask, labels = _batch()
    ours = _step(model, input_ids=ids, attention_mask=mask, labels=labels)
    theirs = _step(native, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    _assert_close_grads(_grads(model), _grads(native))
    assert fused_loss_forward(model).stats == {"fused": 1}


def test_models_the_rule_cannot_prove_are_refused_with_the_reason():
    config = tf.MixtralConfig(**DECODER, num_local_experts=2, output_router_logits=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = fastlayers.patch(tf.MixtralForCausalLM(config), dry_run=True)
    skips = [s for s in report.skips if s.rule == "linear_cross_entropy"]
    assert len(skips) == 1 and "labels" in skips[0].reason, skips
    report = fastlayers.patch(tf.LlamaForSequenceClassification(tf.LlamaConfig(**DECODER)))
    assert "linear_cross_entropy" not in {s.rule for s in report.swaps + report.skips}


def test_changes_after_the_patch_compute_logits_and_stay_right():
    native = _lm("llama")
    model = copy.deepcopy(native)
    fastlayers.patch(model)
    ids, mask, labels = _batch()
    call = dict(input_ids=ids, attention_mask=mask, labels=labels)
    forward = fused_loss_forward(model)
    head = model.lm_head

    def custom(logits, labels, vocab_size, **kwargs):  # a user's own loss
        return logits.float().square().mean()

    class Scaled(nn.Linear):  # a head of another kind
        def forward(self, x):
            return super().forward(x) * 2

    scaled = Scaled(model.config.hidden_size, model.config.vocab_size)
    for change, undo in (
        (lambda: setattr(model, "loss_function", custom), lambda: delattr(model, "_loss_function")),
        (
            lambda: model.lm_head.register_forward_hook(lambda m, i, o: o * 2),
            lambda: model.lm_head._forward_hooks.clear(),
        ),
        (lambda: setattr(model, "lm_head", scaled), lambda: setattr(model, "lm_head", head)),
    ):
        change()
        for m in (model, native):
            m.zero_grad()
        native_copy = copy.deepcopy(native)
        native_copy.loss_function = model.loss_function  # the same change natively
        native_copy.lm_head = copy.deepcopy(model.lm_head)
        ours = _step(model, **call)
        theirs = _step(native_copy, **call)
        assert ours.logits is not None
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
        undo()
    assert forward.stats["fused"] == 0 and sum(forward.stats.values()) == 3, forward.stats
    _step(model, **call)
    assert forward.stats["fused"] == 1
    # a new plain Linear head (as resize_token_embeddings makes one), with a bias: still fused
    model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size)
    native_copy = copy.deepcopy(model)
    fastlayers.unpatch(native_copy)
    model.zero_grad()
    ours = _step(model, **call)
    theirs = _step(native_copy, **call)
    assert ours.logits is None and forward.stats["fused"] == 2
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    _assert_close_grads(_grads(model), _grads(native_copy))


def test_unpatch_copies_state_dict_and_layers_off():
    native = _lm("llama")
    model = copy.deepcopy(native)
    keys = list(model.state_dict())
    fastlayers.patch(model)
    assert list(model.state_dict()) == keys
    assert fastlayers.patch(model).swaps == []  # twice: nothing more
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        ids, mask, labels = _batch()
        assert other(input_ids=ids, attention_mask=mask, labels=labels).logits is None
        assert fused_loss_forward(other) is not None
    fastlayers.unpatch(model)
    assert "forward" not in model.__dict__ and fused_loss_forward(model) is None
    ids, mask, labels = _batch()
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is not None
    off = copy.deepcopy(native)
    layers = [n for n in fastlayers.patching.rules.DEFAULT_LAYERS if n != "linear_cross_entropy"]
    fastlayers.patch(off, layers=layers)
    assert fused_loss_forward(off) is None
    assert off(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_op_matches_native_rounding(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, hidden_size = 32000, 256
    hidden = torch.randn(4, 300, hidden_size, device="cuda", generator=g).requires_grad_()
    weight = (0.05 * torch.randn(vocab, hidden_size, device="cuda", generator=g)).requires_grad_()
    target = torch.randint(0, vocab, (4, 300), device="cuda", generator=g)
    target[:, :50] = -100
    results = []
    for fn in (linear_cross_entropy, native_loss):
        hidden.grad = weight.grad = None
        with torch.autocast("cuda", dtype=dtype):
            loss = fn(hidden, weight, target)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = native_loss(h64, w64, target)
    ref.backward()
    for ours, theirs, r in zip(*results, (ref.detach(), h64.grad, w64.grad), strict=True):
        native_err = (theirs.double() - r).abs().max().item()
        floor = 4 * torch.finfo(torch.float32).eps * r.abs().max().item()
        assert (ours.double() - r).abs().max().item() <= 2 * native_err + floor


@pytest.mark.cuda
@pytest.mark.parametrize("weights", ["bf16", "fp32 under autocast"])
def test_cuda_op_peak_holds_no_whole_copy_of_the_hidden_states(weights):
    """The op's peak is its gradient buffers, the weight's cast copy and one chunk's work: the
    selected rows, their autocast cast and their gradient are never copied whole (each would
    add 64 MiB here, twice that for the float32 cast)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, vocab, chunk = 8192, 4096, 8192, 1024
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g, dtype=dtype)
    weight = 0.02 * torch.randn(vocab, hidden_size, device="cuda", generator=g, dtype=dtype)
    hidden.requires_grad_(), weight.requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    target[::7] = -100
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32)
    with autocast:  # cuBLAS's workspaces made before the count
        linear_cross_entropy(hidden[:64], weight, target[:64]).backward()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with autocast:
        loss = linear_cross_entropy(hidden, weight, target, rows_per_chunk=chunk)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    mib = 2**-20
    expected = (
        vocab * hidden_size * 4 * mib  # the weight's float32 gradient sum
        + tokens * hidden_size * 2 * mib  # the hidden states' gradient, bf16
        + (vocab * hidden_size * 2 * mib if dtype == torch.float32 else 0)  # the weight's cast
        + chunk * vocab * 2 * mib  # one chunk's logits
        + 3 * chunk * hidden_size * dtype.itemsize * mib  # its rows, their cast, their gradient
    )
    assert peak <= expected + 8, (peak, expected)
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and (hidden.grad[::7] == 0).all()


@pytest.mark.cuda
def test_cuda_llama_training_step_bf16_autocast():
    native = _lm("llama").cuda()
    model = copy.deepcopy(native)
    fastlayers.patch(model)
    ids, mask, labels = (t.cuda() for t in _batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = _step(model, input_ids=ids, attention_mask=mask, labels=labels)
        theirs = _step(native, input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=2e-2, atol=1e-3)
    assert ours.logits is None and fused_loss_forward(model).stats == {"fused": 1}


# ------------------------------------------------------------------ the rows kernel


def _rows_reference(logits, target, normaliser, softcap, dtype=None):
    """The loss per row and the gradient as native's autograd chain gives them (in ``dtype``:
    float64 for a reference)."""
    x = logits.detach().clone().to(dtype or logits.dtype).requires_grad_()
    z = torch.tanh(x / softcap) * softcap if softcap else x
    rows = F.cross_entropy(
        z.to(torch.promote_types(z.dtype, torch.float32)), target, reduction="none"
    )
    (rows.sum() / normaliser).backward()
    return rows.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("vocab", [1, 7, 4099])
def test_rows_kernel_loss_and_gradient_as_native(dtype, softcap, vocab, device="cpu"):
    g = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(5, vocab, generator=g)).to(device, dtype)
    target = torch.randint(0, vocab, (5,), generator=g).to(device)
    normaliser = torch.tensor(3.0, device=device)
    loss_native, grad_native = _rows_reference(logits, target, normaliser, softcap)
    loss_ref, grad_ref = _rows_reference(logits, target, normaliser, softcap, torch.float64)
    kept = logits.clone()
    loss = torch.ops.fastlayers.cross_entropy_rows_(kept, target, normaliser, softcap, False)
    assert torch.equal(kept, logits)  # without grad the logits stay
    torch.ops.fastlayers.cross_entropy_rows_(kept, target, normaliser, softcap, True)
    for ours, native, ref in ((loss, loss_native, loss_ref), (kept, grad_native, grad_ref)):
        native_err = (native.double() - ref).abs().max().item()
        floor = torch.finfo(dtype).eps * ref.abs().max().item()
        assert (ours.double() - ref).abs().max().item() <= 2 * native_err + floor


def test_rows_kernel_refuses_bad_arguments():
    logits, target = torch.randn(3, 8), torch.randint(0, 8, (3,))
    norm = torch.tensor(1.0)
    op = torch.ops.fastlayers.cross_entropy_rows_
    for args, text in (
        ((logits.t().contiguous().t(), target, norm), "contiguous"),
        ((logits.double(), target, norm), "float32, float16 or bfloat16"),
        ((logits, target.int(), norm), "target"),
        ((logits, target[:2], norm), "target"),
        ((logits, target, norm.double()), "normaliser"),
        ((logits, torch.full_like(target, 8), norm), "outside"),
    ):
        with pytest.raises(RuntimeError, match=text):
            op(*args, 0.0, True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("vocab", [7, 4099, 128256])
def test_cuda_rows_kernel_loss_and_gradient_as_native(dtype, softcap, vocab):
    test_rows_kernel_loss_and_gradient_as_native(dtype, softcap, vocab, device="cuda")


def test_op_a_second_backward_is_refused_not_wrong():
    hidden, weight, bias, target = _inputs()
    loss = linear_cross_entropy(hidden, weight, target, bias)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_op_called_in_a_compiled_function_is_not_recompiled_per_real_target_count():
    """A compiled function calling the op with a different number of ignored targets each call:
    the op runs outside the graph (one graph break), so no count recompiles it; loss and
    gradients as eager's."""
    torch._dynamo.reset()
    hidden, weight, bias, target = _inputs(rows=(3, 11))

    def head(h, w, t, b):
        return linear_cross_entropy(torch.tanh(h), w, t, b) * 2

    compiled = torch.compile(head, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ignored in range(1, 6):  # five different real-target counts
            t = target.clone()
            t.view(-1)[:ignored] = -100
            ours = _run(compiled, hidden, weight, bias, t)
            theirs = _run(head, hidden, weight, bias, t)
            for a, b in zip(ours, theirs, strict=True):
                assert torch.equal(a, b)


def test_under_torch_compile_the_head_runs_natively():
    native = _lm("llama")
    model = copy.deepcopy(native)
    fastlayers.patch(model)
    ids, mask, labels = _batch()
    ours = _step(torch.compile(model), input_ids=ids, attention_mask=mask, labels=labels)
    theirs = _step(native, input_ids=ids, attention_mask=mask, labels=labels)
    assert ours.logits is not None  # traced: the op's selected rows are a host count
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    _assert_close_grads(_grads(model), _grads(native))
    assert dict(fused_loss_forward(model).stats) == {"logits: torch.compile is tracing": 1}
