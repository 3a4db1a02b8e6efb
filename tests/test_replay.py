"""Host-free replay (``fastlayers.patch(model, replay=True)``): buckets, refusals and the record
on CPU; on CUDA, replayed outputs at the real positions against eager for each family, padding
by bucket, outputs that outlive the next call, captures again after the model changes, and a
model whose output depends on the padded length."""

import copy
import pickle

import pytest
import torch
import transformers as tf
from fastlayers.patching.checking.numerics import default_tolerance
from fastlayers.patching.fused import replay_forward
from fastlayers.patching.runtime.replay import batch_bucket, seq_bucket
from tiny_models import MODELS, TINY, first_output
from torch import nn

import fastlayers

# ---------------------------------------------------------------- CPU: buckets, record, refusals


def test_buckets_round_up_with_bounded_padding():
    assert [seq_bucket(n) for n in (1, 8, 9, 31, 128, 129, 200, 257, 500)] == [
        8,
        8,
        16,
        32,
        128,
        144,
        208,
        288,
        512,
    ]
    for n in range(1, 2049):
        assert n <= seq_bucket(n) <= max(n * 1.125, n + 7)
    buckets = (1, 2, 4, 8, 128)
    assert [batch_bucket(n, buckets) for n in (1, 3, 8, 9, 128, 129)] == [1, 4, 8, 128, 128, None]


def _bert() -> nn.Module:
    return tf.BertModel(tf.BertConfig(num_hidden_layers=2, **TINY)).eval()


def test_replay_is_a_record_reported_undone_and_copied():
    model = _bert()
    keys = set(model.state_dict())
    report = fastlayers.patch(model, replay=True)
    assert report.counts()["replay"] == 1
    assert "CUDA graph replay" in str(report)
    assert replay_forward(model) is not None
    assert set(model.state_dict()) == keys
    assert fastlayers.patch(model, replay=True).counts() == {}  # idempotent
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert replay_forward(twin) is not None and replay_forward(twin).model is twin
    fastlayers.unpatch(model)
    assert "forward" not in model.__dict__
    assert set(model.state_dict()) == keys


def test_replay_alone_wraps_an_unpatched_model():
    model = _bert()
    assert fastlayers.patch(model, layers=(), replay=True).counts() == {"replay": 1}
    ids = torch.randint(0, 90, (2, 7))
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
    fastlayers.unpatch(model)
    with torch.no_grad():
        assert torch.equal(out, model(input_ids=ids).last_hidden_state)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("cpu", "an input is on the CPU"),
        ("training", "training mode"),
        ("autograd", "autograd is on"),
        ("dict argument", "an argument is a dict"),
    ],
)
def test_calls_it_cannot_replay_run_eagerly_with_the_reason(case, reason):
    model = _bert()
    native = copy.deepcopy(model)
    fastlayers.patch(model, replay=True)
    ids = torch.randint(0, 90, (2, 7))
    kwargs = {"input_ids": ids}
    if case == "dict argument":
        kwargs["kwargs_dict"] = {}  # not a tensor or a constant
        call = lambda m: m.forward(**kwargs)  # noqa: E731
    else:
        call = lambda m: m(**kwargs)  # noqa: E731
    if case == "training":
        model.train(), native.train()
        for m in (model, native):
            for d in m.modules():
                if isinstance(d, nn.Dropout):
                    d.p = 0.0
    grad = torch.enable_grad() if case == "autograd" else torch.no_grad()
    with pytest.warns(RuntimeWarning, match=reason), grad:
        try:
            out = call(model)
        except TypeError:  # BertModel takes no such keyword: it ran eagerly, as native does
            with pytest.raises(TypeError):
                call(native)
            return
    stats = replay_forward(model).stats
    assert [k for k in stats if reason in k], stats
    with grad:
        expected = call(native)
    torch.testing.assert_close(first_output(out), first_output(expected), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- CUDA


def _ids_and_mask(batch: int, seq: int, device: str) -> dict:
    """Right-padded ids with a mask, as a tokenizer pads a sorted batch: row i has seq - i
    real tokens (at least 1)."""
    ids = torch.randint(1, 90, (batch, seq), device=device)
    lengths = torch.clamp(seq - torch.arange(batch, device=device), min=1)
    mask = (torch.arange(seq, device=device)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


_FAMILIES = {
    "bert": MODELS["bert"][0],
    "distilbert": MODELS["distilbert"][0],
    "gpt2": MODELS["gpt2"][0],
    "opt": MODELS["opt"][0],
    "t5-encoder": lambda: tf.T5EncoderModel(
        tf.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16)
    ),
    "vit": MODELS["vit"][0],
}


def _inputs(name: str, batch: int, seq: int, dtype: torch.dtype) -> dict:
    if name == "vit":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, device="cuda", dtype=dtype)}
    inputs = _ids_and_mask(batch, seq, "cuda")
    if name in ("gpt2", "opt"):
        inputs["use_cache"] = False
    return inputs


