"""fastlayers: fused CUDA drop-in replacements for torch.nn layers."""

from fastlayers import config, functional
from fastlayers._extension import build_info
from fastlayers._version import __version__
from fastlayers.layers import (
    FusedLinearGELU,
    FusedLinearReLU,
    LayerNorm,
    ReLUScale,
    RMSNorm,
    SharedInputLinear,
)
from fastlayers.patching import (
    CheckReport,
    PatchReport,
    ReplayOptions,
    check,
    patch,
    unpatch,
    warm_up,
)

__all__ = [
    "CheckReport",
    "FusedLinearGELU",
    "FusedLinearReLU",
    "LayerNorm",
    "PatchReport",
    "RMSNorm",
    "ReLUScale",
    "ReplayOptions",
    "SharedInputLinear",
    "__version__",
    "build_info",
    "check",
    "config",
    "functional",
    "patch",
    "unpatch",
    "warm_up",
]
