"""Tracing one module's own forward with torch.fx, robustly enough for whole transformer layers.

Every submodule is a leaf: only the module's own code is read, its children appear as
``call_module`` nodes. What made plain ``fx.symbolic_trace`` fail on most HuggingFace layers, and
what this does instead:

- Decorated forwards (transformers' gradient-checkpointing wrapper ``forward(self, *args,
  **kwargs)``, ``deprecate_kwarg`` ...): the function under the wrappers is traced
  (:func:`inner_forward`); a rewrite later re-builds the wrapper chain around the rewritten inner
  function (:func:`rewrap`), so the wrappers keep running.
- Optional arguments (``attention_mask=None``, ``use_cache=False``, ``**kwargs``): a trace is made
  for one *call key*, the structure of one call: which arguments are tensors (graph inputs) and
  the values of the others (constants baked into the trace). ``if mask is not None`` then takes
  the branch the call takes. :func:`call_key` computes the key of a call in a few microseconds,
  so a rewritten forward can look its trace up per call and trace a new key on first use.
- ``self.training`` read by the forward is baked into a trace too: traces are keyed by it.
- Other objects (a transformers ``Cache`` passed to every decoder layer, even in training when
  ``use_cache`` is on) are graph inputs too, keyed by their class: during the trace they are
  proxies that ``isinstance`` sees as that class, so the block's own code passes them to its
  children or calls their methods, and the generated code does the same with the real object at
  run time. Code that needs their value to trace (``if cache:``, ``len(cache)``) cannot be
  traced, and such calls run the original forward.
- Python values the forward reads from the module's own attributes (``self.scale``, OPT's
  ``self.dropout``) are baked into a trace too: every name the forward looks up on the module
  is recorded during the trace (present or not), and guard.py checks on each call that what
  it read still holds; a call after a change traces again.
- What the trace must keep exactly: an in-place update (``r += y``, which plain fx records as an
  out-of-place add) is recorded as the in-place operator; the forward's return value keeps its
  type (a dataclass ``ModelOutput``, a named tuple), rebuilt around the graph's outputs. A
  forward that assigns attributes of its module does not trace (the copy would not assign them).
"""

from __future__ import annotations

import inspect
import operator
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

# A call key: (training, positional kinds, ((keyword, kind), ...)); a kind is TENSOR, an object
# input (OBJECT, its class), a constant (type, value) or a tuple of kinds for a tuple/list.
TENSOR = "<tensor>"
OBJECT = "<object>"
CallKey = tuple


class Untraceable(Exception):
    """A forward that cannot be traced for a call key; the message says why."""


class _Unsupported(Exception):
    pass


_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _passed_through(value: Any) -> bool:
    """A constant-typed value the forward only hands on (``fastlayers_pass_through`` on its
    class: padding-free's packed length)."""
    return getattr(type(value), "fastlayers_pass_through", False)


def _kind(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TENSOR
    if isinstance(value, float):
        # a float argument is usually a value that varies from call to call (a scale, a
        # temperature): one trace per value would grow without end
        raise _Unsupported("float")
    if isinstance(value, _CONSTANT_TYPES):
        if _passed_through(value):
            # a value the forward only hands on (padding-free's packed length): an input of the
            # trace, not baked in, so that a new value neither retraces nor loses its type
            return (OBJECT, type(value))
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_kind(v) for v in value))
    if isinstance(value, (dict, set, nn.Module)) or callable(value):
        # a mapping or set would be iterated, a module or function called: not passed through
        raise _Unsupported(type(value).__name__)
    return (OBJECT, type(value))


_Tensor = torch.Tensor
# The keys of calls with plain tensors as their only (positional) arguments, by training flag
# and count: the common call, keyed without a walk of its arguments.
_TENSORS_ONLY = {(t, n): (t, (TENSOR,) * n, ()) for t in (False, True) for n in range(9)}


