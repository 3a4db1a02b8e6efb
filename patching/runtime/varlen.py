"""Attention over packed sequences: the tokens of several sequences in one row, each attending only
to its own (padding-free execution, unpad.py). The attention blocks' own attention function is
routed to :func:`varlen_dispatch` (rule ``varlen_attention``), which runs it per sequence, or
flash attention over cumulative sequence lengths on CUDA, when the call carries a packing
(``cu_seq_lens_q`` and the rest of transformers' padding-free keyword arguments, which its
models thread from the model's forward to every attention call), and the function itself
otherwise (a padded call: exactly native).

Paths, per call:
- CUDA, float16/bfloat16, no dropout, no extras (soft-capping, sinks, a sliding window shorter
  than the longest sequence): ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
  ``cu_seq_lens``), causal where the module is.
- Otherwise (CPU, float32/float64, dropout in training, extras): the model's own attention
  function on each group of equal-length sequences, batched, with a causal (or sliding-window)
  mask where the module is causal and none where it is not: per sequence what the native padded
  call computes with its padding masked out."""

from __future__ import annotations

import collections
import contextvars
import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# transformers' padding-free keyword arguments (FlashAttentionKwargs), threaded by its models
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# keyword arguments the flash path reads or that change nothing in the attention's math; any
# other one with a value (sinks, a chunk size, ...) sends the call to the model's own function
_FLASH_KWARGS = {
    "dropout",
    "scaling",
    "sliding_window",
    "softcap",
    "is_causal",
    "position_ids",
    "cache_position",
    "output_attentions",
    "use_cache",
}


@dataclass(frozen=True)
class Packing:
    """How a padded batch ``[batch, seq]`` maps to its real tokens packed in one row: ``order``
    the flat positions (row * seq + column) of every token, the real ones first in row order,
    then the padding; ``cu_seqlens`` the cumulative lengths (int32, on the tokens' device),
    ``lengths`` the lengths on the host; ``gathered``: the call's per-token inputs in that order
    (``[batch * seq, ...]``), gathered before the one host synchronisation so that their
    kernels run while the host waits."""

    batch: int
    seq: int
    order: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    max_length: int
    left: bool  # some row starts with padding (left padding): checked as its own kind of call
    total: int
    gathered: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)
    flat: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)  # the inputs

    @property
    def index(self) -> torch.Tensor:
        """The flat positions of the real tokens, in packed order."""
        return self.order[: self.total]

    @staticmethod
    def of(
        mask: torch.Tensor,
        inputs: Mapping[str, torch.Tensor] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        cu_out: torch.Tensor | None = None,
    ) -> Packing:
        """The packing of a 2-D attention mask (nonzero: a real token), with ``inputs`` (each
        ``[batch, seq, ...]``) gathered in packed order, into ``out``'s tensors where given
        (as many of the ``batch * seq`` rows as each holds), and the cumulative lengths into
        ``cu_out``'s first ``batch + 1`` entries where given (the total in every entry after
        them). One host synchronisation (the packed length is a shape), after every kernel
        here is queued."""
        batch, seq = mask.shape
        real = mask.reshape(-1) != 0
        # a stable sort puts the real tokens first in row order: no synchronisation (nonzero
        # would wait for the GPU before the inputs' gathers are even queued)
        order = torch.argsort(real.logical_not().to(torch.uint8), stable=True)
        gathered, flats = {}, {}
        for name, x in (inputs or {}).items():
            flats[name] = flat = x.reshape(batch * seq, *x.shape[2:])
            into = None if out is None else out[name]
            rows = order if into is None or into.shape[0] == order.shape[0] else order[: len(into)]
            gathered[name] = torch.index_select(flat, 0, rows, out=into)
        lengths_dev = real.view(batch, seq).sum(1, dtype=torch.int32)
        if cu_out is None:
            cu = torch.zeros(batch + 1, dtype=torch.int32, device=mask.device)
        else:
            cu = cu_out[: batch + 1]
        torch.cumsum(lengths_dev, 0, out=cu[1:])
        if cu_out is not None:
            cu_out[batch + 1 :].fill_(cu[batch])  # a 0-d device tensor: no synchronisation
        host = torch.cat([lengths_dev, real.view(batch, seq)[:, 0].int()]).tolist()
        lengths = tuple(int(n) for n in host[:batch])
        left = not all(host[batch:]) if seq else False
        longest = max(lengths, default=0)
        return Packing(batch, seq, order, cu, lengths, longest, left, sum(lengths), gathered, flats)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments a packed call carries to its attention calls."""
        return packing_kwargs(self.cu_seqlens, self.max_length)

    def packed(self, name: str, rows: int | None = None) -> torch.Tensor:
        """The gathered input ``name`` as a packed row ``[1, rows, ...]`` (default: the real
        tokens; more rows: the padding tokens that follow them, then zeros)."""
        x = self.gathered[name]
        rows = self.total if rows is None else rows
        if rows > x.shape[0] and x.shape[0] < self.order.shape[0]:  # gathered into less
            x = self.flat[name].index_select(0, self.order[:rows])
        if rows > x.shape[0]:
            x = torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
        return x[:rows][None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [1, total, ...] -> [batch, seq, ...], zeros at the padding (differentiable)."""
        flat = x[0]
        out = flat.new_zeros(self.batch * self.seq, *flat.shape[1:])
        return out.index_copy(0, self.index, flat).view(self.batch, self.seq, *flat.shape[1:])


