"""Finding ``activation(linear(x))`` inside a module's own forward.

The forward is traced with torch.fx, every submodule a leaf (only this module's code is read),
and the Linear calls are kept whose output has exactly one user, an activation module called on
it alone, each of the two called once. A forward that plain fx cannot trace (optional arguments,
decorators: most HuggingFace decoder layers) is traced by trace.py's tracer for its default call
instead; such a trace covers one call structure, so a pair found there is fused only when the
forward's source also shows the activation as the one consumer of the Linear on every path
(:func:`source_pair_problem`). For a block that traces neither way (data-dependent control flow
elsewhere in the forward: BART-style encoder layers) the pairs are read from the forward's source
alone, with the same proof; a class's name is never enough."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
import types
from collections import Counter
from dataclasses import dataclass, replace

import torch.fx as fx
from torch import nn

from .eligibility import is_linear_candidate, looks_like_activation
from .forms import code_facts
from .fused import is_fused, rewritten_forward
from .trace import Untraceable, default_key, inner_forward, trace_call


class _OwnForwardTracer(fx.Tracer):
    """Records calls to submodules instead of tracing into them."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


@dataclass(frozen=True)
class LinearAct:
    """A direct child Linear (``linear``) whose only consumer is a direct child activation."""

    linear: str
    activation: str
    how: str  # 'traced', 'traced (default call)' or 'source'
    # why the pair may not be fused although the trace of one call shows it (None: proven)
    unproven: str | None = None


def might_hold_pattern(module: nn.Module) -> bool:
    """Cheap filter: a Linear-like child and an activation-like child, none fused yet."""
    children = list(module.children())
    return any(is_linear_candidate(c) and not is_fused(c) for c in children) and any(
        looks_like_activation(c) and not is_fused(c) for c in children
    )


def find_linear_act(module: nn.Module) -> tuple[list[LinearAct], str | None]:
    """The (linear, activation) child pairs of ``module``, and why none could be looked for
    (None when the search ran)."""
    why = _instance_forward_problem(module)
    if why is not None:
        return [], why
    try:
        graph, how = _OwnForwardTracer().trace(module), "traced"
    except Exception as err:  # any forward that does not trace symbolically
        plain = type(err).__name__
        try:
            graph, how = trace_call(module, default_key(module)).graph, "traced (default call)"
        except (Untraceable, ValueError, TypeError) as err:  # inspect.signature's errors too
            return _from_source(module, f"{plain}; for its default call: {err}")
    found = _pairs_in(graph, dict(module.named_children()), how)
    if how != "traced":  # one call structure traced: the source must show the rest
        found = [
            replace(p, unproven=source_pair_problem(module, p.linear, p.activation)) for p in found
        ]
    return found, None


def _from_source(module: nn.Module, why: str) -> tuple[list[LinearAct], str | None]:
    """The pairs that the forward's source proves (see :func:`source_pair_problem`), for a
    forward that does not trace."""
    children = dict(module.named_children())
    linears = [n for n, c in children.items() if is_linear_candidate(c) and not is_fused(c)]
    activations = [n for n, c in children.items() if looks_like_activation(c) and not is_fused(c)]
    found = [
        LinearAct(lin, act, "source")
        for lin in linears
        for act in activations
        if source_pair_problem(module, lin, act, proven_by="source") is None
    ]
    if found:
        return found, None
    return (
        [],
        f"forward does not trace with torch.fx ({why}) and its source does not show a Linear "
        "child whose one consumer is an activation child",
    )


def _pairs_in(graph: fx.Graph, children: dict[str, nn.Module], how: str) -> list[LinearAct]:
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    found = []
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in children:
            continue
        if not is_linear_candidate(children[node.target]) or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op != "call_module" or user.target not in children:
            continue
        if user.args != (node,) or user.kwargs or not looks_like_activation(children[user.target]):
            continue
        # each module called once: replacing it must not change another call site
        if calls[node.target] == 1 and calls[user.target] == 1:
            found.append(LinearAct(node.target, user.target, how))
    return found


