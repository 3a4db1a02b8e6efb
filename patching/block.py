"""Block rewrites: one module instance's forward replaced by a traced copy of its own forward in
which matched subgraphs call fused ops. Each block rule is a pattern (:class:`BlockPattern`):
``residual_layer_norm`` (here: ``layer_norm(dropout(x) + residual)``, and the prenorm form, where
the sum is used again, calls fastlayers' fused dropout + add + LayerNorm op), ``relu_scale``
(relu_scale_rule.py: ``relu(x) * c`` calls fastlayers' relu_scale op) and ``mlp`` (mlp_rule.py:
Linear -> activation -> Linear calls fastlayers' linear_act_linear op). One trace of a block goes
through every enabled pattern; one :class:`BlockRewrite` records all their matches.

The block keeps its class, children, Parameters, state_dict keys and hooks; only
``block.forward`` (or, under an accelerate hook, the ``_old_forward`` it wraps) is an instance
attribute while patched. The rewritten forward traces the block once per call key (see
trace.py: which arguments are tensors, the others' values, ``self.training``), runs the traced
code bound to the live block (children looked up on every call), and runs the original forward
for calls it cannot trace. Decorators on the class's forward (transformers' gradient
checkpointing wrapper) are rebuilt around the rewritten inner function, so they keep working.
"""

from __future__ import annotations

import copy
import operator
import types
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fastlayers import config
from fastlayers.layers import LayerNorm
from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops.dropout_add_layer_norm import dropout_add_layer_norm_forward

from .fallback import warn_once
from .forms import bind_dropout, dropout_of, in_place_updates, is_child, join
from .mlp_rule import RULE as MLP
from .mlp_rule import find_mlps, rewrite_mlps, wants_mlp
from .records import CheckTarget, Rewrite
from .relu_scale_rule import RULE as RELU_SCALE
from .relu_scale_rule import find_relu_scales, rewrite_relu_scales, wants_relu_scale
from .report import Swap
from .rules import (
    CALL_HOOK_KINDS,
    GLOBAL_BACKWARD_HOOKS,
    GLOBAL_BACKWARD_PRE_HOOKS,
    GLOBAL_FORWARD_HOOKS,
    GLOBAL_FORWARD_PRE_HOOKS,
    HOOK_KINDS,
    global_hook_problem,
    hook_problem,
)
from .trace import (
    VALUE_TYPES,
    AttributeGuard,
    CallKey,
    Untraceable,
    Unwrappable,
    call_key,
    compile_graph,
    default_key,
    inner_forward,
    rewrap,
    tensors_of,
    trace_call,
)

RULE = "residual_layer_norm"
_LAYER_NORMS = (nn.LayerNorm, LayerNorm)


# A match (one pattern found in a block's forward; frozen, picklable) has ``rule``, ``fused_op``
# and ``inductor_fuses`` (class attributes: its rule's name, the fused op it calls, whether
# Inductor fuses the native form itself: see RewrittenForward._inner), ``claims()`` (the
# children it takes over: no module rule swaps them) and ``row(block_name)`` (its report row).


@dataclass(frozen=True)
class ResidualLayerNorm:
    """One ``layer_norm(dropout(x) + residual)`` found in a block's forward."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "dropout_add_layer_norm"
    inductor_fuses: ClassVar[bool] = True

    layer_norm: str  # the LayerNorm child's attribute
    dropout: str | None  # 'child <attr>', 'F.dropout(p=...)' or None (no dropout)
    prenorm: bool  # the sum is used again: the op returns it too

    def claims(self) -> set[str]:
        """The LayerNorm child, and the dropout child when there is one."""
        out = {self.layer_norm}
        if is_child(self.dropout):
            out.add(self.dropout.removeprefix("child "))
        return out

    def row(self, block_name: str) -> Swap:
        """The report's row for this match in the block called ``block_name``."""
        native = ("Dropout + add + " if self.dropout else "add + ") + "LayerNorm"
        fused = self.fused_op + (" (prenorm)" if self.prenorm else "")
        return Swap(join(block_name, self.layer_norm), native, fused, self.rule)


