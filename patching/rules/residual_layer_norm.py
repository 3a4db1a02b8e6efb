"""Block rule ``residual_layer_norm``: ``layer_norm(dropout(x) + residual)`` in a block's own
forward (a child ``nn.LayerNorm``; a child ``nn.Dropout``, ``F.dropout`` or no dropout; the sum
used again or not: the prenorm form, where the op returns the sum too) becomes one call of
fastlayers' fused dropout + add + LayerNorm op. The LayerNorm (and a dropout child) stay in
place, claimed by the rewrite. The block rewrite machinery (tracing, call keys, guards, the
record) is blocks.py's."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fastlayers.layers import LayerNorm
from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops.dropout_add_layer_norm import dropout_add_layer_norm_forward

from ..eligibility import hook_problem, reparametrized_problem
from ..fallback import warn_once
from ..forms import bind_dropout, dropout_child, dropout_of, is_child, join
from ..report import Swap
from .base import BlockRule, Found

RULE = "residual_layer_norm"

_LAYER_NORMS = (nn.LayerNorm, LayerNorm)


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
            out.add(dropout_child(self.dropout))
        return out

    def live_attributes(self) -> dict[str, frozenset[str]]:
        """The LayerNorm's eps and shape and the dropout child's p, read on every call."""
        out = {self.layer_norm: frozenset({"eps", "normalized_shape"})}
        if is_child(self.dropout):
            out[dropout_child(self.dropout)] = frozenset({"p"})
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
) -> tuple[list[Found], list[tuple[str, str]]]:
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
            why = hook_problem(ln, "LayerNorm") or reparametrized_problem(ln, ("weight", "bias"))
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
            Found(
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


def rewrite_residual_layer_norms(graph: fx.Graph, found: list[Found]) -> None:
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
        splice_norm_of_sum(graph, ln_node, add, y, s, replaced)
        if match.dropout is not None:
            graph.erase_node(nodes["dropout_node"])
    graph.lint()


def splice_norm_of_sum(
    graph: fx.Graph,
    norm: fx.Node,
    add: fx.Node,
    y: fx.Node,
    s: fx.Node | None,
    replaced: dict[fx.Node, fx.Node],
) -> None:
    """The fused call's outputs take the place of ``norm(add)`` (``y``) and of the sum (``s``;
    None: nothing else used it); both original nodes are erased, and noted in ``replaced`` for
    later matches whose operands they were. Shared with rule residual_rms_norm."""
    norm.replace_all_uses_with(y)
    graph.erase_node(norm)
    replaced[norm] = y
    if s is not None:
        add.replace_all_uses_with(s)
        replaced[add] = s
    graph.erase_node(add)


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


RESIDUAL_LAYER_NORM = BlockRule(
    RULE, _has_layer_norm, find_residual_layer_norms, rewrite_residual_layer_norms
)
