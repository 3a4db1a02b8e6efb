"""fastlayers: fused CUDA drop-in replacements for torch.nn layers."""

from fastlayers import functional
from fastlayers._extension import build_info
from fastlayers._version import __version__
from fastlayers.layers import FusedLinearGELU, LayerNorm, ReLUScale

__all__ = ["FusedLinearGELU", "LayerNorm", "ReLUScale", "__version__", "build_info", "functional"]
