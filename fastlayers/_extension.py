"""Loads the compiled extension fastlayers._C, whose import registers torch.ops.fastlayers.*."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

_REBUILD = "Rebuild it against the torch you run: pip install --no-build-isolation -e ."


def load_extension() -> ModuleType:
    """Imports fastlayers._C, with a message that says how to rebuild when it cannot load."""
    try:
        module = importlib.import_module("fastlayers._C")
    except ImportError as err:  # missing build, or built for another torch/CUDA/Python ABI
        raise ImportError(
            f"fastlayers: the compiled extension fastlayers._C could not be loaded ({err}). "
            f"It is missing or was built for another torch version (running torch "
            f"{torch.__version__}). {_REBUILD}"
        ) from err
    built = tuple(module.build_info()["torch_version"])
    running = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if built != running:
        raise ImportError(
            f"fastlayers: fastlayers._C was built for torch {built[0]}.{built[1]} but torch "
            f"{torch.__version__} is running. {_REBUILD}"
        )
    return module


_C = load_extension()


def build_info() -> dict:
    """How the extension was built: CUDA kernels present, their archs, the torch version."""
    return dict(_C.build_info())
