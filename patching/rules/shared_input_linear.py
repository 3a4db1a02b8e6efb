"""Rule 'shared_input_linear' (on by default): the ``nn.Linear`` children that a block's own
forward calls, two or more, each with one and the same local name as its only argument (an
attention's ``q_proj(hidden_states)``, ``k_proj(hidden_states)``, ``v_proj(hidden_states)``),
become fastlayers.SharedInputLinear: under autocast with a float32 input the input is converted
once for all of them and one copy is kept for their weights' gradients, where natively each
converts and keeps its own (at llama-1b, 8 x 1024 tokens: two conversions and 64 MiB of the
training step's peak a layer). Without autocast the layer is ``F.linear``.

The source only picks the candidates: whether two calls read the same tensor is checked on every
call (ops.shared_cast.shared_use: the very tensor, alive, at the same version, under the same
autocast dtype), and each use has autocast's own backward node, so the results are native's bit
for bit whatever the forward does with the name between the calls. A forward without source
(built at run time) has no candidates."""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from collections import defaultdict

from torch import nn

from fastlayers.layers import SharedInputLinear

from ..trace import inner_forward
from .base import ModuleRule

# forward function -> the sets of attributes of ``self`` called with one name alone
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _single_argument_calls(fn) -> list[frozenset[str]]:
    """The sets of attributes of the forward's first parameter (``self``) that its source calls
    with one local name as the only argument, between two assignments to that name (so
    ``h = self.fc1(h); h = self.fc2(h)`` gives two sets: they never read one tensor)."""
    calls = _CALLS.get(fn)
    if calls is None:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            params = list(inspect.signature(fn).parameters)
        except (OSError, TypeError, ValueError, SyntaxError):
            tree, params = None, []
        found: dict[tuple[str, int], set[str]] = defaultdict(set)
        if tree is not None and params:
            me = params[0]
            stores: dict[str, list[tuple[int, int]]] = defaultdict(list)  # where each store ends
            uses = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        for name in ast.walk(target):
                            if isinstance(name, ast.Name):
                                stores[name.id].append((node.end_lineno, node.end_col_offset))
                elif (
                    isinstance(node, ast.Call)
                    and len(node.args) == 1
                    and not node.keywords
                    and isinstance(node.args[0], ast.Name)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == me
                ):
                    uses.append((node.args[0].id, (node.lineno, node.col_offset), node.func.attr))
            for arg, at, attr in uses:
                # which stretch between stores of the name (in source order) the call is in
                stretch = sum(end <= at for end in stores[arg])
                found[(arg, stretch)].add(attr)
        calls = [frozenset(attrs) for attrs in found.values()]
        _CALLS[fn] = calls
    return calls


def linears_reading_one_name(block: nn.Module, claimed: set[str]) -> frozenset[str]:
    """The children of ``block`` that are Linears (of any subclass: the rule reports those it
    refuses), not ``claimed`` by another rule, and that its forward calls with a name two or
    more plain nn.Linear children are called with (one plain Linear beside subclasses would
    share its conversion with nobody)."""
    try:
        fn = inner_forward(type(block))
    except AttributeError:
        return frozenset()
    if not inspect.isfunction(fn):
        return frozenset()
    children = block._modules
    taken: set[str] = set()
    for attrs in _single_argument_calls(fn):
        linears = {a for a in attrs if a not in claimed and isinstance(children.get(a), nn.Linear)}
        if sum(type(children[a]) is nn.Linear for a in linears) >= 2:
            taken |= linears
    return frozenset(taken)


SHARED_INPUT_LINEAR = ModuleRule(
    "shared_input_linear",
    nn.Linear,
    SharedInputLinear.from_native,
    "fastlayers.SharedInputLinear.from_native(module)",
    (),
    among=linears_reading_one_name,
)
