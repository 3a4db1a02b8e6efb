"""Rule 'linear_cross_entropy': a causal LM's head and loss as one chunked op
(fastlayers.functional.linear_cross_entropy) in training mode with labels, so the logits never
exist; runtime/fused_loss.py runs it per call, records.FusedLossRecord puts it on the model.

What the rule proves, on the source of the model's class forward (transformers' causal LM
forwards cannot be traced by torch.fx: the cache, the output classes): the output embeddings
(``get_output_embeddings()``, an nn.Linear child) are called once, into a name (``logits``),
optionally ``.contiguous()``; that name is only soft-capped in place with
``config.final_logit_softcapping`` (Gemma: divide, tanh, multiply), passed to
``self.loss_function(logits, labels, vocab_size, **kwargs)`` and put in the output; ``labels`` is
read nowhere else than in that call and its ``labels is not None`` test. So the forward run with
``labels=None`` computes the same outputs but the loss, and the loss is the head's input through
the fused op. A forward that uses the labels or the logits otherwise (an auxiliary loss, a
metric) is refused with that reason."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ..report import Swap
from ..trace import inner_forward
from .base import HeadLossRule

NAME = "linear_cross_entropy"


@dataclass(frozen=True)
class LossMatch:
    """A causal LM forward whose head and loss the fused op may compute: the head's attribute
    and whether the forward soft-caps the logits."""

    rule: ClassVar[str] = NAME
    fused_op: ClassVar[str] = "linear_cross_entropy"
    head: str
    softcap: bool

    def row(self, name: str, model: nn.Module) -> Swap:
        what = "head + loss chunked, logits not materialised in training with labels"
        if self.softcap:
            what += " (final logit soft-capping)"
        return Swap(name or "(root)", f"{type(model).__name__}.forward", what, NAME)


def find(model: nn.Module) -> tuple[LossMatch | None, str | None]:
    """(the match, None); (None, why) for a causal LM refused; (None, None) for a model that is
    not one (no loss_function call on an output embedding)."""
    get_head = getattr(model, "get_output_embeddings", None)
    if not callable(get_head) or not callable(getattr(type(model), "forward", None)):
        return None, None
    try:
        head = get_head()
    except Exception:  # a model whose lookup fails has no head to fuse
        return None, None
    attr = next((n for n, c in model.named_children() if c is head), None) if head else None
    if attr is None:
        return None, None
    try:
        source = textwrap.dedent(inspect.getsource(inner_forward(type(model))))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None, None
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None, None
    loss_calls = [n for n in ast.walk(function) if _is_self_call(n, "loss_function")]
    head_calls = [n for n in ast.walk(function) if _is_self_call(n, attr)]
    if not loss_calls or not head_calls:
        return None, None
    why = _refusal(function, attr, loss_calls, head_calls)
    if why is not None:
        return None, why
    if type(head) is not nn.Linear:
        return None, f"its head {attr!r} is a {type(head).__name__}, not an nn.Linear"
    softcap = any(
        isinstance(n, ast.Attribute) and n.attr == "final_logit_softcapping"
        for n in ast.walk(function)
    )
    return LossMatch(attr, softcap), None


def _is_self_call(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _refusal(
    function: ast.AST, attr: str, loss_calls: list[ast.Call], head_calls: list[ast.Call]
) -> str | None:
    if len(loss_calls) != 1 or len(head_calls) != 1:
        return "its forward calls the head or the loss more than once"
    loss_call, head_call = loss_calls[0], head_calls[0]
    # the head's result: `logits = self.<head>(...)` or `... .contiguous()`
    logits = None
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            value = node.value
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "contiguous"
                and not value.args
            ):
                value = value.func.value
            if value is head_call and isinstance(node.targets[0], ast.Name):
                logits = node.targets[0].id
    if logits is None:
        return f"its forward does not assign self.{attr}(...) to a name"
    # the loss call: (logits, labels, vocab_size, **kwargs), by position or by keyword
    names = ("logits", "labels", "vocab_size")
    given = dict(zip(names, loss_call.args, strict=False))
    if len(loss_call.args) > 3:
        return "its loss call passes more than logits, labels and vocab_size by position"
    spread = [k for k in loss_call.keywords if k.arg is None]
    for k in loss_call.keywords:
        if k.arg is not None:
            if k.arg not in names or k.arg in given:
                return f"its loss call passes {k.arg!r}"
            given[k.arg] = k.value
    if set(given) != set(names) or len(spread) > 1:
        return "its loss call is not loss_function(logits, labels, vocab_size, **kwargs)"
    if not (isinstance(given["logits"], ast.Name) and given["logits"].id == logits):
        return "its loss call is not given the head's logits"
    if not (isinstance(given["labels"], ast.Name) and given["labels"].id == "labels"):
        return "its loss call is not given `labels`"
    if spread and not isinstance(spread[0].value, ast.Name):
        return "its loss call spreads other keyword arguments than the forward's own"
    allowed = {id(given["labels"]), id(given["logits"])}
    guard, loss = _loss_statement(function, loss_call)
    if loss is None:
        return (
            "its loss call is not `loss = self.loss_function(...)` under `if labels is not None:`"
        )
    if guard is not None:
        allowed.add(id(guard.test.left))  # type: ignore[attr-defined]
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == "labels" and id(node) not in allowed:
            return "its forward reads `labels` besides the loss (an auxiliary loss or metric)"
    why = _loss_name_refusal(function, loss, loss_call)
    if why is not None:
        return why
    return _logits_refusal(function, logits, allowed)


def _loss_statement(function: ast.AST, loss_call: ast.Call) -> tuple[ast.If | None, str | None]:
    """The ``if labels is not None:`` holding only ``<name> = <loss call>`` (or None where the
    assignment stands alone) and that name; (None, None) where the call is not so placed."""
    for node in ast.walk(function):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for statement in body:
            if not (
                isinstance(statement, ast.Assign)
                and statement.value is loss_call
                and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)
            ):
                continue
            name = statement.targets[0].id
            if isinstance(node, ast.If) and len(node.body) == 1 and not node.orelse:
                test = node.test
                if (
                    isinstance(test, ast.Compare)
                    and _is_name(test.left, "labels")
                    and len(test.ops) == 1
                    and isinstance(test.ops[0], ast.IsNot)
                    and isinstance(test.comparators[0], ast.Constant)
                    and test.comparators[0].value is None
                ):
                    return node, name
            return None, None
    return None, None


def _loss_name_refusal(function: ast.AST, loss: str, loss_call: ast.Call) -> str | None:
    """The loss's name is set to None, to the loss call, and read only into the output."""
    allowed: set[int] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _names(node.targets) == {loss}:
            if node.value is loss_call or (
                isinstance(node.value, ast.Constant) and node.value.value is None
            ):
                allowed.update(id(t) for t in node.targets)
        if isinstance(node, ast.keyword) and node.arg == "loss" and _is_name(node.value, loss):
            allowed.add(id(node.value))
        if isinstance(node, ast.Tuple) and node.elts and _is_name(node.elts[0], loss):
            allowed.add(id(node.elts[0]))
        if isinstance(node, ast.Compare) and _is_name(node.left, loss):
            allowed.add(id(node.left))  # `(loss,) + output if loss is not None else output`
    for node in ast.walk(function):
        if _is_name(node, loss) and id(node) not in allowed:
            return f"its forward changes or reads `{loss}` after the loss call (an auxiliary loss)"
    return None


