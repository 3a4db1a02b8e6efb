"""Rule 'varlen_attention' (on by default): an attention whose class forward looks its
attention function up in transformers' registry (``ALL_ATTENTION_FUNCTIONS``) or calls its
module's ``eager_attention_forward`` runs, for that instance only, with both routed
(patching/routes.py) to runtime.varlen.varlen_dispatch: the very function the model picks, on
CUDA with cuDNN's attention kept off a shape until that shape has been seen often enough for
cuDNN's execution plan build to pay (runtime.varlen.cudnn_plan_pays: a new shape never pays a
plan build), and in a packed call (padding-free execution, ``patch(unpad=True)``) each token
attending to its own sequence's tokens only. No probe is needed for a padded call (the routed
function calls the model's own; the attention backend is torch's to choose within the check's
bounds); the packed calls are checked against the padded model on a model's first padding-free
call (runtime/unpad.py). One report row per attention block."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from ..forms import code_facts
from ..report import Swap
from ..runtime.varlen import varlen_dispatch
from ..trace import inner_forward
from .base import RouteRule

RULE = "varlen_attention"
REGISTRY = "ALL_ATTENTION_FUNCTIONS"
EAGER = "eager_attention_forward"


class _Registry:
    """transformers' attention registry as a routed forward sees it: every function it hands out
    is the varlen dispatch around it."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def get_interface(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return varlen_dispatch(self._registry.get_interface(name, default))

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return varlen_dispatch(self._registry[name])

    def get(self, name: str, default: Any = None) -> Any:
        fn = self._registry.get(name, default)
        return varlen_dispatch(fn) if callable(fn) else fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


@dataclass(frozen=True)
class VarlenMatch:
    """A global (the registry, or the eager function) the attention's forward reads."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "attention: no cuDNN plan per new shape; varlen when packed"
    inductor_fuses: ClassVar[bool] = False
    # a compiled call is never packed (padding-free refuses under torch.compile) and keeps
    # torch's attention backend: the route changes nothing there
    native_when_compiled: ClassVar[bool] = True

    name: str

    def claims(self) -> set[str]:
        return set()

    def live_attributes(self) -> dict[str, frozenset[str]]:
        return {}

    def row(self, block_name: str) -> Swap:
        # the block's row, whichever of its globals: both matches of a block give one row
        return Swap(block_name, "attention function", self.fused_op, RULE)

    def routed(self, original: Any) -> Any:
        if self.name == REGISTRY:
            return _Registry(original)
        return varlen_dispatch(original)


def _reads(block: nn.Module) -> list[str]:
    fn = inner_forward(type(block))
    if not isinstance(fn, types.FunctionType):
        return []
    names = code_facts(fn).globals
    return [n for n in (REGISTRY, EAGER) if n in names and fn.__globals__.get(n) is not None]


def wants_varlen(block: nn.Module) -> bool:
    """Pre-filter: the class forward reads the attention registry or an eager attention."""
    return bool(_reads(block))


def find_varlen(block: nn.Module) -> tuple[list[VarlenMatch], list[tuple[str, str]]]:
    fn = inner_forward(type(block))
    found = _reads(block)
    if REGISTRY in found and not hasattr(fn.__globals__[REGISTRY], "get_interface"):
        return [], [(REGISTRY, "not transformers' attention registry")]
    return [VarlenMatch(name) for name in found], []


VARLEN_ATTENTION = RouteRule(name=RULE, wants=wants_varlen, find=find_varlen)
