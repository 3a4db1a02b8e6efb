"""Block rule ``mlp``: in a block's traced forward, Linear -> activation -> Linear (an MLP: GPT-2's
GPT2MLP, OPT's decoder layer, T5's T5DenseActDense, ``nn.Sequential(Linear, GELU, Linear)``)
becomes one call of fastlayers' linear_act_linear op, whose backward fuses the activation's
derivative into the second Linear's input-gradient GEMM.

The pattern: FC1, a child that the pair rules would accept as a Linear (nn.Linear, HuggingFace
Conv1D, a Linear look-alike), called once, its output used only by the activation; the
activation, a child that computes GELU (erf or tanh form) or ReLU, called once, or ``F.gelu`` /
``F.relu`` / ``torch.relu`` / ``x.relu()`` (their in-place forms too: FC1's output, fresh and
used by nothing else, is all they write); optionally a dropout, a child nn.Dropout (an active
one, training with p > 0, computes natively at call time) or ``F.dropout`` that is the identity
in the trace; FC2, a Linear-like child called once on that alone. The children stay in place,
claimed by the block rewrite (the pair rules linear_gelu / linear_relu do not swap FC1 then).
The block rewrite machinery (tracing, call keys, guards, the record) is blocks.py's.
"""

from __future__ import annotations

import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops.linear_act import GELU_ACTIVATION, GELU_APPROXIMATE, linear_act_linear_entry
from fastlayers.ops.linear_act import linear_act_forward as functional_linear_act

from ..eligibility import (
    CALL_HOOK_KINDS,
    fusable_activation,
    hook_problem,
    is_linear_candidate,
    linear_skip,
    looks_like_activation,
)
from ..fallback import warn_once
from ..forms import bind_dropout, code_facts, dropout_child, is_child, join, native_relu, relu_of
from ..report import Swap
from ..trace import inner_forward
from .base import BlockRule, Found

RULE = "mlp"


@dataclass(frozen=True)
class MLPMatch:
    """One Linear -> activation -> (dropout ->) Linear found in a block's forward."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "linear_act_linear"
    inductor_fuses: ClassVar[bool] = False  # see RewrittenForward._inner: the op compiles as is

    fc1: str  # the first Linear child's attribute
    act: str  # the activation child's attribute, or the functional form ('F.gelu', 'F.relu', ...)
    form: str  # 'child' or the functional form
    activation: str  # 'gelu', 'gelu_tanh' or 'relu'
    dropout: str | None  # 'child <attr>', 'F.dropout(p=..., training=...)' or None
    fc2: str  # the second Linear child's attribute
    native: str  # the report's native column, e.g. 'Conv1D + NewGELUActivation + Conv1D'

    def claims(self) -> set[str]:
        """Both Linears, and the activation and dropout children where they are children."""
        out = {self.fc1, self.fc2}
        if self.form == "child":
            out.add(self.act)
        if is_child(self.dropout):
            out.add(dropout_child(self.dropout))
        return out

    def live_attributes(self) -> dict[str, frozenset[str]]:
        """The dropout child's p, read on every call."""
        child = dropout_child(self.dropout)
        return {child: frozenset({"p"})} if child is not None else {}

    def row(self, block_name: str) -> Swap:
        """The report's row for this match in the block called ``block_name``."""
        return Swap(join(block_name, self.fc1), self.native, self.fused_op, RULE)


# ------------------------------------------------------------------ the pre-filter


def wants_mlp(block: nn.Module) -> bool:
    """Pre-filter, so that the patcher traces only blocks that may hold the pattern: two
    Linear-like children, and an activation-like child or a forward whose own code names
    gelu or relu (read from its code objects, cached per function; never by tracing)."""
    children = list(block.children())
    if sum(is_linear_candidate(c) for c in children) < 2:
        return False
    if any(looks_like_activation(c) for c in children):
        return True
    fn = inner_forward(type(block))
    if not isinstance(fn, types.FunctionType):
        return False  # not Python code: the trace would fail anyway
    return bool(code_facts(fn).names & {"gelu", "relu", "relu_"})


# ------------------------------------------------------------------ finding the pattern


def _linear_call(node: Any, children: dict) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and is_linear_candidate(children.get(node.target))
    )