class PackedLength(int):
    """The longest sequence of a packing that padding-free execution made: one of its marks (a
    hook that copies the call's tensors, accelerate moving them to a layer's device, keeps the
    int as it is). A rewritten block's trace takes it as an input (trace._kind), not as a
    constant: one trace serves every packed length, and the attention gets this object."""

    fastlayers_pass_through = True


_MARK = "_fastlayers_packing"  # another mark, an attribute of the cumulative lengths

# set while padding-free execution runs a packed call (eager or captured): its attention calls
# are packed whatever the hooks and rewritten blocks on the way did to the keyword arguments
PACKED_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fastlayers_packed_call", default=False
)


def packing_kwargs(cu_seqlens: torch.Tensor, max_length: int) -> dict[str, Any]:
    """transformers' padding-free keyword arguments for a packed call, marked as padding-free
    execution's own: the routed attention runs per sequence only for them (a caller's own
    ``cu_seq_lens_q`` goes to the model's function, as natively). Three marks, since each can be
    lost on the way to an attention call: PACKED_CALL while the call runs, and for a gradient
    checkpoint's recomputation (after it) the tensor's attribute and the PackedLength."""
    setattr(cu_seqlens, _MARK, True)
    length = PackedLength(max_length)
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": length,
        "max_length_k": length,
    }


