"""fastlayers.patching: swap fused layers into a live model in place, and back.

report = fastlayers.patch(model)      # PatchReport: swaps and skips, printable
fastlayers.unpatch(model)             # the native modules again, same Parameters
model.apply(fastlayers.patching.swap_children)
report = fastlayers.check(model, inputs)  # patch + prove outputs kept: CheckReport

The floors, each using only those below it: fused.py, eligibility.py, report.py, trace.py,
forms.py, fallback.py (what every rule needs); rules/ (the registry: one file per rule);
discover.py (Linear + activation pairs); blocks.py (the block-rewrite machinery); records.py
(every kind of change, applied and undone); guard.py (the generated per-call tests of what a
trace or a capture read); runtime/ (the call-time paths: replay from CUDA graphs, padding-free
execution); plan.py (patch, unpatch,
swap_children: the walk); checking/ (fastlayers.check, its report, command line and real-length
throughput).
"""

from .checking import CheckReport, LayerCheck, OutputCheck, Timing, check
from .fused import FusedAway
from .plan import patch, swap_children, unpatch
from .report import PatchReport, Skip, Swap
from .rules import ALL_LAYERS, DEFAULT_LAYERS, MODULE_RULES
from .runtime.replay import ReplayOptions
from .runtime.unpad import warm_up

__all__ = [
    "ALL_LAYERS",
    "DEFAULT_LAYERS",
    "MODULE_RULES",
    "CheckReport",
    "FusedAway",
    "LayerCheck",
    "OutputCheck",
    "PatchReport",
    "ReplayOptions",
    "Skip",
    "Swap",
    "Timing",
    "check",
    "patch",
    "swap_children",
    "unpatch",
    "warm_up",
]
