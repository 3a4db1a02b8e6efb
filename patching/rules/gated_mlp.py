"""Block rule ``gated_mlp``: in a block's traced forward, ``act(g) * u`` whose product feeds a
Linear-like child (directly, or through a dropout or a dtype cast) — a gated MLP's core: LLaMA's,
Mistral's, Qwen's ``down(act(gate(x)) * up(x))`` (SwiGLU), Gemma's GeGLU, T5 v1.1's
T5DenseGatedActDense, Phi-3's and ModernBERT's ``gate_up(x).chunk(2)`` — becomes one call of
fastlayers' gated_act op: the activation and the product in one pass forward, their derivatives
in one pass backward.

The Linears stay the block's children, called as the forward wrote them (their hooks, PEFT
adapters and quantized layers keep working); the rule claims only an activation child. The
activation: a child that computes SiLU, GELU (erf or tanh form) or ReLU (probed, see
fastlayers.layers.recognise_activation), called once on one tensor, or ``F.silu`` / ``F.gelu``.
The block rewrite machinery (tracing, call keys, guards, the record) is blocks.py's.
"""

from __future__ import annotations

import operator
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fastlayers import config
from fastlayers.layers.recognise import GATED_KINDS
from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops.gated_act import (
    gated_act_down_forward,
    gated_act_forward,
    gated_act_linear_forward,
)
from fastlayers.ops.linear_act import GELU_ACTIVATION, GELU_APPROXIMATE
from fastlayers.ops.shared_cast import autocast_conversion, converted_use

from ..eligibility import (
    CALL_HOOK_KINDS,
    fusable_activation,
    hook_problem,
    is_linear_candidate,
    linear_skip,
    looks_like_activation,
)
from ..fallback import warn_once
from ..forms import code_facts, join
from ..report import Swap
from ..trace import inner_forward
from .base import BlockRule, Found

RULE = "gated_mlp"
_MULS = (operator.mul, torch.mul)
_FUNCTIONAL = {F.silu: "F.silu", F.gelu: "F.gelu"}


@dataclass(frozen=True)
class GatedMLPMatch:
    """One ``act(g) * u`` feeding a Linear, found in a block's forward."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "gated_act"
    # Inductor fuses act * up (and more) itself: under torch.compile the block compiles its
    # original forward (fastlayers.config.compile_residual_layer_norm, as the other rules)
    inductor_fuses: ClassVar[bool] = True

    act: str  # the activation child's attribute, or the functional form ('F.silu', 'F.gelu')
    form: str  # 'child' or the functional form
    activation: str  # 'silu', 'gelu', 'gelu_tanh' or 'relu'
    down: str  # the Linear child the product feeds
    native: str  # the report's native column, e.g. 'SiLU * up + Linear'
    # (gate, up, down) when the whole MLP is down(act(gate(x)) * up(x)) with three plain
    # nn.Linear children: the rewrite then calls their F.linear itself (no module calls on the
    # host); None: only act * up is fused, the Linears stay called as modules
    linears: tuple[str, str, str] | None = None

    def claims(self) -> set[str]:
        """The activation child, where it is one, and the three Linears where the rewrite
        computes them."""
        out = {self.act} if self.form == "child" else set()
        return out | set(self.linears or ())

    def live_attributes(self) -> dict[str, frozenset[str]]:
        return {}

    def row(self, block_name: str) -> Swap:
        """The report's row for this match in the block called ``block_name``."""
        where = self.act if self.form == "child" else self.down
        fused = self.fused_op + (" (whole MLP)" if self.linears else "")
        return Swap(join(block_name, where), self.native, fused, RULE)