def call_key(training: bool, args: tuple, kwargs: dict) -> CallKey | None:
    """The key of a call, or None when an argument is a mapping, a set, a module or a callable
    (not passed through by a trace) or a float (see _kind): such calls run the original
    forward."""
    if not kwargs and len(args) < 9:
        for a in args:
            if type(a) is not _Tensor:
                break
        else:
            return _TENSORS_ONLY[training, len(args)]
    try:
        return (
            training,
            tuple(_kind(a) for a in args),
            tuple((k, _kind(v)) for k, v in kwargs.items()),
        )
    except _Unsupported:
        return None


def tensors_of(args: tuple, kwargs: dict) -> tuple | list[Any]:
    """The tensors and object inputs of a call in key order: the inputs of its traced graph."""
    if not kwargs:
        for a in args:
            if type(a) is not _Tensor:
                break
        else:
            return args  # plain tensors only: they are the inputs, in order
    out: list[Any] = []
    for a in args:
        _collect(a, out)
    for v in kwargs.values():
        _collect(v, out)
    return out


def _collect(value: Any, out: list) -> None:
    # module level, not a closure: a recursive closure is a reference cycle per call
    if isinstance(value, (tuple, list)):
        for v in value:
            _collect(v, out)
    elif not isinstance(value, _CONSTANT_TYPES) or _passed_through(value):
        out.append(value)  # a tensor or an object input


def _rebuild(kind: Any, tensors: list) -> Any:
    """The argument a kind stands for, tensors (and object inputs) taken in order from
    ``tensors``; during a trace an object input's proxy is given the object's class."""
    if kind == TENSOR:
        return tensors.pop(0)
    typ, value = kind
    if typ == OBJECT:
        proxy = tensors.pop(0)
        return (
            _ObjectProxy(proxy.node, proxy.tracer, value) if isinstance(proxy, fx.Proxy) else proxy
        )
    if typ in (tuple, list):
        return typ(_rebuild(k, tensors) for k in value)
    return value


def count_tensors(key: CallKey) -> int:
    def count(kind: Any) -> int:
        if kind == TENSOR:
            return 1
        typ, value = kind
        if typ == OBJECT:
            return 1
        return sum(count(k) for k in value) if typ in (tuple, list) else 0

    _, pos, kw = key
    return sum(count(k) for k in pos) + sum(count(k) for _, k in kw)


def inner_forward(cls: type) -> Callable:
    """The class's forward under its decorators (functools.wraps chains)."""
    return inspect.unwrap(cls.forward)


def default_key(module: nn.Module) -> CallKey:
    """The key of the most common call: required parameters tensors, the rest at their
    defaults (``mask=None``, ``use_cache=False``, no ``*args`` / ``**kwargs``)."""
    signature = inspect.signature(inner_forward(type(module)))
    positional = []
    for i, param in enumerate(signature.parameters.values()):
        if i == 0 or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue  # self, *args, **kwargs
        if param.default is param.empty:
            if param.kind is param.KEYWORD_ONLY:
                raise Untraceable(f"keyword-only parameter {param.name!r} has no default")
            positional.append(TENSOR)
    return (module.training, tuple(positional), ())


class _ObjectProxy(fx.Proxy):
    """The proxy of an object input: ``isinstance`` sees the object's class (``type()`` does
    not), so the forward's ``isinstance(cache, Cache)`` takes the branch a real call takes."""

    def __init__(self, node: fx.Node, tracer: Any, cls: type) -> None:
        super().__init__(node, tracer)
        self.__dict__["_object_class"] = cls

    @property  # type: ignore[override]
    def __class__(self) -> type:
        return self.__dict__["_object_class"]


# The in-place operators, recorded as such (plain fx has no ``__iadd__`` on its proxies, so
# Python falls back to ``__add__`` and ``r += y`` traces as an out-of-place add: the caller's
# tensor would no longer be updated). fx's code generator writes them back as ``r += y``.
IN_PLACE_OPERATORS = {
    "__iadd__": operator.iadd,
    "__isub__": operator.isub,
    "__imul__": operator.imul,
    "__itruediv__": operator.itruediv,
    "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod,
    "__ipow__": operator.ipow,
    "__imatmul__": operator.imatmul,
    "__iand__": operator.iand,
    "__ior__": operator.ior,
    "__ixor__": operator.ixor,
    "__ilshift__": operator.ilshift,
    "__irshift__": operator.irshift,
}


