"""Block rule ``relu_scale``: in a block's traced forward, ``relu(x) * c``, ``c * relu(x)`` and
``relu(x) / c`` (also ``torch.mul`` / ``torch.div`` / ``.mul(c)`` / ``.div(c)``), with ``c`` a
Python number, become one call of fastlayers' relu_scale op (``torch.relu(x) * alpha`` in one
pass, bit for bit). The ReLU is a direct ``nn.ReLU`` child called once, or ``F.relu`` /
``torch.relu`` / ``x.relu()`` (and their in-place forms). The child stays in place, claimed by
the block rewrite (the module rule 'relu' does not swap it): state_dict, hooks and unpatch stay
simple. The block rewrite machinery (tracing, call keys, guards, the record) is blocks.py's.

Bit-exactness is this rule's promise, hence what is refused:
- ``relu(x) / c`` is computed as ``relu(x) * (1 / c)``: identical to the division only when
  ``1 / c`` is exact in float32 (a power of two in its normal range);
- ``c`` must be a finite int or float; a Parameter or buffer can change, so it is not baked in;
- an in-place ReLU is fused (out of place) only when nobody else can see its input: the input
  has no other user in the graph and is the fresh result of an op that allocates (not a graph
  input, an attribute or a possible view of one, which the native in-place write would change).
"""

from __future__ import annotations

import math
import operator
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fastlayers.layers import LayerNorm
from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops.relu_scale import relu_scale_forward

from ..eligibility import hook_problem
from ..fallback import warn_once
from ..forms import code_facts, native_relu, relu_input, relu_of
from ..report import Swap
from ..trace import inner_forward
from .base import BlockRule, Found

RULE = "relu_scale"


@dataclass(frozen=True)
class ReLUScaleMatch:
    """One ``relu(x) * c`` (or ``c * relu(x)``, ``relu(x) / c``) found in a block's forward."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "relu_scale"
    inductor_fuses: ClassVar[bool] = True

    relu: str  # the nn.ReLU child's attribute, or the fx node name of a functional relu
    form: str  # 'child', or the functional: 'F.relu', 'torch.relu', 'Tensor.relu', '..._'
    how: str  # 'mul' (relu(x) * c), 'rmul' (c * relu(x)) or 'div' (relu(x) / c)
    c: int | float  # the constant as written
    alpha: float  # c, or 1 / c for 'div'
    inplace: bool  # the ReLU writes its input (fused out of place: nobody else sees the input)

    def live_attributes(self) -> dict[str, frozenset[str]]:
        """Nothing of the ReLU child is read per call."""
        return {}

    def claims(self) -> set[str]:
        """The nn.ReLU child, when the ReLU is one."""
        return {self.relu} if self.form == "child" else set()

    def row(self, block_name: str) -> Swap:
        """The report's row for this match in the block called ``block_name``."""
        relu = "ReLU" if self.form == "child" else self.form
        if self.inplace and self.form in ("child", "F.relu"):
            relu += "(inplace=True)"
        op = "div" if self.how == "div" else "mul"
        name = f"{block_name}.{self.relu}" if block_name else self.relu
        return Swap(name, f"{relu} + {op}({self.c!r})", f"relu_scale(alpha={self.alpha!r})", RULE)


# ------------------------------------------------------------------ the pre-filter

_MUL_DIV_NAMES = frozenset({"mul", "div"})


def wants_relu_scale(block: nn.Module) -> bool:
    """Pre-filter, so that the patcher traces only blocks that may hold the pattern: the class's
    own forward multiplies or divides, and it names relu or the block has an nn.ReLU child. Read
    from the forward's code objects (cached per function), never by tracing. A relu * c inside a
    helper function that the forward calls is missed (the trace would see it; this does not)."""
    fn = inner_forward(type(block))
    if not isinstance(fn, types.FunctionType):
        return False  # not Python code: the trace would fail anyway
    names, operators, _ = code_facts(fn)
    if not (names & _MUL_DIV_NAMES or operators & {"*", "/"}):
        return False
    return bool(names & {"relu", "relu_"}) or any(isinstance(c, nn.ReLU) for c in block.children())


