"""Host-free replay for inference (opt-in: ``fastlayers.patch(model, replay=True)``): the model's
forward captured as CUDA graphs, one per shape bucket, and replayed, so a host-bound step costs
a few input copies and one graph launch instead of thousands of Python-level calls.

- Attention is captured as eager runs it (capture_attention.py: transformers builds a mask
  during a capture that sends attention to its slow float32 kernel).
- Buckets: the batch rounded up to a power of two (``batch_buckets``), the sequence length (when
  the call has a 2-D ``attention_mask``) to a multiple of 8 up to 128 tokens and of 1/8 of the
  power of two below it beyond (at most 12.5% padding). Inputs are copied into the bucket's
  static buffers, the rest zeroed: padding rows, and padding columns with an attention mask of
  0, as a tokenizer pads. The outputs are sliced back to the real rows and columns and copied
  out of the graph's buffers.
- Each bucket's first call captures (a few eager warm-up runs, then the capture) and checks the
  replayed outputs at the real positions against the eager forward of the same call, with the
  end-to-end tolerance of fastlayers.check. Where they differ (a model whose output depends on
  the padded length), that call structure is captured at its exact length instead, then at its
  exact batch too, then left to eager.
- Refused, with the reason (the call runs eagerly, warned once per reason): training mode,
  autograd on (replay runs under ``torch.no_grad()`` / ``torch.inference_mode()``), CPU
  inputs, arguments other than tensors and constants, outputs other than tensors and
  constants (a KV cache object: pass ``use_cache=False``), module hooks or accelerate hooks in
  the model (their Python would not run on replay), a forward that cannot be captured (a host
  synchronisation inside it). Past ``max_graphs`` buckets the least used graph is dropped
  for the new one (``stats['evicted']``).
- Guarded: one generated test per call (guard.py's builder) checks that the module tree is as
  captured: every module's class, children, Parameters and buffers (the same objects with the
  same storage: ``.to()``, ``.half()``, ``load_state_dict(assign=True)`` and replaced weights are
  seen; in-place updates such as ``load_state_dict`` copies are what the graph reads anyway), its
  own ``forward`` and training flag, no hooks. A change drops every graph; the next calls capture
  again. Values inside other objects (``model.config``) are read at capture, as by a trace.

All buckets share one memory pool (graphs replay one at a time on the current stream)."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..eligibility import GLOBAL_FORWARD_HOOKS, GLOBAL_FORWARD_PRE_HOOKS
from ..fallback import warn_once
from ..guard import TestBuilder
from .call import CallView, WrappedForward
from .capture_attention import AttentionUnderCapture
from .varlen import TORCH_CHOICE, NotCapturable

_CONSTANTS = (type(None), bool, int, float, str)
_BROKEN: list[str | None] = [None]  # why, once a capture failed mid-way (see record)


@dataclass(frozen=True)
class ReplayOptions:
    """How :func:`fastlayers.patch` with ``replay=`` buckets and bounds the captures."""

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    seq_multiple: int = 8  # sequence lengths round up to a multiple of this at least
    max_graphs: int = 64  # captures kept at once; past it, the least used one is dropped
    warmup: int = 2  # eager runs before a capture (lazy initialisation, autotuning)

    def __post_init__(self) -> None:
        if not self.batch_buckets or any(
            not isinstance(b, int) or b < 1 for b in self.batch_buckets
        ):
            raise ValueError(
                f"ReplayOptions: batch_buckets must be positive ints, got {self.batch_buckets}"
            )
        for name in ("seq_multiple", "max_graphs", "warmup"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ReplayOptions: {name} must be an int >= 1, got {value!r}")


def batch_bucket(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``batch`` rows, or None (past the largest)."""
    for size in buckets:
        if size >= batch:
            return size
    return None