def _real_positions(out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None or out.dim() < 3:
        return out
    return out * mask[..., None].to(out.dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(_FAMILIES))
def test_replay_matches_eager_at_the_real_positions(name, dtype):
    torch.manual_seed(0)
    native = _FAMILIES[name]().to("cuda", dtype).eval()
    model = copy.deepcopy(native)
    report = fastlayers.patch(model, replay=True)
    assert report.counts()["replay"] == 1
    rtol, atol = default_tolerance(dtype)
    shapes = [(3, 13), (3, 13), (4, 9), (7, 30), (2, 5), (4, 9)]  # buckets met again
    kept = []
    for batch, seq in shapes:
        inputs = _inputs(name, batch, seq, dtype)
        with torch.no_grad():
            out = first_output(model(**inputs))
            expected = first_output(native(**inputs))
        mask = inputs.get("attention_mask")
        assert out.shape == expected.shape
        a, b = _real_positions(out, mask).float(), _real_positions(expected, mask).float()
        bound = atol + rtol * b.abs().max().item()
        assert (a - b).abs().max().item() <= bound, (name, batch, seq)
        kept.append((out, out.clone()))
    stats = replay_forward(model).stats
    assert stats["replayed"] >= 2 and stats["captured"] >= 3, stats
    assert not [k for k in stats if k.startswith("eager")], stats
    for out, copy_ in kept:  # outputs are copies: later replays do not overwrite them
        assert torch.equal(out, copy_)


@pytest.mark.cuda
def test_replay_sees_weights_replaced_updated_and_modules_swapped():
    torch.manual_seed(0)
    native = _bert().cuda()
    model = copy.deepcopy(native)
    fastlayers.patch(model, replay=True)
    inputs = _ids_and_mask(4, 12, "cuda")

    def compare():
        with torch.no_grad():
            a = model(**inputs).last_hidden_state
            b = native(**inputs).last_hidden_state
        mask = inputs["attention_mask"]
        torch.testing.assert_close(_real_positions(a, mask), _real_positions(b, mask))

    compare()
    compare()
    with torch.no_grad():  # updated in place: the graph reads the same storage
        for m in (model, native):
            m.encoder.layer[0].intermediate.dense.weight.mul_(1.5)
    compare()
    new = torch.randn_like(native.pooler.dense.weight)  # a Parameter replaced
    native.pooler.dense.weight = nn.Parameter(new.clone())
    model.pooler.dense.weight = nn.Parameter(new.clone())
    compare()
    for m in (model, native):  # a module swapped
        m.encoder.layer[1].output.dropout = nn.Identity()
    compare()
    handle = model.encoder.layer[0].register_forward_hook(lambda *a: None)
    with pytest.warns(RuntimeWarning, match="forward hooks"):
        compare()
    handle.remove()
    compare()
    assert replay_forward(model).stats["replayed"] >= 2


class _MeanOverAllColumns(nn.Module):
    """Ignores its mask: its output depends on how many columns there are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(90, 8)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        return h - h.mean(dim=1, keepdim=True)


@pytest.mark.cuda
def test_a_model_whose_output_depends_on_the_padded_length_is_captured_exactly():
    model = _MeanOverAllColumns().cuda().eval()
    native = copy.deepcopy(model)
    fastlayers.patch(model, layers=(), replay=True)
    inputs = _ids_and_mask(4, 13, "cuda")
    with pytest.warns(RuntimeWarning, match="depends on the padded length"), torch.no_grad():
        first = model(**inputs)
    with torch.no_grad():
        second = model(**inputs)
        third = model(**inputs)
        expected = native(**inputs)
    for out in (first, second, third):
        torch.testing.assert_close(out, expected)
    assert replay_forward(model).stats["replayed"] >= 1


@pytest.mark.cuda
def test_a_kv_cache_output_is_refused_with_the_reason():
    model = MODELS["gpt2"][0]().cuda().eval()
    fastlayers.patch(model, replay=True)
    inputs = _ids_and_mask(2, 8, "cuda")
    with pytest.warns(RuntimeWarning, match="use_cache=False"), torch.no_grad():
        out = model(**inputs, use_cache=True)
    assert out.past_key_values is not None


def test_attention_under_capture_gives_eager_decisions_or_a_usable_mask():
    """While a capture runs, transformers builds a mask where eager passes none: with no mask
    input, each attention call gets eager's decision back (no mask, its causal flag); with one,
    a mask with a stride-0 last dim (which fused kernels refuse) is made contiguous."""
    import torch.nn.functional as F
    from fastlayers.patching.runtime.capture_attention import AttentionUnderCapture

    sdpa = F.scaled_dot_product_attention
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    causal_mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    attention = AttentionUnderCapture(mask_free=True)
    with attention.warming_up():
        F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
    assert attention.eager == [((2, 3, 5, 8), True, True)]
    seen = []
    with attention.capturing():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
        seen.append(F.scaled_dot_product_attention is not sdpa)
    assert seen == [True] and F.scaled_dot_product_attention is sdpa  # put back after
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True))
    broadcast = torch.ones(2, 1, 5, 1, dtype=torch.bool).expand(2, 1, 5, 5)
    with AttentionUnderCapture(mask_free=False).capturing():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=broadcast)
    torch.testing.assert_close(out, sdpa(q, k, v))


def test_replay_options_and_argument_are_checked():
    from fastlayers import ReplayOptions

    with pytest.raises(TypeError, match="replay must be True, False or a ReplayOptions"):
        fastlayers.patch(_bert(), replay=1)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        ReplayOptions(warmup=0)
    with pytest.raises(ValueError, match="batch_buckets"):
        ReplayOptions(batch_buckets=())


def test_positional_inputs_are_named_after_the_forward_parameters():
    """A mask passed positionally is still a mask (sequence buckets; no mask-free capture)."""
    from fastlayers.patching.runtime.call import CallView

    model = _bert()
    fastlayers.patch(model, layers=(), replay=True)
    forward = replay_forward(model)
    ids, mask = torch.randint(3, 100, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    types_ = torch.zeros(2, 5, dtype=torch.long)
    view = CallView.bind(forward.__signature__, (ids, mask), {"token_type_ids": types_})
    assert view.mask is mask  # the view replay reads the mask from (the one padding-free reads)
    assert list(view.tensors()) == ["input_ids", "attention_mask", "token_type_ids"]


def test_the_model_test_sees_what_a_capture_bakes_in():
    """The per-call test of the module tree: it holds across the check's native passes
    (natives_restored puts the very same modules back) and fails on a hook, a replaced
    Parameter, a storage moved (.data), a swapped module or a training flag."""
    from fastlayers.patching.runtime.replay import model_test

    model = _bert()
    fastlayers.patch(model)
    test = model_test(model)
    with fastlayers.patching.plan.natives_restored(model):
        pass
    assert test()
    handle = model.encoder.layer[0].register_forward_hook(lambda *a: None)
    assert not test()
    handle.remove()
    assert test()
    changes = [
        lambda m: setattr(m.pooler.dense, "weight", nn.Parameter(m.pooler.dense.weight.clone())),
        lambda m: setattr(m.pooler.dense.weight, "data", m.pooler.dense.weight.data.clone()),
        lambda m: setattr(m.encoder.layer[1].output, "dropout", nn.Dropout(0.0).eval()),
        lambda m: m.encoder.layer[0].train(),
    ]
    for change in changes:
        test = model_test(model)
        change(model)
        assert not test()


def test_attention_under_capture_puts_back_another_librarys_attention():
    import torch.nn.functional as F
    from fastlayers.patching.runtime.capture_attention import AttentionUnderCapture

    original = F.scaled_dot_product_attention
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = theirs
    try:
        q = torch.randn(1, 1, 3, 4)
        with AttentionUnderCapture(mask_free=False).capturing():
            F.scaled_dot_product_attention(q, q, q)
        assert calls == [1] and F.scaled_dot_product_attention is theirs
    finally:
        F.scaled_dot_product_attention = original
