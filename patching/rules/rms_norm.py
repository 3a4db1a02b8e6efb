"""Rule ``rms_norm``: a ``torch.nn.RMSNorm``, or a model's own RMSNorm module (HuggingFace's
LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm, Olmo2RMSNorm and their many copies) whose class forward
provably computes one of fastlayers' RMSNorm forms, bit for bit, swapped for fastlayers.RMSNorm
around its own weight, in that form (fastlayers.layers.recognise_rms_norm: recognised by what
the forward computes, never by class name)."""

from __future__ import annotations

import weakref

from torch import nn

from fastlayers.layers import RMSNorm
from fastlayers.layers.recognise import recognise_rms_norm, rms_norm_candidate

from .base import ModuleRule

# What _recognise found for a module, handed to _build: the patcher asks takes() and then builds
# the same child, and the probe (~2 ms a module) need not run twice. Weak keys: a module planned
# but never built (a dry run) leaves nothing behind; the next patch asks takes() again.
_RECOGNISED: weakref.WeakKeyDictionary[nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()


def _recognise(module: nn.Module) -> tuple[bool, str | None]:
    if rms_norm_candidate(module) is None:
        return False, None
    form, eps_attr, why = recognise_rms_norm(module)
    if why is None:
        _RECOGNISED[module] = (form, eps_attr)
    return True, why


def _build(module: nn.Module) -> RMSNorm:
    return RMSNorm.from_native(module, _RECOGNISED.pop(module, None))


RMS_NORM = ModuleRule(
    "rms_norm",
    nn.RMSNorm,
    _build,
    "fastlayers.RMSNorm.from_native(module)",
    ("RMSNorm",),
    recognise=_recognise,
)
