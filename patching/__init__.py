"""fastlayers.patching: swap fused layers into a live model in place, and back.

report = fastlayers.patch(model)      # PatchReport: swaps and skips, printable
fastlayers.unpatch(model)             # the native modules again, same Parameters
model.apply(fastlayers.patching.swap_children)
"""

from .report import PatchReport, Skip, Swap
from .rules import ALL_LAYERS, LINEAR_ACT_BLOCKS, MODULE_RULES, FusedAway
from .swap import patch, swap_children, unpatch

__all__ = [
    "ALL_LAYERS",
    "LINEAR_ACT_BLOCKS",
    "MODULE_RULES",
    "FusedAway",
    "PatchReport",
    "Skip",
    "Swap",
    "patch",
    "swap_children",
    "unpatch",
]
