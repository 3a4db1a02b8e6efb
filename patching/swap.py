"""The in-place swap: patch, unpatch and swap_children (usable as ``model.apply``).

A swap replaces a child attribute of its parent with a fused layer built around the native
module's own Parameter objects (state_dict keys, tied weights, optimizer state and device
placement are untouched). The native module is kept on the fused one (not as a submodule) so
that unpatch can put the very same object back. Hooks travel with the swap: the fused module
shares the native one's hook dictionaries, and an accelerate hook (``_hf_hook``) is attached to
it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from fastlayers.layers import FusedLinearGELU

from .discover import find_linear_act, might_hold_pattern
from .report import PatchReport, Skip, Swap
from .rules import (
    ALL_LAYERS,
    MODULE_RULES,
    NATIVE_ATTR,
    FusedAway,
    activation_skip,
    is_fused,
    linear_skip,
    lookalike_reason,
    module_rule_skip,
)

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _check_layers(layers: Iterable[str]) -> tuple[str, ...]:
    layers = tuple(layers)
    unknown = [name for name in layers if name not in ALL_LAYERS]
    if unknown:
        raise ValueError(f"fastlayers.patch: unknown layers {unknown}; choose from {ALL_LAYERS}")
    return layers


def _release(native: nn.Module) -> None:
    """Drop the kept native module's references to its Parameters and buffers (the names stay):
    the fused module owns them now, and anything that replaces them there (FSDP2 sharding,
    ``to_empty``, ``load_state_dict(assign=True)``) must be able to free the old ones.
    unpatch binds the fused module's current ones back."""
    for name in native._parameters:
        native._parameters[name] = None
    for name in native._buffers:
        native._buffers[name] = None


def _adopt(fused: nn.Module, native: nn.Module) -> nn.Module:
    """Make ``fused`` stand in for ``native``: remember it (without its Parameters), share its
    hooks, re-attach its accelerate hook, copy its training flag."""
    object.__setattr__(fused, NATIVE_ATTR, native)
    _release(native)
    for attr in _HOOK_DICTS:
        if hasattr(native, attr):
            setattr(fused, attr, getattr(native, attr))
    fused.train(native.training)
    hf_hook = getattr(native, "_hf_hook", None)
    if hf_hook is not None:
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(fused, hf_hook)
    return fused


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def swap_children(
    module: nn.Module,
    *,
    layers: Iterable[str] = ALL_LAYERS,
    dry_run: bool = False,
    report: PatchReport | None = None,
    prefix: str = "",
) -> PatchReport:
    """Swap the direct children of ``module`` for fused layers, in place; safe to pass to
    ``model.apply``. Returns (and extends, when given) a :class:`PatchReport` whose names are
    relative to ``module`` unless ``prefix`` names it."""
    layers = _check_layers(layers)
    report = report if report is not None else PatchReport(dry_run=dry_run)
    if "linear_gelu" in layers and might_hold_pattern(module):
        _swap_linear_gelu(module, dry_run, report, prefix)
    for name, child in list(module.named_children()):
        for rule in MODULE_RULES:
            if rule.name not in layers:
                continue
            qualified = _qualified(prefix, name)
            if type(child) is rule.native:
                why = module_rule_skip(child)
                if why is not None:
                    report.skips.append(Skip(qualified, type(child).__name__, rule.name, why))
                    continue
                fused = rule.build(child)
                report.swaps.append(
                    Swap(qualified, type(child).__name__, type(fused).__name__, rule.name)
                )
                if not dry_run:
                    setattr(module, name, _adopt(fused, child))
            else:
                why = lookalike_reason(rule, child)
                if why is not None:
                    report.skips.append(Skip(qualified, type(child).__name__, rule.name, why))
    return report


def _swap_linear_gelu(module: nn.Module, dry_run: bool, report: PatchReport, prefix: str) -> None:
    pairs, why_not = find_linear_act(module)
    if why_not is not None:
        report.skips.append(Skip(prefix or "(root)", type(module).__name__, "linear_gelu", why_not))
        return
    for pair in pairs:
        linear, act = getattr(module, pair.linear), getattr(module, pair.activation)
        name = _qualified(prefix, pair.linear)
        if is_fused(linear) or is_fused(act):
            continue
        why = linear_skip(linear) or activation_skip(act)
        if why is not None:
            report.skips.append(Skip(name, type(linear).__name__, "linear_gelu", why))
            continue
        fused = FusedLinearGELU.from_native(linear, act)
        report.swaps.append(
            Swap(
                name,
                f"{type(linear).__name__} + {type(act).__name__} ({pair.activation})",
                f"FusedLinearGELU({fused.approximate!r})",
                "linear_gelu",
            )
        )
        if not dry_run:
            setattr(module, pair.linear, _adopt(fused, linear))
            setattr(module, pair.activation, FusedAway(act, pair.linear))


def patch(
    model: nn.Module, *, layers: Iterable[str] = ALL_LAYERS, dry_run: bool = False
) -> PatchReport:
    """Swap fused layers into ``model`` in place and return a :class:`PatchReport` of what was
    swapped where, and what was skipped and why. ``layers`` picks rules among 'layer_norm',
    'linear_gelu' and 'relu'; ``dry_run`` reports without changing anything. Patching twice
    changes nothing the second time."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastlayers.patch: model must be an nn.Module, got {type(model).__name__}")
    layers = _check_layers(layers)
    report = PatchReport(dry_run=dry_run)
    for name, module in list(model.named_modules()):
        if is_fused(module):
            continue
        swap_children(module, layers=layers, dry_run=dry_run, report=report, prefix=name)
    return report


def unpatch(model: nn.Module) -> int:
    """Put the native modules back (the very objects that were swapped out, re-bound to the
    fused modules' current Parameters, so loading or moving after the patch carries over).
    Returns how many modules were restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fastlayers.unpatch: model must be an nn.Module, got {type(model).__name__}"
        )
    return len(_put_natives_back(model))


@contextmanager
def natives_restored(model: nn.Module) -> Iterator[None]:
    """For the duration, the model runs its native modules (the objects unpatch would put
    back); the very same fused modules return afterwards."""
    swapped = _put_natives_back(model)
    try:
        yield
    finally:
        for parent, name, fused in swapped:
            setattr(parent, name, fused)
            _release(native_of(fused))


def native_of(fused: nn.Module) -> nn.Module | None:
    """The native module a patch swapped ``fused`` in for (None for one built directly)."""
    return fused.__dict__.get(NATIVE_ATTR)


def _put_natives_back(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swaps every fused child back to its native module; returns (parent, name, fused)."""
    swapped = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            native = native_of(child)
            if native is None:
                continue
            for pname, param in child._parameters.items():
                native._parameters[pname] = param
            for bname, buf in child._buffers.items():
                native._buffers[bname] = buf
            native.train(child.training)
            setattr(module, name, native)
            swapped.append((module, name, child))
    return swapped
