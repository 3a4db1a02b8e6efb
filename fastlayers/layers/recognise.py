"""What a native module computes, for the fused layers' ``from_native`` and the patcher: one
recogniser per native kind. Activations (GELU erf/tanh, ReLU) and Linear look-alikes are
recognised by their class when it is torch's own, otherwise by running the module's class forward
on float64 probe inputs (so a subclass or a library's own module is fused only when it provably
computes the same function)."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fastlayers.ops.linear_act import GELU_ACTIVATION, GELU_APPROXIMATE

# Points where an activation module is compared with each known activation: dense over the range
# where the GELU forms differ (up to ~5e-4 apart), plus far points that unmask clipping (ReLU6,
# clipped GELU) and zero.
_PROBE = torch.cat(
    [
        torch.linspace(-8.0, 8.0, 161, dtype=torch.float64),
        torch.tensor([-1e4, -100.0, -20.0, 20.0, 100.0, 1e4], dtype=torch.float64),
    ]
)
# The probe is repeated so that rare train-mode randomness shows: a dropout of p = 1e-3 leaves
# all of 2 x 10,688 points untouched with probability ~5e-10.
_PROBE_REPEATS = 64

# Class-module prefixes of quantized layers (torch's own, bitsandbytes, GPTQ, AWQ, HQQ, quanto).
QUANTIZED_MODULE_PREFIXES = (
    "torch.ao.nn.quantized",
    "torch.nn.quantized",
    "torch.ao.nn.intrinsic.quantized",
    "bitsandbytes",
    "auto_gptq",
    "gptqmodel",
    "awq",
    "hqq",
    "optimum.quanto",
)


_SHOWN = {"gelu": "GELU", "gelu_tanh": "GELU (tanh form)", "relu": "ReLU", "silu": "SiLU"}
# What recognise_activation tells apart by default: the Linear + activation ops' activations.
# The gated MLP's op takes SiLU too (kinds=GATED_KINDS).
LINEAR_ACT_KINDS = ("gelu", "gelu_tanh", "relu")
GATED_KINDS = ("silu", *LINEAR_ACT_KINDS)


def _activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return x.clamp_min(0.0)
    if activation == "silu":
        return x / (1.0 + torch.exp(-x))
    if activation == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))
        return 0.5 * x * (1.0 + torch.tanh(inner))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def recognise_activation(
    activation: nn.Module, kinds: tuple[str, ...] = LINEAR_ACT_KINDS
) -> tuple[str | None, str | None]:
    """``(name, None)`` when ``activation`` provably computes one of ``kinds`` — by default the
    fused Linear + activation ops' ``'gelu'`` (exact, erf), ``'gelu_tanh'`` and ``'relu'``;
    ``'silu'`` where asked (the gated MLP's op) — else ``(None, why)``.

    ``nn.GELU`` / ``nn.ReLU`` (or subclasses that keep their forward) are read from the class
    (``approximate``; ``inplace`` either way). Any other parameter-free module (HuggingFace's
    ``GELUActivation``, ``NewGELUActivation``, ``GELUTanh``, a subclass with its own forward,
    ...) is recognised by what its class forward computes, in float64 on probe points, in eval
    mode and twice in train mode (so dropout or other train-only randomness shows); clipped,
    sigmoid-based or squared variants are not mistaken for one. The probe leaves the training
    flags and the CPU random generator as they were. Hooks are not looked at (the patcher checks
    them before calling this: the probe would run hooks of submodules)."""
    name = type(activation).__name__
    if isinstance(activation, nn.GELU) and type(activation).forward is nn.GELU.forward:
        if activation.approximate in GELU_ACTIVATION:
            return GELU_ACTIVATION[activation.approximate], None
        return None, f"{name} has approximate={activation.approximate!r}"
    if isinstance(activation, nn.ReLU) and type(activation).forward is nn.ReLU.forward:
        return "relu", None
    if (
        "silu" in kinds
        and isinstance(activation, nn.SiLU)
        and type(activation).forward is nn.SiLU.forward
    ):
        return "silu", None
    if not isinstance(activation, nn.Module):
        return None, f"{name} is not an nn.Module"
    if any(True for _ in activation.parameters()) or any(True for _ in activation.buffers()):
        return None, f"{name} has parameters or buffers, so it is not an activation alone"
    why = extra_inputs(activation)
    if why is not None:
        return None, why
    forms = _in_each_mode(activation, lambda: _probe_form(activation, kinds))
    if forms[0] is None:
        shown = "SiLU, " if "silu" in kinds else ""
        return None, f"{name} is not {shown}GELU (erf or tanh form) or ReLU"
    if forms[1] != forms[0] or forms[2] != forms[0]:
        return None, (
            f"{name} computes {_SHOWN[forms[0]]} in eval mode but not in train mode (its own "
            "forward; probed in float64)"
        )
    return forms[0], None


def gelu_approximation(activation: nn.Module) -> str | None:
    """``'none'`` if ``activation`` computes exact (erf) GELU, ``'tanh'`` if it computes the tanh
    approximation, ``None`` otherwise (:func:`recognise_activation` says why)."""
    return GELU_APPROXIMATE.get(recognise_activation(activation)[0])


@contextlib.contextmanager
def probing(grad: bool = False) -> Iterator[None]:
    """The mode every probe runs in, whatever the caller's: outside inference mode, autocast
    off on every device type, autograd on (``grad``) or off; so a probe's verdict depends on
    the probed function alone (a patch inside ``torch.inference_mode()`` or ``torch.autocast``
    proves what one outside proves)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.set_grad_enabled(grad))
        for device_type in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


