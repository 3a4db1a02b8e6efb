"""Rule ``rms_norm``: a ``torch.nn.RMSNorm``, or a model's own RMSNorm module (HuggingFace's
LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm, Olmo2RMSNorm and their many copies) whose class forward
provably computes one of fastlayers' RMSNorm forms, bit for bit, swapped for fastlayers.RMSNorm
around its own weight, in that form (fastlayers.layers.recognise_rms_norm: recognised by what
the forward computes, never by class name)."""

from __future__ import annotations

from torch import nn

from fastlayers.layers import RMSNorm
from fastlayers.layers.recognise import recognise_rms_norm, rms_norm_candidate

from .base import ModuleRule


def _recognise(module: nn.Module) -> tuple[bool, str | None]:
    if rms_norm_candidate(module) is None:
        return False, None
    return True, recognise_rms_norm(module)[2]


RMS_NORM = ModuleRule(
    "rms_norm",
    nn.RMSNorm,
    RMSNorm.from_native,
    "fastlayers.RMSNorm.from_native(module)",
    ("RMSNorm",),
    recognise=_recognise,
)