def _activation_form(node: fx.Node, children: dict) -> str | None:
    """'child' for a call of an activation-like child (recognised later), the functional form
    for F.gelu and the functional ReLUs, else None."""
    if node.op == "call_module":
        child = children.get(node.target)
        if child is not None and (looks_like_activation(child) or isinstance(child, nn.ReLU)):
            return "child"
        return None
    if node.op == "call_function" and node.target is F.gelu:
        return "F.gelu"
    relu = relu_of(node, {})
    return relu[1] if relu is not None else None


def _is_dropout_call(node: fx.Node, children: dict) -> bool:
    if node.op == "call_module":
        return isinstance(children.get(node.target), nn.Dropout)
    return node.op == "call_function" and node.target is F.dropout


def _fc2_after(act: fx.Node, children: dict) -> tuple[fx.Node, fx.Node | None] | None:
    """``(FC2, dropout or None)``: a Linear-like child called on the activation's output
    alone, directly or through a dropout; None when the activation feeds no Linear (the pair
    rules' business)."""
    for user in act.users:
        if _linear_call(user, children) and user.args == (act,) and not user.kwargs:
            return user, None
        if _is_dropout_call(user, children):
            for after in user.users:
                if _linear_call(after, children) and after.args == (user,) and not after.kwargs:
                    return after, user
    return None


def _gelu_kind(node: fx.Node) -> tuple[str | None, str | None]:
    bound = dict(zip(("input", "approximate"), node.args, strict=False))
    bound.update(node.kwargs)
    approximate = bound.get("approximate", "none")
    if set(bound) - {"input", "approximate"} or approximate not in GELU_ACTIVATION:
        return None, f"F.gelu with approximate={approximate!r}"
    return GELU_ACTIVATION[approximate], None


def _activation_kind(
    node: fx.Node, form: str, children: dict, calls: Counter
) -> tuple[str | None, str | None]:
    """``(kind, None)`` for an activation the op computes ('gelu', 'gelu_tanh', 'relu'), else
    ``(None, why)``."""
    if form == "F.gelu":
        return _gelu_kind(node)
    if form != "child":
        return "relu", None  # relu_of bound it: relu(x) alone
    if node.kwargs or len(node.args) != 1:
        return None, "the activation is called with more than its input"
    if calls[node.target] != 1:
        return None, "the activation is called more than once in the forward"
    child = children[node.target]
    if "_hf_hook" in child.__dict__:
        return None, "the activation has an accelerate hook"
    return fusable_activation(child)  # its hooks (it would not run), then what it computes


def _linear_problem(fc: nn.Module, what: str) -> str | None:
    """Why the Linear-like child ``fc`` cannot be computed by the op in its place, or None."""
    if "_hf_hook" in fc.__dict__:
        return f"the {what} has an accelerate hook (it loads offloaded weights when called)"
    return hook_problem(fc, what, CALL_HOOK_KINDS) or linear_skip(fc)


def _dropout_arg(
    node: fx.Node | None, children: dict, calls: Counter
) -> tuple[str | None, str | None]:
    """``(description, None)`` for no dropout (None), an nn.Dropout child ('child <attr>') or an
    F.dropout that is the identity here; else ``(None, why)``."""
    if node is None:
        return None, None
    if node.op == "call_module":
        child = children[node.target]
        if type(child) is not nn.Dropout:
            return None, f"{type(child).__name__} is a subclass of nn.Dropout"
        if child.inplace:
            return None, "the dropout between the Linears is in place"
        if calls[node.target] != 1:
            return None, "the dropout is called more than once in the forward"
        if len(node.args) != 1 or node.kwargs:
            return None, "the dropout is called with more than its input"
        if "_hf_hook" in child.__dict__:
            return None, "the dropout has an accelerate hook"
        why = hook_problem(child, "dropout", CALL_HOOK_KINDS)
        return (None, why) if why else (f"child {node.target}", None)
    bound = bind_dropout(node)
    if bound is None:
        return None, "F.dropout between the Linears with a p or training that is not a constant"
    _, p, training = bound
    if p != 0 and training:
        return None, f"F.dropout with p={p} between the Linears"
    return f"F.dropout(p={p}, training={training})", None


