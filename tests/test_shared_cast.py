"""One autocast conversion shared by several Linears (fastlayers.ops.shared_cast): the same
values and gradients as each Linear converting its input itself, bit for bit, also where the
input has other readers; the gated MLP rewrite under autocast converts its input once; calls
where autocast converts nothing (or once already), traced or transformed calls, the meta
device, and bad arguments."""

from __future__ import annotations

import copy
import weakref

import fastlayers.patching.rules.gated_mlp as gated_mlp_rule
import pytest
import torch
import torch.nn.functional as F
from numerics import DEVICES, poison_allocator
from test_gated_mlp import FAMILIES
from test_gated_mlp import _inputs as family_inputs
from tiny_models import DECODER
from torch.utils._python_dispatch import TorchDispatchMode

import fastlayers
from fastlayers._extension import _C
from fastlayers.ops import shared_cast
from fastlayers.ops.shared_cast import autocast_conversion, converted_use

tf = pytest.importorskip("transformers")

# (input dtype, autocast dtype): float32 activations under either half autocast, and a half
# input autocast converts to the other half dtype
PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16),
]


def _step(x0, weights, upstream, device, dtype, share):
    """act(h W_g^T) * (h W_u^T) under autocast from a non-leaf h that a third op also reads
    (so the engine adds three gradients at h's producer), and the gradients."""
    x = x0.clone().requires_grad_()
    h = x * 1.25
    with torch.autocast(device, dtype=dtype):
        hc = autocast_conversion(h) if share else None
        assert (hc is not None) == share
        a = converted_use(h, hc) if share else h
        g = F.linear(a, weights[0])
        b = converted_use(h, hc) if share else h
        y = F.silu(g) * F.linear(b, weights[1])
    third = (h.float() * h.float()).sum(-1, keepdim=True) * 0.37
    for w in weights:
        w.grad = None
    torch.autograd.backward((y, third), (upstream, torch.ones_like(third)))
    return y, x.grad, *(w.grad for w in weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,dtype", PAIRS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_conversion_gives_per_use_values_and_gradients(device, x_dtype, dtype, seed):
    if device == "cpu" and dtype == torch.float16 and x_dtype == torch.bfloat16:
        pytest.skip("CPU autocast converts to bfloat16 or float16; one pair is enough there")
    g = torch.Generator(device=device).manual_seed(seed)
    x0 = torch.randn(3, 37, 96, device=device, generator=g).to(x_dtype)
    weights = [torch.randn(160, 96, device=device, generator=g).requires_grad_() for _ in "gu"]
    upstream = torch.randn(3, 37, 160, device=device, generator=g).to(dtype)
    native = _step(x0, weights, upstream, device, dtype, share=False)
    shared = _step(x0, weights, upstream, device, dtype, share=True)
    for name, n, s in zip(("y", "x.grad", "gate.grad", "up.grad"), native, shared, strict=True):
        assert s.dtype == n.dtype, name
        assert torch.equal(s, n), name


def test_uses_share_one_storage_each_with_its_own_node():
    x = torch.randn(5, 8, requires_grad=True) * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xc = autocast_conversion(x)
    uses = [converted_use(x, xc) for _ in range(3)]
    assert xc.dtype == torch.bfloat16 and not xc.requires_grad
    assert torch.equal(xc, x.detach().to(torch.bfloat16))
    assert len({u.data_ptr() for u in (xc, *uses)}) == 1
    assert len({id(u.grad_fn) for u in uses}) == 3
    for u in uses:
        assert "ConvertedUseBackward" in u.grad_fn.name()
        assert u.grad_fn.next_functions[0][0] is x.grad_fn


def test_a_use_without_gradient_and_an_unused_use():
    x = torch.randn(4, 6, requires_grad=True)
    h = x * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hc = autocast_conversion(h)
    a, _unused = converted_use(h, hc), converted_use(h, hc)
    (a.float() * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 6.0))


def test_in_place_change_of_a_use_is_caught_by_the_saved_inputs():
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True) * 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xc = autocast_conversion(x)
        y = F.linear(converted_use(x, xc), w)
        converted_use(x, xc).mul_(2)  # the same storage, which F.linear saved for w's gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_is_refused():
    x = torch.randn(4, 6, requires_grad=True) * 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xc = autocast_conversion(x)
    a, b = converted_use(x, xc), converted_use(x, xc)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((a.float() * b.float()).sum(), x, create_graph=True)


