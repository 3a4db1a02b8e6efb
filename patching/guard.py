"""What a block's trace depended on, and the one generated test, run on every call, that it still
holds. A rewritten block runs its traced code only while everything the trace read is as it was:

- the block's own attributes the forward read (trace.py records every name it looked up):
  Python values compared by value, other objects by identity, and names that were absent then
  (``getattr(self, "gain", 1.0)``, a class method the forward calls) still absent from the
  instance; the counts of its children, Parameters and buffers (one registered under a name
  the forward read with a default would change what it reads);
- the containers its code reached into (``for layer in self.layers``, ``self.blocks[0]``):
  each the same object holding the same elements, in the same number and key order;
- the child slots it read, still empty or still filled (``if self.adapter is not None``), and the
  block's class and its class's forward;
- the children its matches claimed (computed inside a fused op, so never called): the same
  object, of the same class with the same class forward (a parametrization changes the class in
  place), with no ``forward`` of its own, the same Python attribute values (what the rules read
  when they matched, e.g. a GELU's ``approximate``; not those the fused op reads on every call,
  ``Match.live_attributes``), the same Parameter names and dtypes.

A change in any of these traces the block again (a bounded number of times: blocks.py). Hooks on
the claimed children, an accelerate hook and global module hooks come and go (fastlayers.check's
probes, a debugger): the code's full test checks them too, and while one is there the call runs
the original forward instead of tracing again.

Non-claimed children are called by the traced code through ``nn.Module.__call__`` on the live
attribute, so whatever is there now (another module, hooks, a forward of its own) runs as it would
natively; they need no guard."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .eligibility import (
    GLOBAL_BACKWARD_HOOKS,
    GLOBAL_BACKWARD_PRE_HOOKS,
    GLOBAL_FORWARD_HOOKS,
    GLOBAL_FORWARD_PRE_HOOKS,
)

# nn.Module's own bookkeeping in an instance's __dict__ (hook dicts, _parameters, training, ...)
# and where a rewrite or accelerate put the forward: not values a forward reads as data
# (training is part of the call key; each child reads its own at call time).
# HuggingFace's initialisation flag is bookkeeping of the same kind.
MODULE_STATE = frozenset(nn.Module().__dict__) | {
    "forward",
    "_old_forward",
    "_hf_hook",
    "_is_hf_initialized",
}

# Compared by value (equal values of the same type are the same setting); anything else by
# identity.
VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)

_ABSENT = object()


def is_plain_value(value: Any) -> bool:
    """A Python value (VALUE_TYPES, or a tuple of them: LayerNorm's ``normalized_shape``),
    compared by value: under torch.compile a tuple read from an attribute is rebuilt, so an
    identity test would fail."""
    if type(value) is tuple:
        return all(is_plain_value(v) for v in value)
    return isinstance(value, VALUE_TYPES)


@dataclass(frozen=True)
class ModuleState:
    """A module as a rule read it: its object, class, ``forward`` of its own (None: the class's),
    Python attribute values (but the ``live`` ones, which its fused op reads on every call),
    Parameter names and the Parameters' dtypes (a fused op takes one dtype; fx cannot see a
    forward's own casts to a weight's dtype, e.g. T5's to ``wo.weight.dtype``)."""

    module: nn.Module
    cls: type
    forward: Any
    values: tuple[tuple[str, Any], ...]
    parameters: tuple[str, ...]
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()

    @classmethod
    def of(cls, module: nn.Module, live: frozenset[str] = frozenset()) -> ModuleState:
        d = module.__dict__
        values = tuple((k, v) for k, v in d.items() if k not in MODULE_STATE and k not in live)
        params = module._parameters
        dtypes = tuple((k, p.dtype) for k, p in params.items() if p is not None)
        return cls(module, type(module), d.get("forward"), values, tuple(params), dtypes)


@dataclass(frozen=True)
class TraceGuard:
    """Everything one trace of a block read (see the module docstring)."""

    cls: type  # the block's class (its forward is what was traced)
    values: tuple[tuple[str, Any], ...]  # block attributes read, present then
    absent: tuple[str, ...]  # block attributes read, absent from the instance then
    children: tuple[tuple[str, bool], ...]  # child slots read -> None then (`if self.x`)
    sizes: tuple[int, int, int]  # the block's children, Parameters, buffers, counted
    containers: tuple[tuple[str, nn.Module, tuple[tuple[str, nn.Module], ...]], ...]
    claimed: tuple[tuple[str, ModuleState], ...]  # claimed child name -> its state

    @classmethod
    def of(
        cls,
        block: nn.Module,
        reads: Iterable[str],
        before: dict[str, Any],
        reached: Iterable[str],
        claimed: Iterable[str],
        live: dict[str, frozenset[str]] | None = None,
    ) -> TraceGuard:
        """The guard of a trace of ``block`` that read the attribute names ``reads`` (its
        ``__dict__`` was ``before`` the trace), reached the submodules at dotted paths
        ``reached`` (call_module / get_attr targets) and whose matches claim ``claimed``
        (``live``: claimed child -> attributes its fused op reads on every call)."""
        modules = block._modules
        values, absent, children = [], [], []
        for name in sorted(set(reads)):
            if name in MODULE_STATE or (name.startswith("__") and name.endswith("__")):
                continue
            if name in before:
                if not isinstance(before[name], nn.Module):
                    values.append((name, before[name]))
            elif name in modules:
                children.append((name, modules[name] is None))
            elif not (name in block._parameters or name in block._buffers):
                absent.append(name)
        containers = []
        read_containers = {
            n
            for n in reads
            if isinstance(modules.get(n), (nn.ModuleList, nn.ModuleDict, nn.Sequential))
        }
        for path in sorted(read_containers | _prefixes(reached)):
            try:
                container = block.get_submodule(path)
            except AttributeError:  # a path through something that is not a module
                continue
            containers.append((path, container, tuple(container._modules.items())))
        live = live or {}
        return cls(
            type(block),
            tuple(values),
            tuple(absent),
            tuple(children),
            (len(modules), len(block._parameters), len(block._buffers)),
            tuple(containers),
            tuple(
                (name, ModuleState.of(modules[name], live.get(name, frozenset())))
                for name in sorted(claimed)
            ),
        )

    def changed(self, block: nn.Module) -> list[str]:
        """What differs on ``block`` now, in words (for messages; not run per call)."""
        probe = TestBuilder()
        claimed = {_claimed_check(name): (name, state) for name, state in self.claimed}
        out = []
        for what, lines in self._checks(probe):
            if not probe.compile(lines)(block):
                if what in claimed:  # say how the child changed
                    name, state = claimed[what]
                    what = _child_change(name, state, block._modules.get(name))
                out.append(what)
        return out

    def test(self, with_hooks: bool) -> Callable[[nn.Module], bool]:
        """``test(block) -> bool``, written out check by check (no loops: it runs on every
        call). ``with_hooks``: the claimed children have no call hooks and no accelerate hook,
        and no global module hooks are registered, too."""
        builder = TestBuilder()
        lines = [line for _, part in self._checks(builder, with_hooks) for line in part]
        if with_hooks:
            lines.append(builder.no_global_hooks())
        return builder.compile(lines)

    def _checks(self, b: TestBuilder, with_hooks: bool = False) -> list[tuple[str, list[str]]]:
        """(what, source lines) per check; the lines assume ``d`` (the block's __dict__) and
        ``m`` (its _modules) are bound."""
        cls, forward = b.const(self.cls), b.const(self.cls.forward)
        line = f"    if type(block) is not {cls} or {cls}.forward is not {forward}: return False"
        out: list[tuple[str, list[str]]] = [("the block's class or its forward", [line])]
        for name, value in self.values:
            line = f"    if {b.differs('d', name, value)}: return False"
            out.append((f"attribute {name!r}", [line]))
        for name in self.absent:
            out.append((f"attribute {name!r} set", [f"    if {name!r} in d: return False"]))
        for name, was_none in self.children:
            test = "is not None" if was_none else "is None"
            line = f"    if m.get({name!r}) {test}: return False"
            out.append((f"child {name!r} {'set' if was_none else 'set to None'}", [line]))
        n_modules, n_params, n_buffers = self.sizes
        out.append(
            (
                "children, Parameters or buffers added or removed",
                [
                    f"    if len(m) != {n_modules} or len(d['_parameters']) != {n_params} or "
                    f"len(d['_buffers']) != {n_buffers}: return False"
                ],
            )
        )
        for path, container, elements in self.containers:
            lines = []
            if "." not in path:  # nested ones are held by a container checked before them
                lines.append(f"    if m.get({path!r}) is not {b.const(container)}: return False")
            lines.append(f"    e = {b.const(container)}._modules")
            checks = [f"len(e) != {len(elements)}"] + [
                f"e.get({key!r}) is not {b.const(element)}" for key, element in elements
            ]
            if not isinstance(container, nn.ModuleList):  # its keys say its order
                checks.append(f"list(e) != {b.const([key for key, _ in elements])}")
            lines += [f"    if {check}: return False" for check in checks]
            out.append((f"the contents of {path!r}", lines))
        for name, state in self.claimed:
            lines = state_lines(b, f"m.get({name!r})", state, with_hooks)
            out.append((_claimed_check(name), lines))
        return out


def _claimed_check(name: str) -> str:
    """The name of a claimed child's check (changed() says more where it fails)."""
    return f"the claimed child {name!r}"


def _child_change(name: str, state: ModuleState, now: nn.Module | None) -> str:
    if now is None:
        return f"its child {name!r} was removed"
    if now is not state.module or type(now) is not state.cls:
        return f"its child {name!r} is now a {type(now).__name__}"
    if now.__dict__.get("forward") is not state.forward:
        return f"its child {name!r} has a forward set on the instance"
    if type(now).forward is not state.cls.forward:
        return f"its child {name!r}'s class has another forward"
    return f"its child {name!r} changed (its attributes, Parameter names or dtypes)"


_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def state_lines(
    b: TestBuilder, expression: str, state: ModuleState, with_hooks: bool = False
) -> list[str]:
    """Source lines testing that ``expression`` is still ``state``'s module as it was (and,
    ``with_hooks``, that it has no call hooks and no accelerate hook)."""
    cls = b.const(state.cls)
    lines = [
        f"    c = {expression}",
        f"    if c is not {b.const(state.module)} or type(c) is not {cls}: return False",
        "    cd = c.__dict__",
    ]
    if state.forward is None:
        tests = ["'forward' in cd"]
    else:
        tests = [f"cd.get('forward') is not {b.const(state.forward)}"]
    tests.append(f"{cls}.forward is not {b.const(state.cls.forward)}")  # replaced on the class
    if state.parameters:  # the names a fused op reads (an activation or dropout has none)
        tests.append(f"(p := cd['_parameters']).keys() != {b.const(frozenset(state.parameters))}")
    tests += [b.differs("cd", name, value) for name, value in state.values]
    tests += [
        # p is bound by the names' test before (a Parameter's dtype implies a name)
        f"p[{name!r}].dtype is not {b.const(dtype)}"
        for name, dtype in state.dtypes
    ]
    if with_hooks:
        tests += [f"cd[{kind!r}]" for kind in _CALL_HOOKS] + ["'_hf_hook' in cd"]
    lines.append(f"    if {' or '.join(tests)}: return False")
    return lines


def module_state_test(state: ModuleState) -> Callable[[], bool]:
    """``test() -> bool``: the module is still as ``state`` recorded it (state_lines)."""
    b = TestBuilder()
    lines = state_lines(b, b.const(state.module), state)
    return b.compile(lines, signature="")


class TestBuilder:
    """Collects the constants a generated test compares against, and compiles it."""

    def __init__(self) -> None:
        self.names: dict[str, Any] = {"_ABSENT": _ABSENT}

    def const(self, value: Any) -> str:
        name = f"_K{len(self.names)}"
        self.names[name] = value
        return name

    def no_global_hooks(self) -> str:
        """A line returning False while global module hooks are registered."""
        self.names.update(
            _G0=GLOBAL_FORWARD_HOOKS,
            _G1=GLOBAL_FORWARD_PRE_HOOKS,
            _G2=GLOBAL_BACKWARD_HOOKS,
            _G3=GLOBAL_BACKWARD_PRE_HOOKS,
        )
        return "    if _G0 or _G1 or _G2 or _G3: return False"

    def differs(self, dict_name: str, key: str, value: Any) -> str:
        """An expression true when ``dict_name[key]`` is no longer ``value`` (a Python value:
        equal and of the same type; anything else: the same object)."""
        got = f"{dict_name}.get({key!r}, _ABSENT)"
        if value is None or isinstance(value, bool) or not is_plain_value(value):
            return f"{got} is not {self.const(value)}"
        v, t = self.const(value), self.const(type(value))
        return f"((v := {got}) is not {v} and (type(v) is not {t} or v != {v}))"

    def compile(self, lines: list[str], signature: str = "block") -> Callable[..., bool]:
        head = [f"def test({signature}):"]
        if signature:
            head += ["    d = block.__dict__", "    m = d['_modules']"]
        source = "\n".join([*head, *lines, "    return True"])
        namespace = dict(self.names)
        namespace["__source__"] = source
        exec(source, namespace)  # source built here from repr()s of attribute names
        return namespace["test"]


def _prefixes(paths: Iterable[str]) -> set[str]:
    """Every proper dotted prefix of each path: 'layers.0.fc' -> {'layers', 'layers.0'}."""
    out = set()
    for path in paths:
        parts = path.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out