# ------------------------------------------------------------------ finding the pattern

# Ops that always return a new tensor (never their input or a view of it): an in-place ReLU of
# their result, that result used by nothing else, changes nothing anyone else sees.
_FRESH_MODULES = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.LayerNorm,
    LayerNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
)
_FRESH_FUNCTIONS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.matmul,
    operator.neg,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    F.linear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.layer_norm,
}
_FRESH_METHODS = {"add", "sub", "mul", "div", "matmul"}

# float32's normal range: a power of two c in it has 1 / c exact in float32 (and float64);
# float16 and bfloat16 compute the product in float32, as native does
_MIN_NORMAL_EXP, _MAX_NORMAL_EXP = -126, 126


def _scale_of(node: fx.Node, relu: fx.Node) -> tuple[str, Any] | None:
    """``(how, c)`` when ``node`` multiplies ``relu`` by, or divides it by, something that is
    not a value computed in the graph (a number, an attribute), else None."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    how = None
    if node.op == "call_function" and node.target in (operator.mul, torch.mul):
        how = "mul" if a is relu else "rmul" if b is relu else None
    elif node.op == "call_function" and node.target in (operator.truediv, torch.div):
        how = "div" if a is relu else None
    elif node.op == "call_method" and node.target in ("mul", "div") and a is relu:
        how = node.target
    if how is None:
        return None
    c = a if how == "rmul" else b
    if c is relu or (isinstance(c, fx.Node) and c.op != "get_attr"):
        return None  # relu * relu, relu * (a tensor computed in the graph): not this pattern
    return how, c


def _alpha(how: str, c: Any, block: nn.Module) -> tuple[float | None, str | None]:
    """``(alpha, None)`` for a constant ``c`` the op computes with bit for bit, else
    ``(None, why)``."""
    if isinstance(c, fx.Node):  # an attribute of the block (reachable: blocks.py checks)
        value = block
        for part in str(c.target).split("."):
            value = getattr(value, part)
        kind = (
            "Parameter"
            if isinstance(value, nn.Parameter)
            else "buffer"
            if any(value is b for b in block.buffers())
            else "tensor attribute"
        )
        return None, f"c is the {kind} {c.target!r}, which can change (only constants are fused)"
    if type(c) not in (int, float):
        return None, f"c is a {type(c).__name__}, not an int or float"
    if type(c) is int and abs(c) > 2**53:
        return None, "c is an integer beyond 2**53 (inexact in float64)"
    if not math.isfinite(c):
        return None, f"c is not finite ({c!r})"
    if how != "div":
        return float(c), None
    if c == 0:
        return None, "relu(x) / c with c = 0"
    mantissa, exponent = math.frexp(abs(c))  # |c| = mantissa * 2**exponent, mantissa in [.5, 1)
    if mantissa != 0.5:
        return None, "relu(x) / c with 1/c inexact"
    if not _MIN_NORMAL_EXP <= exponent - 1 <= _MAX_NORMAL_EXP:
        return None, "relu(x) / c with 1/c inexact (c outside float32's normal range)"
    return 1.0 / float(c), None  # exact: a power of two


def _is_fresh(x: Any, children: dict) -> bool:
    """Whether ``x`` is a new tensor nobody else holds: made by an op that allocates its
    result (see _FRESH_*)."""
    if not isinstance(x, fx.Node):
        return False
    if x.op == "call_module":
        return type(children.get(x.target)) in _FRESH_MODULES
    if x.op == "call_function":
        return x.target in _FRESH_FUNCTIONS and "out" not in x.kwargs
    return x.op == "call_method" and x.target in _FRESH_METHODS


def find_relu_scales(
    block: nn.Module, graph: fx.Graph
) -> tuple[list[Found], list[tuple[str, str]]]:
    """The ``relu(x) * c`` patterns in ``graph`` (each with its nodes), and (ReLU child or node
    name, reason) for ReLUs scaled by a constant that cannot be fused."""
    children = dict(block.named_children())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    found, skipped = [], []
    for node in graph.nodes:
        relu = relu_of(node, children)
        if relu is None:
            continue
        x, form, inplace = relu
        scales = [s for s in (_scale_of(u, node) for u in node.users) if s is not None]
        if not scales:
            continue  # nothing multiplies this ReLU by a constant
        name = node.target if form == "child" else node.name
        (how, c), why = scales[0], None
        if len(node.users) != 1:
            why = "the ReLU's output is used elsewhere too"
        elif form == "child":
            child = children[node.target]
            if type(child) is not nn.ReLU:
                why = f"{type(child).__name__} is a subclass of nn.ReLU (may compute otherwise)"
            elif calls[node.target] != 1:
                why = "the ReLU is called more than once in the forward"
            elif "_hf_hook" in child.__dict__:
                why = "the ReLU has an accelerate hook"
            else:
                why = hook_problem(child, "ReLU")
        alpha = None
        if why is None:
            alpha, why = _alpha(how, c, block)
        if why is None and not isinstance(x, fx.Node):
            why = "the ReLU's input is not a tensor of the graph"
        elif why is None and inplace and len(x.users) != 1:
            why = "the ReLU is in place and its input is used elsewhere"
        elif why is None and inplace and not _is_fresh(x, children):
            why = (
                "the ReLU is in place and its input may be held elsewhere (a graph input, an "
                "attribute or a view), where native's write would show"
            )
        if why is not None:
            skipped.append((name, why))
            continue
        match = ReLUScaleMatch(name, form, how, c, alpha, inplace)
        found.append(Found(match, {"relu": node, "scale": next(iter(node.users))}))
    return found, skipped


def rewrite_relu_scales(graph: fx.Graph, found: list[Found]) -> None:
    """Replace each found ReLU and its multiply/divide by one call of :func:`relu_times`."""
    for match, nodes in found:
        relu, scale = nodes["relu"], nodes["scale"]
        # read now, not at find time: an earlier match may have replaced the node x was
        x = relu_input(relu)[0]
        with graph.inserting_before(scale):
            relu_arg = graph.get_attr(match.relu) if match.form == "child" else match.form
            fused = graph.call_function(
                relu_times, (x, relu_arg, match.how, match.c, match.alpha, match.inplace)
            )
        scale.replace_all_uses_with(fused)
        graph.erase_node(scale)
        graph.erase_node(relu)
    graph.lint()


# ------------------------------------------------------------------ at call time


def _why_native(x: Any, relu: nn.Module | str, inplace: bool) -> str | None:
    """Why this call computes the native expression instead of the fused op (None: fused). The
    ReLU child itself (replaced, hooked) is the block's guard's business (block._Code)."""
    if type(x) is not torch.Tensor:
        return "the ReLU's input is not a plain tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"the ReLU's input is {x.dtype}, not float32/float64/float16/bfloat16"
    if not isinstance(relu, str) and relu.inplace != inplace:
        return "the ReLU child's inplace flag changed since the patch"
    return None


def relu_times(
    x: torch.Tensor,
    relu: nn.ReLU | str,
    how: str,
    c: int | float,
    alpha: float,
    inplace: bool,
) -> torch.Tensor:
    """``relu(x) * c`` (``how`` 'mul'), ``c * relu(x)`` ('rmul') or ``relu(x) / c`` ('div') by
    fastlayers' relu_scale op with ``alpha`` (c, or the exact 1 / c), out of place; ``relu`` is
    the block's nn.ReLU child or the functional form's name. Where the op does not apply (a
    tensor subclass, an unsupported dtype, the child replaced or hooked since the patch: warned
    once per reason) the original expression, exactly as the forward wrote it."""
    why = _why_native(x, relu, inplace)
    if why is None:
        return relu_scale_forward(x, alpha)  # alpha: a float the patch checked
    warn_once(f"a rewritten block computes relu(x) * c natively: {why}", 2)
    r = native_relu(x, relu, inplace)
    if how == "mul":
        return r * c
    if how == "rmul":
        return c * r
    return r / c


RELU_SCALE = BlockRule(RULE, wants_relu_scale, find_relu_scales, rewrite_relu_scales)