def seq_bucket(length: int, multiple: int = 8) -> int:
    """``length`` rounded up: to a multiple of ``multiple`` up to 128 tokens, then to a multiple
    of 1/8 of the power of two below it (at most 12.5% more tokens)."""
    step = multiple if length <= 128 else max(multiple, 1 << (length.bit_length() - 4))
    return -(-length // step) * step


class _Refused(Exception):
    """A call structure that cannot be replayed; the message says why."""


@dataclass
class _Graph:
    """One captured bucket: the graph, its static inputs and outputs, how the outputs nest,
    which output dims are the batch (``row_dims``) and the sequence (``col_dims``) to cut back
    to the call's size, and the kinds of padding ('rows', 'cols') checked against eager."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[Any]
    spec: pytree.TreeSpec
    rows: int  # the bucket's batch
    cols: int  # the bucket's sequence length (0: no sequence padding)
    row_dims: list[bool] = field(default_factory=list)
    col_dims: list[bool] = field(default_factory=list)
    checked: set[str] = field(default_factory=set)
    uses: int = 0  # replays, for the eviction past max_graphs

    def plan(self, expected: Any, rows: int, cols: int) -> None:
        """Which output dims to cut: learnt from the capturing call's eager output where it
        was padded (a dim the bucket's size in the graph and the call's in eager), else
        guessed (the first dim of the bucket's batch; the second of its length, in outputs of
        3 or more dims), and checked against eager on the first call padded that way."""
        want = pytree.tree_leaves(expected)
        self.row_dims, self.col_dims = [], []
        for out, ref in zip(self.outputs, want, strict=False):  # _differs compares structures
            tensor = isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
            is_rows = tensor and out.dim() >= 1 and out.shape[0] == self.rows
            if tensor and rows != self.rows and is_rows:
                is_rows = ref.dim() >= 1 and ref.shape[0] == rows
            is_cols = tensor and bool(self.cols) and out.dim() >= 3 and out.shape[1] == self.cols
            if tensor and cols and cols != self.cols and out.dim() >= 2:
                is_cols = out.shape[1] == self.cols and ref.dim() >= 2 and ref.shape[1] == cols
            self.row_dims.append(bool(is_rows))
            self.col_dims.append(bool(is_cols))
        missing = len(self.outputs) - len(self.row_dims)
        self.row_dims += [False] * missing
        self.col_dims += [False] * missing
        self.checked = self.padding(rows, cols)

    def padding(self, rows: int, cols: int) -> set[str]:
        """The kinds of padding a call of ``rows`` x ``cols`` gets in this bucket."""
        kinds = set()
        if rows != self.rows:
            kinds.add("rows")
        if cols and cols != self.cols:
            kinds.add("cols")
        return kinds

    def run(self, tensors: list[torch.Tensor], rows: int, cols: int) -> Any:
        """Replay for a call with ``rows`` x ``cols`` (cols 0: no sequence dim) real inputs."""
        padded = rows != self.rows or (cols and cols != self.cols)
        for static, x in zip(self.inputs, tensors, strict=True):
            if padded:
                static.zero_()
            static[_real(x.shape, self.cols, cols)].copy_(x)
        self.graph.replay()
        out = [
            self._cut(o, r, c, rows, cols)
            for o, r, c in zip(self.outputs, self.row_dims, self.col_dims, strict=True)
        ]
        return pytree.tree_unflatten(out, self.spec)

    @staticmethod
    def _cut(out: Any, is_rows: bool, is_cols: bool, rows: int, cols: int) -> Any:
        """A copy of ``out`` at the call's rows and columns (the graph's buffers are rewritten
        by the next replay)."""
        if not isinstance(out, torch.Tensor):
            return out
        if is_cols:
            return out[:rows, :cols].clone()
        return out[:rows].clone() if is_rows else out.clone()


def _real(shape: torch.Size, bucket_cols: int, cols: int) -> tuple[slice, ...]:
    """The index of a real input of ``shape`` in its bucket's static buffer."""
    if cols and len(shape) >= 2 and shape[1] == cols and bucket_cols:
        return (slice(0, shape[0]), slice(0, cols))
    return (slice(0, shape[0]),)


