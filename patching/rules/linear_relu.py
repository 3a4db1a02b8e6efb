"""Rule ``linear_relu``: a Linear whose output goes only to a module computing ReLU becomes a
FusedLinearReLU, the activation a FusedAway (discover.py finds the pairs)."""

from __future__ import annotations

from fastlayers.layers import FusedLinearReLU

from .base import PairRule

LINEAR_RELU = PairRule(
    "linear_relu", ("relu",), "ReLU", lambda linear, kind: FusedLinearReLU.from_native(linear)
)