def _use_of(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, one converted_use of x): a leaf, so x.grad is the use node's output itself."""
    x = torch.randn(shape, device=device, requires_grad=True)
    return x, converted_use(x, x.detach().to(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape,offset,layout",
    [
        ((8192, 512), 0, "contiguous"),  # many blocks of whole vectors
        ((3, 37), 0, "contiguous"),  # fewer elements than a block, a tail of 7
        ((1000, 13), 1, "contiguous"),  # a source 2 bytes off 16: one element at a time
        ((0, 8), 0, "contiguous"),
        ((64, 48), 0, "transposed"),  # not contiguous: ATen's copy
        ((64, 48), 0, "expanded"),
    ],
)
def test_a_half_gradient_widens_to_autocasts_float32_values(dtype, shape, offset, layout):
    torch.manual_seed(0)
    n = shape[0] * shape[1]
    base = torch.randn(n + offset, device="cuda").to(dtype)
    # specials: infinities, signed zero, a subnormal, the largest half, NaN
    specials = torch.tensor([float("inf"), -0.0, 6e-8, -65504.0, float("nan")], device="cuda")
    every_fifth = base[offset::5]
    every_fifth.copy_(specials.repeat(len(every_fifth) // 5 + 1)[: len(every_fifth)])
    g = base[offset:].view(shape)
    if layout == "transposed":
        g = g.t()
    elif layout == "expanded":
        g = g[:1].expand(shape)
    x, use = _use_of(g.shape, dtype, "cuda")
    poison_allocator("cuda", 64 << 20)
    use.backward(g)
    want = g.to(torch.float32)
    assert x.grad.dtype == torch.float32 and x.grad.shape == g.shape
    assert torch.equal(x.grad.view(torch.int32), want.view(torch.int32))  # NaNs bit for bit


def _profiled_kernels(fn) -> dict[str, int]:
    """The CUDA kernels fn() runs: name -> launches."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.count for e in prof.key_averages() if e.self_device_time_total > 0}


@pytest.mark.cuda
def test_the_widening_runs_one_kernel_of_its_own():
    g = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    _, use = _use_of(g.shape, g.dtype, "cuda")
    names = list(_profiled_kernels(lambda: use.backward(g)))
    assert any("widen_kernel" in k for k in names), names
    assert not any("direct_copy_kernel" in k for k in names), names


@pytest.mark.cuda
def test_batched_gradients_and_a_dispatch_mode_take_atens_conversion():
    x, use = _use_of((4, 8), torch.bfloat16, "cuda")
    gs = torch.randn(3, 4, 8, device="cuda").to(torch.bfloat16)
    (batched,) = torch.autograd.grad(use, x, gs, is_grads_batched=True, retain_graph=True)
    assert torch.equal(batched, gs.float())  # each gradient of the batch, widened

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        (one,) = torch.autograd.grad(use, x, gs[0])
    assert torch.equal(one, gs[0].float())
    assert torch.ops.aten._to_copy.default in seen  # the mode saw the conversion


def _uses_and_other_readers(x0, weights, upstream, share, order, hook=None):
    """x0 -> h (non-leaf) read by bf16 uses (converted_use, or autocast's per-use conversion),
    each through a Linear, and by other readers, made in ``order`` ('u': the next use, 'r': a
    float32 reader on h's device, 'c': a reader through a copy to the CPU, whose backward runs
    on the CPU's thread), so that the engine receives their gradients in that order (reverse
    creation); (x's gradient, every weight's)."""
    x = x0.clone().requires_grad_()
    h = x * 1.5
    hc = h.detach().to(torch.bfloat16) if share else None
    outs, ws, k = [], iter(weights), 0
    for kind in order:
        if kind == "u":
            use = converted_use(h, hc) if share else h.to(torch.bfloat16)
            if hook is not None and share:
                use.grad_fn.register_hook(hook)
            outs.append(F.linear(use, next(ws)).float())
        else:
            k += 1
            outs.append(torch.tanh((h.cpu() if kind == "c" else h) * k).to(h.device))
    for w in weights:
        w.grad = None
    torch.autograd.backward(outs, [upstream[: o.shape[0], : o.shape[1]] for o in outs])
    return x.grad, *(w.grad for w in weights)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _uses_case(order, seed, rows=256, cols=512):
    torch.manual_seed(seed)
    x0 = torch.randn(rows, cols, device="cuda")
    weights = [
        torch.randn(384, cols, device="cuda").to(torch.bfloat16).requires_grad_()
        for _ in range(order.count("u"))
    ]
    upstream = torch.randn(rows, max(cols, 384), device="cuda")  # sliced to each output
    return x0, weights, upstream


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["uuu", "uru", "ruur", "urru", "uu", "u"])
def test_uses_and_other_readers_give_autocasts_bits(order):
    """(A reader on the CPU's thread makes the engine's order of additions at h depend on the
    threads' timing, natively too: no bit pattern is defined there; the next test takes it.)"""
    x0, weights, upstream = _uses_case(order, seed=1)
    poison_allocator("cuda", 64 << 20)
    ours = _uses_and_other_readers(x0, weights, upstream, True, order)
    native = _uses_and_other_readers(x0, weights, upstream, False, order)
    for a, b in zip(ours, native, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "order,adds_in_place",
    [("uuu", 2), ("uu", 1), ("uru", 0), ("ucu", 0), ("uuc", 0)],
)
def test_uses_add_into_the_engines_sum_only_where_every_reader_is_a_use(order, adds_in_place):
    """Only uses of ours feeding x's producer: the first widens, the others add into the
    engine's buffer and the engine adds nothing; any other reader (on the GPU, or on the CPU's
    thread) keeps the engine's own additions."""
    x0, weights, upstream = _uses_case(order, seed=2, rows=128, cols=256)
    ours = []
    kernels = _profiled_kernels(
        lambda: ours.extend(_uses_and_other_readers(x0, weights, upstream, True, order))
    )
    native = _uses_and_other_readers(x0, weights, upstream, False, order)
    for a, b in zip(ours, native, strict=True):
        if "c" in order:  # the engine's order of additions follows the threads' timing:
            # a few ulps of the largest summand apart at most
            torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-6 * b.abs().max().item())
        else:
            assert torch.equal(_bits(a), _bits(b))
    count = lambda part: sum(c for k, c in kernels.items() if part in k)  # noqa: E731
    assert count("add_widened_kernel") == adds_in_place, kernels
    assert count("widen_kernel") == order.count("u") - adds_in_place, kernels
    if adds_in_place:  # the engine added nothing on the GPU itself
        assert count("CUDAFunctor_add") == 0, kernels


@pytest.mark.cuda
def test_a_second_backward_of_a_kept_graph_and_a_post_hook_see_native_gradients():
    torch.manual_seed(3)
    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    w = torch.randn(32, 128, device="cuda").to(torch.bfloat16).requires_grad_()
    up = torch.randn(64, 32, device="cuda")

    def run(share, hook=None):
        h = x * 2
        hc = h.detach().to(torch.bfloat16)
        uses = [converted_use(h, hc) if share else h.to(torch.bfloat16) for _ in range(3)]
        if hook is not None:
            uses[1].grad_fn.register_hook(hook)
        y = sum(F.linear(u, w).float() for u in uses)
        x.grad = None
        y.backward(up, retain_graph=True)
        first = x.grad.clone()
        y.backward(up)  # the kept graph again: x.grad accumulates
        return first, x.grad

    seen = []
    ours = run(True, hook=lambda grad_inputs, grad_outputs: seen.append(grad_inputs[0]))
    native = run(False)
    for a, b in zip(ours, native, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert len(seen) == 2 and all(s is not None and s.dtype == torch.float32 for s in seen)


@pytest.mark.cuda
def test_a_captured_backward_adds_as_the_engine_and_replays_native_gradients():
    """Under CUDA-graph capture the uses hand the engine their gradients (no addition of ours
    into its buffer): the replayed gradients equal eager autocast's."""
    torch.manual_seed(4)
    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    ws = [torch.randn(32, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
    up = torch.randn(64, 32, device="cuda")

    def step(share):
        h = x * 2
        hc = h.detach().to(torch.bfloat16)
        uses = [converted_use(h, hc) if share else h.to(torch.bfloat16) for _ in ws]
        sum(F.linear(u, w).float() for u, w in zip(uses, ws, strict=True)).backward(up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    x.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    captured = x.grad.clone()
    x.grad = None
    step(False)
    assert torch.equal(_bits(captured), _bits(x.grad))


def _three_uses(x, ws, ups, share):
    """h = x * 1.5 read by one bf16 use a weight, each through a Linear; (h, the uses, the loss
    sum((F.linear(use, w) * up).sum())). One scalar root: the engine's order of additions is then
    fixed by the graph (several roots are handed to the device's thread by the caller's, as it
    goes)."""
    h = x * 1.5
    hc = h.detach().to(torch.bfloat16)
    uses = [converted_use(h, hc) if share else h.to(torch.bfloat16) for _ in ws]
    return h, uses, _loss(uses, ws, ups)


def _loss(uses, ws, ups):
    return sum((F.linear(u, w).float() * up).sum() for u, w, up in zip(uses, ws, ups, strict=True))


def _three_use_case(seed):
    torch.manual_seed(seed)
    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    ws = [torch.randn(48, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
    ups = [torch.randn(64, 48, device="cuda") for _ in ws]
    return x, ws, ups


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["h among the roots", "grad of h", "h retains its grad", "leaf"])
def test_roots_inputs_retained_and_leaf_sums_equal_autocasts(how):
    x, ws, ups = _three_use_case(seed=5)
    gh = torch.randn(64, 128, device="cuda")

    def run(share):
        x.grad = None
        if how == "leaf":  # the uses read x itself: the engine's sum is x's AccumulateGrad's
            xc = x.detach().to(torch.bfloat16)
            uses = [converted_use(x, xc) if share else x.to(torch.bfloat16) for _ in ws]
            _loss(uses, ws, ups).backward()
            return x.grad
        h, _, loss = _three_uses(x, ws, ups, share)
        if how == "h among the roots":
            (loss + (h * gh).sum()).backward()
            return x.grad
        if how == "grad of h":
            return torch.autograd.grad(loss, [h])[0]
        h.retain_grad()
        loss.backward()
        return torch.cat([x.grad, h.grad])

    ours, native = run(True), run(False)
    assert torch.equal(_bits(ours), _bits(native))


@pytest.mark.cuda
def test_a_use_called_by_a_hook_hands_its_gradient_and_leaves_the_engines_sum():
    """A hook calling another use's node directly (not the engine evaluating it) gets the
    widened gradient back and adds nothing into the engine's buffer."""
    x, ws, ups = _three_use_case(seed=6)
    g = torch.randn(64, 128, device="cuda").to(torch.bfloat16)

    def run(share):
        x.grad = None
        _, uses, loss = _three_uses(x, ws, ups, share)
        called = []

        # the first use's node runs last: the other two have handed or added theirs by then
        def call_another_use(grad):
            out = uses[1].grad_fn(g)  # a node's own call: its outputs (one here)
            called.append(out[0] if isinstance(out, tuple) else out)

        uses[0].register_hook(call_another_use)
        loss.backward()
        return x.grad, called

    (ours, ours_called), (native, native_called) = run(True), run(False)
    assert torch.equal(_bits(ours), _bits(native))
    assert len(ours_called) == 1 and torch.equal(ours_called[0], native_called[0])
    assert torch.equal(ours_called[0], g.float())


@pytest.mark.cuda
def test_under_anomaly_mode_every_use_hands_its_gradient():
    """detect_anomaly checks every node's output: there each use hands the engine its widened
    gradient (no addition into the engine's buffer), and the sums are autocast's bits."""
    x, ws, ups = _three_use_case(seed=7)

    def run(share):
        x.grad = None
        _three_uses(x, ws, ups, share)[2].backward()
        return x.grad

    with torch.autograd.detect_anomaly():
        kernels = _profiled_kernels(lambda: run(True))
        ours = x.grad
        native = run(False)
    assert torch.equal(_bits(ours), _bits(native))
    assert not any("add_widened_kernel" in k for k in kernels), kernels
    assert sum(c for k, c in kernels.items() if "widen_kernel" in k) == 3, kernels


@pytest.mark.cuda
def test_concurrent_backwards_from_threads_give_autocasts_bits():
    """Four Python threads' backwards interleave on the device's one worker thread (each graph
    task its own sums)."""
    import threading

    cases = [_three_use_case(seed=10 + i) for i in range(4)]

    def grads(case, share):
        x, ws, ups = case
        x.grad = None
        _three_uses(x, ws, ups, share)[2].backward()
        return x.grad.clone()

    native = [grads(c, False) for c in cases]
    ours: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(cases))}

    def worker(i):
        for _ in range(20):
            ours[i].append(grads(cases[i], True))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for i, want in enumerate(native):
        assert len(ours[i]) == 20
        assert all(torch.equal(_bits(got), _bits(want)) for got in ours[i])


class _Sub(torch.Tensor):
    pass


def test_no_conversion_where_autocast_converts_nothing_or_once_already():
    x = torch.randn(4, 6)
    assert autocast_conversion(x) is None  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        converted = autocast_conversion(x)
        assert converted.dtype is torch.bfloat16 and converted.grad_fn is None
        assert torch.equal(converted, x.to(torch.bfloat16))
        assert autocast_conversion(x.double()) is None  # autocast leaves float64
        assert autocast_conversion(x.bfloat16()) is None  # already the autocast dtype
        assert autocast_conversion(torch.ones(3, dtype=torch.int64)) is None
        assert autocast_conversion(x.as_subclass(_Sub)) is None  # each Linear converts
        # a leaf that requires grad: autocast's cache converts it once for every reader
        assert autocast_conversion(x.clone().requires_grad_()) is None
        got = []
        torch.func.vmap(lambda t: got.append(autocast_conversion(t)) or t)(x)
        assert got == [None]  # under a torch.func transform
        meta = torch.empty(4, 6, device="meta")
        assert autocast_conversion(meta) is None  # no autocast for meta tensors (nor an error)


def test_a_patched_model_runs_on_the_meta_device():
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER))
    fastlayers.patch(model, layers=("gated_mlp",))
    ids = torch.zeros(2, 9, dtype=torch.int64, device="meta")
    assert model(input_ids=ids).logits.shape == (2, 9, DECODER["vocab_size"])


def test_bad_arguments_are_named():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="nothing converted"):
        _C.converted_use(x, x)
    with pytest.raises(RuntimeError, match="shape"):
        _C.converted_use(x, torch.randn(4, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="outside autograd"):
        _C.converted_use(x, torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True))
    with pytest.raises(RuntimeError, match="floating point"):
        _C.converted_use(x, torch.ones(3, 4, dtype=torch.int32))


class _Conversions(TorchDispatchMode):
    """Counts the float32 -> bfloat16 conversions (the weights' are the same in every run), or
    only those of tensors of ``shape``."""

    def __init__(self, shape=None):
        super().__init__()
        self.count = 0
        self.shape = shape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32:
            if self.shape is None or args[0].shape == self.shape:
                self.count += kwargs.get("dtype") == torch.bfloat16
        return func(*args, **kwargs)


def _train_step(model, ids, device):
    mode = _Conversions()
    with mode, torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss, mode.count, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _patched_pair(build, device, counts):
    """(native, the patch converting per projection, the patch converting once) of one model."""
    torch.manual_seed(0)
    model = build().to(device).train()
    native, per_use = copy.deepcopy(model), copy.deepcopy(model)
    for m in (model, per_use):
        assert fastlayers.patch(m, layers=("gated_mlp",)).counts() == counts
    return native, per_use, model


@pytest.mark.parametrize("device", DEVICES)
def test_gated_mlp_under_autocast_converts_its_input_once(device, monkeypatch):
    """fp32 weights under bf16 autocast, the whole-MLP rewrite alone: one conversion of each
    MLP's input where each projection made its own; loss and every gradient bit for bit those
    of the same patch converting per projection, and on CPU those of native (on CUDA the
    gated_act kernel's own backward is within bounds of native's, tests/test_gated_act.py)."""
    layers = DECODER["num_hidden_layers"]
    native, per_use, model = _patched_pair(
        lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)), device, {"gated_mlp": layers}
    )
    ids = torch.randint(1, 100, (2, 9), device=device)
    real = gated_mlp_rule.autocast_conversion
    runs = []
    for m in (native, per_use, model):
        conversion = real if m is model else (lambda x: None)
        monkeypatch.setattr(gated_mlp_rule, "autocast_conversion", conversion)
        runs.append(_train_step(m, ids, device))
    (loss_n, conv_n, grads_n), (loss_u, conv_u, grads_u), (loss_p, conv_p, grads_p) = runs
    assert conv_u == conv_n and conv_p == conv_n - layers
    assert torch.equal(loss_p, loss_u) and torch.equal(loss_p, loss_n)
    assert grads_p.keys() == grads_n.keys()
    for name, grad in grads_u.items():
        assert torch.equal(grads_p[name], grad), name
        if device == "cpu":
            assert torch.equal(grads_p[name], grads_n[name]), name


def test_a_shared_expert_whose_input_the_router_also_reads_matches_native():
    """Qwen2-MoE: the shared expert (a gated MLP the rule rewrites) reads the input the router
    and the routed experts read too; the engine adds all their gradients at the input's
    producer, and the patch's must arrive as native's do (bit for bit, three seeds)."""
    config = tf.Qwen2MoeConfig(
        **DECODER,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    for seed in range(3):
        torch.manual_seed(seed)
        model = tf.Qwen2MoeForCausalLM(config).train()
        native = copy.deepcopy(model)
        assert fastlayers.patch(model, layers=("gated_mlp",)).counts().get("gated_mlp")
        ids = torch.randint(1, 100, (2, 9))
        (loss_n, conv_n, grads_n), (loss_p, conv_p, grads_p) = (
            _train_step(m, ids, "cpu") for m in (native, model)
        )
        assert conv_p < conv_n
        assert torch.equal(loss_p, loss_n)
        for name, grad in grads_n.items():
            assert torch.equal(grads_p[name], grad), (seed, name)


def test_gated_mlp_without_autocast_converts_nothing(monkeypatch):
    calls = []
    real = gated_mlp_rule.autocast_conversion
    monkeypatch.setattr(
        gated_mlp_rule, "autocast_conversion", lambda x: calls.append(x.dtype) or real(x)
    )
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).train()
    fastlayers.patch(model, layers=("gated_mlp",))
    ids = torch.randint(1, 100, (2, 9))
    loss = model(input_ids=ids, labels=ids).loss
    assert calls == [torch.float32] * DECODER["num_hidden_layers"]
    names = set()
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    assert not any("ConvertedUse" in n for n in names)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gated_mlp_under_autocast_with_gradient_checkpointing_matches_native(reentrant):
    """The recomputation in backward converts once again: loss and every gradient equal
    native's, both checkpointing kinds."""
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
    real = gated_mlp_rule.autocast_conversion

    def spy(x):
        out = real(x)
        if out is not None:
            converted.append(weakref.ref(out))
        return out

    linear = F.linear

    def down_watch(x, weight, bias=None):
        if weight.shape[0] == DECODER["hidden_size"]:  # the down projection
            alive_at_down.append([r() is not None for r in converted])
        return linear(x, weight, bias)

    monkeypatch.setattr(gated_mlp_rule, "autocast_conversion", spy)
    monkeypatch.setattr(F, "linear", down_watch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.model.layers[0].mlp(torch.randn(2, 5, DECODER["hidden_size"]))
    assert len(converted) == 1 and alive_at_down == [[False]]


@pytest.mark.parametrize("name", [n for n, (_, _, exact) in FAMILIES.items() if exact])
def test_each_family_trains_under_autocast_as_natively(name):
    """Every decoder family whose gated MLP the rule rewrites bit for bit: a training step
    under CPU bf16 autocast with the rule alone gives native's loss and gradients."""
    build, _, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = build().train()
    native = copy.deepcopy(model)
    fastlayers.patch(model, layers=("gated_mlp",))
    inputs = family_inputs(name)
    runs = []
    for m in (native, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss_n, grads_n), (loss_p, grads_p) = runs
    assert torch.equal(loss_p, loss_n)
    assert grads_p.keys() == grads_n.keys()
    for n, grad in grads_n.items():
        assert torch.equal(grads_p[n], grad), n


# ----------------------------------------------------------------------------------------------
# SharedInputLinear: siblings reading one tensor (an attention's q, k and v)


def _llama(seed=0):
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER)).train()


@pytest.mark.parametrize("device", DEVICES)
def test_q_k_v_convert_their_input_once_under_autocast(device):
    """The rule alone on a tiny LLaMA under bf16 autocast (fp32 weights): each attention's q, k
    and v (and, with gated_mlp off, each MLP's gate and up) take one conversion of their input;
    loss and every gradient bit for bit native's."""
    model = _llama().to(device)
    native = copy.deepcopy(model)
    report = fastlayers.patch(model, layers=("shared_input_linear",))
    layers = DECODER["num_hidden_layers"]
    assert report.counts() == {"shared_input_linear": 5 * layers}
    attention = model.model.layers[0].self_attn
    assert all(
        type(getattr(attention, n)) is fastlayers.SharedInputLinear
        for n in ("q_proj", "k_proj", "v_proj")
    )
    assert type(attention.o_proj) is torch.nn.Linear  # reads the attention's output alone
    ids = torch.randint(1, 100, (2, 9), device=device)
    loss_n, conv_n, grads_n = _train_step(native, ids, device)
    loss_p, conv_p, grads_p = _train_step(model, ids, device)
    assert conv_p == conv_n - 3 * layers  # two of q / k / v's, one of gate / up's
    assert torch.equal(loss_p, loss_n)
    assert grads_p.keys() == grads_n.keys()
    for name, grad in grads_n.items():
        assert torch.equal(grads_p[name], grad), name
    assert fastlayers.unpatch(model) == 5 * layers
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_every_default_rule_with_and_without_shared_inputs_gives_the_same_bits():
    from fastlayers.patching.rules import DEFAULT_LAYERS

    model = _llama(1)
    without = copy.deepcopy(model)
    fastlayers.patch(model)
    fastlayers.patch(without, layers=[n for n in DEFAULT_LAYERS if n != "shared_input_linear"])
    ids = torch.randint(1, 100, (2, 9))
    loss_w, conv_w, grads_w = _train_step(without, ids, "cpu")
    loss_p, conv_p, grads_p = _train_step(model, ids, "cpu")
    assert conv_p == conv_w - 2 * DECODER["num_hidden_layers"]
    assert torch.equal(loss_p, loss_w)
    for name, grad in grads_w.items():
        assert torch.equal(grads_p[name], grad), name


def _siblings(dtype=torch.float32):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, n, dtype=dtype) for n in (12, 8, 8)]
    return linears, [fastlayers.SharedInputLinear.from_native(lin) for lin in linears]


