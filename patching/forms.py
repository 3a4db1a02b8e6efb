"""The native forms the block rules recognise, shared by their patterns: a dropout and a ReLU in
a traced graph (a child module or a functional call), how the original forward computes a
functional ReLU, and what a forward's code names (the rules' pre-filters read it instead of
tracing)."""

from __future__ import annotations

import dis
import inspect
import operator
import types
import weakref
from collections import Counter
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .eligibility import hook_problem
from .trace import IN_PLACE_OPERATORS

# ------------------------------------------------------------------ dropout


def dropout_of(node: Any, children: dict, calls: Counter) -> tuple[Any, str | None]:
    """``(x, description)`` when ``node`` is a dropout of ``x`` whose only user is the next op
    of a pattern, else ``(None, None)``. A child nn.Dropout ('child <attr>') is read at call
    time (p, training); a functional F.dropout ('F.dropout(p=..., training=...)') has constant p
    and training in a trace (keyed by self.training)."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None, None
    if node.op == "call_module" and type(children.get(node.target)) is nn.Dropout:
        child = children[node.target]
        if calls[node.target] != 1 or child.inplace or hook_problem(child, "dropout"):
            return None, None
        if len(node.args) == 1 and not node.kwargs:
            return node.args[0], f"child {node.target}"
    if node.op == "call_function" and node.target is F.dropout:
        bound = bind_dropout(node)
        if bound is not None:
            x, p, training = bound
            return x, f"F.dropout(p={p}, training={training})"
    return None, None


def bind_dropout(node: fx.Node) -> tuple[Any, float, bool] | None:
    """``(x, p, training)`` of an F.dropout node whose p and training are constants (and not in
    place), else None."""
    args = dict(zip(("input", "p", "training", "inplace"), node.args, strict=False))
    args.update(node.kwargs)
    p, training, inplace = args.get("p", 0.5), args.get("training", True), args.get("inplace")
    if not isinstance(p, (int, float)) or not isinstance(training, bool) or inplace:
        return None
    return args.get("input"), float(p), training


def is_child(dropout: str | None) -> bool:
    """Whether a dropout description (see :func:`dropout_of`) names a child module."""
    return dropout is not None and dropout.startswith("child ")


def dropout_child(dropout: str | None) -> str | None:
    """The child's attribute a dropout description names, or None (see :func:`dropout_of`)."""
    return dropout.removeprefix("child ") if is_child(dropout) else None


def join(prefix: str, name: str) -> str:
    """``prefix.name`` (``name`` alone at the root)."""
    return f"{prefix}.{name}" if prefix else name


# ------------------------------------------------------------------ ReLU

FUNCTIONAL_RELUS = {F.relu: "F.relu", torch.relu: "torch.relu", torch.relu_: "torch.relu_"}
METHOD_RELUS = {"relu": "Tensor.relu", "relu_": "Tensor.relu_"}


def relu_input(node: fx.Node) -> tuple[Any, bool] | None:
    """``(x, inplace)`` for a ReLU node called as ``relu(x)`` (F.relu: ``inplace`` as a bool
    too), None for other signatures."""
    if node.op == "call_function" and node.target is F.relu:
        bound = dict(zip(("input", "inplace"), node.args, strict=False))
        bound.update(node.kwargs)
        inplace = bound.get("inplace", False)
        if set(bound) - {"input", "inplace"} or not isinstance(inplace, bool):
            return None
        return bound.get("input"), inplace
    if len(node.args) == 1 and not node.kwargs:
        return node.args[0], False
    return None


def relu_of(node: fx.Node, children: dict) -> tuple[Any, str, bool] | None:
    """``(x, form, inplace)`` when ``node`` is a ReLU of ``x``: a child nn.ReLU (form 'child';
    its subclasses included, for the skip reason) or a functional relu (form 'F.relu',
    'torch.relu', 'Tensor.relu' or the in-place 'torch.relu_', 'Tensor.relu_'); else None."""
    if node.op == "call_module" and isinstance(children.get(node.target), nn.ReLU):
        form, inplace = "child", children[node.target].inplace
    elif node.op == "call_function" and node.target in FUNCTIONAL_RELUS:
        form = FUNCTIONAL_RELUS[node.target]
        inplace = form.endswith("_")
    elif node.op == "call_method" and node.target in METHOD_RELUS:
        form = METHOD_RELUS[node.target]
        inplace = form.endswith("_")
    else:
        return None
    bound = relu_input(node)
    if bound is None:
        return None
    return bound[0], form, inplace or bound[1]


