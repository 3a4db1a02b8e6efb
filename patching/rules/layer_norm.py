"""Rule ``layer_norm``: an ``nn.LayerNorm`` (exactly that type) swapped for fastlayers.LayerNorm
around its own Parameters. Other modules named like a LayerNorm that no rule takes are reported
as skipped (the models' RMSNorms, T5's T5LayerNorm among them, are rule rms_norm's)."""

from __future__ import annotations

from torch import nn

from fastlayers.layers import LayerNorm

from .base import ModuleRule

LAYER_NORM = ModuleRule(
    "layer_norm",
    nn.LayerNorm,
    LayerNorm.from_native,
    "fastlayers.LayerNorm.from_native(module)",
    ("LayerNorm",),
)
