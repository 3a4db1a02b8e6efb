"""The in-place swap: patch, unpatch and swap_children (usable as ``model.apply``).

A swap replaces a child attribute of its parent with a fused layer built around the native
module's own Parameter objects (state_dict keys, tied weights, optimizer state and device
placement are untouched). The native module is kept on the fused one (not as a submodule) so
that unpatch can put the very same object back. Hooks travel with the swap: the fused module
shares the native one's hook dictionaries, and an accelerate hook (``_hf_hook``) is attached to
it again.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fastlayers.layers import FusedLinearAct, FusedLinearGELU, ReLUScale

from .block import BLOCK_RULES, BlockRewrite, claimed_children, plan_block, rewritten_forward
from .discover import find_linear_act, might_hold_pattern
from .fallback import warn_once
from .records import CheckTarget, Rewrite
from .report import PatchReport, Skip, Swap
from .rules import (
    ALL_LAYERS,
    DEFAULT_LAYERS,
    GLOBAL_BACKWARD_HOOKS,
    GLOBAL_BACKWARD_PRE_HOOKS,
    GLOBAL_FORWARD_HOOKS,
    GLOBAL_FORWARD_PRE_HOOKS,
    HOOK_KINDS,
    MODULE_RULES,
    NATIVE_ATTR,
    OWN_HOOKS,
    PAIR_RULES,
    FusedAway,
    PairRule,
    foreign_kind,
    fusable_activation,
    global_hook_problem,
    hook_problem,
    is_fused,
    linear_skip,
    lookalike_reason,
    module_rule_skip,
    pair_rule,
)

_HOOK_DICTS = tuple(HOOK_KINDS)


def _check_layers(layers: str | Iterable[str]) -> tuple[str, ...]:
    """``layers`` as a tuple of rule names (one name alone is taken as that rule)."""
    layers = (layers,) if isinstance(layers, str) else tuple(layers)
    unknown = [name for name in layers if not isinstance(name, str) or name not in ALL_LAYERS]
    if unknown:
        raise ValueError(
            f"fastlayers.patch: unknown layers {unknown}; layers is a rule name or a sequence of "
            f"them, from {ALL_LAYERS}"
        )
    return layers


def _share_tensors(fused: nn.Module, native: nn.Module) -> None:
    """Make ``fused`` hold ``native``'s very Parameter and buffer dicts: both modules see the same
    tensors, now and whatever replaces them later on either one (loading with ``assign=True``,
    ``to_empty``, FSDP2 sharding, a user's assignment). So the native module stays intact for
    anyone else who holds it (a second parent, the user), and keeps no stale tensors alive."""
    for attr in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
        fused.__dict__[attr] = native.__dict__[attr]


def _adopt(fused: nn.Module, native: nn.Module) -> nn.Module:
    """Make ``fused`` stand in for ``native``: remember it, share its tensors and hooks,
    re-attach its accelerate hook, copy its training flag."""
    object.__setattr__(fused, NATIVE_ATTR, native)
    _share_tensors(fused, native)
    for attr in _HOOK_DICTS:
        if hasattr(native, attr):
            setattr(fused, attr, getattr(native, attr))
    fused.train(native.training)
    hf_hook = getattr(native, "_hf_hook", None)
    if hf_hook is not None:
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(fused, hf_hook)
    return fused


def _carry_accelerate_hook(fused: nn.Module, native: nn.Module) -> None:
    """Give ``native`` the accelerate hook ``fused`` has now (one attached after the patch:
    ``cpu_offload`` put the weights on the meta device and loads them in that hook), or take
    native's away where it was removed from the fused module since."""
    hook, had = fused.__dict__.get("_hf_hook"), native.__dict__.get("_hf_hook")
    if hook is had:
        return
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module

    if hook is None:
        remove_hook_from_module(native)
    else:
        add_hook_to_module(native, hook)


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _rebind(native: nn.Module, fused: nn.Module) -> None:
    """Give ``native`` the fused module's current Parameters and buffers, where the two do not
    share their dicts (a model pickled by an older fastlayers, whose kept native modules hold
    no tensors)."""
    if native._parameters is fused._parameters:
        return
    for pname, param in fused._parameters.items():
        native._parameters[pname] = param
    for bname, buf in fused._buffers.items():
        native._buffers[bname] = buf


class ChildSwap(Rewrite):
    """``parent.<attr>``: ``native`` replaced by ``fused`` (built around its Parameters)."""

    def __init__(
        self,
        parent: nn.Module,
        attr: str,
        native: nn.Module,
        fused: nn.Module,
        *,
        rule: str = "",
        name: str = "",
        adopted: bool = False,
    ) -> None:
        self.parent, self.attr, self.native, self.fused = parent, attr, native, fused
        self.rule, self.name = rule, name
        # False until fused has taken over native's hooks (done once: a swap undone by
        # natives_restored and applied again keeps them)
        self.adopted = adopted

    def apply(self) -> None:
        if not self.adopted:
            # looked up at call time (a test injects a failure here)
            _adopt(self.fused, self.native)
            self.adopted = True
        setattr(self.parent, self.attr, self.fused)

    def undo(self) -> None:
        # also safe after a partial apply: the tensors are shared, the hook the same then
        _rebind(self.native, self.fused)
        if self.adopted:
            _carry_accelerate_hook(self.fused, self.native)
        self.native.train(self.fused.training)
        if self.parent._modules.get(self.attr) is self.fused:
            setattr(self.parent, self.attr, self.native)

    def undo_problem(self) -> str | None:
        """Why undo could not hand the native module back as it runs now, or None."""
        if self.adopted and not type(self.fused).__module__.startswith("fastlayers."):
            return (
                f"{self.name or self.attr} is now a {type(self.fused).__name__} (a wrapper such "
                "as FSDP2's fully_shard changed its class after the patch); unpatch before "
                "wrapping"
            )
        return None

    def describe(self) -> list[Swap]:
        if not self.rule:
            return []
        return [Swap(self.name, type(self.native).__name__, type(self.fused).__name__, self.rule)]

    def restored_modules(self) -> int:
        return 1

    def check_targets(self) -> list[CheckTarget]:
        return [_chain_target(self.name, self.fused, [self.native])]


class Pairing:
    """A fused Linear + activation pair as the patch made it: the fused layer in the parent's
    ``linear_attr``, the FusedAway in its ``act_attr``. Asked on every call of either, it says
    whether the pair is broken since: either one replaced in the parent, or hooks added that would
    see the fused layer's output as the Linear's (forward and backward hooks on the fused layer,
    any hook on the activation, global module hooks). Then the fused layer computes the Linear
    alone and the FusedAway the original activation: what the native modules compute, with
    their hooks seeing what they would (warned once per reason)."""

    def __init__(self, parent: nn.Module, linear_attr: str, act_attr: str) -> None:
        self.parent, self.linear_attr, self.act_attr = parent, linear_attr, act_attr
        self.fused = parent._modules[linear_attr]
        self.away = parent._modules[act_attr]

    def broken(self) -> bool:
        """A few identity and emptiness tests while the pair stands."""
        fused, away, modules = self.fused, self.away, self.parent._modules
        if (
            modules.get(self.linear_attr) is fused
            and modules.get(self.act_attr) is away
            and not (fused._forward_hooks or fused._backward_hooks or fused._backward_pre_hooks)
            and not (
                away._forward_pre_hooks
                or away._forward_hooks
                or away._backward_hooks
                or away._backward_pre_hooks
            )
            and not (
                GLOBAL_FORWARD_HOOKS
                or GLOBAL_FORWARD_PRE_HOOKS
                or GLOBAL_BACKWARD_HOOKS
                or GLOBAL_BACKWARD_PRE_HOOKS
            )
        ):
            return False
        why = self.why_broken()
        if why is not None:
            warn_once(f"a fused Linear + activation computes them apart, natively: {why}", 3)
        return why is not None

    def why_broken(self) -> str | None:
        modules, fused, away = self.parent._modules, self.fused, self.away
        if modules.get(self.linear_attr) is not fused:
            return f"its Linear ({self.linear_attr}) was replaced since the patch"
        if modules.get(self.act_attr) is not away:
            return f"its activation ({self.act_attr}) was replaced since the patch"
        for kind in ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(fused, kind).keys() - OWN_HOOKS:
                return f"the Linear ({self.linear_attr}) has {HOOK_KINDS[kind]} since the patch"
        return hook_problem(away, f"activation ({self.act_attr})") or global_hook_problem()

    def linear_alone(self, input: torch.Tensor) -> torch.Tensor:
        """The Linear's output, as the native Linear computes it (its hooks, shared with the
        fused layer, ran around this call already)."""
        native = self.fused.__dict__[NATIVE_ATTR]
        return type(native).forward(native, input)


class LinearActSwap(Rewrite):
    """A Linear and the activation it feeds (a pair rule: linear_gelu, linear_relu): the Linear
    becomes a fused layer (FusedLinearGELU, FusedLinearReLU), the activation a FusedAway; both
    hold a :class:`Pairing` that undoes the fusion per call where the pair was broken since."""

    def __init__(self, linear: ChildSwap, activation: ChildSwap, rule: str) -> None:
        self.linear, self.activation, self.rule = linear, activation, rule

    def apply(self) -> None:
        self.linear.apply()
        self.activation.apply()
        pairing = Pairing(self.linear.parent, self.linear.attr, self.activation.attr)
        self.linear.fused.__dict__["_pairing"] = pairing
        self.activation.fused.__dict__["pairing"] = pairing

    def undo(self) -> None:
        self.linear.fused.__dict__.pop("_pairing", None)
        self.activation.fused.__dict__.pop("pairing", None)
        self.activation.undo()
        self.linear.undo()

    def undo_problem(self) -> str | None:
        return self.linear.undo_problem()

    def describe(self) -> list[Swap]:
        native = (
            f"{type(self.linear.native).__name__} + {type(self.activation.native).__name__} "
            f"({self.activation.attr})"
        )
        fused = self.linear.fused
        what = type(fused).__name__
        if isinstance(fused, FusedLinearGELU):
            what += f"({fused.approximate!r})"
        return [Swap(self.linear.name, native, what, self.rule)]

    def restored_modules(self) -> int:
        return 2

    def check_targets(self) -> list[CheckTarget]:
        chain = [self.linear.native, self.activation.native]
        return [_chain_target(self.linear.name, self.linear.fused, chain)]


class BuiltFused(Rewrite):
    """A fused layer built directly (no patch swapped it in): nothing to undo; fastlayers.check
    compares it with the native modules its ``to_native()`` gives."""

    def __init__(self, name: str, fused: nn.Module) -> None:
        self.name, self.fused = name, fused

    def apply(self) -> None:
        pass

    def undo(self) -> None:
        pass

    def check_targets(self) -> list[CheckTarget] | str:
        if isinstance(self.fused, ReLUScale) and self.fused.alpha != 1.0:
            return "no native twin (built directly with alpha != 1)"
        natives = self.fused.to_native()
        chain = list(natives) if isinstance(natives, tuple) else [natives]
        return [_chain_target(self.name, self.fused, chain)]


def _chain_target(name: str, fused: nn.Module, chain: list[nn.Module]) -> CheckTarget:
    """Compare ``fused`` with ``chain`` (native modules applied in turn; the first one re-bound
    to the fused module's current Parameters, in float64 for the reference)."""
    return CheckTarget(
        name,
        fused,
        lambda *a, **k: run_chain([rebound(chain[0], fused, False), *chain[1:]], a, k),
        lambda: lambda *a, **k: run_chain([rebound(chain[0], fused, True), *chain[1:]], a, k),
        type(fused).__name__,
    )


def rebound(native: nn.Module, fused: nn.Module, to64: bool) -> nn.Module:
    """A shallow copy of ``native`` holding the fused module's current Parameters and buffers
    (float64 copies when ``to64``)."""
    twin = copy.copy(native)

    def tensors(d: dict) -> dict:
        if not to64:
            return dict(d)
        return {
            k: (v.detach().double() if v is not None and v.is_floating_point() else v)
            for k, v in d.items()
        }

    object.__setattr__(twin, "_parameters", tensors(fused._parameters))
    object.__setattr__(twin, "_buffers", tensors(fused._buffers))
    return twin


def run_chain(chain: list[nn.Module], args: tuple, kwargs: dict):
    """``chain[-1](...chain[0](*args, **kwargs))`` through each class's forward: the native
    twins share hook dicts with the fused modules (and accelerate replaces instance forwards),
    so calling them would run hooks, ours included."""
    out = type(chain[0]).forward(chain[0], *args, **kwargs)
    for module in chain[1:]:
        out = type(module).forward(module, out)
    return out


class InitWeightsForFused(Rewrite):
    """HuggingFace initialisation (``_init_weights``, reached by ``init_weights()``,
    ``initialize_weights()``, ``apply(model._init_weights)`` and ``from_pretrained``'s
    initialisation of missing keys) tests ``isinstance(module, nn.Linear)``; the fused Linear
    layers (FusedLinearGELU, FusedLinearReLU) are not, on purpose. This rewrite puts a callable
    on the PreTrainedModel instance that initialises a fused layer by calling the model's own
    ``_init_weights`` on its native Linear sharing the same Parameters, so the fused weights get
    exactly the native ones' init."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.previous = model.__dict__.get("_init_weights", _MISSING)

    def apply(self) -> None:
        previous = None if self.previous is _MISSING else self.previous
        self.model.__dict__["_init_weights"] = _FusedAwareInit(self.model, previous)

    def undo(self) -> None:
        if self.previous is _MISSING:
            self.model.__dict__.pop("_init_weights", None)
        else:
            self.model.__dict__["_init_weights"] = self.previous


_MISSING = object()


class _FusedAwareInit:
    """``model._init_weights`` for a patched PreTrainedModel (see InitWeightsForFused); a plain
    object holding the model, so deepcopy and pickle of the model carry it."""

    def __init__(self, model: nn.Module, previous: Callable[[nn.Module], None] | None) -> None:
        self.model, self.previous = model, previous

    def __call__(self, module: nn.Module) -> None:
        init = self.previous or type(self.model)._init_weights.__get__(self.model)
        if isinstance(module, FusedLinearAct):
            module = module.to_native()[0]  # nn.Linear / Conv1D around the same Parameters
        return init(module)


def _is_pretrained_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _plan_children(
    module: nn.Module, layers: tuple[str, ...], report: PatchReport, prefix: str
) -> list[Rewrite]:
    """The rewrites of ``module``'s direct children; skips go to ``report``. Changes nothing."""
    plan: list[Rewrite] = []
    claimed: set[str] = set()  # a child taken by one rule is not looked at by another
    existing = rewritten_forward(module)
    if existing is not None:  # rewritten by an earlier patch: its children stay claimed
        claimed.update(claimed_children(existing.matches))
    block_rules = [rule for rule in BLOCK_RULES if rule in layers]
    if block_rules:  # one trace of the block serves every enabled block rule
        block, skips = plan_block(module, prefix, block_rules)
        report.skips += [
            Skip(name or "(root)", type(module).__name__, rule, why) for name, rule, why in skips
        ]
        if block is not None:
            claimed.update(block.claims())
            plan.append(block)
    pair_rules = [r for r in PAIR_RULES if r.name in layers]
    if pair_rules and might_hold_pattern(module):
        for record in _plan_linear_act(module, pair_rules, report, prefix, claimed):
            claimed.update((record.linear.attr, record.activation.attr))
            plan.append(record)
    for name, child in list(module.named_children()):
        if name in claimed:
            continue
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
                plan.append(ChildSwap(module, name, child, fused, rule=rule.name, name=qualified))
            else:
                why = lookalike_reason(rule, child)
                if why is not None:
                    report.skips.append(Skip(qualified, type(child).__name__, rule.name, why))
    return plan


def _plan_linear_act(
    module: nn.Module,
    rules: list[PairRule],
    report: PatchReport,
    prefix: str,
    claimed: set[str],
) -> list[LinearActSwap]:
    """The Linear + activation pairs among ``module``'s children that the selected pair
    ``rules`` fuse; the others are reported skipped. Pairs with a child ``claimed`` by a block
    rewrite are left to it. Each activation is recognised once (after its hooks are checked),
    and the Linear only looked at when the activation's rule runs."""
    pairs, why_not = find_linear_act(module)
    if why_not is not None:
        report.skips.append(Skip(prefix or "(root)", type(module).__name__, rules[0].name, why_not))
        return []
    plan = []
    for pair in pairs:
        linear, act = getattr(module, pair.linear), getattr(module, pair.activation)
        name = _qualified(prefix, pair.linear)
        if is_fused(linear) or is_fused(act) or {pair.linear, pair.activation} & claimed:
            continue
        kind, why = fusable_activation(act)
        rule = pair_rule(kind)
        if why is None and rule not in rules:
            why = _unselected(act, rule, rules)
        why = why or pair.unproven or linear_skip(linear)
        if why is not None:
            shown = rule.name if rule in rules else rules[0].name
            report.skips.append(Skip(name, type(linear).__name__, shown, why))
            continue
        fused = rule.build(linear, kind)
        away = FusedAway(act, fused)
        plan.append(
            LinearActSwap(
                ChildSwap(module, pair.linear, linear, fused, rule=rule.name, name=name),
                ChildSwap(module, pair.activation, act, away, adopted=True),
                rule.name,
            )
        )
    return plan


def _unselected(act: nn.Module, rule: PairRule | None, rules: list[PairRule]) -> str:
    """The skip reason for an activation whose kind no selected rule fuses."""
    wanted = " or ".join(r.what for r in rules)
    text = f"{type(act).__name__} is not {wanted}"
    if rule is None:  # recognised, but no pair rule takes its kind
        return text
    return f"{text}: it computes {rule.what}, and rule {rule.name!r} is not in layers"


def _apply_all(plan: list[Rewrite]) -> None:
    """Apply every rewrite, or, if one raises, undo the applied ones (and the failing one's
    partial work) in reverse and re-raise: the model is then exactly as before."""
    done: list[Rewrite] = []
    try:
        for record in plan:
            done.append(record)  # before apply: undo also cleans up a half-applied record
            record.apply()
    except BaseException:
        for record in reversed(done):
            record.undo()
        raise


def _finish(plan: list[Rewrite], report: PatchReport, dry_run: bool) -> PatchReport:
    if not dry_run:
        _apply_all(plan)
    report.swaps.extend(row for r in plan for row in r.describe())
    return report


def swap_children(
    module: nn.Module,
    *,
    layers: str | Iterable[str] = DEFAULT_LAYERS,
    dry_run: bool = False,
    report: PatchReport | None = None,
    prefix: str = "",
) -> PatchReport:
    """Swap the direct children of ``module`` for fused layers, in place (all or none); safe to
    pass to ``model.apply``. Returns (and extends, when given) a :class:`PatchReport` whose
    names are relative to ``module`` unless ``prefix`` names it."""
    layers = _check_layers(layers)
    report = report if report is not None else PatchReport(dry_run=dry_run)
    return _finish(_plan_children(module, layers, report, prefix), report, dry_run)


def patch(
    model: nn.Module, *, layers: str | Iterable[str] = DEFAULT_LAYERS, dry_run: bool = False
) -> PatchReport:
    """Swap fused layers into ``model`` in place and return a :class:`PatchReport` of what was
    swapped where, and what was skipped and why. ``layers`` picks rules (rules.ALL_LAYERS; the
    default, rules.DEFAULT_LAYERS, is all of them but 'relu'; one name alone is that rule):

    - 'layer_norm', 'relu': ``nn.LayerNorm`` / ``nn.ReLU`` swapped one for one (LayerNorm,
      ReLUScale); 'relu' only when named: a bare ReLU gains nothing from ReLUScale(1);
    - 'linear_gelu', 'linear_relu': an ``nn.Linear`` (or a subclass whose forward computes
      F.linear, or HuggingFace ``Conv1D``) whose output goes only to a GELU / ReLU module becomes
      a FusedLinearGELU / FusedLinearReLU, the activation an identity (FusedAway);
    - 'residual_layer_norm', 'relu_scale', 'mlp': block rewrites (a block whose own forward
      computes ``layer_norm(dropout(x) + residual)``, ``relu(x) * c``, or Linear -> GELU / ReLU
      -> Linear, runs the fused op; see patching/block.py); a Linear taken by 'mlp' is not also
      fused with its activation by 'linear_gelu' / 'linear_relu'.

    ``dry_run`` reports without changing anything. Patching twice changes nothing the second
    time.

    All or nothing: every rewrite is planned first, then applied; if one raises, the applied
    ones are undone and the model is exactly as before. Adapter-wrapped (PEFT/LoRA) and
    quantized modules are left native, with a warning naming them."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastlayers.patch: model must be an nn.Module, got {type(model).__name__}")
    layers = _check_layers(layers)
    _warn_foreign(model)
    report = PatchReport(dry_run=dry_run)
    report.skips += _root_skips(model, layers)
    plan: list[Rewrite] = []
    for name, module in list(model.named_modules()):
        if is_fused(module):
            continue
        plan += _plan_children(module, layers, report, name)
    if any(isinstance(r, LinearActSwap) for r in plan):
        plan += [
            InitWeightsForFused(m)
            for m in model.modules()
            if _is_pretrained_model(m)
            and not isinstance(m.__dict__.get("_init_weights"), _FusedAwareInit)
        ]
    return _finish(plan, report, dry_run)


def _root_skips(model: nn.Module, layers: tuple[str, ...]) -> list[Skip]:
    """The model itself as a module rule's target: a patch swaps children in place, and cannot
    replace the object the caller holds."""
    return [
        Skip(
            "(root)",
            type(model).__name__,
            rule.name,
            "the model itself is the module to swap; patch replaces a model's children in "
            f"place, so wrap it in a container, or build the fused layer directly: {rule.fused}",
        )
        for rule in MODULE_RULES
        if rule.name in layers and type(model) is rule.native and module_rule_skip(model) is None
    ]


def _warn_foreign(model: nn.Module) -> None:
    """One warning naming the adapter-wrapped and quantized modules (outermost only)."""
    found: dict[str, list[str]] = {}
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in inside):
            continue
        kind = foreign_kind(module)
        if kind is not None:
            found.setdefault(kind, []).append(name or "(root)")
            inside.append(name)
    if not found:
        return
    parts = []
    for kind, names in found.items():
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{len(names)} {kind} ({shown})")
    warnings.warn(
        f"fastlayers.patch: {'; '.join(parts)} left native. Apply LoRA/quantization before "
        "patch() (as here) or unpatch() first: tools run after a patch do not see fused "
        "Linears as nn.Linear",
        UserWarning,
        stacklevel=3,
    )


def applied_rewrites(model: nn.Module) -> list[Rewrite]:
    """The rewrites a patch applied to ``model``, and the fused layers built into it directly,
    found on the model itself (so they survive deepcopy and pickling), in the order they can be
    undone."""
    records: list[Rewrite] = []
    for prefix, module in list(model.named_modules()):
        forward = rewritten_forward(module)
        if forward is not None:
            records.append(BlockRewrite(module, prefix, forward.matches, forward))
        children = dict(module.named_children())
        attr_of = {id(c): name for name, c in children.items()}
        paired = {id(c.into) for c in children.values() if isinstance(c, FusedAway)}
        for name, child in children.items():
            native, qualified = native_of(child), _qualified(prefix, name)
            if isinstance(child, FusedAway):
                linear = attr_of.get(id(child.into))
                if linear is not None:
                    records.append(
                        LinearActSwap(
                            ChildSwap(
                                module,
                                linear,
                                native_of(child.into),
                                child.into,
                                name=_qualified(prefix, linear),
                                adopted=True,
                            ),
                            ChildSwap(module, name, native, child, adopted=True),
                            _pair_rule_of(child.into),
                        )
                    )
                    continue
            if id(child) in paired:
                continue  # recorded with its FusedAway
            if native is not None:
                records.append(ChildSwap(module, name, native, child, name=qualified, adopted=True))
            elif is_fused(child) and not isinstance(child, FusedAway):
                records.append(BuiltFused(qualified, child))
        if isinstance(module.__dict__.get("_init_weights"), _FusedAwareInit):
            record = InitWeightsForFused(module)
            record.previous = module.__dict__["_init_weights"].previous or _MISSING
            records.append(record)
    return records


def _pair_rule_of(fused: nn.Module) -> str:
    """The pair rule that built ``fused`` (a FusedLinearAct), from its activation."""
    rule = pair_rule(fused.activation)
    return rule.name if rule is not None else ""


def unpatch(model: nn.Module) -> int:
    """Put the native modules back (the very objects that were swapped out, re-bound to the
    fused modules' current Parameters, so loading or moving after the patch carries over).
    Returns how many modules were restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fastlayers.unpatch: model must be an nn.Module, got {type(model).__name__}"
        )
    records = applied_rewrites(model)
    problems = [p for p in (r.undo_problem() for r in records) if p is not None]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"fastlayers.unpatch: cannot hand the model back: {problems[0]}{more}")
    for record in records:
        record.undo()
    return sum(r.restored_modules() for r in records)


@contextmanager
def natives_restored(model: nn.Module) -> Iterator[None]:
    """For the duration, the model runs its native modules (the objects unpatch would put
    back); the very same fused modules return afterwards."""
    records = applied_rewrites(model)
    for record in records:
        record.undo()
    try:
        yield
    finally:
        for record in reversed(records):
            record.apply()


def native_of(fused: nn.Module) -> nn.Module | None:
    """The native module a patch swapped ``fused`` in for (None for one built directly)."""
    return fused.__dict__.get(NATIVE_ATTR)
