"""Whether a module may be rewritten, and why not: hooks (the module's own and global ones, those
fastlayers registers itself aside), parametrizations and pruning, adapter-wrapped (PEFT/LoRA) and
quantized modules, dtypes and devices without kernels, Linear look-alikes, activations and what
they compute. Every rule asks here; the call-time guards of the rewrites ask here too."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.nn.modules import module as _module_globals
from torch.nn.utils import parametrize

from fastlayers.layers import linear_layout, recognise_activation
from fastlayers.layers.recognise import LINEAR_ACT_KINDS, QUANTIZED_MODULE_PREFIXES
from fastlayers.ops._checks import SUPPORTED_DTYPES
from fastlayers.ops._native import no_kernels_reason

# Parameter-free modules that are activations (so a Linear feeding one that is neither GELU
# nor ReLU is reported as skipped rather than passed over silently).
_ACTIVATION_NAME_PARTS = ("Activation", "GELU", "GLU", "SiLU", "Swish", "ReLU", "Tanh", "Sigmoid")


def looks_like_activation(module: nn.Module) -> bool:
    return any(part in type(module).__name__ for part in _ACTIVATION_NAME_PARTS)


def is_linear_candidate(module: nn.Module) -> bool:
    """A Linear-like module, including ones no rule can fuse (reported as skipped): every module
    linear_layout accepts is an nn.Linear or named Conv1D; PEFT wrappers have a base_layer."""
    return (
        isinstance(module, nn.Linear)
        or type(module).__name__ == "Conv1D"
        or hasattr(module, "base_layer")
    )


def _device_problem(module: nn.Module) -> str | None:
    """Why ``module``'s CUDA device cannot run this build's kernels (a GPU it was not compiled
    for: the fused layer would only compute natively there), or None."""
    devices = {p.device for p in module.parameters(recurse=False) if p.device.type == "cuda"}
    for device in devices:
        why = no_kernels_reason(device)
        if why is not None:
            return why
    return None


def _dtype_problem(module: nn.Module) -> str | None:
    for name, p in module.named_parameters(recurse=False):
        if p.dtype not in SUPPORTED_DTYPES:
            return f"{name} is {p.dtype}; the fused layers take float32, float64, float16, bfloat16"
    return None


# Every per-module hook dictionary, with the words a skip reason uses for it. A swap shares
# these dicts between the native and the fused module (swap._adopt).
HOOK_KINDS = {
    "_forward_hooks": "forward hooks",
    "_forward_hooks_with_kwargs": "forward hooks (with kwargs)",
    "_forward_hooks_always_called": "forward hooks (always called)",
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_pre_hooks_with_kwargs": "forward pre-hooks (with kwargs)",
    "_backward_hooks": "backward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_state_dict_hooks": "state_dict hooks",
    "_state_dict_pre_hooks": "state_dict pre-hooks",
    "_load_state_dict_pre_hooks": "load_state_dict pre-hooks",
    "_load_state_dict_post_hooks": "load_state_dict post-hooks",
}

# The hooks that run when a module is called: a block rewrite that keeps a child in place but
# computes it inside a fused op (rule mlp) refuses just these; the child's state_dict hooks still
# run (FSDP2 registers some on every module that holds its Parameters).
CALL_HOOK_KINDS = tuple(kind for kind in HOOK_KINDS if "state_dict" not in kind)

# Hooks on a Linear fused with its activation whose meaning would change: forward hooks would
# see the activation's output, backward hooks gradients w.r.t. it. Pre-forward and state-dict
# hooks see what they saw before and travel with the swap.
_MEANING_CHANGES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
)

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)

# The global hook dicts a module call runs (torch mutates them in place, never rebinds them):
# the call-time guards test their emptiness directly.
GLOBAL_FORWARD_HOOKS = _module_globals._global_forward_hooks
GLOBAL_FORWARD_PRE_HOOKS = _module_globals._global_forward_pre_hooks
GLOBAL_BACKWARD_HOOKS = _module_globals._global_backward_hooks
GLOBAL_BACKWARD_PRE_HOOKS = _module_globals._global_backward_pre_hooks

# The ids of hooks fastlayers registers itself (fastlayers.check's per-layer probes): the
# call-time guards of a rewrite do not count them as the user's.
OWN_HOOKS: set[int] = set()


def hook_problem(module: nn.Module, what: str, kinds: Iterable[str] = HOOK_KINDS) -> str | None:
    """Why hooks of the given ``kinds`` (HOOK_KINDS keys) on ``module`` forbid the rewrite."""
    hooks = module.__dict__  # nn.Module keeps its hook dicts there (dict.get: the cheap lookup)
    found = [HOOK_KINDS[k] for k in kinds if hooks.get(k)]
    if not found:
        return None
    if kinds is HOOK_KINDS:
        return f"the {what} has {', '.join(found)}; fusing removes it, so they would not run"
    if kinds is CALL_HOOK_KINDS:
        return (
            f"the {what} has {', '.join(found)}; the fused op does not call it, so they would "
            "not run"
        )
    return f"the {what} has {', '.join(found)}, which would see the activation's output once fused"


def own_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` set on the instance (a user's or a library's
    wrapper; accelerate's hook is told apart by its own reason): a fused op that computes the
    class's forward in its place would ignore it."""
    return "forward" in module.__dict__ and "_hf_hook" not in module.__dict__