def is_packed(kwargs: dict[str, Any]) -> bool:
    """Whether an attention call's keyword arguments are a packing padding-free execution made."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return False
    return (
        PACKED_CALL.get()
        or getattr(cu, _MARK, False)
        or type(kwargs.get("max_length_q")) is PackedLength
    )


def token_bucket(total: int) -> int:
    """A packed call's token count rounded up for replay: at least 64, then the next of 1, 1.25,
    1.5 and 1.75 times a power of two (at most 25% more tokens; about four graphs an octave)."""
    if total <= 64:
        return 64
    base = 1 << (total.bit_length() - 1)
    for step in (4, 5, 6, 7, 8):
        if base * step // 4 >= total:
            return base * step // 4
    return 2 * base


def sequence_bucket(count: int) -> int:
    """A packed call's number of sequences rounded up for replay: a power of two, at least 64
    (empty sequences cost the flash kernel next to nothing)."""
    return max(64, 1 << (count - 1).bit_length())


class NotCapturable(RuntimeError):
    """A packed call on its way to a CUDA graph took a path that cannot be captured (the
    per-sequence attention reads the lengths on the host)."""


# set while a packed call runs for replay (runtime/unpad.py): the per-sequence path refuses
CAPTURING: contextvars.ContextVar[bool] = contextvars.ContextVar("fastlayers_varlen", default=False)


class PackingMismatch(RuntimeError):
    """An attention call of a packed forward that the packing does not describe (another query
    length: cross-attention, a cache): the call runs padded instead."""


_DISPATCH: dict[int, Callable[..., Any]] = {}
# set around replay's warm-up and capture of a bucket: its attention keeps torch's choice, so
# that a plan cuDNN builds is built in the warm-up (not first inside the capture) and serves
# every replay of the graph
TORCH_CHOICE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fastlayers_torch_choice", default=False
)


def varlen_dispatch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a transformers attention function: ``fn(module, q, k, v, mask, **kwargs) ->
    (out [B, S, H, D], weights)``) as it runs in a packed call, and as itself otherwise. One
    wrapper per function (the route's guard and torch.compile see a stable object)."""
    known = _DISPATCH.get(id(fn))
    if known is not None and known.__wrapped__ is fn:  # type: ignore[attr-defined]
        return known

    def dispatch(*args, **kwargs):
        if len(args) == 5:
            module, query, key, value, attention_mask = args
            rest = kwargs
        elif len(args) == 4 and "attention_mask" in kwargs:  # the mask by name
            module, query, key, value = args
            rest = dict(kwargs)
            attention_mask = rest.pop("attention_mask")
        else:
            return fn(*args, **kwargs)  # not transformers' calling convention: as it is
        if not isinstance(query, torch.Tensor):
            return fn(*args, **kwargs)
        if is_packed(rest):
            return varlen_attention(fn, module, query, key, value, rest)
        if (
            not query.is_cuda
            or torch.compiler.is_compiling()
            or TORCH_CHOICE.get()
            or cudnn_plan_pays(query, key, attention_mask, module)
        ):
            return fn(*args, **kwargs)
        return without_cudnn(fn, *args, **kwargs)

    dispatch.__wrapped__ = fn  # type: ignore[attr-defined]
    dispatch.__name__ = getattr(fn, "__name__", "attention")
    _DISPATCH[id(fn)] = dispatch
    return dispatch


# Attention calls of one shape after which cuDNN may take it (torch's own choice): its plan build
# for a new shape costs as much as about this many calls on the flash / memory-efficient kernel
# lose to cuDNN's where cuDNN is faster (H200, torch 2.11, bf16, benchmarks/
# bench_attention_backends.py: llama-1b SFT 1,366 ms of plan against 1.3 ms a call, training
# without padding 505 ms against 0.21 ms, prefill 147 ms against 0.07 ms). Renting the plan-free
# kernels until then costs at most about twice the better of the two choices, whichever it is for
# a shape (the ski-rental bound): a stream of new shapes never builds a plan, a fixed shape
# builds one after a few dozen forwards of a model.
CUDNN_AFTER_CALLS = 1024
_MAX_SHAPES = 4096  # the count is forgotten past this many shapes (a stream of new ones)
_SHAPE_CALLS: dict[tuple, int] = {}
# per attention module and shape, the choices of its forwards under saved-tensor hooks (gradient
# checkpointing) that await their recomputation inside backward, which must take the same one
# (another backend saves other tensors for backward: non-reentrant checkpointing refuses it)
_RECORDED: weakref.WeakKeyDictionary[Any, dict[tuple, collections.deque]] = (
    weakref.WeakKeyDictionary()
)


def cudnn_plan_pays(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    module: Any = None,
) -> bool:
    """Whether this attention call may go to cuDNN: its shape (the operands', the mask's, the
    dtype, whether autograd records it) has been seen more than CUDNN_AFTER_CALLS times in this
    process. Counts the call. A call inside backward (a gradient checkpoint's recomputation of
    ``module``'s forward, which must save what its forward saved) makes the choice of the
    latest of ``module``'s forwards of the shape not yet recomputed; where there is none (a
    reentrant checkpoint's forward ran without autograd) it counts as any call, in step with
    that forward's own count."""
    recorded = query.requires_grad and torch.is_grad_enabled()
    shape = (
        query.shape,
        key.shape,
        None if attention_mask is None else attention_mask.shape,
        query.dtype,
        query.device.index,
        recorded,
    )
    in_backward = torch._C._current_graph_task_id() != -1
    # a forward that may be recomputed: saved-tensor hooks are active (non-reentrant
    # checkpointing's; an offloading hook's too, which only keeps a shape off cuDNN longer)
    recomputable = recorded and not in_backward and _saved_tensor_hooks() is not None
    memo = _memo(module) if recorded and (in_backward or recomputable) else None
    pending = None if memo is None else memo.get(shape)
    if in_backward and pending:
        return pending.popleft()  # all pending choices are equal (below): order is moot
    calls = _SHAPE_CALLS.get(shape, 0) + 1
    if calls <= CUDNN_AFTER_CALLS:
        if len(_SHAPE_CALLS) >= _MAX_SHAPES and calls == 1:
            _SHAPE_CALLS.clear()
        _SHAPE_CALLS[shape] = calls
    pays = calls > CUDNN_AFTER_CALLS
    if memo is not None and recomputable:
        if pending:  # a forward of this module and shape awaits its recomputation: no change
            pays = pending[-1]  # until it has run (recomputations pair in any order)
        if len(memo) >= _MAX_RECORDED and shape not in memo:
            memo.clear()
        memo.setdefault(shape, collections.deque(maxlen=_MAX_PENDING)).append(pays)
    return pays


