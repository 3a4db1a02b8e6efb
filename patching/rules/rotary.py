"""Rule 'rotary': an attention whose forward calls a module-level rotary embedding function
(transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``) calls fastlayers'
rotary op in its place, for that module instance only (a route: patching/routes.py).

What the function computes is proven, not read from its name: the name only picks which of the
forward's globals to probe (one containing 'rotary' or 'rope'). Only the model's own code is
probed: a plain function of the attention's module or a transformers module, no closure, reading
nothing but modules (``torch``) and other such functions; a wrapper (a user's or a library's,
which may hold state or must itself run) is left to run, unprobed, and reported. The function is
then run on random q, k, cos, sin in six dtype pairings (half q with float32 cos included), two
layouts (``unsqueeze_dim`` 1 and 2), two sizes and partial rotary widths, forward and backward,
and must match one of the op's forms (fastlayers/ops/rotary.py: LLaMA's, Phi-3's partial,
OLMo2's cast back, Cohere's interleaved float32, ModernBERT's float32 per use) bit for bit. A
function that matches none (DeepSeek's de-interleaving form, GLM's repeated halves, a
single-tensor form) is reported as skipped with the reason. The probe runs once per function
(and again when a global it reads changes).

The routed function keeps the original's signature: ``position_ids`` given (an old signature)
calls the original. The op itself computes the model's composite with native autograd where its
kernels do not apply (q and k of two dtypes, cos or sin requiring grad), so a routed call never
computes otherwise than the model's function."""

from __future__ import annotations

import builtins
import inspect
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fastlayers.layers.recognise import probing
from fastlayers.ops.rotary import (
    ALL_FLAGS,
    PARTIAL,
    UPCAST,
    UPCAST_EACH,
    form_name,
    rotary_bwd,
    rotary_forward,
    rotary_fwd,
)

from ..forms import code_facts, global_reads, join, reachable_functions
from ..report import Swap
from ..trace import inner_forward
from .base import RouteRule

RULE = "rotary"
_NAME_PARTS = ("rotary", "rope")

# The signatures a routed function reproduces: the parameters after (q, k, cos, sin).
_SIGNATURES = (("unsqueeze_dim",), ("position_ids", "unsqueeze_dim"))


@dataclass(frozen=True)
class RotaryMatch:
    """A rotary function the block's forward calls by the global ``name``, computing ``form``."""

    rule: ClassVar[str] = RULE
    fused_op: ClassVar[str] = "rotary"
    # Inductor fuses the rotation into one kernel itself: under torch.compile the block runs its
    # original forward (fastlayers.config.compile_rotary)
    inductor_fuses: ClassVar[bool] = True

    name: str  # the global the forward calls
    form: int
    params: tuple[str, ...]  # the parameters after (q, k, cos, sin): one of _SIGNATURES
    unsqueeze_default: int

    def claims(self) -> set[str]:
        return set()  # no child: the block's modules are called as before

    def live_attributes(self) -> dict[str, frozenset[str]]:
        return {}

    def row(self, block_name: str) -> Swap:
        return Swap(
            join(block_name, f"{self.name}()"),
            self.name,
            f"{self.fused_op} ({form_name(self.form)})",
            RULE,
        )

    def routed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The function the block's forward calls in ``original``'s place (same signature)."""
        form, default = self.form, self.unsqueeze_default
        if self.params == _SIGNATURES[0]:

            def fused(q, k, cos, sin, unsqueeze_dim=default):
                return rotary_forward(q, k, cos, sin, unsqueeze_dim, form)

        else:

            def fused(q, k, cos, sin, position_ids=None, unsqueeze_dim=default):
                if position_ids is not None:
                    return original(q, k, cos, sin, position_ids, unsqueeze_dim)
                return rotary_forward(q, k, cos, sin, unsqueeze_dim, form)

        fused.__name__ = fused.__qualname__ = original.__name__
        fused.__wrapped__ = original  # type: ignore[attr-defined]
        return fused


# ------------------------------------------------------------------ recognition


def _candidates() -> list[int]:
    """Every form, simplest first (the first one matching every probe is taken)."""
    forms = [f for f in range(ALL_FLAGS + 1) if not f & PARTIAL]
    forms = [f for f in forms if not (f & UPCAST_EACH and not f & UPCAST)]
    return sorted(forms, key=lambda f: (bin(f).count("1"), f))


_PAIRINGS = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float64, torch.float64),
)


@dataclass
class _Probe:
    q: torch.Tensor
    k: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    unsqueeze_dim: int
    grads: tuple[torch.Tensor, torch.Tensor] | None = None


def _values(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal values over five decades: where two rounding orders differ, they differ here (and
    float16 products stay finite)."""
    scale = torch.pow(10.0, torch.randint(-3, 2, shape, generator=gen).double())
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _probe(
    gen: torch.Generator,
    q_dtype,
    cos_dtype,
    rotary: int,
    heads_second: bool,
    shape: tuple[int, int, int, int, int] = (2, 3, 4, 2, 8),
) -> _Probe:
    b, s, h, hk, d = shape
    q = _values(gen, b, s, h * d).to(q_dtype).view(b, s, h, d)
    k = _values(gen, b, s, hk * d).to(q_dtype).view(b, s, hk, d)
    if heads_second:  # [B, H, S, D] views of the projections, as the models make them
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = (_values(gen, b, s, rotary).to(cos_dtype) for _ in range(2))
    return _Probe(q, k, cos, sin, 1 if heads_second else 2)