def wants_gated_mlp(block: nn.Module) -> bool:
    """Pre-filter, so that the patcher traces only blocks that may hold the pattern: two
    Linear-like children, a forward that multiplies, and an activation-like child or a forward
    naming silu or gelu (read from its code objects, cached per function; never by tracing)."""
    children = list(block.children())
    if sum(is_linear_candidate(c) for c in children) < 2:
        return False
    fn = inner_forward(type(block))
    if not isinstance(fn, types.FunctionType):
        return False  # not Python code: the trace would fail anyway
    names, operators, _ = code_facts(fn)
    if "*" not in operators and "mul" not in names:
        return False
    return any(looks_like_activation(c) for c in children) or bool(names & {"silu", "gelu"})


# ------------------------------------------------------------------ finding the pattern


def _act_form(node: Any, children: dict) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        child = children.get(node.target)
        if child is not None and (
            looks_like_activation(child) or isinstance(child, (nn.SiLU, nn.GELU, nn.ReLU))
        ):
            return "child"
        return None
    if node.op == "call_function":
        return _FUNCTIONAL.get(node.target)
    return None


def _is_linear_call(node: fx.Node, children: dict) -> bool:
    return node.op == "call_module" and is_linear_candidate(children.get(node.target))


def _passes_through(node: fx.Node, children: dict) -> bool:
    """A dropout or a dtype cast between the product and the down projection."""
    if node.op == "call_module":
        return isinstance(children.get(node.target), nn.Dropout)
    if node.op == "call_function":
        return node.target is F.dropout
    return node.op == "call_method" and node.target in ("to", "type_as", "type")


def _down_after(node: fx.Node, children: dict, depth: int = 0) -> fx.Node | None:
    for user in node.users:
        if _is_linear_call(user, children) and user.args and user.args[0] is node:
            return user
        if depth < 3 and _passes_through(user, children) and user.args[0] is node:
            down = _down_after(user, children, depth + 1)
            if down is not None:
                return down
    return None