def _three_reads(layers, x0, change_between=False, dtype_between=None):
    """q, k, v of one non-leaf tensor under autocast (optionally changed in place, or read
    under another autocast dtype, before the third), and the gradients."""
    x = x0.clone().requires_grad_()
    h = x * 1.5
    outs = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs.append(layers[0](h))
        outs.append(layers[1](h))
        if change_between:
            h.mul_(1.0)  # same values, a new version: the conversion is made again
        if dtype_between is not None:
            with torch.autocast("cpu", dtype=dtype_between):
                outs.append(layers[2](h))
        else:
            outs.append(layers[2](h))
    grads = torch.autograd.grad(
        [o.float().pow(2).sum() for o in outs], [x, *(lin.weight for lin in layers)]
    )
    return outs, grads


@pytest.mark.parametrize("case", ["plain", "changed in place", "another dtype"])
def test_siblings_match_native_linears_bit_for_bit(case):
    native, shared = _siblings()
    x0 = torch.randn(3, 5, 16)
    kwargs = {"change_between": case == "changed in place"}
    if case == "another dtype":
        kwargs["dtype_between"] = torch.float16
    counts = []
    results = []
    for layers in (native, shared):
        mode = _Conversions(x0.shape)
        with mode:
            results.append(_three_reads(layers, x0, **kwargs))
        counts.append(mode.count)
    (outs_n, grads_n), (outs_p, grads_p) = results
    assert [o.dtype for o in outs_p] == [o.dtype for o in outs_n]
    for a, b in zip(outs_p + list(grads_p), outs_n + list(grads_n), strict=True):
        assert torch.equal(a, b)
    # float32 -> bf16 conversions: native 3 of h; shared 1, or 2 where the third read needed
    # its own (changed in place); under float16 the third converts to float16 (not counted)
    expected = {"plain": (3, 1), "changed in place": (3, 2), "another dtype": (2, 1)}[case]
    assert tuple(counts) == expected


