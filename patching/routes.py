"""Routes: one module instance's forward run with some of the module-level functions it calls
routed to fused ops (rules of kind RouteRule: 'rotary'). For forwards torch.fx cannot trace
(attention: a cache object, the attention-function lookup, shape arithmetic), where a block
rewrite (blocks.py) cannot go.

The routed forward is the class's own forward function, the very code object, made with a globals
dict of its own: a copy of its module's globals in which each routed name holds the fused
function. Nothing in the model's module changes (another model, or this model's class elsewhere,
calls the originals), and the code reads its children, attributes and arguments live on every
call, as the original does. Decorators on the class forward are rebuilt around it (trace.rewrap),
so they keep running.

A copy of globals goes stale when the module changes after the patch, so one generated test per
call checks, by identity, that the class forward is the one copied, and that every global the
forward reads, and every global the routed functions' recognition read (``rotate_half``), is
still the object it was; the routed names must still hold the recognised originals. A change
builds the route again (the functions recognised again: a wrapper a library or the user puts in
the module afterwards is not the model's code, so it is left to run, not bypassed); where nothing
is left to route, the original forward runs, with a warning once (where some is, the rest stays
routed, with a warning naming what no longer is), and the test keeps watching what the patch
routed, so putting the original (or its dependency) back routes again. Under
torch.compile a route whose matches Inductor fuses itself runs the original forward
(fastlayers.config.compile_rotary), as does a route of varlen_attention's alone in a compiled
call, or in a call not on CUDA and not packed (it would change nothing there but add the guard's
host time). Such calls skip the test, so for a block the patch routed for varlen_attention alone
they neither warn that what it calls changed nor route a rotary function put back after the
patch: the first CUDA or packed call does both (the calls before run the class forward as it is
then, as an unpatched model would).

The record is the block rewrite's (records.BlockRewrite): ``RoutedForward`` is a rewritten
forward as fused.rewritten_forward recognises one (``is_fastlayers_rewrite``, ``matches``), so
unpatch, the report, the check and natives_restored treat it as they treat a block rewrite."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fastlayers import config

from .blocks import is_class_forward
from .fallback import warn_once
from .forms import code_facts, global_reads, join
from .fused import forward_attr, forward_signature, rewritten_forward
from .rules import ROUTE_RULES
from .runtime.varlen import is_packed
from .trace import Unwrappable, inner_forward, rewrap

_ABSENT = object()

# How many times one block's route is built again after changes (then: its original forward).
MAX_BUILDS = 16


class _Route:
    """The routed forward for the block as it is now, and the test that it still is."""

    __slots__ = ("chain", "holds")

    def __init__(self, chain: Callable[..., Any] | None, holds: Callable[[nn.Module], bool]):
        self.chain, self.holds = chain, holds


def _test(cls_forward: Any, watched: list[tuple[dict, str, Any]]) -> Callable[[nn.Module], bool]:
    """One function: ``type(block).forward is cls_forward`` and each watched global is the same
    object (identity; an absent name still absent)."""
    env: dict[str, Any] = {"_F": cls_forward, "_A": _ABSENT}
    terms = ["type(block).forward is _F"]
    for i, (namespace, name, value) in enumerate(watched):
        env[f"_g{i}"], env[f"_n{i}"], env[f"_v{i}"] = namespace, name, value
        terms.append(f"_g{i}.get(_n{i}, _A) is _v{i}")
    source = "def holds(block):\n    return " + " and ".join(terms) + "\n"
    exec(compile(source, "<fastlayers route guard>", "exec"), env)
    return env["holds"]


def _watched(block: nn.Module, routed_names: Iterable[str]) -> list[tuple[dict, str, Any]]:
    """(globals, name, value now) of every global the class forward reads and of every global
    the functions under ``routed_names`` read (what their recognition depends on)."""
    inner = inner_forward(type(block))
    namespace = inner.__globals__
    pairs = [(namespace, name) for name in code_facts(inner).globals]
    for name in routed_names:
        original = namespace.get(name)
        if isinstance(original, types.FunctionType):
            pairs += global_reads(original)
    seen: set[tuple[int, str]] = set()
    out = []
    for g, name in pairs:
        if (id(g), name) not in seen:
            seen.add((id(g), name))
            out.append((g, name, g.get(name, _ABSENT)))
    return out


def build_route(block: nn.Module, matches: Iterable[Any], watch: Iterable[str] = ()) -> _Route:
    """The class forward of ``block`` with each match's global routed (``match.routed``), and
    its test, which also watches what the functions under the names ``watch`` read; without
    matches, a route running the original forward whose test watches the same globals (the
    original function, or a dependency, put back routes again). Raises Unwrappable where the
    decorators cannot be rebuilt."""
    matches = list(matches)
    cls_forward = type(block).forward
    names = dict.fromkeys([m.name for m in matches] + list(watch))
    holds = _test(cls_forward, _watched(block, names))
    if not matches:
        return _Route(None, holds)
    inner = inner_forward(type(block))
    namespace = inner.__globals__
    routed = {m.name: m.routed(namespace.get(m.name)) for m in matches}
    own = _module_copy(namespace, routed)
    copy = types.FunctionType(
        inner.__code__, own, inner.__name__, inner.__defaults__, inner.__closure__
    )
    copy.__kwdefaults__ = inner.__kwdefaults__
    copy.__dict__.update(inner.__dict__)
    copy.__qualname__ = inner.__qualname__
    return _Route(rewrap(cls_forward, copy), holds)


def _module_copy(namespace: dict, routed: dict[str, Any]) -> dict:
    """The globals of a routed forward: a copy of ``namespace`` with ``routed`` in it, as the dict
    of a module registered in sys.modules under a name of its own. torch.compile looks a frame's
    globals up by their ``__name__``: under the original module's name it would read (and guard
    on) the module's function where this copy calls the routed one."""
    base = str(namespace.get("__name__", "module"))
    name = f"{base}.__fastlayers_route_{'_'.join(sorted(routed))}__"
    module = types.ModuleType(name)
    module.__dict__.update(namespace)
    module.__dict__.update(routed)
    module.__dict__["__name__"] = name
    sys.modules[name] = module  # the latest build's; earlier ones stay referenced by their code
    return module.__dict__


