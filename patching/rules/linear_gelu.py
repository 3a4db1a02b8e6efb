"""Rule ``linear_gelu``: a Linear (``nn.Linear``, HuggingFace ``Conv1D``, a Linear look-alike) whose
output goes only to a module computing GELU (erf or tanh form) becomes a FusedLinearGELU, the
activation a FusedAway (discover.py finds the pairs)."""

from __future__ import annotations

from fastlayers.layers import FusedLinearGELU
from fastlayers.ops.linear_act import GELU_APPROXIMATE

from .base import PairRule

LINEAR_GELU = PairRule(
    "linear_gelu",
    ("gelu", "gelu_tanh"),
    "GELU (erf or tanh form)",
    lambda linear, kind: FusedLinearGELU.from_native(linear, GELU_APPROXIMATE[kind]),
)