def own_forward_problem(module: nn.Module, what: str) -> str | None:
    """The skip reason for a ``module`` with a forward of its own (see :func:`own_forward`)."""
    if own_forward(module):
        return (
            f"the {what}'s forward was replaced on the instance; the fused layer would not call it"
        )
    return None


def global_hook_problem() -> str | None:
    """Module hooks registered for every module (register_module_forward_hook and kin) would
    see a fused Linear's output and no call of the activation."""
    found = [name for name in _GLOBAL_HOOKS if getattr(_module_globals, name, None)]
    if found:
        return f"global module hooks are registered ({', '.join(found)})"
    return None


def reparametrized_problem(module: nn.Module, names: tuple[str, ...]) -> str | None:
    """Why ``module``'s tensors are not plain Parameters ``names`` that the fused layer could
    share: parametrized (torch.nn.utils.parametrize), pruned (torch.nn.utils.prune), or
    recomputed by a hook (the old torch.nn.utils.weight_norm)."""
    if parametrize.is_parametrized(module):
        which = ", ".join(module.parametrizations)
        return f"{which} parametrized (torch.nn.utils.parametrize / parametrizations)"
    for name in names:
        if f"{name}_orig" in module._parameters and f"{name}_mask" in module._buffers:
            return f"{name} pruned (torch.nn.utils.prune): recomputed from {name}_orig by a hook"
    extra = [n for n in module._parameters if n not in names] + list(module._buffers)
    missing = [n for n in names if n not in module._parameters]
    if extra or missing:
        return (
            f"its tensors are not plain Parameters {'/'.join(names)} "
            f"(has {', '.join(extra) or 'none else'}; {', '.join(missing) or 'none'} computed)"
        )
    return None


def module_rule_skip(module: nn.Module) -> str | None:
    """Why ``module`` (of exactly a module rule's native type) cannot be swapped, or None."""
    names = tuple(n for n in ("weight", "bias") if hasattr(module, n))
    return (
        own_forward_problem(module, type(module).__name__)
        or reparametrized_problem(module, names)
        or _dtype_problem(module)
        or _device_problem(module)
    )


def linear_skip(module: nn.Module) -> str | None:
    """Why a module feeding a fusable activation cannot become a fused Linear layer, or None."""
    layout, why = linear_layout(module)  # adapter-wrapped and quantized layers refused there
    if layout is None:  # those, a subclass whose forward is not F.linear, or not a Linear
        return why
    return (
        own_forward_problem(module, "Linear")
        or reparametrized_problem(module, ("weight", "bias"))
        or _dtype_problem(module)
        or _device_problem(module)
        or hook_problem(module, "Linear", _MEANING_CHANGES)
    )


def fusable_activation(
    activation: nn.Module, kinds: tuple[str, ...] = LINEAR_ACT_KINDS
) -> tuple[str | None, str | None]:
    """``(kind, None)`` when an activation computes one of ``kinds`` (by default those a pair
    rule can fuse, and remove: 'gelu', 'gelu_tanh', 'relu'; the gated MLP's add 'silu'); else
    ``(None, why)``. Probes the activation at most once (see
    fastlayers.layers.recognise_activation)."""
    # Hooks first: fusing removes the activation's submodules too, and the probe would run
    # their hooks (and global ones) on probe tensors.
    why = global_hook_problem() or own_forward_problem(activation, "activation")
    for name, m in activation.named_modules():
        why = why or hook_problem(m, f"activation's submodule {name!r}" if name else "activation")
    return (None, why) if why else recognise_activation(activation, kinds)


def foreign_kind(module: nn.Module) -> str | None:
    """'adapter-wrapped (PEFT/LoRA)' or 'quantized' for a module such tools put in a model
    (the patcher leaves them native), else None."""
    cls = type(module)
    # PEFT's own containers (PeftModel, LoraModel) hold the model: only its wrappers count
    if hasattr(module, "base_layer") or (
        cls.__module__.startswith("peft") and hasattr(module, "original_module")
    ):
        return "adapter-wrapped (PEFT/LoRA)"
    if cls.__module__.startswith(QUANTIZED_MODULE_PREFIXES):
        return "quantized"
    return None