def _saved_tensor_hooks() -> Any:
    """The innermost saved-tensor hooks in effect (None: none)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


_MAX_RECORDED = 64  # shapes remembered per module (calls of several shapes before a backward)
_MAX_PENDING = 16  # forwards of one module and shape remembered (not recomputed: the oldest go)


def _memo(module: Any) -> dict[tuple, collections.deque] | None:
    """``module``'s forwards' choices per shape (None for no module, or one without weak
    references)."""
    if module is None:
        return None
    try:
        return _RECORDED.setdefault(module, {})
    except TypeError:
        return None


def without_cudnn(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with cuDNN's attention switched off for the call: a padded call's
    attention, which scaled_dot_product_attention would send to cuDNN (with a mask, and on an
    H200 with torch 2.11 without one too), and cuDNN builds an execution plan for every new
    shape (tens of milliseconds each; a stream of requests of random sizes is mostly new
    shapes). The flash and memory-efficient kernels have no per-shape plan. The switch is
    torch's process-wide flag, set back when the last of this module's calls that switched it
    off (in any thread) returns: another thread's attention during the call skips cuDNN too,
    and a caller changing the flags meanwhile in another thread (``sdpa_kernel``) races with
    it; docs/decisions.md has the measurement. Only where the backends that
    take any call cuDNN takes are on (memory-efficient and math, as torch starts): a caller's
    own choice (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``) is left as it is."""
    backends = torch.backends.cuda
    with _SWITCH:
        global _OFF_CALLS
        # the caller's flags as torch starts (cuDNN's may be off by another of our calls);
        # otherwise the caller chose (sdpa_kernel, maybe in this thread while another of our
        # calls runs in another): left as it is
        switched = (
            (backends.cudnn_sdp_enabled() or _OFF_CALLS > 0)
            and backends.mem_efficient_sdp_enabled()
            and backends.math_sdp_enabled()
        )
        if switched:  # the first call in switches it off; the last one out, back on
            _OFF_CALLS += 1
            backends.enable_cudnn_sdp(False)
    if not switched:
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    finally:
        with _SWITCH:
            _OFF_CALLS -= 1
            if _OFF_CALLS == 0:
                backends.enable_cudnn_sdp(True)


# this module's calls with cuDNN's attention switched off, across threads (one of them may
# return while another still runs: the flag goes back on when the last one returns)
_SWITCH = threading.Lock()
_OFF_CALLS = 0


