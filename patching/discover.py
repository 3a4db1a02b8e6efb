"""Finding ``activation(linear(x))`` inside a module's own forward: trace the forward with
torch.fx (every submodule a leaf, so only this module's code is read) and keep the Linear calls
whose output has exactly one user, an activation module called on it alone. Blocks that do not
trace fall back to the rule table (rules.LINEAR_ACT_BLOCKS)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from .rules import LINEAR_ACT_BLOCKS, is_fused, looks_like_activation


class _OwnForwardTracer(fx.Tracer):
    """Records calls to submodules instead of tracing into them."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


@dataclass(frozen=True)
class LinearAct:
    """A direct child Linear (``linear``) whose only consumer is a direct child activation."""

    linear: str
    activation: str
    how: str  # 'traced' or 'rule table'


def _is_linear_candidate(module: nn.Module) -> bool:
    # Linear-like children, including ones we cannot fuse (reported as skipped): every module
    # linear_kind accepts is an nn.Linear or named Conv1D.
    return (
        isinstance(module, nn.Linear)
        or type(module).__name__ == "Conv1D"
        or hasattr(module, "base_layer")
    )


def might_hold_pattern(module: nn.Module) -> bool:
    """Cheap filter: a Linear-like child and an activation-like child, none fused yet."""
    children = list(module.children())
    return any(_is_linear_candidate(c) and not is_fused(c) for c in children) and any(
        looks_like_activation(c) and not is_fused(c) for c in children
    )


def find_linear_act(module: nn.Module) -> tuple[list[LinearAct], str | None]:
    """The (linear, activation) child pairs of ``module``, and why none could be looked for
    (None when the search ran)."""
    try:
        graph = _OwnForwardTracer().trace(module)
    except Exception as err:  # any forward that does not trace symbolically
        entry = LINEAR_ACT_BLOCKS.get(type(module).__name__)
        if entry is not None:
            lin, act = entry
            if hasattr(module, lin) and hasattr(module, act):
                return [LinearAct(lin, act, "rule table")], None
        return (
            [],
            f"forward does not trace with torch.fx ({type(err).__name__}) and "
            f"{type(module).__name__} is not in the rule table",
        )
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    children = dict(module.named_children())
    found = []
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in children:
            continue
        if not _is_linear_candidate(children[node.target]) or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op != "call_module" or user.target not in children:
            continue
        if user.args != (node,) or user.kwargs or not looks_like_activation(children[user.target]):
            continue
        # each module called once: replacing it must not change another call site
        if calls[node.target] == 1 and calls[user.target] == 1:
            found.append(LinearAct(node.target, user.target, "traced"))
    return found, None
