"""The one answer the fused layers give ``torch.jit.script``."""

from __future__ import annotations

from torch import nn


def refuse_script(self: nn.Module) -> nn.Module:
    """``__prepare_scriptable__`` of the fused layers: TorchScript cannot compile them (their
    ops are called through Python entry points), so say what to do in one line instead of the
    compiler's error deep in a forward. Swapping in the native module here would unpatch the
    user's model in place (torch.jit.script writes the result back into the parent)."""
    raise RuntimeError(
        f"torch.jit.script cannot compile fastlayers.{type(self).__name__}: script the model "
        "before patching it, or call fastlayers.unpatch(model) first (torch.jit.trace, "
        "torch.export and torch.onnx.export do work on patched models)"
    )