def _logits_refusal(function: ast.AST, logits: str, allowed: set[int]) -> str | None:
    """Past the head, the logits are only soft-capped (``config.final_logit_softcapping``)
    and put in the output (a call's keyword ``logits=``, or a tuple's first element)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _names(node.targets) == {logits}:
            if _is_softcap_step(node.value, logits):
                allowed.update(id(n) for n in ast.walk(node.value) if _is_name(n, logits))
        if isinstance(node, ast.keyword) and node.arg == "logits" and _is_name(node.value, logits):
            allowed.add(id(node.value))
        if isinstance(node, ast.Tuple) and node.elts and _is_name(node.elts[0], logits):
            allowed.add(id(node.elts[0]))  # `output = (logits,) + outputs[1:]`
    for node in ast.walk(function):
        if _is_name(node, logits) and isinstance(node.ctx, ast.Load) and id(node) not in allowed:
            return f"its forward reads `{logits}` otherwise than for the loss and the output"
    return None


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _names(targets: list[ast.expr]) -> set[str]:
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _is_softcap_step(value: ast.AST, logits: str) -> bool:
    """``logits / <..>.final_logit_softcapping``, ``torch.tanh(logits)``, ``logits * <..>``."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Div, ast.Mult)):
        other = value.right
        return (
            _is_name(value.left, logits)
            and isinstance(other, ast.Attribute)
            and other.attr == "final_logit_softcapping"
        )
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "tanh"
        and len(value.args) == 1
        and _is_name(value.args[0], logits)
    )


LINEAR_CROSS_ENTROPY = HeadLossRule(NAME, find)