def _plain_linear_call(node: Any, children: dict, calls: Counter) -> str | None:
    """The attribute of the plain nn.Linear child ``node`` calls on one tensor, called once in
    the forward, whose F.linear the rewrite may compute in its place (no hooks, no accelerate
    hook, not PEFT-wrapped, quantized, reparametrized or a subclass), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_module" or node.kwargs:
        return None
    child = children.get(node.target)
    if type(child) is not nn.Linear or calls[node.target] != 1 or len(node.args) != 1:
        return None
    if not isinstance(node.args[0], fx.Node) or "_hf_hook" in child.__dict__:
        return None
    if hook_problem(child, "Linear", CALL_HOOK_KINDS) or linear_skip(child):
        return None
    return node.target


def _whole_mlp(
    act: fx.Node, up: fx.Node, mul: fx.Node, down: fx.Node, children: dict, calls: Counter
) -> tuple[str, str, str] | None:
    """(gate, up, down) when ``down(act(gate(x)) * up(x))`` is exactly the MLP's data flow on
    three plain Linears, else None."""
    gate = act.args[0]
    names = [_plain_linear_call(n, children, calls) for n in (gate, up, down)]
    if None in names or down.args != (mul,):
        return None
    if gate.args[0] is not up.args[0]:  # both Linears read the same x
        return None
    if len(gate.users) != 1 or len(up.users) != 1 or len(mul.users) != 1:
        return None
    return tuple(names)  # type: ignore[return-value]


def _functional_kind(node: fx.Node, form: str) -> tuple[str | None, bool, str | None]:
    """``(kind, inplace, None)`` for F.silu / F.gelu with constant arguments, else
    ``(None, False, why)``."""
    names = ("input", "inplace") if form == "F.silu" else ("input", "approximate")
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    if set(bound) - set(names):
        return None, False, f"{form} with arguments {sorted(set(bound) - set(names))}"
    if form == "F.silu":
        inplace = bound.get("inplace", False)
        if not isinstance(inplace, bool):
            return None, False, "F.silu with an inplace that is not a constant"
        return "silu", inplace, None
    approximate = bound.get("approximate", "none")
    if approximate not in GELU_ACTIVATION:
        return None, False, f"F.gelu with approximate={approximate!r}"
    return GELU_ACTIVATION[approximate], False, None


def _child_kind(
    node: fx.Node, children: dict, calls: Counter
) -> tuple[str | None, bool, str | None]:
    if node.kwargs or len(node.args) != 1:
        return None, False, "the activation is called with more than its input"
    if calls[node.target] != 1:
        return None, False, "the activation is called more than once in the forward"
    child = children[node.target]
    if "_hf_hook" in child.__dict__:
        return None, False, "the activation has an accelerate hook"
    kind, why = fusable_activation(child, GATED_KINDS)  # its hooks, then what it computes
    return kind, bool(getattr(child, "inplace", False)), why


def find_gated_mlps(block: nn.Module, graph: fx.Graph) -> tuple[list[Found], list[tuple[str, str]]]:
    """The gated products in ``graph`` (each with the nodes the rewrite needs), and
    (activation, reason) for those that cannot be fused."""
    children = dict(block.named_children())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    found: list[Found] = []
    skipped: list[tuple[str, str]] = []
    for mul in list(graph.nodes):
        if mul.op != "call_function" or mul.target not in _MULS or mul.kwargs:
            continue
        if len(mul.args) != 2:
            continue
        act_first = _act_form(mul.args[0], children) is not None
        act, up = mul.args if act_first else mul.args[::-1]
        form = _act_form(act, children)
        if form is None or not isinstance(up, fx.Node) or up is act:
            continue
        down = _down_after(mul, children)
        if down is None:
            continue  # not an MLP's product
        name = act.target if form == "child" else form
        gate = act.args[0] if act.args else None
        if not isinstance(gate, fx.Node):
            skipped.append((name, "the activation's input is not a tensor of the graph"))
            continue
        if len(act.users) != 1:
            skipped.append((name, "the activation's output has another user"))
            continue
        if form == "child":
            kind, inplace, why = _child_kind(act, children, calls)
        else:
            kind, inplace, why = _functional_kind(act, form)
        if why is None and inplace and len(gate.users) > 1:
            why = "the activation is in place and its input has another user"
        if why is not None:
            skipped.append((name, why))
            continue
        shown = type(children[name]).__name__ if form == "child" else form
        native = f"{shown} * up + {type(children[down.target]).__name__}"
        linears = _whole_mlp(act, up, mul, down, children, calls)
        match = GatedMLPMatch(name, form, kind, down.target, native, linears)
        nodes = {"mul": mul, "act": act, "act_first": act_first, "up": up, "down": down}
        found.append(Found(match, nodes))
    return found, skipped


def rewrite_gated_mlps(graph: fx.Graph, found: list[Found]) -> None:
    """Replace each found ``act(g) * u`` by one call of :func:`gated_act_block`."""
    for match, nodes in found:
        mul, act = nodes["mul"], nodes["act"]
        gate = act.args[0]
        up = mul.args[1] if nodes["act_first"] else mul.args[0]
        if match.linears is not None:
            _rewrite_whole(graph, match, nodes, gate, up)
            continue
        with graph.inserting_before(mul):
            act_ref: Any = graph.get_attr(match.act) if match.form == "child" else match.form
            fused = graph.call_function(
                gated_act_block, (gate, up, act_ref, match.activation, nodes["act_first"])
            )
        mul.replace_all_uses_with(fused)
        graph.erase_node(mul)
        graph.erase_node(act)
    graph.lint()


def _rewrite_whole(graph: fx.Graph, match: GatedMLPMatch, nodes: dict, gate, up) -> None:
    """``down(act(gate(x)) * up(x))`` -> one call of :func:`gated_mlp_block`."""
    down, mul, act = nodes["down"], nodes["mul"], nodes["act"]
    x = gate.args[0]
    with graph.inserting_before(down):
        refs = [graph.get_attr(name) for name in match.linears]
        act_ref: Any = graph.get_attr(match.act) if match.form == "child" else match.form
        fused = graph.call_function(
            gated_mlp_block, (x, *refs, act_ref, match.activation, nodes["act_first"])
        )
    down.replace_all_uses_with(fused)
    for node in (down, mul, act, gate, up):
        graph.erase_node(node)


# ------------------------------------------------------------------ at call time


def _why_native(gate: Any, up: Any) -> str | None:
    """Why this call computes the native expression instead of the fused op (None: fused). The
    activation child itself (replaced, hooked, changed) is the block's guard's business."""
    for t in (gate, up):
        if type(t) is not torch.Tensor and not (
            isinstance(t, torch.Tensor) and torch.compiler.is_compiling()
        ):
            return "an operand is not a plain tensor"
    if gate.shape != up.shape:
        return f"act(gate) * up broadcasts ({list(gate.shape)} * {list(up.shape)})"
    if gate.dtype != up.dtype:
        return f"gate and up differ in dtype ({gate.dtype}, {up.dtype})"
    if gate.dtype not in SUPPORTED_DTYPES:
        return f"the operands are {gate.dtype}, not float32/float64/float16/bfloat16"
    if gate.device != up.device:
        return "gate and up are on different devices"
    return None


_Tensor = torch.Tensor


def _plain_pair(gate: Any, up: Any) -> bool:
    """The common call's cheap test (every MLP of every layer on every step): two plain tensors
    of one shape, dtype and device, in a dtype the op takes (_why_native says why not)."""
    return (
        type(gate) is _Tensor
        and type(up) is _Tensor
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in SUPPORTED_DTYPES
        and gate.device == up.device
    )


def gated_act_block(
    gate: torch.Tensor,
    up: torch.Tensor,
    act: nn.Module | str,
    activation: str,
    act_first: bool,
) -> torch.Tensor:
    """``act(gate) * up`` by fastlayers' gated_act op (``activation`` 'silu', 'gelu',
    'gelu_tanh' or 'relu'); ``act`` is the block's activation child or the functional form's
    name. Where the op does not apply (a tensor subclass, broadcasting, mixed dtypes: warned
    once per reason) the original expression, in the forward's operand order."""
    if _plain_pair(gate, up):  # the common call, decided by the cheap test first
        return gated_act_forward(gate, up, activation)
    why = _why_native(gate, up)
    if why is None:
        return gated_act_forward(gate, up, activation)
    warn_once(f"a rewritten block computes a gated MLP's product natively: {why}")
    if not isinstance(act, str):
        a = act(gate)
    elif act == "F.silu":
        a = F.silu(gate)
    else:
        a = F.gelu(gate, approximate=GELU_APPROXIMATE[activation])
    return a * up if act_first else up * a


