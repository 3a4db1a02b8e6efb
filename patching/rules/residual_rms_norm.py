"""Block rule ``residual_rms_norm``: ``norm(residual + x)`` in a block's own forward, where the norm
is an RMSNorm child (``torch.nn.RMSNorm``, fastlayers.RMSNorm, or a model's own RMSNorm that
provably computes one of the forms: fastlayers.layers.recognise_rms_norm) — a decoder layer's
``h = residual + h; residual = h; h = post_attention_layernorm(h)`` — becomes one call of
fastlayers' add_rms_norm op, which returns the sum too (the next residual) and writes nothing in
place. The norm stays in place, claimed by the rewrite. The block rewrite machinery (tracing,
call keys, guards, the record) is blocks.py's; the add is recognised as residual_layer_norm
recognises it."""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch import nn

from fastlayers.layers import RMSNorm
from fastlayers.layers.recognise import recognise_rms_norm, rms_norm_candidate
from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops.rms_norm import FORMS, add_rms_norm_forward

from ..eligibility import hook_problem, reparametrized_problem
from ..fallback import warn_once
from ..forms import join
from ..report import Swap
from .base import BlockRule, Found
from .residual_layer_norm import _is_add, _is_in_place, splice_norm_of_sum

RULE = "residual_rms_norm"


@dataclass(frozen=True)
class ResidualRMSNorm:
    """One ``rms_norm(residual + x)`` found in a block's forward."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "add_rms_norm"
    inductor_fuses: ClassVar[bool] = True  # under torch.compile: the original forward

    norm: str  # the RMSNorm child's attribute
    form: str  # its rounding order (fastlayers.ops.rms_norm.FORMS)
    eps_attr: str  # where it keeps epsilon
    prenorm: bool  # the sum is used again: the op returns it too

    def claims(self) -> set[str]:
        return {self.norm}

    def live_attributes(self) -> dict[str, frozenset[str]]:
        """The norm's epsilon, read on every call."""
        return {self.norm: frozenset({self.eps_attr})}

    def row(self, block_name: str) -> Swap:
        fused = self.fused_op + (" (prenorm)" if self.prenorm else "")
        return Swap(join(block_name, self.norm), "add + RMSNorm", fused, self.rule)


def _has_rms_norm(block: nn.Module) -> bool:
    """Pre-filter: only a block with an RMSNorm-shaped child can hold the pattern."""
    return any(rms_norm_candidate(c) is not None for c in block.children())


def _norm_problem(norm: nn.Module, calls: int) -> tuple[str | None, str | None, str | None]:
    """``(form, eps attribute, None)`` for an RMSNorm child the op can compute, else
    ``(None, None, why)``."""
    if calls != 1:
        return None, None, "the RMSNorm is called more than once in the forward"
    if "_hf_hook" in norm.__dict__:
        return None, None, "the RMSNorm has an accelerate hook (it loads offloaded weights)"
    why = hook_problem(norm, "RMSNorm") or reparametrized_problem(norm, ("weight",))
    if why is not None:
        return None, None, why
    if isinstance(norm, RMSNorm):  # swapped by an earlier patch
        return norm.form, norm._eps_attr, None
    form, eps_attr, why = recognise_rms_norm(norm)
    return form, eps_attr, why


def find_residual_rms_norms(
    module: nn.Module, graph: fx.Graph
) -> tuple[list[Found], list[tuple[str, str]]]:
    """The patterns in ``graph`` (each with the nodes the rewrite needs), and (norm attribute,
    reason) for RMSNorms applied to a sum that cannot be fused."""
    children = dict(module.named_children())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    order = {n: i for i, n in enumerate(graph.nodes)}
    found, skipped = [], []
    for node in graph.nodes:
        if node.op != "call_module" or rms_norm_candidate(children.get(node.target)) is None:
            continue
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        add = node.args[0]
        if not _is_add(add):
            continue
        a, b = add.args
        others = [u for u in add.users if u is not node]
        why = None
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            why = "the sum adds a constant"
        elif any(order[u] < order[node] for u in others):
            why = "the sum is used before the RMSNorm"
        elif any(_is_in_place(u) for u in others):
            why = "the sum is modified in place"
        form = eps_attr = None
        if why is None:
            form, eps_attr, why = _norm_problem(children[node.target], calls[node.target])
        if why is not None:
            skipped.append((node.target, why))
            continue
        match = ResidualRMSNorm(node.target, form, eps_attr, bool(others))
        found.append(Found(match, {"norm": node, "add": add, "x": b, "residual": a}))
    return found, skipped


def rewrite_residual_rms_norms(graph: fx.Graph, found: list[Found]) -> None:
    """Replace each found pattern by one call of :func:`residual_rms_norm`."""
    replaced: dict[fx.Node, fx.Node] = {}
    for match, nodes in found:
        norm_node, add = nodes["norm"], nodes["add"]
        x, residual = (replaced.get(nodes[k], nodes[k]) for k in ("x", "residual"))
        with graph.inserting_before(norm_node):
            fused = graph.call_function(
                residual_rms_norm,
                (x, residual, graph.get_attr(match.norm), FORMS[match.form], match.eps_attr),
            )
            y = graph.call_function(operator.getitem, (fused, 0))
            s = graph.call_function(operator.getitem, (fused, 1)) if match.prenorm else None
        splice_norm_of_sum(graph, norm_node, add, y, s, replaced)
    graph.lint()


_Tensor = torch.Tensor
# float64 takes the native sequence: its autograd differentiates the forms' float32 statistics
_FUSED_DTYPES = tuple(d for d in SUPPORTED_DTYPES if d is not torch.float64)


def residual_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, form: int, eps_attr: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)`` by the fused op (``residual`` is the add's first
    operand as the forward wrote it); the native sequence where the op does not apply (a
    broadcasting add, float64, another device, a tensor subclass: warned once per reason)."""
    if (
        type(x) is _Tensor
        and type(residual) is _Tensor
        and x.shape == residual.shape
        and x.device == residual.device
    ):
        if x.dtype != residual.dtype:
            # autocast: a projection's bfloat16 output added to the float32 residual stream. The
            # sum promotes; the lower operand converted first (exactly) gives the same sum,
            # and its gradient comes back in its own dtype, as the add's does
            dtype = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(dtype), residual.to(dtype)
        if x.dtype in _FUSED_DTYPES:
            p = norm._parameters
            weight = p["weight"] if "weight" in p else norm.weight
            shape = norm.normalized_shape if isinstance(norm, nn.RMSNorm) else weight.shape
            eps = norm.__dict__[eps_attr]
            return add_rms_norm_forward(x, residual, shape, weight, eps, form)
    warn_once(f"a rewritten block computes add + RMSNorm natively: {_why_native(x, residual)}", 3)
    s = residual + x
    return norm(s), s


def _why_native(x: Any, residual: Any) -> str:
    if type(x) is not _Tensor or type(residual) is not _Tensor:
        return "an operand is not a plain tensor"
    if x.shape != residual.shape:
        return "the sum broadcasts (operands of different shapes)"
    if x.device != residual.device:
        return "operands on different devices"
    # operands of two dtypes are added in the promoted one: only that one is left to say
    return f"the operands are {torch.promote_types(x.dtype, residual.dtype)}"


RESIDUAL_RMS_NORM = BlockRule(
    RULE, _has_rms_norm, find_residual_rms_norms, rewrite_residual_rms_norms
)