def _instance_forward_problem(module: nn.Module) -> str | None:
    """Why what ``module`` runs is not its class's forward (which the traces read), or None.
    accelerate's wrapper (the class forward kept as ``_old_forward``) and a residual_layer_norm
    rewrite (a traced copy calling the same children) are fine."""
    attr = "_old_forward" if "_hf_hook" in module.__dict__ else "forward"
    fn = module.__dict__.get(attr)
    if fn is None or rewritten_forward(module) is not None:
        return None
    if (
        isinstance(fn, types.MethodType)
        and fn.__self__ is module
        and fn.__func__ is type(module).forward
    ):
        return None
    return "its forward was replaced on the instance (the class's forward is what is traced)"


def source_pair_problem(
    module: nn.Module, linear: str, activation: str, proven_by: str = "trace"
) -> str | None:
    """Why the source of ``module``'s forward does not prove that ``self.<activation>`` is the
    one consumer of ``self.<linear>``'s output on every path, or None. A trace of one call
    cannot: another call may take a branch where the Linear's output is used again. Accepted:
    each child named once in the forward, as ``self.act(self.linear(...))``, or as
    ``h = self.linear(...)`` directly followed by ``h = self.act(h)`` (or by a statement calling
    ``self.act(h)`` when ``h`` is read nowhere else); and no other method of the class names
    either child (one the forward calls could call the Linear again). ``proven_by`` 'source':
    there is no trace at all."""
    if proven_by == "trace":
        unproven = "the trace covers its default call only and"
    else:
        unproven = "its forward does not trace and"
    elsewhere = _named_by_other_methods(type(module), (linear, activation))
    if elsewhere is not None:
        return f"{unproven} {elsewhere}"
    try:
        source = textwrap.dedent(inspect.getsource(inner_forward(type(module))))
        fn = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return f"{unproven} its forward's source cannot be read"
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
        return f"{unproven} its forward's source is not a method"
    me = fn.args.args[0].arg

    def child(node: ast.AST, attr: str) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == me
            and node.attr == attr
        )

    def call_of(node: ast.AST | None, attr: str) -> bool:
        return isinstance(node, ast.Call) and child(node.func, attr)

    def act_argument(node: ast.AST | None) -> ast.AST | None:
        if call_of(node, activation) and len(node.args) == 1 and not node.keywords:
            return node.args[0]
        return None

    nodes = list(ast.walk(fn))
    for attr in (linear, activation):
        uses = sum(child(n, attr) for n in nodes)
        if uses != 1:
            return f"{unproven} its forward names {me}.{attr} {uses} times"
    if any(call_of(act_argument(n), linear) for n in nodes):
        return None  # self.act(self.linear(...))
    for first, second in _consecutive_statements(nodes):
        target = _assigned_name(first)
        if target is None or not call_of(first.value, linear):
            continue
        arg = act_argument(getattr(second, "value", None))
        if not (isinstance(arg, ast.Name) and arg.id == target):
            continue
        reads = sum(
            isinstance(n, ast.Name) and n.id == target and isinstance(n.ctx, ast.Load)
            for n in nodes
        )
        if _assigned_name(second) == target or reads == 1:
            return None  # the Linear's output is gone (rebound) or never read again
    return (
        f"{unproven} its forward does not show {me}.{activation} as the one consumer of "
        f"{me}.{linear}'s output on every path"
    )


def _consecutive_statements(nodes: list[ast.AST]) -> list[tuple[ast.stmt, ast.stmt]]:
    pairs = []
    for node in nodes:
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                pairs += list(itertools.pairwise(stmts))
    return pairs


def _assigned_name(stmt: ast.AST) -> str | None:
    """``h`` for ``h = ...`` / ``h: T = ...``, else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        target = stmt.target
    else:
        return None
    return target.id if isinstance(target, ast.Name) else None


def _named_by_other_methods(cls: type, attrs: tuple[str, ...]) -> str | None:
    """'method X names self.<attr> too' when a function of ``cls`` (its own classes, not torch's
    nn.Module) other than ``__init__`` and the forward uses one of ``attrs``, else None."""
    forward = inner_forward(cls)
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.nn") or klass is object:
            continue
        for name, fn in vars(klass).items():
            fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else None
            if fn is None or fn is forward or name == "__init__":
                continue
            used = code_facts(fn).names & set(attrs)
            if used:
                return f"its method {name!r} names {', '.join(sorted(used))} too"
    return None