# ------------------------------------------------------------------ finding the pattern


def _is_add(node: fx.Node) -> bool:
    if node.kwargs or len(node.args) != 2:
        return False
    if node.op == "call_function":
        return node.target in (operator.add, torch.add)
    return node.op == "call_method" and node.target == "add"


_IN_PLACE_OPERATORS = (
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.ipow,
    operator.imod,
)


def _is_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_")
    return node.op == "call_function" and node.target in _IN_PLACE_OPERATORS


def _has_layer_norm(block: nn.Module) -> bool:
    """Pre-filter: only a block with a LayerNorm child can hold the pattern."""
    return any(isinstance(c, _LAYER_NORMS) for c in block.children())


def find_residual_layer_norms(
    module: nn.Module, graph: fx.Graph
) -> tuple[list[tuple[ResidualLayerNorm, dict]], list[tuple[str, str]]]:
    """The patterns in ``graph`` (each with the nodes the rewrite needs), and (layer_norm
    attribute, reason) for LayerNorms applied to a sum that cannot be fused."""
    children = dict(module.named_children())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    order = {n: i for i, n in enumerate(graph.nodes)}
    found, skipped = [], []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(children.get(node.target), _LAYER_NORMS):
            continue
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        add = node.args[0]
        if not _is_add(add):
            continue
        ln = children[node.target]
        why = None
        if type(ln) not in _LAYER_NORMS:
            why = f"{type(ln).__name__} is a subclass of nn.LayerNorm (may compute otherwise)"
        elif calls[node.target] != 1:
            why = "the LayerNorm is called more than once in the forward"
        elif "_hf_hook" in ln.__dict__:
            why = "the LayerNorm has an accelerate hook (it loads offloaded weights when called)"
        else:
            why = hook_problem(ln, "LayerNorm")
        a, b = add.args
        x, dropout = dropout_of(a, children, calls)
        residual, residual_first, dropout_node = b, False, a
        if x is None:
            x, dropout = dropout_of(b, children, calls)
            residual, residual_first, dropout_node = a, True, b
        if x is None:  # no dropout: add + LayerNorm
            x, residual, residual_first, dropout_node = a, b, False, None
        others = [u for u in add.users if u is not node]
        if not (isinstance(x, fx.Node) and isinstance(residual, fx.Node)):
            why = why or "the sum adds a constant"
        elif any(order[u] < order[node] for u in others):
            why = why or "the sum is used before the LayerNorm"
        elif any(_is_in_place(u) for u in others):
            why = why or "the sum is modified in place"
        if why is not None:
            skipped.append((node.target, why))
            continue
        match = ResidualLayerNorm(node.target, dropout, bool(others))
        found.append(
            (
                match,
                {
                    "ln": node,
                    "add": add,
                    "x": x,
                    "residual": residual,
                    "residual_first": residual_first,
                    "dropout_node": dropout_node,
                },
            )
        )
    return found, skipped