def test_the_remembered_conversion_goes_with_its_input():
    """The last conversion is kept no longer than the tensor it converts lives."""
    _, shared = _siblings()
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        shared[0](x)
        last = shared_cast._last
        assert last is not None and last[0]() is x
        converted = weakref.ref(last[2])
        del last
        shared[1](x)
        assert converted() is not None
        del x
    assert shared_cast._last is None and converted() is None


def test_a_leaf_that_requires_grad_and_calls_without_autocast_are_plain_linears():
    native, shared = _siblings()
    leaf = torch.randn(2, 16, requires_grad=True)
    for x, autocast, conversions in ((leaf, True, 1), (torch.randn(2, 16) * 2, False, 0)):
        ys = []
        for layers in (native, shared):
            mode = _Conversions(x.shape)
            with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                ys.append([lin(x) for lin in layers])
            # a leaf that requires grad: autocast's cache converts it once for all three
            assert mode.count == conversions
        assert all(torch.equal(a, b) for a, b in zip(*ys, strict=True))
        assert shared_cast._last is None or shared_cast._last[0]() is not x


def test_shared_input_linear_keeps_the_linear_contract():
    linear = torch.nn.Linear(8, 4)
    layer = fastlayers.SharedInputLinear.from_native(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.state_dict().keys() == linear.state_dict().keys()
    assert isinstance(layer, torch.nn.Linear)
    back = layer.to_native()
    assert type(back) is torch.nn.Linear and back.weight is linear.weight
    assert "fastlayers" in repr(layer) and "in_features=8" in repr(layer)
    meta = fastlayers.SharedInputLinear(8, 4, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert meta(torch.randn(2, 8, device="meta")).shape == (2, 4)
    with pytest.raises(TypeError, match=r"linear must be a torch\.nn\.Linear"):
        fastlayers.SharedInputLinear.from_native(torch.nn.LayerNorm(4))
    with pytest.raises(TypeError, match="not a subclass"):
        fastlayers.SharedInputLinear.from_native(layer)


class _TwoHeads(torch.nn.Module):
    """Two Linears reading the module's own input (the candidates the rule picks)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 4)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.a(x) + self.b(x)


class _Chain(torch.nn.Module):
    """A name reassigned between two Linear calls: they never read one tensor."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 16)

    def forward(self, h):
        h = self.fc1(h)
        h = torch.tanh(h)
        h = self.fc2(h)
        return h


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x, scale=1.0):
        return super().forward(x) * scale


class _OnePlainAmongSubclasses(torch.nn.Module):
    """Three Linears reading x, two of them a subclass the rule refuses: the plain one alone
    would share its conversion with nobody."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _ScaledLinear(16, 4), _ScaledLinear(16, 4)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.a(x) + self.b(x) * self.c(x)


def test_compiled_shared_input_linear_is_an_nn_linear_with_a_parametrization_too():
    """Under torch.compile the layer is nn.Linear's forward (F.linear of self.weight and
    self.bias, what Inductor fuses with the conversions): one graph, native's values, also with
    a parametrized weight."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    linear = torch.nn.Linear(8, 4)
    layer = fastlayers.SharedInputLinear.from_native(copy.deepcopy(linear))
    x = torch.randn(3, 8)
    for m in (linear, layer):
        parametrize.register_parametrization(m, "weight", Double())
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = compiled(x), linear(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)


