"""The kinds of rule the patcher knows, as types: a rule declares what it matches and what record
it makes; rules/__init__.py holds the one registry of them.

- :class:`ModuleRule`: one native module type, swapped one for one (record: records.ChildSwap).
- :class:`PairRule`: a Linear and the activation module that alone consumes its output, fused
  into one layer (record: records.LinearActSwap, with a FusedAway where the activation was).
- :class:`BlockRule`: a pattern in a block's own traced forward, replaced by a call of a fused
  op (record: records.BlockRewrite, one per block, holding every block rule's matches); its
  matches follow the :class:`Match` protocol.
- :class:`RouteRule`: a module-level function a block's forward calls (transformers'
  ``apply_rotary_pos_emb``), proven to compute what a fused op computes; the block's forward
  runs with that one global routed to the fused op (record: records.BlockRewrite around a
  routes.RoutedForward, for a forward that torch.fx cannot trace: attention with its cache and
  attention-function lookups). Its matches follow :class:`Match` and say what to route."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize

from ..eligibility import reparametrized_problem
from ..fused import is_fused
from ..report import Swap


@dataclass(frozen=True)
class ModuleRule:
    """One native module type (matched exactly: subclasses may compute something else) swapped
    for a fused layer built around its own Parameters. Makes a records.ChildSwap."""

    name: str
    native: type[nn.Module]
    build: Callable[[nn.Module], nn.Module]
    fused: str  # how a user builds the fused layer directly, for messages
    # Class-name fragments of modules that look like this rule's target but are not it; they
    # are reported as skipped (e.g. T5's RMSNorm-style T5LayerNorm).
    lookalikes: tuple[str, ...]
    # Modules of other types the rule takes when they provably compute its function: module ->
    # (is a candidate, why it is refused or None). The models' own RMSNorms, for rms_norm.
    recognise: Callable[[nn.Module], tuple[bool, str | None]] | None = None
    # Where set: (parent, its children other rules took) -> the names of its children this
    # rule may take (the rest, and a model itself, are not looked at): the Linears an
    # attention's forward reads one tensor with.
    among: Callable[[nn.Module, set[str]], frozenset[str]] | None = None

    def takes(self, module: nn.Module) -> tuple[bool, str | None]:
        """``(True, None)``: this rule's target (the patcher still asks module_rule_skip);
        ``(True, why)``: a target refused; ``(False, why)``: not a target, ``why`` the reason
        to report a look-alike as skipped, or None."""
        if type(module) is self.native and not is_fused(module):
            return True, None
        if self.recognise is not None and not is_fused(module):
            candidate, why = self.recognise(module)
            if candidate:
                return True, why
        return False, self.lookalike_reason(module)

    def lookalike_reason(self, module: nn.Module) -> str | None:
        """A reason to report ``module`` as skipped by this rule when it resembles the target."""
        if type(module) is self.native or is_fused(module):
            return None
        if isinstance(module, self.native) and parametrize.is_parametrized(module):
            return reparametrized_problem(module, ())
        if isinstance(module, self.native):
            return (
                f"a subclass of {self.native.__name__} ({type(module).__name__}), may compute "
                "otherwise"
            )
        if any(part in type(module).__name__ for part in self.lookalikes):
            return f"not a torch.nn.{self.native.__name__} (its own computation)"
        return None


@dataclass(frozen=True)
class PairRule:
    """A Linear (or Conv1D) and the activation module that alone consumes its output, fused
    into one layer; chosen by what the activation computes (recognise_activation's kinds).
    Makes a records.LinearActSwap."""

    name: str
    activations: tuple[str, ...]  # the kinds recognise_activation returns that this rule takes
    what: str  # the activation in words, for skip reasons
    build: Callable[[nn.Module, str], nn.Module]  # (linear, kind) -> the fused layer


class Match(Protocol):
    """One pattern a block rule found in a block's forward (frozen, picklable: a patched model's
    rewrite holds its matches)."""

    rule: ClassVar[str]  # its block rule's name
    fused_op: ClassVar[str]  # the fused op it calls, for the report
    # whether Inductor fuses the native form itself: such a block compiles its original forward
    # under torch.compile (fastlayers.config.compile_residual_layer_norm)
    inductor_fuses: ClassVar[bool]

    def claims(self) -> set[str]:
        """The block's children it takes over (no other rule swaps them)."""
        ...

    def live_attributes(self) -> dict[str, frozenset[str]]:
        """Claimed child -> the attributes its fused op reads on every call (a Dropout's
        ``p``, a LayerNorm's ``eps``): the block's guard leaves them out, so a schedule that
        changes them does not trace the block again."""
        ...

    def row(self, block_name: str) -> Swap:
        """The report's row for this match in the block called ``block_name``."""
        ...


class Found(NamedTuple):
    """A match in a traced graph, with the graph nodes its rewrite needs."""

    match: Match
    nodes: dict[str, Any]


@dataclass(frozen=True)
class BlockRule:
    """One block rule: a cheap test of whether a block may hold its pattern (so that the patcher
    does not trace every module of a big model), the finder that returns the matches in a
    traced graph and (local name, reason) skips, and the graph rewrite of those matches. One
    trace of a block serves every enabled block rule; blocks.py holds that machinery."""

    name: str
    wants: Callable[[nn.Module], bool]
    find: Callable[[nn.Module, fx.Graph], tuple[list[Found], list[tuple[str, str]]]]
    rewrite: Callable[[fx.Graph, list[Found]], None]


@dataclass(frozen=True)
class RouteRule:
    """Functions a block's forward calls by a global name, routed to fused ops for that block
    instance (patching/routes.py). ``wants``: a cheap test of the class forward; ``find``: the
    matches (each with ``name``, the global, and ``routed(original)``, the function called in
    its place) and (where, reason) skips."""

    name: str
    wants: Callable[[nn.Module], bool]
    find: Callable[[nn.Module], tuple[list[Any], list[tuple[str, str]]]]


@dataclass(frozen=True)
class HeadLossRule:
    """A model whose forward computes its head's output and a loss from it, both computed by one
    fused op where the output is not needed. ``find(model)``: (the match, None), (None, why)
    for a model refused, (None, None) for a model that is not a target."""

    name: str
    find: Callable[[nn.Module], tuple[Any, str | None]]
