"""Block rewrites, the machinery: one module instance's forward replaced by a traced copy of its
own forward in which the block rules' matches (rules/residual_layer_norm.py, relu_scale.py,
mlp.py) call fused ops. One trace of a block goes through every enabled block rule; one
records.BlockRewrite holds all their matches.

The block keeps its class, children, Parameters, state_dict keys and hooks; only
``block.forward`` (or, under an accelerate hook, the ``_old_forward`` it wraps) is an instance
attribute while patched. The rewritten forward traces the block once per call key (trace.py:
which arguments are tensors, the others' values, ``self.training``), runs the traced code bound
to the live block (children looked up on every call), and runs the original forward for calls it
cannot trace. Before running a trace's code, one generated test (guard.py) checks that
everything the trace read still holds and that the children its matches claimed are unhooked; a
change traces again (at most MAX_TRACES times, nothing stored past that), a hook runs the
original forward for that call. Decorators on the class's forward (transformers' gradient
checkpointing wrapper) are rebuilt around the rewritten inner function, so they keep working."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fastlayers import config

from .eligibility import CALL_HOOK_KINDS, global_hook_problem, hook_problem, own_forward_problem
from .fallback import warn_once
from .forms import in_place_updates, join
from .fused import forward_attr, forward_signature, rewritten_forward
from .guard import TraceGuard
from .rules import block_rules
from .trace import (
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
    """The rewritten code for one call key, and the guard of its trace (guard.py). ``holds``
    (generated; run on every call) tests the guard and that the claimed children are unhooked
    and no global module hooks are registered; ``guard_holds`` the guard alone (a failed
    ``holds`` with the guard holding is a hook: the call runs the original forward)."""

    __slots__ = ("fn", "guard", "guard_holds", "holds")

    def __init__(self, fn: Callable[..., Any], guard: TraceGuard) -> None:
        self.fn, self.guard = fn, guard
        self.holds = guard.test(with_hooks=True)
        self.guard_holds = guard.test(with_hooks=False)

    def hook_problem(self, block: nn.Module) -> str | None:
        """Why the code cannot run now while its guard holds: a hooked claimed child, or
        global module hooks."""
        for name, _ in self.guard.claimed:
            why = _call_hook_problem(block._modules[name], name)
            if why is not None:
                return why
        return global_hook_problem()


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

    @property
    def __signature__(self) -> inspect.Signature | None:
        return forward_signature(self.block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            torch.compiler.is_compiling()
            and self._inductor_fuses
            and config.compile_residual_layer_norm == "inductor"
        ):
            # compiled from the original forward (see _inner): the class's forward, its
            # decorators included, called as native's module call calls it. Tracing the
            # rebuilt chain and _inner to reach the same code cost dynamo a guard for each
            # object they read (the chain's closure cells, the decorators' own reads) on
            # every compiled call.
            block = self.block
            return type(block).forward(block, *args, **kwargs)
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
            if not code.guard_holds(block):  # something the trace read changed since
                code = None if compiling else self.traced(key, code)
            else:  # a claimed child hooked, or global hooks, since
                why = code.hook_problem(block)
                if why is not None:
                    warn_once(
                        f"a rewritten {type(block).__name__} runs its original forward: {why}"
                    )
                    return self._original(block, *args, **kwargs)
        if code is None:
            return self._original(block, *args, **kwargs)
        return code.fn(block, *tensors_of(args, kwargs))

    def traced(self, key: CallKey, stale: _Code | None = None) -> _Code | None:
        """The rewritten code for calls with ``key`` as the block is now (None: the original
        forward serves them), traced unless a valid trace is kept. ``stale``: the code this
        key had, whose guard no longer holds (the block changed since: said in a warning
        when the change leaves nothing to fuse)."""
        code = self._graphs.get(key)
        if code is not None and code.guard_holds(self.block):
            return code
        if key in self._graphs and code is None:
            return None
        if self._traces >= MAX_TRACES:
            # nothing stored past the bound: a block called with ever new arguments would
            # otherwise grow its table on every call
            warn_once(
                f"a rewritten {type(self.block).__name__} was traced {MAX_TRACES} times (new "
                "argument structures or changes to what its trace read): further ones run its "
                "original forward",
                3,
            )
            return None
        self._traces += 1
        if stale is not None:  # the class or its forward may have changed: rebuilt on use
            self._chain, self._original = None, inner_forward(type(self.block))
        why = "its forward no longer matches a pattern"
        try:
            fn, _, skipped, guard = rewritten_code(self.block, key, self.rules)
            if skipped:
                why = skipped[0][2]
        except Untraceable as err:
            fn, why = None, str(err)
        self._graphs[key] = None if fn is None else _Code(fn, guard)
        if fn is None and stale is not None:
            changed = "; ".join(stale.guard.changed(self.block))
            warn_once(
                f"a rewritten {type(self.block).__name__} runs its original forward: {changed} "
                f"since the patch ({why})",
                3,
            )
        return self._graphs[key]


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
) -> tuple[Any, list, list[tuple[str, str, str]], TraceGuard | None]:
    """(code or None, matches, (local name, rule, reason) skips, the guard of what the trace
    read (None without code)) for ``block`` called with ``key``: its forward traced, each
    enabled rule's pattern found and replaced, the graph compiled to code bound to the block.
    Raises Untraceable."""
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
        found, skips = _without_own_forwards(block, found)
        skipped += [(where, rule.name, why) for where, why in skips]
        if found:
            rule.rewrite(graph, found)
            matches += [f.match for f in found]
    if not matches:
        return None, [], skipped, None
    in_place = in_place_updates(graph, block)
    if in_place:
        raise InPlaceUpdates(
            f"its forward updates a tensor in place ({', '.join(in_place)}); a rewritten copy "
            "could change what that update reaches, or what autograd saved"
        )
    reached = [str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")]
    live: dict[str, frozenset[str]] = {}
    for match in matches:
        for child, names in match.live_attributes().items():
            live[child] = live.get(child, frozenset()) | names
    claimed = claimed_children(matches)
    guard = TraceGuard.of(block, traced.reads, traced.before, reached, claimed, live)
    return compile_graph(graph, traced.output), matches, skipped, guard


def _without_own_forwards(block: nn.Module, found: list) -> tuple[list, list[tuple[str, str]]]:
    """The matches none of whose claimed children has a ``forward`` set on the instance (a
    fused op would compute the class's forward instead), and (child, reason) for the others."""
    kept, skipped = [], []
    for f in found:
        whys = [(c, own_forward_problem(block._modules[c], c)) for c in sorted(f.match.claims())]
        whys = [(c, why) for c, why in whys if why is not None]
        if whys:
            skipped.append(whys[0])
        else:
            kept.append(f)
    return kept, skipped


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
    if attr == "_old_forward" and not is_class_forward(block, block.__dict__.get(attr)):
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
    forward._graphs[key] = _Code(code, guard)
    forward._traces = 1
    forward.matches = matches
    return forward, skips


def is_class_forward(block: nn.Module, fn: Any) -> bool:
    """``fn`` is the class's forward bound to ``block`` (what accelerate keeps in _old_forward)."""
    return (
        isinstance(fn, types.MethodType)
        and fn.__self__ is block
        and fn.__func__ is type(block).forward
    )
