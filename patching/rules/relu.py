"""Rule ``relu`` (not in the default rules): an ``nn.ReLU`` swapped for ``ReLUScale(1)``. A bare
ReLU gains nothing from it: one elementwise pass either way (H100: 93.8 vs 93.4 us forward, 224
vs 222 us GPU time forward + backward at 16384 x 4096 bf16; CPU at parity; docs/decisions.md),
so it runs only where named in ``layers``."""

from __future__ import annotations

from torch import nn

from fastlayers.layers import ReLUScale

from .base import ModuleRule

RELU = ModuleRule(
    "relu",
    nn.ReLU,
    lambda relu: ReLUScale.from_native(relu, 1.0),
    "fastlayers.ReLUScale.from_native(module, 1.0)",
    ("ReLU",),
)