def _native_run(fn: Callable, probe: _Probe, gen: torch.Generator) -> tuple | None:
    """fn's outputs and q, k grads on the probe, or None where fn raises."""
    q = probe.q.detach().requires_grad_()
    k = probe.k.detach().requires_grad_()
    try:
        with torch.enable_grad():
            out = fn(q, k, probe.cos, probe.sin, unsqueeze_dim=probe.unsqueeze_dim)
            if not (isinstance(out, tuple) and len(out) == 2):
                return None
            if not all(isinstance(t, torch.Tensor) and t.requires_grad for t in out):
                return None
            grads = tuple(_values(gen, *t.shape).to(t.dtype) for t in out)
            dq, dk = torch.autograd.grad(out, (q, k), grads, allow_unused=True)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    probe.grads = grads
    return (*(t.detach() for t in out), dq, dk)


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values, NaNs where the other has NaNs."""
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _op_matches(form: int, probe: _Probe, native: tuple) -> bool:
    try:
        q_out, k_out = rotary_fwd(probe.q, probe.k, probe.cos, probe.sin, probe.unsqueeze_dim, form)
        dq, dk = rotary_bwd(
            *probe.grads, probe.cos, probe.sin, probe.unsqueeze_dim, form, probe.q.dtype
        )
    except (RuntimeError, IndexError, ValueError):
        return False
    return all(_same(n, o) for n, o in zip(native, (q_out, k_out, dq, dk), strict=True))


_RECOGNISED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def recognise_rotary(fn: Callable) -> tuple[int | None, str]:
    """(the op's form computing what ``fn`` computes, forward and backward, bit for bit, or
    None; the reason when None). The probes run with autograd on, outside inference mode and
    autocast, whatever the caller's (fastlayers.layers.recognise.probing), so the verdict is
    the function's own; it is cached per function while the globals it reads stay, except a
    verdict of a function that raised on a probe (the cause may be the process's state: a
    deterministic-algorithms setting, memory), which is asked again next time."""
    deps = global_reads(fn) if isinstance(fn, types.FunctionType) else []
    state = tuple(id(g.get(n)) for g, n in deps)
    cached = _RECOGNISED.get(fn)
    if cached is not None and cached[0] == state:
        return cached[1]
    with probing(grad=True):
        result, raised = _recognise(fn)
    if not raised:
        try:
            _RECOGNISED[fn] = (state, result)
        except TypeError:  # not weak-referenceable
            pass
    return result


def _recognise(fn: Callable) -> tuple[tuple[int | None, str], bool]:
    """(recognise_rotary's answer, whether fn raised on a probe that decided it)."""
    gen = torch.Generator().manual_seed(1234)
    forms = _candidates()
    for heads_second in (True, False):
        for q_dtype, cos_dtype in _PAIRINGS:
            if not heads_second and q_dtype != torch.float32:
                continue  # the layout probe: one pairing suffices
            probe = _probe(gen, q_dtype, cos_dtype, 8, heads_second)
            native = _native_run(fn, probe, gen)
            if native is None:
                why = f"raised or returned otherwise on {q_dtype} q with {cos_dtype} cos"
                return (None, why), True
            forms = [f for f in forms if _op_matches(f, probe, native)]
            if not forms:
                return (
                    None,
                    "computes otherwise than every rotary form fastlayers has (tried bit for "
                    f"bit, forward and backward; first differing: {q_dtype} q, {cos_dtype} cos)",
                ), False
    # other sizes (one sequence, one KV head, a wider head): a form holds at every shape
    for q_dtype, cos_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        probe = _probe(gen, q_dtype, cos_dtype, 16, True, shape=(1, 5, 3, 1, 16))
        native = _native_run(fn, probe, gen)
        forms = [f for f in forms if native is not None and _op_matches(f, probe, native)]
        if not forms:
            why = "computes otherwise at another shape (head size 16, one KV head)"
            return (None, why), native is None
    form = forms[0]
    # partial rotary widths: the function refuses them (the forms above), or must compute the
    # PARTIAL form (Phi-3, GPT-NeoX); anything else would make routed calls differ
    for q_dtype, cos_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        probe = _probe(gen, q_dtype, cos_dtype, 4, True)
        native = _native_run(fn, probe, gen)
        if native is None:
            continue
        if _op_matches(form | PARTIAL, probe, native):
            form |= PARTIAL
            continue
        return (None, "computes otherwise on a partial rotary width (cos narrower than q)"), False
    return (form, ""), False


def _looks_rotary(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in _NAME_PARTS)


def _signature(fn: Callable) -> tuple[tuple[str, ...], int] | None:
    """(the parameters after q, k, cos, sin; unsqueeze_dim's default) where ``fn`` has one of
    _SIGNATURES, else None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(params) < 4 or any(
        p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params[:4]
    ):
        return None
    rest = tuple(p.name for p in params[4:])
    if rest not in _SIGNATURES or any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params[4:]):
        return None
    default = params[-1].default
    return (rest, default) if isinstance(default, int) else None


def _model_namespace(g: dict, forward_globals: dict) -> bool:
    """``g`` is the attention's own module's globals, or a transformers module's."""
    if g is forward_globals:
        return True
    name = str(g.get("__name__", ""))
    module = sys.modules.get(name)
    return name.startswith("transformers.") and module is not None and vars(module) is g


def _state_problem(fn: Any, forward_globals: dict) -> str | None:
    """Why a probe cannot prove what ``fn`` computes on every later call, or None. A probe
    proves a function whose result depends on its arguments alone: a plain function of the
    model's code (the attention's module or a transformers module), no closure, reading only
    modules (``torch``) and other such functions. A wrapper (a user's, a library's), a closure,
    or a function reading other global objects (a dict, a flag, a class) may compute otherwise
    later, or must itself be called: it is left to run."""
    if not isinstance(fn, types.FunctionType):
        what = getattr(fn, "__qualname__", repr(fn))
        return f"{what} is not a plain Python function (a wrapper?): left to run"
    for f in reachable_functions(fn):
        what = f.__qualname__
        if not _model_namespace(f.__globals__, forward_globals):
            return (
                f"{what} is defined outside the model's code (module "
                f"{f.__globals__.get('__name__')!r}: a wrapper?): left to run"
            )
        if f.__closure__:
            return f"{what} is a closure (its result may depend on state): left to run"
        for name in code_facts(f).globals:
            if name not in f.__globals__ and name in vars(builtins):
                continue  # a builtin (len, int, isinstance)
            if not isinstance(f.__globals__.get(name), (types.ModuleType, types.FunctionType)):
                return f"{what} reads the global {name!r}, state a probe cannot vouch for"
    return None


def wants_rotary(block: nn.Module) -> bool:
    """Pre-filter: the class forward is a Python function naming a rotary-like global."""
    fn = inner_forward(type(block))
    return isinstance(fn, types.FunctionType) and any(map(_looks_rotary, code_facts(fn).globals))


def find_rotary(block: nn.Module) -> tuple[list[RotaryMatch], list[tuple[str, str]]]:
    """The rotary functions ``block``'s forward calls that the op computes, and (name, reason)
    for those it does not."""
    fn = inner_forward(type(block))
    matches, skips = [], []
    for name in code_facts(fn).globals:
        if not _looks_rotary(name):
            continue
        value = fn.__globals__.get(name)
        if not callable(value) or isinstance(value, type):
            continue
        where = f"{name}()"
        why = _state_problem(value, fn.__globals__)
        if why is not None:  # asked before any probe: a user's wrapper is never called here
            skips.append((where, why))
            continue
        signature = _signature(value)
        if signature is None:
            skips.append(
                (where, "its signature is not (q, k, cos, sin[, position_ids], unsqueeze_dim)")
            )
            continue
        form, why = recognise_rotary(value)
        if form is None:
            skips.append((where, why))
            continue
        matches.append(RotaryMatch(name, form, *signature))
    return matches, skips


ROTARY = RouteRule(name=RULE, wants=wants_rotary, find=find_rotary)
