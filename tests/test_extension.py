"""Loading the compiled extension: an extension built for another torch, or one that cannot be
imported, or a GPU the build has no kernels for, gives a message that says how to rebuild."""

import importlib
import types

import pytest

import fastlayers
from fastlayers import _extension
from fastlayers._extension import _C

REBUILD = "pip install --no-build-isolation -e ."


def test_arch_mismatch_message_names_the_gpu_the_build_and_the_rebuild_command():
    message = _C._arch_mismatch_message(12, 0, "NVIDIA Future GPU")
    assert "NVIDIA Future GPU" in message and "sm_120" in message
    assert 'TORCH_CUDA_ARCH_LIST="12.0"' in message and REBUILD in message
    archs = fastlayers.build_info()["cuda_archs"]
    assert archs or not fastlayers.build_info()["cuda"]
    for arch in archs:
        assert f"sm_{arch}" in message
    # Hopper needs the 'a' target for the fused Linear + GELU kernels.
    assert 'TORCH_CUDA_ARCH_LIST="9.0a"' in _C._arch_mismatch_message(9, 0, "NVIDIA H100")


def test_extension_built_for_another_torch_refuses_to_load(monkeypatch):
    fake = types.SimpleNamespace(build_info=lambda: {"torch_version": (1, 13)})
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    with pytest.raises(ImportError, match=r"built for torch 1\.13") as err:
        _extension.load_extension()
    assert REBUILD in str(err.value)


def test_extension_that_cannot_be_imported_says_how_to_rebuild(monkeypatch):
    def broken(name):
        raise ImportError("undefined symbol: _ZN3c1015SmallVectorBase")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError, match="could not be loaded") as err:
        _extension.load_extension()
    assert REBUILD in str(err.value) and "undefined symbol" in str(err.value)
    assert isinstance(err.value.__cause__, ImportError)