_AUTOCAST_DEVICES = ("cpu", "cuda")


def extra_inputs(module: nn.Module) -> str | None:
    """Why ``module``'s class forward is not a one-tensor function: the parameters it takes
    beyond its input (``gate=None``, ``*args``, ``**kwargs``), named; or None. A fused module
    takes one tensor, so a module whose forward takes more is no plain norm or activation
    (Mamba's gated RMSNorm is called ``norm(x, gate)`` by its mixer), whatever a probe with the
    defaults shows."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())
    except (TypeError, ValueError):
        return f"{type(module).__name__}'s forward has no signature to read"
    kind = inspect.Parameter
    extra = [
        ("*" if p.kind is kind.VAR_POSITIONAL else "**" if p.kind is kind.VAR_KEYWORD else "")
        + p.name
        for p in params[2:]
    ]
    if len(params) < 2 or params[1].kind not in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD):
        return f"{type(module).__name__}'s forward does not take its input as one argument"
    if extra:
        return (
            f"{type(module).__name__}'s forward takes more than its input ({', '.join(extra)}): "
            "a call with them computes something a one-input fused module cannot"
        )
    return None


def _in_each_mode(module: nn.Module, probe, runs: int = 3) -> list:
    """``probe()`` in eval mode, then twice in train mode (the first ``runs`` of those), under a
    forked CPU generator and no grad (:func:`probing`); the training flags are put back."""
    modes = [(m, m.training) for m in module.modules()]
    out = []
    try:
        with probing(), torch.random.fork_rng(devices=[]):
            for training in (False, True, True)[:runs]:
                for m, _ in modes:  # the flag itself: an overridden train() may do more
                    m.training = training
                out.append(probe())
    finally:
        for m, training in modes:
            m.training = training
    return out


def _probe_form(activation: nn.Module, kinds: tuple[str, ...]) -> str | None:
    """Which of ``kinds`` ``activation``'s class forward computes on the probe, or None."""
    probe = _PROBE.repeat(_PROBE_REPEATS)
    try:
        # the class's forward: no hooks (user or accelerate) run on the probe
        out = type(activation).forward(activation, probe.clone())
    except Exception:  # not an elementwise activation we can run on a float64 CPU tensor
        return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return None
    for name in ("relu", *GELU_ACTIVATION.values(), "silu"):
        if name not in kinds:
            continue
        ref = _activation_reference(probe, name)
        if bool(((out.double() - ref).abs() <= 1e-7 * (1.0 + ref.abs())).all()):
            return name
    return None