def varlen_attention(
    fn: Callable[..., Any],
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Attention of packed ``query`` [1, Hq, T, D], ``key`` / ``value`` [1, Hkv, T, D], each
    token attending to its own sequence's (``kwargs``' cu_seq_lens): [1, T, Hq, D], no
    weights."""
    # [batch + 1], or [1, batch + 1] as a replayed call passes it (replay's inputs are rows)
    cu = kwargs["cu_seq_lens_q"].reshape(-1)
    rest = {k: v for k, v in kwargs.items() if k not in PACKING_KWARGS}
    same = kwargs["cu_seq_lens_k"].numel() == cu.numel()
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or not same:
        raise PackingMismatch("an attention call whose keys are not the packed queries")
    causal = rest.pop("is_causal", None)
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    window = rest.get("sliding_window") or getattr(module, "sliding_window", None)
    max_len = int(kwargs["max_length_q"])
    if _flash_applies(query, rest, module, window, max_len):
        return _flash(query, key, value, cu, max_len, causal, rest.get("scaling")), None
    if CAPTURING.get():
        raise NotCapturable(
            f"{type(module).__name__}'s packed attention runs per sequence here (not the flash "
            "kernel), which reads the lengths on the host"
        )
    return _per_sequence(fn, module, query, key, value, cu, causal, window, rest), None


def _flash_applies(query, rest: dict, module: Any, window: int | None, max_len: int) -> bool:
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if (_ATEN_FLASH is None and _VARLEN is None) or (rest.get("dropout") or 0.0) != 0.0:
        return False
    if query.shape[-1] % 8 or query.shape[-1] > 256:  # the flash kernels' head sizes
        return False
    if any(rest[k] not in (None, False) for k in set(rest) - _FLASH_KWARGS):
        return False
    if rest.get("softcap") is not None:
        return False
    if getattr(module, "attn_logit_softcapping", None) is not None:
        return False
    return not (window is not None and max_len > window)


def _aten_flash() -> Callable[..., Any] | None:
    """aten's flash attention over cumulative lengths, called directly: varlen_attn's custom-op
    wrapper costs tens of microseconds of host time per call (a dozen calls a forward), and
    this op has its own autograd (its backward is aten's flash backward). None where this
    torch's op lacks the arguments used here."""
    try:
        op = torch.ops.aten._flash_attention_forward.default
        names = {a.name for a in op._schema.arguments}
    except (AttributeError, RuntimeError):
        return None
    return op if "scale" in names else None


def _varlen_attn() -> tuple[Callable[..., Any], set[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


_ATEN_FLASH = _aten_flash()
_VARLEN = _varlen_attn()


def _flash(query, key, value, cu, max_len: int, causal: bool, scaling) -> torch.Tensor:
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if _ATEN_FLASH is not None:
        # fewer key heads than query heads (GQA) are the kernel's own case: no copies
        out = _ATEN_FLASH(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scaling)
        return out[0][None]  # [1, T, H, D]
    fn, params = _VARLEN  # type: ignore[misc]
    groups = q.shape[1] // k.shape[1]
    extra: dict[str, Any] = {"scale": scaling}
    if groups > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif groups > 1:  # this torch's varlen_attn takes as many key heads as query heads
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if "is_causal" in params:
        extra["is_causal"] = causal
    elif causal:
        extra["window_size"] = (-1, 0)
    out = fn(q, k, v, cu, cu, max_len, max_len, **extra)
    return out[None]  # [1, T, H, D]


def _mask(length: int, causal: bool, window: int | None, dtype, device) -> torch.Tensor | None:
    """The additive mask of one sequence: causal (within ``window`` where set), or None."""
    if not causal:
        return None
    i = torch.arange(length, device=device)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _per_sequence(fn, module, query, key, value, cu, causal, window, rest) -> torch.Tensor:
    """``fn`` on each group of equal-length sequences (batched), outputs in packed order."""
    starts = cu.tolist()
    by_length: dict[int, list[int]] = {}
    for i in range(len(starts) - 1):
        by_length.setdefault(starts[i + 1] - starts[i], []).append(i)
    pieces: list[tuple[int, torch.Tensor]] = []
    for length, members in by_length.items():
        if length == 0:
            continue
        take = torch.cat(
            [torch.arange(starts[i], starts[i] + length, device=query.device) for i in members]
        )

        n = len(members)

        def rows(t: torch.Tensor, take=take, n=n, length=length) -> torch.Tensor:
            # [1, H, T, D] -> [n, H, length, D]
            return t[0].index_select(1, take).view(t.shape[1], n, length, -1).transpose(0, 1)

        mask = _mask(length, causal, window, query.dtype, query.device)
        out, _ = fn(module, rows(query), rows(key), rows(value), mask, **rest)
        # out: [n, length, H, D] -> per sequence
        for j, i in enumerate(members):
            pieces.append((starts[i], out[j]))
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p[1] for p in pieces])[None]