def rewrite_graph(graph: fx.Graph, found: list[tuple[ResidualLayerNorm, dict]]) -> None:
    """Replace each found pattern by one call of :func:`residual_layer_norm`."""
    # an operand of a later match may be an earlier match's (erased) LayerNorm or sum
    replaced: dict[fx.Node, fx.Node] = {}
    for match, nodes in found:
        ln_node, add = nodes["ln"], nodes["add"]
        x, residual = (replaced.get(nodes[k], nodes[k]) for k in ("x", "residual"))
        with graph.inserting_before(ln_node):
            ln_ref = graph.get_attr(match.layer_norm)
            dropout_arg: Any = None
            drop = nodes["dropout_node"]
            if is_child(match.dropout):
                dropout_arg = graph.get_attr(drop.target)
            elif match.dropout is not None:
                _, p, training = bind_dropout(drop)
                dropout_arg = (p, training)
            fused = graph.call_function(
                residual_layer_norm,
                (
                    x,
                    residual,
                    ln_ref,
                    dropout_arg,
                    match.prenorm,
                    nodes["residual_first"],
                ),
            )
            if match.prenorm:
                y = graph.call_function(operator.getitem, (fused, 0))
                s = graph.call_function(operator.getitem, (fused, 1))
            else:
                y, s = fused, None
        ln_node.replace_all_uses_with(y)
        graph.erase_node(ln_node)
        replaced[ln_node] = y
        if s is not None:
            add.replace_all_uses_with(s)
            replaced[add] = s
        graph.erase_node(add)
        if match.dropout is not None:
            graph.erase_node(nodes["dropout_node"])
    graph.lint()


# ------------------------------------------------------------------ at call time


def _why_native(x: Any, residual: Any, dropout: Any) -> str | None:
    """Why this call computes the native sequence instead of the fused op (None: fused). The
    children themselves (replaced, hooked) are the block's guard's business (_Code)."""
    if type(x) is not torch.Tensor or type(residual) is not torch.Tensor:
        return "an operand is not a plain tensor"
    if x.shape != residual.shape:
        return "the sum broadcasts (operands of different shapes)"
    if x.dtype not in SUPPORTED_DTYPES or residual.dtype not in SUPPORTED_DTYPES:
        return "an operand's dtype is not float32/float64/float16/bfloat16"
    if x.device != residual.device:
        return "operands on different devices"
    if isinstance(dropout, nn.Module) and dropout.inplace:
        return "the dropout child is in place since the patch"
    return None


_Tensor = torch.Tensor