def _in_place_method(op: Callable) -> Callable:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


_InPlaceProxy = type(
    "_InPlaceProxy",
    (fx.Proxy,),
    {name: _in_place_method(op) for name, op in IN_PLACE_OPERATORS.items()},
)


class _LeafTracer(fx.Tracer):
    """Records calls to submodules instead of tracing into them, and in-place operators as
    such. While it traces, fx replaces ``nn.Module.__call__`` and ``__getattr__`` for the whole
    process: calls and lookups from other threads (a server's other requests) pass through as
    if no trace ran."""

    _thread = 0

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self._thread = threading.get_ident()
        return super().trace(root, concrete_args)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)


class _TraceRoot(nn.Module):
    """Stands for the traced module during a trace: it shares the module's children, Parameters
    and buffers (the same dicts), so the graph's targets are the module's own attribute names
    and its generated code, bound to the module, looks them up live on every call."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for attr in ("_modules", "_parameters", "_buffers"):
            self.__dict__[attr] = module.__dict__[attr]


_ABSENT = object()
_TRACING = threading.RLock()


def _recording_class(cls: type, reads: set[str]) -> type:
    """A subclass of ``cls`` that adds every attribute name looked up on an instance to
    ``reads`` (set as the module's class for the length of a trace): what the forward read, so
    the guard (guard.py) covers exactly that, present or absent."""
    lookup = cls.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        reads.add(name)
        return lookup(self, name)

    namespace = {
        "__getattribute__": __getattribute__,
        "__slots__": (),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    return type(cls.__name__, (cls,), namespace)


@dataclass(frozen=True)
class Traced:
    """One trace of a module's own forward for one call key: the graph (tensors and object
    inputs -> placeholders t0, t1, ...), how to rebuild the forward's return value from the
    graph's outputs (None: the graph returns it as it is), the attribute names the forward
    looked up on the module and the module's ``__dict__`` as it was then (guard.py makes the
    per-call guard of these)."""

    graph: fx.Graph
    output: pytree.TreeSpec | None
    reads: frozenset[str]
    before: dict[str, Any]


def trace_call(module: nn.Module, key: CallKey) -> Traced:
    """``module``'s own forward traced for calls with this key (everything but tensors and
    object inputs baked in). Raises Untraceable with the reason."""
    training, pos_kinds, kw_kinds = key
    inner = inner_forward(type(module))
    n = count_tensors(key)
    names = [f"t{i}" for i in range(n)]
    structure: dict[str, Any] = {}

    def call(*tensors: Any) -> Any:
        pending = list(tensors)
        args = [_rebuild(k, pending) for k in pos_kinds]
        kwargs = {name: _rebuild(k, pending) for name, k in kw_kinds}
        out = inner(module, *args, **kwargs)
        if _plain(out):
            return out
        leaves, spec = pytree.tree_flatten(out)
        rebuilt = [leaf for leaf in leaves if isinstance(leaf, (tuple, list, dict))]
        if rebuilt:
            raise Untraceable(
                f"its forward returns a {type(rebuilt[0]).__name__} inside a "
                f"{type(out).__name__}, which the rewritten forward could not rebuild"
            )
        structure["output"] = spec
        return leaves

    # fx reads the root forward's signature: one named parameter per graph input.
    namespace: dict[str, Any] = {"_call": call}
    exec(  # source built here from generated identifiers only
        f"def forward(self, {', '.join(names)}):\n    return _call({', '.join(names)})\n",
        namespace,
    )
    # fx traces type(root).forward: a class of its own per trace, with the generated forward
    root_cls = type("_TraceRoot", (_TraceRoot,), {"forward": namespace["forward"]})
    root = root_cls(module)
    with _TRACING:  # one trace at a time: each swaps the module's class and training flag
        was_training = module.training
        module.training = training
        before = dict(module.__dict__)
        reads: set[str] = set()
        cls = type(module)
        module.__class__ = _recording_class(cls, reads)
        try:
            graph = _on_own_thread(lambda: _LeafTracer().trace(root))
        finally:
            module.__class__ = cls
            written = _written(before, module.__dict__)
            for name in written:  # put back what the trace assigned (proxies, trace values)
                if name in before:
                    module.__dict__[name] = before[name]
                else:
                    module.__dict__.pop(name, None)
            module.training = was_training
    if written:
        raise Untraceable(
            f"its forward assigns attributes of the module ({', '.join(written)}), which a "
            "traced copy would not do"
        )
    return Traced(graph, structure.get("output"), frozenset(reads), before)


def _plain(value: Any) -> bool:
    """Whether fx's graph output keeps ``value`` as it is: tensors (proxies) and constants in
    tuples, lists and dicts of exactly those types."""
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(_plain(v) for v in value.values())
    return not isinstance(value, (tuple, list, dict))


def _written(before: dict, after: dict) -> list[str]:
    """The attributes a trace assigned (new, removed or rebound), ``training`` aside."""
    names = (before.keys() | after.keys()) - {"training"}
    return sorted(n for n in names if before.get(n, _ABSENT) is not after.get(n, _ABSENT))


def _on_own_thread(trace: Callable[[], fx.Graph]) -> fx.Graph:
    """``trace()`` on a thread of its own. torch.fx's Proxy.__iter__ (tuple unpacking of a
    proxy, in every transformer layer) keeps a reference cycle through its own frame, and so the
    whole calling stack until the cyclic collector runs: traced from inside a real call, that
    stack holds the caller's tensors and cache (seen: GPT-2's DynamicCache and activations kept
    one step longer on an H100). A fresh thread's stack holds nothing of the caller's."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["graph"] = trace()
        except Untraceable as err:
            out["error"] = str(err)
        except Exception as err:  # any forward that does not trace symbolically
            out["error"] = _reason(err)

    worker = threading.Thread(target=run, name="fastlayers-trace", daemon=True)
    worker.start()
    worker.join()
    if "error" in out:
        raise Untraceable(out["error"])
    return out["graph"]


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:120]}" if text else type(err).__name__


