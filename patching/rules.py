"""The patcher's rule table: which native modules and module patterns become which fused layer,
and why a candidate is left alone. Data here, mechanics in swap.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fastlayers.layers import FusedLinearGELU, LayerNorm, ReLUScale
from fastlayers.layers.linear_gelu import _is_hf_conv1d, _is_plain_linear, gelu_approximation
from fastlayers.ops._checks import SUPPORTED_DTYPES

ALL_LAYERS = ("layer_norm", "linear_gelu", "relu")
# Where a fused module (or FusedAway) keeps the native module it replaced (not a submodule).
NATIVE_ATTR = "_fastlayers_native"
FUSED_TYPES = (LayerNorm, FusedLinearGELU, ReLUScale)


@dataclass(frozen=True)
class ModuleRule:
    """One native module type (matched exactly: subclasses may compute something else) swapped
    for a fused layer built around its own Parameters."""

    name: str
    native: type[nn.Module]
    build: Callable[[nn.Module], nn.Module]
    # Class-name fragments of modules that look like this rule's target but are not it; they
    # are reported as skipped (e.g. T5's RMSNorm-style T5LayerNorm).
    lookalikes: tuple[str, ...]


MODULE_RULES = (
    ModuleRule("layer_norm", nn.LayerNorm, LayerNorm.from_native, ("LayerNorm", "RMSNorm")),
    ModuleRule("relu", nn.ReLU, lambda relu: ReLUScale.from_native(relu, 1.0), ("ReLU",)),
)

# Blocks whose forward applies ``activation(linear(x))`` but does not trace with torch.fx
# (data-dependent control flow elsewhere in the forward). Class name -> (linear attribute,
# activation attribute). The linear's output goes only to the activation in each of them
# (checked against each model's source; the patcher tests cover BART).
LINEAR_ACT_BLOCKS: dict[str, tuple[str, str]] = {
    f"{family}{role}Layer": ("fc1", "activation_fn")
    for family in (
        "Bart",
        "MBart",
        "PLBart",
        "Marian",
        "Pegasus",
        "Blenderbot",
        "BlenderbotSmall",
        "M2M100",
        "Whisper",
        "Speech2Text",
    )
    for role in ("Encoder", "Decoder")
}

# Parameter-free modules that are activations (so a Linear feeding one that is not GELU is
# reported as skipped rather than passed over silently).
_ACTIVATION_NAME_PARTS = ("Activation", "GELU", "GLU", "SiLU", "Swish", "ReLU", "Tanh", "Sigmoid")


def looks_like_activation(module: nn.Module) -> bool:
    return any(part in type(module).__name__ for part in _ACTIVATION_NAME_PARTS)


class FusedAway(nn.Identity):
    """Stands where an activation was after it was fused into the preceding layer (the
    activation now runs inside that layer). :func:`fastlayers.unpatch` puts the original back."""

    def __init__(self, original: nn.Module, into: str) -> None:
        super().__init__()
        object.__setattr__(self, NATIVE_ATTR, original)
        self.into = into
        self.train(original.training)

    def extra_repr(self) -> str:
        return f"{type(self.__dict__[NATIVE_ATTR]).__name__} fused into {self.into!r}"


def is_fused(module: nn.Module) -> bool:
    """Already one of ours (a second patch leaves it alone)."""
    return isinstance(module, (*FUSED_TYPES, FusedAway))


def _dtype_problem(module: nn.Module) -> str | None:
    for name, p in module.named_parameters(recurse=False):
        if p.dtype not in SUPPORTED_DTYPES:
            return f"{name} is {p.dtype}; the fused layers take float32, float16, bfloat16"
    return None


def _hook_problem(module: nn.Module, what: str) -> str | None:
    if module._forward_hooks:  # hooks registered with_kwargs are in this dict too
        return f"the {what} has forward hooks, which would see a different output once fused"
    return None


def module_rule_skip(module: nn.Module) -> str | None:
    """Why ``module`` (of exactly a module rule's native type) cannot be swapped, or None."""
    return _dtype_problem(module)


def lookalike_reason(rule: ModuleRule, module: nn.Module) -> str | None:
    """A reason to report ``module`` as skipped by ``rule`` when it resembles the target."""
    if type(module) is rule.native or is_fused(module):
        return None
    if isinstance(module, rule.native):
        return (
            f"a subclass of {rule.native.__name__} ({type(module).__name__}), may compute otherwise"
        )
    if any(part in type(module).__name__ for part in rule.lookalikes):
        return f"not a torch.nn.{rule.native.__name__} (its own computation)"
    return None


def linear_kind(module: nn.Module) -> str | None:
    """'linear' (nn.Linear computing what it computes), 'conv1d' (HuggingFace Conv1D), None."""
    if _is_plain_linear(module):
        return "linear"
    if _is_hf_conv1d(module):
        return "conv1d"
    return None


def linear_skip(module: nn.Module) -> str | None:
    """Why a module feeding a GELU cannot become a FusedLinearGELU, or None."""
    cls = type(module)
    if cls.__module__.startswith("peft") or hasattr(module, "base_layer"):
        return "wrapped by PEFT/LoRA (adapter weights would be dropped)"
    if linear_kind(module) is None:
        if isinstance(module, nn.Linear):
            return f"{cls.__name__} has its own forward (quantized or custom Linear)"
        return f"{cls.__name__} is not an nn.Linear or HuggingFace Conv1D"
    return _dtype_problem(module) or _hook_problem(module, "Linear")


def activation_skip(activation: nn.Module) -> str | None:
    """Why an activation after a Linear cannot be fused into it, or None."""
    if gelu_approximation(activation) is None:
        return f"{type(activation).__name__} is not GELU (erf or tanh form)"
    return _hook_problem(activation, "activation")
