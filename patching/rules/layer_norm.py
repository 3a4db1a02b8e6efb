"""Rule ``layer_norm``: an ``nn.LayerNorm`` (exactly that type) swapped for fastlayers.LayerNorm
around its own Parameters. Module look-alikes (T5's RMSNorm-style T5LayerNorm) are reported as
skipped."""

from __future__ import annotations

from torch import nn

from fastlayers.layers import LayerNorm

from .base import ModuleRule

LAYER_NORM = ModuleRule(
    "layer_norm",
    nn.LayerNorm,
    LayerNorm.from_native,
    "fastlayers.LayerNorm.from_native(module)",
    ("LayerNorm", "RMSNorm"),
)