def record(
    run: Callable[[], Any], device: torch.device, pool: Any, options: ReplayOptions, mask_free: bool
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` warmed up on a side stream (``options.warmup`` times), then captured into a
    graph in ``pool``: (graph, its output). Raises _Refused where the output holds what a graph
    cannot replay or the forward cannot be captured (after a capture failed mid-way, none
    follows in this process)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    attention = AttentionUnderCapture(mask_free)
    capturing = False
    # the routed attentions keep torch's choice in the warm-up and the capture alike: a cuDNN
    # plan is built in the warm-up, and serves every replay
    choice = TORCH_CHOICE.set(True)
    try:
        with torch.cuda.device(device):
            with torch.cuda.stream(side):
                for i in range(options.warmup):
                    last = i == options.warmup - 1
                    with attention.warming_up() if last else contextlib.nullcontext():
                        warm = run()
            torch.cuda.current_stream(device).wait_stream(side)
            leaves = pytree.tree_leaves(warm)
            odd = [v for v in leaves if not isinstance(v, (torch.Tensor, *_CONSTANTS))]
            if odd:
                raise _Refused(
                    f"its output holds a {type(odd[0]).__name__}, which a graph cannot "
                    "replay (for a KV cache: pass use_cache=False)"
                )
            del warm, leaves
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' allocator or driver calls do not invalidate it
            capture = torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
            with capture, attention.capturing():
                capturing = True
                out = run()
    except _Refused:
        raise
    except NotCapturable:  # the packed call's own refusal (unpad.py decides)
        raise
    except Exception as err:  # a forward that does not capture (a host sync inside it)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        why = f"the forward cannot be captured ({type(err).__name__}: {first})"
        if capturing:
            # torch leaves its CUDA generator and allocator mid-capture after a failed one: no
            # further capture in this process
            _BROKEN[0] = f"an earlier capture failed in this process ({why})"
        raise _Refused(why) from err
    finally:
        TORCH_CHOICE.reset(choice)
    return graph, out


class ReplayForward(WrappedForward):
    """The forward of a model patched with ``replay=``, set on the instance (records.py's
    ReplayRecord puts it there and takes it away). Holds the model, the forward it replaced
    (``previous``: a rewritten block's forward, or None for the class's) and the options;
    graphs are made on first use. ``stats`` counts replays, captures and eager calls by
    reason."""

    is_fastlayers_replay = True  # what fused.rewritten_forward looks through

    def __init__(self, model: nn.Module, previous: Any, options: ReplayOptions) -> None:
        self.model, self.previous, self.options = model, previous, options
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._drop()

    def __getstate__(self) -> dict:
        return {"model": self.model, "previous": self.previous, "options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"], state["previous"], state["options"])

    def _drop(self) -> None:
        self._graphs: dict[tuple, _Graph | str] = {}
        self._exact: dict[tuple, int] = {}  # structure -> 1: exact length, 2: exact batch too
        self._pool: Any = None
        self._holds: Callable[[], bool] | None = None
        self._stream: Any = None  # the stream the graphs were captured for

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        why = _why_eager(self.model, args, kwargs)
        if why is None and not self._lock.acquire(blocking=False):
            # the static buffers are one per bucket: one call at a time replays
            why = "another thread is replaying this model"
        elif why is None:
            try:
                return self._replayed(args, kwargs)
            except _Refused as err:
                why = str(err)
            finally:
                self._lock.release()
        self.stats[f"eager: {why}"] += 1
        warn_once(f"replay runs {type(self.model).__name__} eagerly: {why}", 3)
        return self.eager(*args, **kwargs)

    def _replayed(self, args: tuple, kwargs: dict) -> Any:
        if self._holds is not None and not self._holds():
            warn_once(f"{type(self.model).__name__} changed since its capture: captured again", 4)
            self._drop()
        names = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        names += [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        tensors = [args[n] if isinstance(n, int) else kwargs[n] for n in names]
        stream = torch.cuda.current_stream(tensors[0].device)
        if self._stream is not None and stream != self._stream:
            raise _Refused("the call is on another CUDA stream than the captures' own")
        view = CallView.bind(self.__signature__, args, kwargs)  # the call by parameter name
        rows = tensors[0].shape[0]
        cols = view.mask.shape[1] if view is not None and view.mask is not None else 0
        structure = _structure(args, kwargs, names, tensors, cols)
        exact = self._exact.get(structure, 0)
        bucket_rows = rows if exact >= 2 else batch_bucket(rows, self.options.batch_buckets)
        if bucket_rows is None:
            raise _Refused("the batch is past the largest bucket")
        bucket_cols = cols if (exact or not cols) else seq_bucket(cols, self.options.seq_multiple)
        key = (structure, bucket_rows, bucket_cols)
        entry = self._graphs.get(key)
        if isinstance(entry, str):
            raise _Refused(entry)
        if entry is not None:
            self.stats["replayed"] += 1
            entry.uses += 1
            out = entry.run(tensors, rows, cols)
            new = entry.padding(rows, cols) - entry.checked
            if not new:
                return out
            # first call padded this way: its output cut as planned, checked against eager
            expected = self.eager(*args, **kwargs)
            why = _differs(out, expected)
            if why is None:
                entry.checked |= new
            else:
                del self._graphs[key]
                self._more_exact(structure, "cols" in new, why)
            return expected
        graphs = {k: g for k, g in self._graphs.items() if isinstance(g, _Graph)}
        if len(graphs) >= self.options.max_graphs:  # no cliff: the least used one goes
            del self._graphs[min(graphs, key=lambda k: graphs[k].uses)]
            self.stats["evicted"] += 1
        return self._capture(key, args, kwargs, view, names, tensors, (rows, cols))

    def graph_count(self) -> int:
        """How many buckets are captured now."""
        return sum(isinstance(g, _Graph) for g in self._graphs.values())

    def _capture(
        self,
        key: tuple,
        args: tuple,
        kwargs: dict,
        view: CallView | None,
        names: list,
        tensors: list,
        real: tuple,
    ) -> Any:
        """Capture the bucket ``key``, check it against the eager call, and give the call's
        (eager) output."""
        structure, bucket_rows, bucket_cols = key
        rows, cols = real
        try:
            # outside inference mode: its tensors (the static buffers) could not be written
            # later under plain torch.no_grad()
            with torch.inference_mode(False), torch.no_grad():
                graph = self._captured(
                    args, kwargs, view, names, tensors, real, (bucket_rows, bucket_cols)
                )
        except _Refused as err:
            self._graphs[key] = str(err)
            raise
        expected = self.eager(*args, **kwargs)
        graph.plan(expected, rows, cols)
        why = _differs(graph.run(tensors, rows, cols), expected)
        if why is None:
            self._graphs[key] = graph
            self.stats["captured"] += 1
        elif graph.padding(rows, cols):
            self._more_exact(structure, "cols" in graph.padding(rows, cols), why)
        else:
            self._graphs[key] = f"the replayed output differs from eager ({why})"
        return expected

    def _more_exact(self, structure: tuple, cols: bool, why: str) -> None:
        """The output of ``structure``'s calls depends on the padding: capture them at their
        exact length from now on (then at their exact batch too)."""
        exact = self._exact.get(structure, 0)
        self._exact[structure] = 1 if cols and exact == 0 else 2
        for key in [k for k in self._graphs if k[0] == structure]:  # padded: not used again
            del self._graphs[key]
        warn_once(
            f"replay: {type(self.model).__name__}'s output depends on the padded "
            f"{'length' if cols else 'batch'} ({why}): captured at the exact size",
            5,
        )

    def _captured(
        self,
        args: tuple,
        kwargs: dict,
        view: CallView | None,
        names: list,
        tensors: list,
        real: tuple,
        bucket: tuple,
    ) -> _Graph:
        device = tensors[0].device
        if self._holds is None:  # the model as refused or captured: a change drops both
            self._holds = model_test(self.model)
        problem = _BROKEN[0] or _capture_problem(self.model)
        if problem is not None:
            raise _Refused(problem)
        (_, real_cols), (rows, cols) = real, bucket
        statics = []
        for x in tensors:
            shape = list(x.shape)
            shape[0] = rows
            if real_cols and x.dim() >= 2 and x.shape[1] == real_cols:
                shape[1] = cols
            static = torch.zeros(shape, dtype=x.dtype, device=device)
            static[_real(x.shape, cols, real_cols)].copy_(x)
            statics.append(static)
        s_args, s_kwargs = _with(args, kwargs, names, statics)
        # no mask input: transformers' masks then depend on shapes alone (a call that does not
        # bind to the forward's parameters, *args, could pass one: not mask-free)
        mask_free = view is not None and not any("mask" in name for name in view.tensors())
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.current_stream(device)
        graph, out = record(
            lambda: self.eager(*s_args, **s_kwargs), device, self._pool, self.options, mask_free
        )
        outputs, spec = pytree.tree_flatten(out)
        return _Graph(graph, statics, outputs, spec, rows, cols)


def _why_eager(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this call runs eagerly (None: it may replay)."""
    if model.training:
        return "the model is in training mode (replay is for inference: call model.eval())"
    if torch.is_grad_enabled():
        return "autograd is on (replay runs under torch.no_grad() or torch.inference_mode())"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing it"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph capture is under way (the caller's)"
    values = (*args, *kwargs.values())
    for value in values:
        if not isinstance(value, (torch.Tensor, *_CONSTANTS)):
            return f"an argument is a {type(value).__name__} (replay takes tensors and constants)"
    device = None
    for value in values:
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor:
                return f"an input is a {type(value).__name__}, not a plain tensor"
            if value.device.type != "cuda":
                return f"an input is on the {value.device.type.upper()}, not a CUDA device"
            if value.dim() == 0:
                return "an input is a 0-d tensor"
            if device is not None and value.device != device:
                return "inputs on different devices"
            device = value.device
    if device is None:
        return "no tensor inputs"
    rows = {v.shape[0] for v in values if isinstance(v, torch.Tensor)}
    if len(rows) > 1:
        return "tensor inputs of different batch sizes"
    return None


def _structure(args: tuple, kwargs: dict, names: list, tensors: list, cols: int) -> tuple:
    """The call's structure: each tensor's place, dtype and shape past the padded dims, the
    constants, the autocast state."""
    kinds = []
    for name, x in zip(names, tensors, strict=True):
        skip = 2 if cols and x.dim() >= 2 and x.shape[1] == cols else 1
        kinds.append((name, x.dtype, x.dim(), tuple(x.shape[skip:]), skip, x.device))
    constants = tuple(  # by type too: True, 1 and 1.0 are equal keys
        (i, type(a), a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)
    ) + tuple((k, type(v), v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return (tuple(kinds), constants, autocast)


def _with(args: tuple, kwargs: dict, names: list, tensors: list) -> tuple[tuple, dict]:
    """The call's arguments with ``tensors`` in the places ``names`` say."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for name, x in zip(names, tensors, strict=True):
        if isinstance(name, int):
            new_args[name] = x
        else:
            new_kwargs[name] = x
    return tuple(new_args), new_kwargs


def _differs(got: Any, expected: Any) -> str | None:
    """Why the replayed output is not the eager one at the real positions (within the
    end-to-end tolerance of fastlayers.check), or None."""
    from ..checking.numerics import end_to_end_error

    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(expected)
    if got_spec != want_spec:
        return "another output structure"
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return "another output value"
            continue
        if a.shape != b.shape:
            return f"an output of shape {tuple(a.shape)} instead of {tuple(b.shape)}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return "an integer output differs"
            continue
        error, bound = end_to_end_error(a, b)
        if not error <= bound:
            return f"max abs error {error:.3g} over {bound:.3g}"
    return None


def _capture_problem(model: nn.Module) -> str | None:
    """Why the model's modules cannot be captured as they are (hooks whose Python would not
    run on replay), or None."""
    if GLOBAL_FORWARD_HOOKS or GLOBAL_FORWARD_PRE_HOOKS:
        return "global module hooks are registered (they would not run on replay)"
    for name, m in model.named_modules():
        d = m.__dict__
        if "_hf_hook" in d:
            return f"{name or 'the model'} has an accelerate hook (it moves weights when called)"
        if (d["_forward_hooks"] or d["_forward_pre_hooks"]) and m is not model:
            return f"{name} has forward hooks (they would not run on replay)"
    return None


def model_test(model: nn.Module, capture: bool = True) -> Callable[[], bool]:
    """``test() -> bool``, generated: every module of ``model`` as now (class, children, own
    forward; for a capture also Parameters and buffers with their storage, training flag, no
    forward hooks below the root, no global forward hooks). ``capture=False``: the structure
    alone (what a padding-free call's first check vouched for: which modules run, by which
    forward)."""
    b = TestBuilder()
    lines = []
    for m in model.modules():
        d = m.__dict__
        lines.append(f"    d = {b.const(m)}.__dict__")
        tests = [f"type({b.const(m)}) is not {b.const(type(m))}"]
        if capture:
            tests.append(f"d['training'] is not {d['training']}")
        if capture and m is not model:
            tests += ["d['_forward_hooks']", "d['_forward_pre_hooks']"]
        if m is not model or capture:  # the root's own forward is the padding-free one
            tests.append(f"d.get('forward') is not {b.const(d.get('forward'))}")
        lines.append(f"    if {' or '.join(tests)}: return False")
        for slot in ("_modules", "_parameters", "_buffers") if capture else ("_modules",):
            items = d[slot]
            checks = [f"len(s) != {len(items)}"]
            for name, value in items.items():
                checks.append(f"s.get({name!r}) is not {b.const(value)}")
                if isinstance(value, torch.Tensor):
                    checks.append(f"{b.const(value)}.data_ptr() != {value.data_ptr()}")
            lines.append(f"    s = d[{slot!r}]")
            lines.append(f"    if {' or '.join(checks)}: return False")
    if capture:
        hooks = f"{b.const(GLOBAL_FORWARD_HOOKS)} or {b.const(GLOBAL_FORWARD_PRE_HOOKS)}"
        lines.append(f"    if {hooks}:")
        lines.append("        return False")
    return b.compile(lines, signature="")