def _is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2 and kin): a linear layer whose weight is [in, out]."""
    return (
        type(module).__name__ == "Conv1D"
        and type(module).__module__.startswith("transformers")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    )


def foreign_linear_reason(module: nn.Module) -> str | None:
    """Why ``module`` is an adapter-wrapped or quantized layer (never fused), or None."""
    cls = type(module)
    if cls.__module__.startswith("peft") or hasattr(module, "base_layer"):
        return "wrapped by PEFT/LoRA (adapter weights would be dropped)"
    if cls.__module__.startswith(QUANTIZED_MODULE_PREFIXES):
        return f"{cls.__name__} is quantized"
    return None


def linear_layout(module: nn.Module) -> tuple[str | None, str | None]:
    """``('linear', None)`` for an ``nn.Linear`` (weight [out, in]) — torch's own forward, or a
    subclass whose own forward provably computes ``F.linear`` (Falcon's ``FalconLinear``:
    ``x @ W.T + b``), probed in float64 —, ``('conv1d', None)`` for HuggingFace's ``Conv1D``
    (weight [in, out]), else ``(None, why)``: adapter-wrapped and quantized layers, subclasses
    computing something else, and other modules."""
    why = foreign_linear_reason(module)
    if why is not None:
        return None, why
    if _is_hf_conv1d(module):
        return "conv1d", None
    name = type(module).__name__
    if not isinstance(module, nn.Linear):
        return None, f"{name} is not an nn.Linear or HuggingFace Conv1D"
    if type(module).forward is nn.Linear.forward:
        return "linear", None
    why = extra_inputs(module) or _linear_probe_problem(module)
    if why is not None:
        return None, f"{name} has its own forward ({why}; probed in float64)"
    return "linear", None


def _linear_probe_problem(module: nn.Linear) -> str | None:
    """Why ``module``'s class forward does not compute ``F.linear`` on a small float64 twin (a
    shallow copy holding random float64 weight and bias of a small shape: the real weights are
    neither read nor copied), or None."""
    if module._buffers or set(module._parameters) - {"weight", "bias"} or module._modules:
        return "it holds tensors or modules beyond weight and bias"
    has_bias = module._parameters.get("bias") is not None
    gen = torch.Generator().manual_seed(0)
    in_f, out_f = 7, 5
    weight = torch.randn(out_f, in_f, dtype=torch.float64, generator=gen)
    bias = torch.randn(out_f, dtype=torch.float64, generator=gen) if has_bias else None
    x = torch.randn(3, 2, in_f, dtype=torch.float64, generator=gen)
    twin = copy.copy(module)
    object.__setattr__(twin, "_parameters", {"weight": weight, "bias": bias})
    object.__setattr__(twin, "_buffers", {})
    object.__setattr__(twin, "_modules", {})
    twin.__dict__.update(in_features=in_f, out_features=out_f)
    expected = F.linear(x, weight, bias)

    def probe() -> bool:
        try:
            out = type(module).forward(twin, x.clone())
        except Exception:
            return False
        return (
            isinstance(out, torch.Tensor)
            and out.shape == expected.shape
            and bool(((out.double() - expected).abs() <= 1e-12 * (1 + expected.abs())).all())
        )

    if not all(_in_each_mode(twin, probe)):
        return "it does not compute F.linear"
    return None


# RMSNorm modules. The forms differ only in rounding (which casts come before the weight), so
# they are told apart on half-precision probes, compared bit for bit, in every dtype pairing a
# model runs (input x weight), plus float64 (OLMo2 computes in float32 even there).
_RMS_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")
_RMS_PROBE_DTYPES = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
    (torch.float64, torch.float64),
)


def rms_norm_candidate(module: nn.Module) -> str | None:
    """The attribute holding ``module``'s epsilon when it is shaped like an RMSNorm (one 1-D
    Parameter ``weight``, no buffers or children, a plain number for epsilon), else None.
    Structure only: :func:`recognise_rms_norm` proves what it computes."""
    if isinstance(module, nn.RMSNorm):
        return "eps"
    if not isinstance(module, nn.Module):
        return None
    params = module._parameters
    if set(params) != {"weight"} or module._buffers or module._modules:
        return None
    weight = params["weight"]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    return next(
        (
            a
            for a in _RMS_EPS_ATTRS
            if type(module.__dict__.get(a)) in (float, int) and module.__dict__[a] >= 0
        ),
        None,
    )


def recognise_rms_norm(module: nn.Module) -> tuple[str | None, str | None, str | None]:
    """``(form, eps_attribute, None)`` when ``module`` computes one of fastlayers' RMSNorm
    forms (fastlayers.functional.rms_norm), else ``(None, None, why)``.

    ``torch.nn.RMSNorm`` (or a subclass keeping its forward) is read from the class: form
    ``'torch'``. Any other module shaped like an RMSNorm (:func:`rms_norm_candidate`) whose
    class forward takes its input alone (:func:`extra_inputs`: a gated norm is refused) is run,
    by its class forward (no hooks), on a twin holding random weights, for each dtype pairing
    of ``_RMS_PROBE_DTYPES``, in eval and train mode, at the module's own width and at twice
    it (a norm over groups or blocks of the row shows there, and so does one computing
    otherwise once its weight is resized); it is taken when one form reproduces every output
    bit for bit, dtype included, at both widths (or at its own, where the forward refuses the
    other width: a width-bound module). docs/decisions.md, "What a probe varies"."""
    name = type(module).__name__
    if isinstance(module, nn.RMSNorm) and type(module).forward is nn.RMSNorm.forward:
        return "torch", "eps", None
    eps_attr = rms_norm_candidate(module)
    if eps_attr is None:
        return (
            None,
            None,
            (
                f"{name} is not shaped like an RMSNorm (one 1-D Parameter 'weight', no buffers or "
                f"submodules, epsilon in one of {_RMS_EPS_ATTRS})"
            ),
        )
    why = extra_inputs(module)
    if why is not None:
        return None, None, why
    width = module._parameters["weight"].shape[0]
    key = _probe_key(module, width)
    cache = _PROBE_CACHE.get()
    if cache is not None and key is not None and key in cache:
        return cache[key]
    result = _recognise_rms_probed(module, name, eps_attr, width)
    if cache is not None and key is not None:
        cache[key] = result
    return result


# Verdicts of one patch (see :func:`probe_cache`), keyed by what a probe's result depends on.
_PROBE_CACHE: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "fastlayers_probe_cache", default=None
)
_PLAIN = (int, float, bool, str, type(None))


@contextlib.contextmanager
def probe_cache() -> Iterator[None]:
    """Within it, modules of one class, width and attribute values are probed once (a decoder's
    norms: one probe per kind, not one per layer). Scoped to one patch: the globals a class
    forward reads may change between patches."""
    token = _PROBE_CACHE.set({})
    try:
        yield
    finally:
        _PROBE_CACHE.reset(token)


def _probe_key(module: nn.Module, width: int) -> tuple | None:
    """What a norm probe's verdict depends on besides the code: class, width and the instance's
    plain attribute values; None where the instance holds other public values (not cached)."""
    items = []
    for attr, value in module.__dict__.items():
        if attr.startswith("_") or attr == "training":
            continue
        if type(value) not in _PLAIN:
            return None
        items.append((attr, value))
    return (type(module), type(module).forward, width, tuple(sorted(items)))


def _recognise_rms_probed(
    module: nn.Module, name: str, eps_attr: str, width: int
) -> tuple[str | None, str | None, str | None]:
    forms = _in_each_mode(module, lambda: _probe_rms_form(module, eps_attr, width))
    if forms[0] in (None, _REFUSED) or forms[1] != forms[0] or forms[2] != forms[0]:
        return (
            None,
            None,
            (
                f"{name} does not compute an RMSNorm form fastlayers reproduces bit for bit "
                f"(torch, cast_first, t5, gemma, float32; probed on its class forward at its "
                f"width, {width})"
            ),
        )
    # eval mode alone: train-mode randomness showed at its own width
    wider = _in_each_mode(module, lambda: _probe_rms_form(module, eps_attr, 2 * width), 1)
    if any(form not in (forms[0], _REFUSED) for form in wider):
        return (
            None,
            None,
            (
                f"{name} computes a plain RMSNorm at its width ({width}) but otherwise at "
                f"{2 * width} (normalises in groups or blocks of the row, or reads its width "
                "from elsewhere)"
            ),
        )
    return forms[0], eps_attr, None


# What _probe_rms_form returns where the forward raised or returned another shape.
_REFUSED = "refused"


def _probe_rms_form(module: nn.Module, eps_attr: str, cols: int) -> str | None:
    """The one form whose output equals ``module``'s class forward on every probe ``cols``
    wide, None where none or several do, ``_REFUSED`` where the forward raised or returned
    another shape."""
    from fastlayers.ops.rms_norm import FORMS, native_rms_norm

    gen = torch.Generator().manual_seed(0)
    eps = module.__dict__[eps_attr]
    # rows of very different scales: a small one makes eps matter (a wrong eps shows); two
    # leading dimensions, so that a norm over more than the last one shows
    scale = torch.tensor([[[1.0], [3e-4], [40.0]], [[0.5], [7.0], [1e-2]]], dtype=torch.float64)
    twin = copy.copy(module)
    object.__setattr__(twin, "_buffers", {})
    object.__setattr__(twin, "_modules", {})
    candidates = set(FORMS)
    for x_dtype, w_dtype in _RMS_PROBE_DTYPES:
        x = (torch.randn(2, 3, cols, dtype=torch.float64, generator=gen) * scale).to(x_dtype)
        w = (torch.randn(cols, dtype=torch.float64, generator=gen) * 0.5 + 1.0).to(w_dtype)
        object.__setattr__(twin, "_parameters", {"weight": nn.Parameter(w, requires_grad=False)})
        try:
            out = type(module).forward(twin, x.clone())
        except Exception:
            return _REFUSED
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return _REFUSED
        for form in list(candidates):
            ref = native_rms_norm(x, [cols], w, eps, FORMS[form])
            if ref.dtype != out.dtype or not torch.equal(ref, out):
                candidates.discard(form)
        if not candidates:
            return None
    # "torch" and "float32" differ only on float64 probes, which the loop ran
    return next(iter(candidates)) if len(candidates) == 1 else None