class RoutedForward:
    """The forward of a routed block, set on the instance. Holds the block, its matches (the
    report's rows) and the enabled route rules, so it deep-copies and pickles with the model; the
    routed function is built on first use."""

    is_fastlayers_rewrite = True  # what fused.rewritten_forward looks for

    def __init__(self, block: nn.Module, matches: list, rules: Iterable[str]) -> None:
        self.block = block
        self.matches = list(matches)
        self.rules = tuple(rules)
        self._route: _Route | None = None
        self._builds = 0
        # read on every compiled call: plain bools for dynamo to guard on
        self._inductor_fuses = any(m.inductor_fuses for m in self.matches)
        # matches that change nothing in a compiled call (varlen_attention's): the original
        # forward is traced, without the route's guards
        self._native_when_compiled = all(
            getattr(m, "native_when_compiled", False) for m in self.matches
        )

    def __getstate__(self) -> dict:
        return {"block": self.block, "matches": self.matches, "rules": self.rules}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["block"], state["matches"], state["rules"])

    @property
    def __code__(self) -> types.CodeType:
        return inner_forward(type(self.block)).__code__

    @property
    def __signature__(self) -> inspect.Signature | None:
        return forward_signature(self.block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if torch.compiler.is_compiling():
            if self._native_when_compiled or (
                self._inductor_fuses and config.compile_rotary == "inductor"
            ):
                return type(block).forward(block, *args, **kwargs)
        elif self._native_when_compiled and _native_call(args, kwargs):
            return type(block).forward(block, *args, **kwargs)
        route = self._route
        if route is None or not route.holds(block):
            route = self._rebuild()
        if route.chain is None:
            return type(block).forward(block, *args, **kwargs)
        return route.chain(block, *args, **kwargs)

    def _rebuild(self) -> _Route:
        """The route for the block as it is now (first use after a copy or unpickling, or after a
        change)."""
        first = self._route is None
        self._builds += 1
        block = self.block
        if self._builds > MAX_BUILDS:
            why = f"changed more than {MAX_BUILDS} times since the patch"
            matches = []
        else:  # recognised again (cached per function while what it reads stays)
            matches, skips = _find(block, _wanting(block, self.rules))
            why = "; ".join(why for _, _, why in skips)
        watch = [m.name for m in self.matches]  # the patch's: watched while they fall back
        try:
            route = build_route(block, matches, watch)
        except Unwrappable as err:
            why = f"cannot rebuild its forward's decorators ({err})"
            route = build_route(block, [], watch)
        lost = [n for n in dict.fromkeys(watch) if n not in {m.name for m in matches}]
        if route.chain is None and not first:
            warn_once(
                f"a routed {type(block).__name__} runs its original forward: what it calls "
                f"changed since the patch ({why or 'nothing left to route'})",
                4,
            )
        elif lost and not first:  # the rest stays routed (another rule's match)
            warn_once(
                f"a routed {type(block).__name__} calls {', '.join(lost)} as the model's "
                f"module now holds it: what it calls changed since the patch "
                f"({why or 'no longer the function the patch recognised'})",
                4,
            )
        self._route = route
        return route


def _native_call(args: tuple, kwargs: dict) -> bool:
    """Whether a call of a block whose every match is varlen_attention's changes nothing when
    routed: its hidden states are not on CUDA (no cuDNN to keep off a shape) and it is not a
    padding-free packed call. The original forward runs, without the route's host cost."""
    if is_packed(kwargs):
        return False
    first = args[0] if args else kwargs.get("hidden_states")
    return isinstance(first, torch.Tensor) and not first.is_cuda


def _wanting(block: nn.Module, rules: Iterable[str]) -> list:
    """The enabled route rules whose cheap test ``block`` passes."""
    return [r for r in ROUTE_RULES if r.name in rules and r.wants(block)]


def _find(block: nn.Module, rules: list) -> tuple[list, list[tuple[str, str, str]]]:
    """Every match of ``rules`` (route rules) in ``block``, and (where, rule, reason) skips."""
    matches, skips = [], []
    for rule in rules:
        found, skipped = rule.find(block)
        matches += found
        skips += [(where, rule.name, why) for where, why in skipped]
    return matches, skips


def plan_route(
    block: nn.Module, name: str, rules: Iterable[str]
) -> tuple[RoutedForward | None, list[tuple[str, str, str]]]:
    """The routed forward of ``block`` for the enabled route ``rules``, or None, and (module
    name, rule, reason) skips. Changes nothing: records.BlockRewrite puts it on the block."""
    if rewritten_forward(block) is not None:
        return None, []  # patched already, or rewritten by a block rule
    wanting = _wanting(block, rules)
    if not wanting:
        return None, []
    attr = forward_attr(block)
    own = block.__dict__.get(attr)
    if own is not None and not is_class_forward(block, own):
        why = "its forward was replaced on the instance"
        return None, [(name, r.name, why) for r in wanting]
    matches, found_skips = _find(block, wanting)
    skips = [(join(name, where), rule, why) for where, rule, why in found_skips]
    if not matches:
        return None, skips
    forward = RoutedForward(block, matches, [r.name for r in wanting])
    try:
        forward._route = build_route(block, matches)
        forward._builds = 1
    except Unwrappable as err:
        why = f"cannot rebuild its forward's decorators ({err})"
        return None, skips + [(name, r.name, why) for r in wanting]
    return forward, skips