def _structure_problem(
    fc1: fx.Node, act: fx.Node, drop: fx.Node | None, fc2: fx.Node, calls: Counter
) -> str | None:
    """Why the chain's data flow is not exactly ``fc2(dropout(act(fc1(x))))``, or None."""
    if len(fc1.users) != 1:
        return "FC1's output has another user"
    if len(act.users) != 1:
        return "the activation's output has another user"
    if drop is not None and len(drop.users) != 1:
        return "the dropout's output has another user"
    if calls[fc1.target] != 1:
        return f"FC1 ({fc1.target}) is called more than once in the forward"
    if calls[fc2.target] != 1:
        return f"FC2 ({fc2.target}) is called more than once in the forward"
    if len(fc1.args) != 1 or fc1.kwargs or not isinstance(fc1.args[0], fx.Node):
        return "FC1 is called with other than one tensor of the graph"
    return None


def find_mlps(block: nn.Module, graph: fx.Graph) -> tuple[list[Found], list[tuple[str, str]]]:
    """The MLPs in ``graph`` (each with the nodes the rewrite needs), and (FC1 attribute,
    reason) for Linear -> activation -> Linear chains that cannot be fused."""
    children = dict(block.named_children())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    found: list[Found] = []
    skipped: list[tuple[str, str]] = []
    second: dict[fx.Node, str] = {}  # FC2 nodes of the matches so far -> their FC1
    for act in graph.nodes:
        form = _activation_form(act, children)
        fc1_node = act.args[0] if form is not None and act.args else None
        if not _linear_call(fc1_node, children):
            continue
        after = _fc2_after(act, children)
        if after is None:
            continue  # no second Linear: the pair rules fuse Linear + activation
        fc2_node, drop = after
        fc1, fc2 = children[fc1_node.target], children[fc2_node.target]
        why = _structure_problem(fc1_node, act, drop, fc2_node, calls)
        if fc1_node in second:  # Linear, act, Linear, act, Linear: the first MLP takes it
            why = f"its Linear is the second Linear of the MLP at {second[fc1_node]!r}"
        why = (
            why
            or _linear_problem(fc1, f"FC1 ({fc1_node.target})")
            or _linear_problem(fc2, f"FC2 ({fc2_node.target})")
            or _same_placement(fc1, fc2)
        )
        dropout = kind = None
        if why is None:
            dropout, why = _dropout_arg(drop, children, calls)
        if why is None:  # last: recognising a child activation may probe it
            kind, why = _activation_kind(act, form, children, calls)
        if why is not None:
            skipped.append((fc1_node.target, why))
            continue
        relu = relu_of(act, {}) if form not in ("child", "F.gelu") else None
        inplace = relu is not None and relu[2]
        name = act.target if form == "child" else form
        shown = type(children[name]).__name__ if form == "child" else form
        shown += "(inplace=True)" if form == "F.relu" and inplace else ""
        shown += "(approximate='tanh')" if form == "F.gelu" and kind == "gelu_tanh" else ""
        parts = [type(fc1).__name__, shown]
        if dropout is not None:
            parts.append("Dropout" if is_child(dropout) else dropout)
        native = " + ".join([*parts, type(fc2).__name__])
        match = MLPMatch(fc1_node.target, name, form, kind, dropout, fc2_node.target, native)
        second[fc2_node] = fc1_node.target
        nodes = {
            "fc1": fc1_node,
            "act": act,
            "dropout": drop,
            "fc2": fc2_node,
            "inplace": inplace,
            # Conv1D's [in, out] weights (the guard keeps each child's class)
            "transposed": (not isinstance(fc1, nn.Linear), not isinstance(fc2, nn.Linear)),
        }
        found.append(Found(match, nodes))
    return found, skipped


def _same_placement(fc1: nn.Module, fc2: nn.Module) -> str | None:
    """Why the two Linears' Parameters are not all of one dtype and device, or None."""
    tensors = [t for fc in (fc1, fc2) for t in fc.parameters(recurse=False)]
    dtypes = sorted({str(t.dtype) for t in tensors})
    devices = sorted({str(t.device) for t in tensors})
    if len(dtypes) > 1:
        return f"FC1 and FC2 differ in dtype ({', '.join(dtypes)})"
    if len(devices) > 1:
        return f"FC1 and FC2 are on different devices ({', '.join(devices)})"
    return None