def residual_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    ln: nn.LayerNorm,
    dropout: nn.Dropout | tuple[float, bool] | None,
    prenorm: bool,
    residual_first: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ln(dropout(x) + residual)`` (and the sum, when ``prenorm``) by the fused op; the native
    sequence, exactly as the original forward computes it, where the op does not apply (a
    broadcasting add, another dtype or device, a tensor subclass: warned once per reason)."""
    # The common call checked inline (it runs once per block and layer on every step)
    if (
        type(x) is _Tensor
        and type(residual) is _Tensor
        and x.shape == residual.shape
        and x.dtype in SUPPORTED_DTYPES
        and residual.dtype in SUPPORTED_DTYPES
        and x.device == residual.device
    ) or _why_native(x, residual, dropout) is None:
        if dropout is None:
            p, training = 0.0, False
        elif type(dropout) is tuple:
            p, training = dropout
        elif dropout.inplace:
            return _native(x, residual, ln, dropout, prenorm, residual_first)
        else:
            p, training = dropout.p, dropout.training
        if not 0.0 <= p <= 1.0:  # F.dropout's error (p set on the child since the patch)
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        params = ln._parameters  # not ln.weight: Module.__getattr__ is a Python call
        y, s = dropout_add_layer_norm_forward(
            x,
            residual,
            ln.normalized_shape,
            params["weight"],
            params["bias"],
            ln.eps,
            p,
            training,
            prenorm,
        )
        return (y, s) if prenorm else y
    return _native(x, residual, ln, dropout, prenorm, residual_first)


def _native(x, residual, ln, dropout, prenorm, residual_first):
    warn_once(
        "a rewritten block computes dropout + add + LayerNorm natively: "
        f"{_why_native(x, residual, dropout)}",
        3,
    )
    if isinstance(dropout, tuple):
        d = F.dropout(x, dropout[0], dropout[1])
    else:
        d = x if dropout is None else dropout(x)
    s = residual + d if residual_first else d + residual
    y = ln(s)
    return (y, s) if prenorm else y


# ------------------------------------------------------------------ the block rules


@dataclass(frozen=True)
class BlockPattern:
    """One block rule: a cheap test of whether a block may hold its pattern (so that the patcher
    does not trace every module of a big model), the finder that returns the matches in a
    traced graph (each with the nodes its rewrite needs) and (local name, reason) skips, and the
    graph rewrite of those matches."""

    rule: str
    wants: Callable[[nn.Module], bool]
    find: Callable[[nn.Module, fx.Graph], tuple[list[tuple[Any, dict]], list[tuple[str, str]]]]
    rewrite: Callable[[fx.Graph, list[tuple[Any, dict]]], None]


BLOCK_PATTERNS = (
    BlockPattern(RULE, _has_layer_norm, find_residual_layer_norms, rewrite_graph),
    BlockPattern(RELU_SCALE, wants_relu_scale, find_relu_scales, rewrite_relu_scales),
    BlockPattern(MLP, wants_mlp, find_mlps, rewrite_mlps),
)
BLOCK_RULES = tuple(p.rule for p in BLOCK_PATTERNS)


def _patterns(rules: Iterable[str]) -> list[BlockPattern]:
    rules = set(rules)
    return [p for p in BLOCK_PATTERNS if p.rule in rules]


_MISSING = object()


# How many traces one block keeps (call structures, and attribute values that changed): past
# it, new ones run the original forward (a block called with ever new arguments would otherwise
# trace on every call).
MAX_TRACES = 16


class _Code:
    """The rewritten code for one call key: valid while the attribute values its trace read
    hold (``guard``), and run while the children its matches claimed are in place and unhooked
    (``children``: name -> the child as traced, or an equivalent one accepted since).
    :meth:`holds` tests both at once, on every call."""

    __slots__ = ("children", "fn", "guard", "holds")

    def __init__(
        self, fn: Callable[..., Any], guard: AttributeGuard, children: dict[str, nn.Module]
    ) -> None:
        self.fn, self.guard, self.children = fn, guard, children
        self.holds = _holds_function(guard, children)

    def children_problem(self, block: nn.Module) -> str | None:
        """Why the rewritten code cannot run now (holds failed with the attribute values in
        place), or None: a child replaced by one of the very same class, unhooked, is accepted in
        its place (the code looks its children up on every call)."""
        for name, child in list(self.children.items()):
            now = block._modules.get(name)
            if now is not child and type(now) is type(child):
                if _call_hook_problem(now, name) is None:
                    self.children[name] = child = now
                    self.holds = _holds_function(self.guard, self.children)
            if now is not child:
                return f"its child {name!r} is now a {type(now).__name__}"
            why = _call_hook_problem(child, name)
            if why is not None:
                return why
        return global_hook_problem()


def _holds_function(guard: AttributeGuard, children: dict[str, nn.Module]) -> Callable:
    """``holds(block) -> bool`` for one trace, written out test by test (no loops: it runs on
    every call): each attribute value the trace read (a Python value compared by value, any
    other object by identity), each claimed child the same object with no call hooks and no
    accelerate hook, and no global module hooks."""
    namespace: dict[str, Any] = {
        "_ABSENT": _MISSING,
        "_G0": GLOBAL_FORWARD_HOOKS,
        "_G1": GLOBAL_FORWARD_PRE_HOOKS,
        "_G2": GLOBAL_BACKWARD_HOOKS,
        "_G3": GLOBAL_BACKWARD_PRE_HOOKS,
    }
    lines = ["def holds(block):", "    d = block.__dict__", "    m = d['_modules']"]
    for i, (name, value) in enumerate(zip(guard.names, guard.values, strict=True)):
        namespace[f"_V{i}"] = value
        if isinstance(value, VALUE_TYPES):
            namespace[f"_T{i}"] = type(value)
            lines.append(
                f"    v = d.get({name!r}, _ABSENT)\n"
                f"    if v is not _V{i} and not (type(v) is _T{i} and v == _V{i}): return False"
            )
        else:
            lines.append(f"    if d.get({name!r}, _ABSENT) is not _V{i}: return False")
    for i, (name, child) in enumerate(children.items()):
        namespace[f"_C{i}"] = child
        lines.append(
            f"    c = m.get({name!r})\n"
            f"    if c is not _C{i} or c._forward_hooks or c._forward_pre_hooks or "
            "c._backward_hooks or c._backward_pre_hooks or '_hf_hook' in c.__dict__: "
            "return False"
        )
    lines.append("    return not (_G0 or _G1 or _G2 or _G3)")
    exec("\n".join(lines), namespace)  # source built here from repr()s of attribute names
    return namespace["holds"]


def _call_hook_problem(child: nn.Module, name: str) -> str | None:
    if "_hf_hook" in child.__dict__:
        return f"its child {name!r} has an accelerate hook (the fused op would not call it)"
    return hook_problem(child, f"child {name!r}", CALL_HOOK_KINDS)


class RewrittenForward:
    """The forward of a rewritten block, set on the instance. Holds only the block, its
    matches and the enabled block rules (so it deep-copies and pickles with the model, and a
    trace for a new call key applies the same patterns); traces and the rebuilt decorator chain
    are made on first use."""

    def __init__(
        self,
        block: nn.Module,
        matches: list | None = None,
        rules: Iterable[str] = BLOCK_RULES,
    ) -> None:
        self.block = block
        self.matches = matches or []  # what the patch found (the report's rows, claims)
        self.rules = tuple(rules)
        # call key -> its code, or None where the original forward serves that key
        self._graphs: dict[CallKey, _Code | None] = {}
        self._traces = 0  # traces made (bounded by MAX_TRACES)
        self._chain: Any = None  # the class's decorator chain around _inner
        self._original: Any = None  # the class's undecorated forward

    @property
    def matches(self) -> list:
        return self._matches

    @matches.setter
    def matches(self, matches: list) -> None:
        self._matches = list(matches)
        # read on every compiled call: a plain bool for dynamo to guard on
        self._inductor_fuses = any(m.inductor_fuses for m in self._matches)

    def __getstate__(self) -> dict:
        return {"block": self.block, "matches": self.matches, "rules": self.rules}

    def __setstate__(self, state: dict) -> None:
        # pickles made before relu_scale existed hold no rules: residual_layer_norm was the one
        self.__init__(state["block"], state["matches"], state.get("rules", (RULE,)))

    @property
    def __code__(self) -> types.CodeType:
        # torch.export reads its root module's forward.__code__ (for names in its messages)
        return inner_forward(type(self.block)).__code__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._chain is None:
            self._original = inner_forward(type(self.block))
            self._chain = rewrap(type(self.block).forward, self._inner)
        return self._chain(self.block, *args, **kwargs)

    def _inner(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        # 'inductor': a block with a residual_layer_norm or relu_scale match compiles from its
        # original forward (Inductor fuses dropout + add + LayerNorm and relu * c itself), its
        # mlp matches included (one forward or the other); a block whose matches are all mlp
        # ones keeps the rewritten code (linear_act_linear is what we want compiled). 'fused':
        # the rewritten code
        if compiling and self._inductor_fuses and config.compile_residual_layer_norm == "inductor":
            return self._original(block, *args, **kwargs)
        key = call_key(block.training, args, kwargs)
        code = self._graphs.get(key, _MISSING) if key is not None else None
        if code is _MISSING:  # a new call structure
            code = None if compiling else self.traced(key)
        elif code is not None and not code.holds(block):
            if not code.guard.holds(block):  # an attribute the trace read changed since
                code = None if compiling else self.traced(key)
            else:  # a claimed child replaced or hooked since
                why = code.children_problem(block)
                if why is not None:
                    warn_once(
                        f"a rewritten {type(block).__name__} runs its original forward: {why}"
                    )
                    return self._original(block, *args, **kwargs)
        if code is None:
            return self._original(block, *args, **kwargs)
        return code.fn(block, *tensors_of(args, kwargs))

    def traced(self, key: CallKey) -> _Code | None:
        """The rewritten code for calls with ``key`` as the block is now (None: the original
        forward serves them), traced unless a valid trace is kept."""
        code = self._graphs.get(key)
        if code is not None and code.guard.holds(self.block):
            return code
        if key in self._graphs and code is None:
            return None
        if self._traces >= MAX_TRACES:
            warn_once(
                f"a rewritten {type(self.block).__name__} was traced {MAX_TRACES} times (new "
                "argument structures or changed attribute values): further ones run its "
                "original forward",
                3,
            )
            self._graphs[key] = None
            return None
        self._traces += 1
        try:
            fn, matches, _, guard = rewritten_code(self.block, key, self.rules)
        except Untraceable:
            fn = None
        self._graphs[key] = None if fn is None else _Code(fn, guard, self._claimed(matches))
        return self._graphs[key]

    def _claimed(self, matches: list) -> dict[str, nn.Module]:
        modules = self.block._modules
        return {name: modules[name] for name in sorted(claimed_children(matches))}


class TensorConstants(Untraceable):
    """The trace made tensors in the forward into graph constants (fx's ``_tensor_constant<n>``
    attributes of the trace's root): the rewritten code, run with the block as its root,
    cannot reach them (trace.py does not keep them)."""


def _unreachable(block: nn.Module, graph: fx.Graph) -> list[str]:
    """The attributes the graph reads that ``block`` does not have."""
    out = []
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        owner: Any = block
        for part in str(node.target).split("."):
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                out.append(str(node.target))
                break
    return out


def rewritten_code(
    block: nn.Module, key: CallKey, rules: Iterable[str]
) -> tuple[Any, list, list[tuple[str, str, str]], AttributeGuard]:
    """(code or None, matches, (local name, rule, reason) skips, the attribute values the trace
    read) for ``block`` called with ``key``: its forward traced, each enabled rule's pattern
    found and replaced, the graph compiled to code bound to the block. Raises Untraceable."""
    traced = trace_call(block, key)
    graph = traced.graph
    missing = _unreachable(block, graph)
    if missing:
        raise TensorConstants(
            f"its forward makes tensor constants ({', '.join(missing)}) that the rewritten "
            "forward could not reach"
        )
    matches: list = []
    skipped: list[tuple[str, str, str]] = []
    for pattern in _patterns(rules):
        found, skips = pattern.find(block, graph)
        skipped += [(where, pattern.rule, why) for where, why in skips]
        if found:
            pattern.rewrite(graph, found)
            matches += [m for m, _ in found]
    if not matches:
        return None, [], skipped, traced.guard
    in_place = in_place_updates(graph, block)
    if in_place:
        raise InPlaceUpdates(
            f"its forward updates a tensor in place ({', '.join(in_place)}); a rewritten copy "
            "could change what that update reaches, or what autograd saved"
        )
    return compile_graph(graph, traced.output), matches, skipped, traced.guard


class InPlaceUpdates(Untraceable):
    """The forward updates tensors in place outside the matched patterns: not rewritten."""


def _forward_attr(block: nn.Module) -> str:
    """Where the block's forward is replaced: accelerate's ``_old_forward`` under its hook."""
    return "_old_forward" if "_hf_hook" in block.__dict__ else "forward"


def rewritten_forward(block: nn.Module) -> RewrittenForward | None:
    value = block.__dict__.get(_forward_attr(block))
    return value if isinstance(value, RewrittenForward) else None


class BlockRewrite(Rewrite):
    """A block whose forward runs fused ops in place of the matched subgraphs (one report row
    per match, under the match's rule)."""

    def __init__(self, block: nn.Module, name: str, matches: list, forward: Any) -> None:
        self.block, self.name, self.matches, self.forward = block, name, matches, forward
        self.rule = ", ".join(dict.fromkeys(m.rule for m in matches))
        self.attr = _forward_attr(block)
        self.previous = _MISSING

    def apply(self) -> None:
        self.previous = self.block.__dict__.get(self.attr, _MISSING)
        self.block.__dict__[self.attr] = self.forward

    def undo(self) -> None:
        if self.block.__dict__.get(self.attr) is not self.forward:
            return
        if self.previous is _MISSING and self.attr == "forward":
            del self.block.__dict__["forward"]
        elif self.previous is _MISSING:  # accelerate's: the class forward, bound
            self.block.__dict__[self.attr] = types.MethodType(type(self.block).forward, self.block)
        else:
            self.block.__dict__[self.attr] = self.previous

    def describe(self) -> list[Swap]:
        return [m.row(self.name) for m in self.matches]

    def restored_modules(self) -> int:
        return len(self.matches)  # one per report row (a fused LayerNorm, a relu * c)

    def claims(self) -> set[str]:
        """The children this rewrite takes over (no module rule swaps them)."""
        return claimed_children(self.matches)

    def check_targets(self) -> list[CheckTarget]:
        block = self.block

        def native(*args: Any, **kwargs: Any) -> Any:
            return type(block).forward(block, *args, **kwargs)

        def reference() -> Any:
            twin = copy.deepcopy(block).double()
            for m in twin.modules():  # the copies of the check's own probes among them
                for attr in HOOK_KINDS:
                    getattr(m, attr, {}).clear()
            return lambda *a, **k: type(twin).forward(twin, *a, **k)

        fused = " + ".join(dict.fromkeys(m.fused_op for m in self.matches))
        return [CheckTarget(self.name or "(root)", block, native, reference, fused)]


def claimed_children(matches: Iterable) -> set[str]:
    """The children the matches take over, together."""
    return {child for m in matches for child in m.claims()}


def plan_block(
    block: nn.Module, name: str, rules: Iterable[str]
) -> tuple[BlockRewrite | None, list[tuple[str, str, str]]]:
    """The rewrite of ``block``'s forward for the enabled block ``rules`` (names in
    BLOCK_RULES), or None, and (module name, rule, reason) skips. Changes nothing."""
    if rewritten_forward(block) is not None:
        return None, []  # patched already (swap.py keeps its claims)
    patterns = _patterns(rules)
    wanting = [p.rule for p in patterns if p.wants(block)]
    if not wanting:
        return None, []

    def refused(why: str) -> tuple[None, list[tuple[str, str, str]]]:
        return None, [(name, rule, why) for rule in wanting]

    attr = _forward_attr(block)
    if attr == "forward" and "forward" in block.__dict__:
        return refused("its forward was replaced on the instance")
    if attr == "_old_forward" and not _is_class_forward(block, block.__dict__.get(attr)):
        return refused("accelerate wraps a forward that is not the class's")
    enabled = tuple(p.rule for p in patterns)
    try:
        key = default_key(block)
        forward = RewrittenForward(block, rules=enabled)
        forward._chain = rewrap(type(block).forward, forward._inner)
        forward._original = inner_forward(type(block))
    except (Untraceable, Unwrappable, ValueError, TypeError) as err:
        return refused(f"cannot rewrite its forward: {err}")
    try:
        code, matches, skipped, guard = rewritten_code(block, key, enabled)
    except (TensorConstants, InPlaceUpdates) as err:
        return refused(str(err))
    except Untraceable as err:
        return refused(f"forward does not trace with torch.fx ({err})")
    skips = [(join(name, where), rule, why) for where, rule, why in skipped]
    if code is None:
        return None, skips
    forward._graphs[key] = _Code(code, guard, forward._claimed(matches))
    forward._traces = 1
    forward.matches = matches
    return BlockRewrite(block, name, matches, forward), skips


def _is_class_forward(block: nn.Module, fn: Any) -> bool:
    return (
        isinstance(fn, types.MethodType)
        and fn.__self__ is block
        and fn.__func__ is type(block).forward
    )
