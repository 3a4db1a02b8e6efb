"""The unit of patching: a rewrite record. Each applied change to a model is one record that can
apply and undo itself, describe itself for the report and give fastlayers.check its native
reference; patch plans records, unpatch / natives_restored / check iterate them; nothing else
matches module types. The records:

- :class:`ChildSwap`: a child replaced by a fused module built around its Parameters (rules
  layer_norm, relu), sharing its Parameter dicts and hooks;
- :class:`LinearActSwap`: a Linear and its activation (rules linear_gelu, linear_relu) as two
  ChildSwaps, the pair guarded per call by a :class:`Pairing`;
- :class:`BlockRewrite`: a block's forward rewritten (rules residual_layer_norm, relu_scale,
  mlp; blocks.py);
- :class:`BuiltFused`: a fused layer built directly (nothing to undo; check compares it);
- :class:`InitWeightsForFused`: HuggingFace initialisation routed to the fused Linears;
- :class:`ReplayRecord`: the model's forward replayed from CUDA graphs (runtime/replay.py);
- :class:`UnpadRecord`: a base model run on its real tokens only (runtime/unpad.py);
- :class:`FusedLossRecord`: a causal LM's head and loss fused in training
  (runtime/fused_loss.py)."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastlayers.layers import FusedLinearAct, FusedLinearGELU, ReLUScale

from .blocks import claimed_children
from .eligibility import (
    HOOK_KINDS,
    OWN_HOOKS,
    global_hook_problem,
    hook_problem,
    own_forward,
)
from .fallback import warn_once
from .fused import NATIVE_ATTR, forward_attr
from .guard import (
    MODULE_STATE,
    ModuleState,
    TestBuilder,
    is_plain_value,
    module_state_test,
    state_lines,
)
from .report import Swap


@dataclass(frozen=True)
class CheckTarget:
    """What fastlayers.check compares for one record: ``module``'s output against ``native``
    called on the same inputs (both in the model's dtype), and against ``reference``, a float64
    version of native, or None when float64 is not available for it."""

    name: str
    module: nn.Module
    native: Callable[..., object]
    reference: Callable[[], Callable[..., object]] | None
    fused: str


class Rewrite:
    """One planned change to a model: it can apply itself, undo itself (the model exactly as
    before: the same module objects, Parameters and hooks), and describe itself for the report.
    Planning a rewrite never changes the model; :func:`patch` applies all or none."""

    rule: str = ""

    def apply(self) -> None:
        raise NotImplementedError

    def undo(self) -> None:
        raise NotImplementedError

    def describe(self) -> list[Swap]:
        """The report's rows (none for a rewrite the report does not list)."""
        return []

    def undo_problem(self) -> str | None:
        """Why :meth:`undo` could not give the model back as it runs now (unpatch refuses then,
        before undoing anything), or None."""
        return None

    def restored_modules(self) -> int:
        """How many native modules (or forwards) undo puts back (unpatch's count)."""
        return 0

    def check_targets(self) -> list[CheckTarget] | str:
        """What fastlayers.check compares for this rewrite, or why it cannot compare it."""
        return []


# ------------------------------------------------------------------ module swaps

_HOOK_DICTS = tuple(HOOK_KINDS)


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
    _carry_init_state(fused, native)
    for attr in _HOOK_DICTS:
        if hasattr(native, attr):
            setattr(fused, attr, getattr(native, attr))
    fused.train(native.training)
    hf_hook = getattr(native, "_hf_hook", None)
    if hf_hook is not None:
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(fused, hf_hook)
    return fused


# HuggingFace's mark of a module its initialisation has done (or loading filled): modules
# flagged are skipped by init_weights() / post_init(). The Parameters' own flags travel with
# the Parameters, which fused and native share.
HF_INITIALIZED = "_is_hf_initialized"


def _carry_init_state(to: nn.Module, source: nn.Module) -> None:
    """Give ``to`` the initialisation flag ``source`` has, so that init_weights() after a patch
    (or after unpatch) skips what it would have skipped natively."""
    if HF_INITIALIZED in source.__dict__:
        to.__dict__[HF_INITIALIZED] = source.__dict__[HF_INITIALIZED]


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


def _carry_settings(native: nn.Module, fused: nn.Module) -> None:
    """Give ``native`` the settings changed on ``fused`` since the patch (a LayerNorm's
    ``eps``): the Python values of the attributes both have."""
    ours = fused.__dict__
    for name, value in list(native.__dict__.items()):
        if name in MODULE_STATE or name not in ours or ours[name] is value:
            continue
        if is_plain_value(value) and is_plain_value(ours[name]):
            native.__dict__[name] = ours[name]


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
        _carry_settings(self.native, self.fused)
        _carry_init_state(self.native, self.fused)
        if self.adopted:
            _carry_accelerate_hook(self.fused, self.native)
        self.native.train(self.fused.training)
        if self.parent._modules.get(self.attr) is self.fused:
            setattr(self.parent, self.attr, self.native)

    def undo_problem(self) -> str | None:
        """Why undo could not hand the native module back as it runs now, or None."""
        if self.adopted and not type(self.fused).__module__.startswith("fastlayers."):
            return (
                f"{self.name or self.attr} is now a {type(self.fused).__name__} (a "
                "parametrization, or a wrapper such as FSDP2's fully_shard, changed its class "
                "after the patch); unpatch before wrapping, or remove the parametrization first"
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
    ``linear_attr``, the FusedAway in its ``act_attr``. Asked on every call of the fused layer
    (the FusedAway follows its decision), it says whether the pair is broken since: either one
    replaced in the parent, hooks added that would see the fused layer's output as the
    Linear's (forward and backward hooks on the fused layer, any hook on the activation, global
    module hooks), a ``forward`` set on either instance, or the original activation changed
    (class, forward, attribute values). Then the fused layer computes the Linear alone and the
    FusedAway the original activation: what the native modules compute, with their hooks
    seeing what they would (warned once per reason)."""

    def __init__(self, parent: nn.Module, linear_attr: str, act_attr: str) -> None:
        self.parent, self.linear_attr, self.act_attr = parent, linear_attr, act_attr
        self.fused = parent._modules[linear_attr]
        self.away = parent._modules[act_attr]
        # what the fused layer computes was read off the original activation at the patch:
        # its class, forward and attribute values must still say the same
        self.activation = ModuleState.of(self.away.__dict__[NATIVE_ATTR])
        self._compile()

    def _compile(self) -> None:
        """The generated tests: ``_holds`` (the whole pair, on every call of the fused layer)
        and ``_activation_holds`` (the original activation alone, for the reason)."""
        self._holds = self._test()
        self._activation_holds = module_state_test(self.activation)

    def _test(self) -> Callable[[], bool]:
        """``holds() -> bool``: both in their slots, without the hooks and forwards that break
        the pair, no global module hooks, the original activation as it was."""
        b = TestBuilder()
        lines = [
            f"    m = {b.const(self.parent)}.__dict__['_modules']",
            f"    if m.get({self.linear_attr!r}) is not {b.const(self.fused)}: return False",
            f"    if m.get({self.act_attr!r}) is not {b.const(self.away)}: return False",
            f"    fd = {b.const(self.fused)}.__dict__",
            "    if fd['_forward_hooks'] or fd['_backward_hooks'] or fd['_backward_pre_hooks'] "
            "or 'forward' in fd: return False",
            f"    ad = {b.const(self.away)}.__dict__",
            "    if ad['_forward_pre_hooks'] or ad['_forward_hooks'] or ad['_backward_hooks'] or "
            "ad['_backward_pre_hooks'] or 'forward' in ad: return False",
            b.no_global_hooks(),
            *state_lines(b, b.const(self.activation.module), self.activation),
        ]
        return b.compile(lines, signature="")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_holds"], state["_activation_holds"]  # generated code: made again on load
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "activation" not in state:  # pickled by an older fastlayers
            self.activation = ModuleState.of(self.away.__dict__[NATIVE_ATTR])
        self._compile()

    # What the fused layer's latest call decided: True while it computes the Linear alone,
    # so the FusedAway applies the original activation. One decision per pass, read by both,
    # so the activation runs exactly once whatever changes between the two calls.
    apart = False

    def broken(self) -> bool:
        """Asked by the fused layer on each call: one generated test while the pair stands."""
        if self._holds():
            self.apart = False
            return False
        why = self.why_broken()
        if why is not None:
            warn_once(f"a fused Linear + activation computes them apart, natively: {why}", 3)
        self.apart = why is not None
        return self.apart

    def activation_applies(self) -> bool:
        """Asked by the FusedAway on each call: whether it computes the original activation
        (the fused layer computed the Linear alone, or is no longer in its slot)."""
        if self.parent._modules.get(self.linear_attr) is not self.fused:
            why = self.why_broken()
            warn_once(f"a fused Linear + activation computes them apart, natively: {why}", 3)
            return True
        return self.apart

    def why_broken(self) -> str | None:
        modules, fused, away = self.parent._modules, self.fused, self.away
        if modules.get(self.linear_attr) is not fused:
            return f"its Linear ({self.linear_attr}) was replaced since the patch"
        if modules.get(self.act_attr) is not away:
            return f"its activation ({self.act_attr}) was replaced since the patch"
        for kind in ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(fused, kind).keys() - OWN_HOOKS:
                return f"the Linear ({self.linear_attr}) has {HOOK_KINDS[kind]} since the patch"
        for what, module in ((self.linear_attr, fused), (self.act_attr, away)):
            if own_forward(module):
                return f"{what}'s forward was replaced on the instance since the patch"
        if not self._activation_holds():
            return (
                f"the activation ({self.act_attr}) changed since the patch (its class, forward "
                "or attributes)"
            )
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


# ------------------------------------------------------------------ HuggingFace initialisation


class InitWeightsForFused(Rewrite):
    """HuggingFace initialisation (``_init_weights``, reached by ``init_weights()``,
    ``post_init()``, ``initialize_weights()``, ``apply(model._init_weights)`` and
    ``from_pretrained``'s initialisation of missing keys) picks what to do by the module's
    class (``isinstance(module, nn.Linear)``, ``isinstance(module, T5LayerNorm)``, "RMSNorm" in
    the class name); the fused layers are other classes. This rewrite puts a callable on the
    PreTrainedModel instance that initialises a fused module by calling the model's own
    ``_init_weights`` on the native module it replaced (sharing its Parameters), so the fused
    weights get exactly the native ones' init. Which modules it skips follows the flag each
    fused module took over from its native one (``_carry_init_state``)."""

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
        native = module.__dict__.get(NATIVE_ATTR)
        if native is not None:  # the module a patch replaced, sharing the same Parameters
            module = native
        elif isinstance(module, FusedLinearAct):  # built directly
            module = module.to_native()[0]  # nn.Linear / Conv1D around the same Parameters
        return init(module)


# ------------------------------------------------------------------ block rewrites


class _ForwardWrap(Rewrite):
    """A module's forward replaced, on the instance, by a call-time path (runtime/) around the
    forward it had (``forward.previous``: the class's when None, or a block rewrite's)."""

    def __init__(self, model: nn.Module, forward: Any, name: str = "") -> None:
        self.model, self.forward, self.name = model, forward, name

    def apply(self) -> None:
        self.forward.previous = self.model.__dict__.get("forward")
        self.model.__dict__["forward"] = self.forward

    def undo(self) -> None:
        if self.model.__dict__.get("forward") is not self.forward:
            return
        if self.forward.previous is None:
            del self.model.__dict__["forward"]
        else:
            self.model.__dict__["forward"] = self.forward.previous

    def row(self, what: str) -> list[Swap]:
        name = type(self.model).__name__
        return [Swap(self.name or "(root)", f"{name}.forward", what, self.rule)]


class ReplayRecord(_ForwardWrap):
    """The model's forward replaced by a replay.ReplayForward."""

    rule = "replay"

    def describe(self) -> list[Swap]:
        return self.row("CUDA graph replay per shape bucket")


class UnpadRecord(_ForwardWrap):
    """A base model's forward replaced by a runtime.unpad.UnpadForward."""

    rule = "unpad"

    def describe(self) -> list[Swap]:
        what = "padding-free (real tokens)"
        if self.forward.replay is not None:
            what += ", CUDA graph replay per packed-size bucket"
        return self.row(what)


class FusedLossRecord(_ForwardWrap):
    """A causal LM's forward replaced by a runtime.fused_loss.FusedLossForward."""

    rule = "linear_cross_entropy"

    def describe(self) -> list[Swap]:
        what = "head + loss chunked, no logits in training with labels (outputs.logits None)"
        if self.forward.softcap:
            what += ", final logit soft-capping"
        return self.row(what)


class BlockRewrite(Rewrite):
    """A block whose forward runs fused ops in place of the matched subgraphs (one report row
    per match, under the match's rule)."""

    def __init__(self, block: nn.Module, name: str, matches: list, forward: Any) -> None:
        self.block, self.name, self.matches, self.forward = block, name, matches, forward
        self.rule = ", ".join(dict.fromkeys(m.rule for m in matches))
        self.attr = forward_attr(block)
        self.previous = _MISSING

    def apply(self) -> None:
        self.previous = self.block.__dict__.get(self.attr, _MISSING)
        self.block.__dict__[self.attr] = self.forward

    def undo(self) -> None:
        if self.block.__dict__.get(self.attr) is not self.forward:
            return
        if self.previous is _MISSING and self.attr == "forward":
            del self.block.__dict__["forward"]
        elif self.previous is _MISSING:  # accelerate's: the class forward, bound
            self.block.__dict__[self.attr] = types.MethodType(type(self.block).forward, self.block)
        else:
            self.block.__dict__[self.attr] = self.previous

    def describe(self) -> list[Swap]:
        # matches that describe one thing give one row (an attention's two routed globals)
        return list(dict.fromkeys(m.row(self.name) for m in self.matches))

    def restored_modules(self) -> int:
        return len(self.describe())  # one per report row (a fused LayerNorm, a relu * c)

    def claims(self) -> set[str]:
        """The children this rewrite takes over (no module rule swaps them)."""
        return claimed_children(self.matches)

    def check_targets(self) -> list[CheckTarget]:
        block = self.block

        def native(*args: Any, **kwargs: Any) -> Any:
            return type(block).forward(block, *args, **kwargs)

        def reference() -> Any:
            twin = copy.deepcopy(block).double()
            for m in twin.modules():  # the copies of the check's own probes among them
                for attr in HOOK_KINDS:
                    getattr(m, attr, {}).clear()
            return lambda *a, **k: type(twin).forward(twin, *a, **k)

        fused = " + ".join(dict.fromkeys(m.fused_op for m in self.matches))
        return [CheckTarget(self.name or "(root)", block, native, reference, fused)]