def gated_mlp_block(
    x: torch.Tensor,
    gate: nn.Linear,
    up: nn.Linear,
    down: nn.Linear,
    act: nn.Module | str,
    activation: str,
    act_first: bool,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with the three Linears' F.linear called here (their
    Parameters read from ``_parameters``: no module calls on the host) and act * up by
    :func:`gated_act_block`; in eval mode, in a call that records no gradient, up's GEMM and the
    product by gated_act_linear (the product in the GEMM's epilogue where it runs: see
    fastlayers.config.gated_mlp_epilogue); in a call that records gradients, act * up and down's
    GEMM by gated_act_down (:func:`_down_of_product`: the product recomputed in backward, not
    kept). Under autocast x is converted once for gate and up
    (fastlayers.ops.shared_cast: native's values and gradients, one kept copy). The children
    are the very ones the patch took, or of their class with no hooks (the block's guard says
    so first): F.linear is what their forward computes."""
    pg, pu, pd = gate._parameters, up._parameters, down._parameters
    # gate(x) and up(x) are never named: they are freed as soon as act * up is computed, before
    # the down projection runs (as in the native forward), so the step's peak memory does not
    # hold them beside its output
    if _epilogue_takes(x, up, pg, pu):
        return F.linear(
            gated_act_linear_forward(
                F.linear(x, pg["weight"], pg["bias"]), x, pu["weight"], activation
            ),
            pd["weight"],
            pd["bias"],
        )
    # under autocast x (float32) converted once for both projections, each taking it where it
    # would convert it (argument order: gate's use and GEMM, then up's), as native's nodes are
    xc = autocast_conversion(x)
    if _records_grad(x, pg, pu, pd):
        # a recorded step keeps gate(x) and up(x) for act * up's backward anyway: the down
        # projection's node recomputes the product from them instead of keeping it too
        return _down_of_product(
            F.linear(x if xc is None else converted_use(x, xc), pg["weight"], pg["bias"]),
            F.linear(x if xc is None else converted_use(x, xc), pu["weight"], pu["bias"]),
            pd,
            act,
            activation,
            act_first,
        )
    product = gated_act_block(
        F.linear(x if xc is None else converted_use(x, xc), pg["weight"], pg["bias"]),
        F.linear(x if xc is None else converted_use(x, xc), pu["weight"], pu["bias"]),
        act,
        activation,
        act_first,
    )
    # the converted copy freed before the down projection, as autocast's own copies are (where
    # no gradient is recorded; otherwise the projections' backward holds it)
    del xc
    return F.linear(product, pd["weight"], pd["bias"])


_PLAIN = (nn.Parameter, torch.Tensor)


def _records_grad(x: Any, *params: dict) -> bool:
    """Whether the MLP's call records gradients: grad mode on and its input or a Parameter
    requiring grad. (Otherwise gate(x) and up(x) are freed before the down projection.)"""
    if not torch.is_grad_enabled():
        return False
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return True
    return any(p is not None and p.requires_grad for ps in params for p in ps.values())


def _down_of_product(
    gate: torch.Tensor,
    up: torch.Tensor,
    pd: dict,
    act: nn.Module | str,
    activation: str,
    act_first: bool,
) -> torch.Tensor:
    """``down(act(gate) * up)`` by gated_act_down (one node, saving gate, up and the weight, the
    product recomputed in backward: the same values and gradients) where its operands are plain
    tensors of one shape, dtype and device and down's Parameters plain tensors (a DTensor or a
    quantized weight has no rule for the op); else act * up by :func:`gated_act_block` and
    down's F.linear, as before."""
    w, b = pd["weight"], pd["bias"]
    if _plain_pair(gate, up) and type(w) in _PLAIN and (b is None or type(b) in _PLAIN):
        return gated_act_down_forward(gate, up, w, b, activation)
    return F.linear(gated_act_block(gate, up, act, activation, act_first), w, b)


