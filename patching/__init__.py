"""fastlayers.patching: swap fused layers into a live model in place, and back.

report = fastlayers.patch(model)      # PatchReport: swaps and skips, printable
fastlayers.unpatch(model)             # the native modules again, same Parameters
model.apply(fastlayers.patching.swap_children)
report = fastlayers.check(model, inputs)  # patch + prove outputs kept: CheckReport
"""

from .check import check
from .check_report import CheckReport, LayerCheck, OutputCheck, Timing
from .report import PatchReport, Skip, Swap
from .rules import ALL_LAYERS, DEFAULT_LAYERS, MODULE_RULES, FusedAway
from .swap import patch, swap_children, unpatch

__all__ = [
    "ALL_LAYERS",
    "DEFAULT_LAYERS",
    "MODULE_RULES",
    "CheckReport",
    "FusedAway",
    "LayerCheck",
    "OutputCheck",
    "PatchReport",
    "Skip",
    "Swap",
    "Timing",
    "check",
    "patch",
    "swap_children",
    "unpatch",
]