def rewrite_mlps(graph: fx.Graph, found: list[Found]) -> None:
    """Replace each found MLP by one call of :func:`linear_act_linear_block`."""
    for match, nodes in found:
        fc1, act, drop, fc2 = nodes["fc1"], nodes["act"], nodes["dropout"], nodes["fc2"]
        x = fc1.args[0]  # read now: an earlier rewrite may have replaced the node it was
        with graph.inserting_before(fc2):
            fc1_ref = graph.get_attr(match.fc1)
            act_ref: Any = graph.get_attr(match.act) if match.form == "child" else match.form
            dropout_arg: Any = None
            if is_child(match.dropout):
                dropout_arg = graph.get_attr(drop.target)
            elif match.dropout is not None:
                dropout_arg = bind_dropout(drop)[1:]  # (p, training)
            fused = graph.call_function(
                linear_act_linear_block,
                (
                    x,
                    fc1_ref,
                    act_ref,
                    match.activation,
                    nodes["inplace"],
                    dropout_arg,
                    graph.get_attr(match.fc2),
                    *nodes["transposed"],
                ),
            )
        fc2.replace_all_uses_with(fused)
        for node in (fc2, drop, act, fc1):
            if node is not None:
                graph.erase_node(node)
    graph.lint()


# ------------------------------------------------------------------ at call time


def _why_native(x: Any, act: nn.Module | str, activation: str, dropout: Any) -> str | None:
    """Why this call computes the native expression instead of the fused op (None: fused). The
    children themselves (replaced, hooked) are the block's guard's business (block._Code); what
    is read here can change on the children the guard accepts (their attributes)."""
    # torch.export traces with fake tensors (the op has fake kernels); other subclasses: native
    if type(x) is not torch.Tensor and not (
        isinstance(x, torch.Tensor) and torch.compiler.is_compiling()
    ):
        return "the input is not a plain tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"the input is {x.dtype}, not float32/float64/float16/bfloat16"
    if isinstance(act, nn.GELU) and GELU_ACTIVATION.get(act.approximate) != activation:
        return "the GELU child's approximate changed since the patch"
    if isinstance(dropout, nn.Module) and dropout.inplace:
        return "the dropout child is in place since the patch"
    return None


def linear_act_linear_block(
    x: torch.Tensor,
    fc1: nn.Module,
    act: nn.Module | str,
    activation: str,
    inplace: bool,
    dropout: nn.Dropout | tuple[float, bool] | None,
    fc2: nn.Module,
    w1t: bool,
    w2t: bool,
) -> torch.Tensor:
    """``fc2(dropout(act(fc1(x))))`` by fastlayers' linear_act_linear op (``activation`` 'gelu',
    'gelu_tanh' or 'relu'; a dropout that is the identity here skipped; ``w1t`` / ``w2t``: a
    HuggingFace Conv1D's weight, read transposed). ``act`` is the block's activation child or the
    functional form's name. An active dropout child (training, p > 0) between the Linears: the
    first Linear + activation fused, the rest native. Where the op does not apply (a tensor
    subclass, an unsupported dtype, a child's attribute changed since the patch: warned once per
    reason) the original expression, exactly as the forward wrote it. The children are the very
    ones the patch took, or of their class (the block's guard, block._Code, says so first)."""
    why = _why_native(x, act, activation, dropout)
    if why is None:
        # the Parameters straight from _parameters: Module.__getattr__ costs ~1 us a lookup
        p1, p2 = fc1._parameters, fc2._parameters
        w1, b1, w2, b2 = p1["weight"], p1.get("bias"), p2["weight"], p2.get("bias")
    if why is None and isinstance(dropout, nn.Module) and dropout.training and dropout.p > 0:
        # an active dropout between the Linears: the op cannot apply it, so the first Linear
        # and the activation run fused (what rule linear_gelu / linear_relu would make of
        # them), the dropout and the second Linear natively
        warn_once(
            f"the dropout between the Linears is active (training, p={dropout.p}): the first "
            "Linear + activation run fused, the dropout and the second Linear natively"
        )
        h = functional_linear_act(x, w1, b1, activation, w1t)
        return fc2(dropout(h))
    if why is None:
        return linear_act_linear_entry(x, w1, b1, w2, b2, activation, w1t, w2t)
    warn_once(f"a rewritten block computes an MLP natively: {why}")
    h = fc1(x)
    if not isinstance(act, str):
        h = act(h)
    elif act == "F.gelu":
        h = F.gelu(h, approximate=GELU_APPROXIMATE[activation])
    else:
        h = native_relu(h, act, inplace)
    if isinstance(dropout, tuple):
        h = F.dropout(h, *dropout)
    elif dropout is not None:
        h = dropout(h)
    return fc2(h)


MLP = BlockRule(RULE, wants_mlp, find_mlps, rewrite_mlps)
