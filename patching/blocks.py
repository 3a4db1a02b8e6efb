"""Block rewrites, the machinery: one module instance's forward replaced by a traced copy of its
own forward in which the block rules' matches (rules/residual_layer_norm.py, relu_scale.py,
mlp.py) call fused ops. One trace of a block goes through every enabled block rule; one
records.BlockRewrite holds all their matches.

The block keeps its class, children, Parameters, state_dict keys and hooks; only
``block.forward`` (or, under an accelerate hook, the ``_old_forward`` it wraps) is an instance
attribute while patched. The rewritten forward traces the block once per call key (trace.py:
which arguments are tensors, the others' values, ``self.training``), runs the traced code bound
to the live block (children looked up on every call), and runs the original forward for calls it
cannot trace. Before running a trace's code, one generated test (_Code.holds) checks that the
attribute values the trace read still hold and that the children its matches claimed are still
in place and unhooked. Decorators on the class's forward (transformers' gradient checkpointing
wrapper) are rebuilt around the rewritten inner function, so they keep working."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fastlayers import config

from .eligibility import (
    CALL_HOOK_KINDS,
    GLOBAL_BACKWARD_HOOKS,
    GLOBAL_BACKWARD_PRE_HOOKS,
    GLOBAL_FORWARD_HOOKS,
    GLOBAL_FORWARD_PRE_HOOKS,
    global_hook_problem,
    hook_problem,
)
from .fallback import warn_once
from .forms import in_place_updates, join
from .fused import forward_attr, rewritten_forward
from .rules import block_rules
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

    is_fastlayers_rewrite = True  # what fused.rewritten_forward looks for

    def __init__(
        self,
        block: nn.Module,
        matches: list | None = None,
        rules: Iterable[str] = (),
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
        self.__init__(
            state["block"], state["matches"], state.get("rules", ("residual_layer_norm",))
        )

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
    for rule in block_rules(tuple(rules)):
        found, skips = rule.find(block, graph)
        skipped += [(where, rule.name, why) for where, why in skips]
        if found:
            rule.rewrite(graph, found)
            matches += [f.match for f in found]
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


def claimed_children(matches: Iterable) -> set[str]:
    """The children the matches take over, together."""
    return {child for m in matches for child in m.claims()}


def plan_block(
    block: nn.Module, name: str, rules: Iterable[str]
) -> tuple[RewrittenForward | None, list[tuple[str, str, str]]]:
    """The rewritten forward of ``block`` for the enabled block ``rules`` (names of
    rules.BLOCK_RULES; its ``matches`` what they found), or None, and (module name, rule,
    reason) skips. Changes nothing: records.BlockRewrite puts it on the block."""
    if rewritten_forward(block) is not None:
        return None, []  # patched already (plan.py keeps its claims)
    enabled_rules = block_rules(tuple(rules))
    wanting = [r.name for r in enabled_rules if r.wants(block)]
    if not wanting:
        return None, []

    def refused(why: str) -> tuple[None, list[tuple[str, str, str]]]:
        return None, [(name, rule, why) for rule in wanting]

    attr = forward_attr(block)
    if attr == "forward" and "forward" in block.__dict__:
        return refused("its forward was replaced on the instance")
    if attr == "_old_forward" and not _is_class_forward(block, block.__dict__.get(attr)):
        return refused("accelerate wraps a forward that is not the class's")
    enabled = tuple(r.name for r in enabled_rules)
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
    return forward, skips


def _is_class_forward(block: nn.Module, fn: Any) -> bool:
    return (
        isinstance(fn, types.MethodType)
        and fn.__self__ is block
        and fn.__func__ is type(block).forward
    )