def compile_graph(graph: fx.Graph, output: pytree.TreeSpec | None = None) -> Callable:
    """Python function ``f(module, t0, t1, ...)`` running ``graph`` with ``module`` as its root:
    ``self.<child>`` is looked up on the module at call time, so later swaps of its children
    are seen (a GraphModule would hold copies of the references). With ``output``, the graph's
    outputs are rebuilt into the forward's own return type."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(code.src, namespace)  # torch.fx generated source
    fn = namespace["forward"]
    if output is None:
        return fn

    def rebuilt(module: nn.Module, *tensors: Any) -> Any:
        return pytree.tree_unflatten(fn(module, *tensors), output)

    return rebuilt


class Unwrappable(Exception):
    """A decorator chain whose innermost function cannot be replaced (not a closure over it)."""


def rewrap(fn: Callable, inner: Callable) -> Callable:
    """``fn``'s functools.wraps chain rebuilt around ``inner`` in place of the innermost
    function: each wrapper is a copy of the original function object whose closure cell that
    held the wrapped function holds the rebuilt inner chain instead (its other cells, e.g. a
    reference to itself, are kept). Raises Unwrappable when a wrapper does not hold what it
    wraps in a closure cell."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None:
        return inner
    new_wrapped = rewrap(wrapped, inner)
    cells = getattr(fn, "__closure__", None) or ()
    holding = [i for i, c in enumerate(cells) if _cell_holds(c, wrapped)]
    if not isinstance(fn, types.FunctionType) or len(holding) != 1:
        raise Unwrappable(f"its forward's decorator {getattr(fn, '__qualname__', fn)!r}")
    new_cells = tuple(
        types.CellType(new_wrapped) if i == holding[0] else c for i, c in enumerate(cells)
    )
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, new_cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__wrapped__ = new_wrapped
    return copy


def _cell_holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