def test_only_linears_reading_one_name_between_its_assignments_are_taken():
    assert fastlayers.patch(_TwoHeads()).counts() == {"shared_input_linear": 2}
    assert fastlayers.patch(_Chain()).counts() == {}
    assert fastlayers.patch(_OnePlainAmongSubclasses()).counts() == {}


def test_inference_mode_under_autocast_runs_as_natively():
    """Tensors made under inference mode have no version counter: each reader converts."""
    model = _llama().eval()
    native = copy.deepcopy(model)
    fastlayers.patch(model, layers=("shared_input_linear",))
    ids = torch.randint(1, 100, (2, 9))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(ids).logits, native(ids).logits)
    assert shared_cast._last is None


def test_a_trace_does_not_bake_in_an_earlier_calls_conversion():
    torch.manual_seed(0)
    native = _TwoHeads()
    patched = copy.deepcopy(native)
    fastlayers.patch(patched)
    x, new = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        patched(x)  # an eager call remembers x's conversion
        traced = torch.jit.trace(patched, x, check_trace=False)
        assert torch.equal(traced(new), native(new))


@pytest.mark.cuda
def test_a_cuda_graph_capture_does_not_read_a_warm_up_conversion():
    torch.manual_seed(0)
    native = _TwoHeads().cuda()
    patched = copy.deepcopy(native)
    fastlayers.patch(patched)
    static_x = torch.randn(2, 16, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            patched(static_x)  # warm-up on the static input: its conversion remembered
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = patched(static_x)
        static_x.copy_(torch.randn(2, 16, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, native(static_x))


def test_report_folds_siblings_into_one_row_only_where_each_parent_holds_all():
    from collections import namedtuple

    from fastlayers.patching.report import grouped

    Row = namedtuple("Row", "name rule")

    def where(names):
        return [w for _, _, w in grouped([Row(n, "r") for n in names], lambda r: (r.rule,))]

    qkv = [f"layers.{i}.attn.{p}" for i in range(2) for p in ("q", "k", "v")]
    assert where(qkv) == ["layers.*.attn.{q,k,v}"]
    # one layer's q missing: no row may claim q everywhere
    assert where(qkv[1:]) == ["layers.*.attn.k", "layers.*.attn.v", "layers.1.attn.q"]
    # T5: a self-attention and a cross-attention in different layers of one block
    assert where(["dec.0.layer.0.SelfAttention", "dec.0.layer.1.EncDecAttention"]) == [
        "dec.0.layer.0.SelfAttention",
        "dec.0.layer.1.EncDecAttention",
    ]