def _epilogue_takes(x: Any, up: nn.Linear, pg: dict, pu: dict) -> bool:
    """Whether up's GEMM and the product go to gated_act_linear: selected; up in eval mode (in
    training mode the forward may run under no_grad only to be recomputed with gradients, as
    reentrant activation checkpointing does: both runs must compute the same up); up without a
    bias; no gradient recorded; no autocast (F.linear would cast); x and both weights plain
    tensors (a subclass such as DTensor or a quantized weight has no rule for the op) of up's
    dtype. Which kernel runs is the op's choice (cuBLAS + gated_act where the epilogue does not
    pay)."""
    w, wg = pu["weight"], pg["weight"]
    if config.gated_mlp_epilogue != "fused" or up.training or pu["bias"] is not None:
        return False
    if type(x) is not _Tensor or type(w) not in _PLAIN or type(wg) not in _PLAIN:
        return False
    if x.dtype != w.dtype:
        return False
    if torch.is_grad_enabled():
        gb = pg["bias"]
        if x.requires_grad or w.requires_grad or wg.requires_grad:
            return False
        if gb is not None and gb.requires_grad:
            return False
    return not torch.is_autocast_enabled(x.device.type)


GATED_MLP = BlockRule(RULE, wants_gated_mlp, find_gated_mlps, rewrite_gated_mlps)