def native_relu(x: torch.Tensor, relu: nn.Module | str, inplace: bool) -> torch.Tensor:
    """The ReLU exactly as the original forward calls it: the child module, or the functional
    form named as :func:`relu_of` names it."""
    if not isinstance(relu, str):
        return relu(x)
    if relu == "F.relu":
        return F.relu(x, inplace=inplace)
    if relu == "torch.relu":
        return torch.relu(x)
    if relu == "torch.relu_":
        return torch.relu_(x)
    if relu == "Tensor.relu":
        return x.relu()
    return x.relu_()


# ------------------------------------------------------------------ in-place updates

_IN_PLACE_FUNCTIONS = frozenset(IN_PLACE_OPERATORS.values()) | {operator.setitem}


def _inplace_argument(fn: Any, node: fx.Node) -> bool:
    """Whether a call of ``fn`` (a torch function with an ``inplace`` parameter, as most of
    torch.nn.functional's activations and dropouts) asks for ``inplace=True``. The rules' own
    runtime functions (relu_times, ...) compute out of place whatever their arguments say."""
    if not (getattr(fn, "__module__", None) or "").startswith("torch"):
        return False
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if "inplace" not in parameters:
        return False
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except TypeError:
        return True  # a call we cannot read: assume the worst
    return bound.arguments.get("inplace") is True


def in_place_updates(graph: fx.Graph, block: nn.Module) -> list[str]:
    """The graph's operations that write a tensor in place (``r += y``, ``x.add_(y)``,
    ``F.relu(x, inplace=True)``, an ``out=`` argument, a child module built with
    ``inplace=True``), as fx names them."""
    found = []
    for node in graph.nodes:
        target = node.target
        name = getattr(target, "__name__", str(target))
        if node.op == "call_function":
            writes = (
                target in _IN_PLACE_FUNCTIONS
                or (name.endswith("_") and not name.startswith("_"))
                or "out" in node.kwargs
                or node.kwargs.get("inplace") is True
                or _inplace_argument(target, node)
            )
        elif node.op == "call_method":
            writes = name.endswith("_") and not name.startswith("_")
        elif node.op == "call_module":
            child = block.get_submodule(str(target))
            writes = getattr(child, "inplace", False) is True
        else:
            writes = False
        if writes:
            found.append(node.name)
    return found


# ------------------------------------------------------------------ a forward's code


class CodeFacts(NamedTuple):
    """What a function's code (nested code objects included) uses, read from its bytecode."""

    names: frozenset[str]  # globals, attributes, methods: ``co_names``
    operators: frozenset[str]  # binary operators applied ('*', '/'; on Python 3.10 only those)
    globals: tuple[str, ...]  # the globals it looks up (LOAD_GLOBAL), first use first


# Per function. Weak keys: classes made at run time (tests, dynamic models) are not kept alive by
# the cache.
_CODE_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BINARY_OPCODES = {"BINARY_MULTIPLY": "*", "BINARY_TRUE_DIVIDE": "/"}  # Python 3.10's


def code_facts(fn: types.FunctionType) -> CodeFacts:
    """The names, binary operators and globals ``fn``'s code uses (CodeFacts). Cached per
    function."""
    facts = _CODE_FACTS.get(fn)
    if facts is None:
        names: set[str] = set()
        operators: set[str] = set()
        loaded: dict[str, None] = {}
        codes = [fn.__code__]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            for ins in dis.get_instructions(code):
                if ins.opname == "BINARY_OP":
                    operators.add(ins.argrepr)
                elif ins.opname in _BINARY_OPCODES:
                    operators.add(_BINARY_OPCODES[ins.opname])
                elif ins.opname == "LOAD_GLOBAL":
                    loaded[str(ins.argval)] = None
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        facts = CodeFacts(frozenset(names), frozenset(operators), tuple(loaded))
        _CODE_FACTS[fn] = facts
    return facts


def reachable_functions(fn: types.FunctionType) -> list[types.FunctionType]:
    """``fn`` and every Python function its code reaches through globals (``rotate_half`` from
    ``apply_rotary_pos_emb``), in turn, each once."""
    found: dict[int, types.FunctionType] = {}
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in found:
            continue
        found[id(f)] = f
        for name in code_facts(f).globals:
            value = f.__globals__.get(name)
            if isinstance(value, types.FunctionType):
                todo.append(value)
    return list(found.values())


def global_reads(fn: types.FunctionType) -> list[tuple[dict, str]]:
    """(globals dict, name) of every global ``fn`` and the functions it reaches read: what its
    behaviour depends on beyond its arguments, where only modules and functions are read."""
    return [
        (f.__globals__, name) for f in reachable_functions(fn) for name in code_facts(f).globals
    ]
