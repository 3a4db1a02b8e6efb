"""Process-wide settings of fastlayers, read when a layer is traced by torch.compile (never on an
eager call). ``FASTLAYERS_COMPILE_LAYER_NORM`` in the environment sets the default."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

COMPILE_LAYER_NORM_MODES = ("inductor", "fused")


def _checked(mode: str, source: str = "compile_layer_norm") -> str:
    if mode not in COMPILE_LAYER_NORM_MODES:
        raise ValueError(
            f"fastlayers.config: {source} must be one of {COMPILE_LAYER_NORM_MODES}, got {mode!r}"
        )
    return mode


# How torch.compile sees fastlayers.LayerNorm:
# - "inductor" (default): as aten.layer_norm, the op nn.LayerNorm itself traces to, so Inductor
#   fuses it with its neighbours (residual add, dropout, the cast of an autocast output to
#   half precision). In whole models this beats our faster but opaque kernel: with the opaque
#   kernel a compiled training step of GPT-2 medium ran 6% and of ViT-B/16 10% slower than
#   with aten.layer_norm (5% / 8% slower than native; H100, benchmarks/RESULTS.md). Numerics
#   are then torch.compile's own LayerNorm's. Calls aten.layer_norm would compute otherwise
#   (float64 inputs, half inputs with float32 parameters outside autocast) keep our op.
# - "fused": fastlayers' op, opaque to Inductor (what eager mode always runs).
compile_layer_norm: str = _checked(
    os.environ.get("FASTLAYERS_COMPILE_LAYER_NORM", "inductor"),
    "the environment variable FASTLAYERS_COMPILE_LAYER_NORM",
)


def set_compile_layer_norm(mode: str) -> None:
    """Sets how torch.compile traces fastlayers.LayerNorm: ``'inductor'`` or ``'fused'``.
    Compiled functions recompile on their next call (dynamo guards on the setting)."""
    global compile_layer_norm
    compile_layer_norm = _checked(mode)


@contextmanager
def compile_layer_norm_as(mode: str) -> Iterator[None]:
    """``set_compile_layer_norm(mode)`` for the duration of a ``with`` block."""
    global compile_layer_norm
    before = compile_layer_norm
    set_compile_layer_norm(mode)
    try:
        yield
    finally:
        compile_layer_norm = before
