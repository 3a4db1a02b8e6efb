"""Process-wide settings of fastlayers: how torch.compile sees the fused layers (read when a
layer is traced, never on an eager call), and which GEMM a patched gated MLP's inference calls
run (read per call). ``FASTLAYERS_COMPILE_LAYER_NORM``, ``FASTLAYERS_COMPILE_RESIDUAL_LAYER_NORM``,
``FASTLAYERS_COMPILE_RMS_NORM``, ``FASTLAYERS_COMPILE_ROTARY`` and
``FASTLAYERS_GATED_MLP_EPILOGUE`` in the environment set the defaults."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

COMPILE_LAYER_NORM_MODES = ("inductor", "fused")
COMPILE_RESIDUAL_LAYER_NORM_MODES = COMPILE_LAYER_NORM_MODES
GATED_MLP_EPILOGUE_MODES = ("fused", "cublas")
# the settings whose modes are not COMPILE_LAYER_NORM_MODES
_MODES = {"gated_mlp_epilogue": GATED_MLP_EPILOGUE_MODES}


def _checked(mode: str, source: str, modes: tuple[str, ...] = COMPILE_LAYER_NORM_MODES) -> str:
    if mode not in modes:
        raise ValueError(f"fastlayers.config: {source} must be one of {modes}, got {mode!r}")
    return mode


def _modes(setting: str) -> tuple[str, ...]:
    return _MODES.get(setting, COMPILE_LAYER_NORM_MODES)


def _from_env(setting: str, default: str = "inductor") -> str:
    """The setting's default: the environment variable FASTLAYERS_<SETTING>, else ``default``."""
    variable = f"FASTLAYERS_{setting.upper()}"
    return _checked(
        os.environ.get(variable, default), f"the environment variable {variable}", _modes(setting)
    )


def _set(setting: str, mode: str) -> None:
    globals()[setting] = _checked(mode, setting, _modes(setting))


@contextmanager
def _setting_as(setting: str, mode: str) -> Iterator[None]:
    """``_set(setting, mode)`` for the duration of a ``with`` block, then the value before."""
    before = globals()[setting]
    _set(setting, mode)
    try:
        yield
    finally:
        globals()[setting] = before


# How torch.compile sees fastlayers.LayerNorm:
# - "inductor" (default): as aten.layer_norm, the op nn.LayerNorm itself traces to, so Inductor
#   fuses it with its neighbours (residual add, dropout, the cast of an autocast output to
#   half precision). In whole models this beats our faster but opaque kernel: with the opaque
#   kernel a compiled training step of GPT-2 medium ran 6% and of ViT-B/16 10% slower than
#   with aten.layer_norm (5% / 8% slower than native; H100, docs/decisions.md). Numerics
#   are then torch.compile's own LayerNorm's. Calls aten.layer_norm would compute otherwise
#   (float64 inputs, half inputs with float32 parameters outside autocast) keep our op.
# - "fused": fastlayers' op, opaque to Inductor (what eager mode always runs).
compile_layer_norm: str = _from_env("compile_layer_norm")

# How torch.compile sees fastlayers.functional.dropout_add_layer_norm (dropout + residual add +
# LayerNorm):
# - "inductor" (default): as the native sequence F.dropout, add, F.layer_norm, which Inductor
#   fuses into its own kernels (and with the neighbours) as it does for an unpatched model. The
#   dropout mask is then Inductor's random stream, not fastlayers' Philox one. Measured on an
#   H100 (docs/decisions.md, 2026-11-23, compile_infer): BERT-base 1.014x of native this
#   way against 0.993x with "fused", GPT-2 medium 1.081x against 1.076x; so this is the default
#   (the same setting governs the relu_scale block rule, and an mlp rewrite in a block that also
#   holds one of those: the block traces one forward or the other; a block with only mlp
#   rewrites always traces the rewritten code).
# - "fused": fastlayers' op, opaque to Inductor (what eager mode always runs); its mask is the
#   one eager draws (same generator, same Philox stream).
# Calls the native sequence would compute otherwise keep our op, as for LayerNorm.
compile_residual_layer_norm: str = _from_env("compile_residual_layer_norm")


def set_compile_layer_norm(mode: str) -> None:
    """Sets how torch.compile traces fastlayers.LayerNorm: ``'inductor'`` or ``'fused'``.
    Compiled functions recompile on their next call (dynamo guards on the setting)."""
    _set("compile_layer_norm", mode)


def compile_layer_norm_as(mode: str) -> AbstractContextManager[None]:
    """``set_compile_layer_norm(mode)`` for the duration of a ``with`` block."""
    return _setting_as("compile_layer_norm", mode)


def set_compile_residual_layer_norm(mode: str) -> None:
    """Sets how torch.compile traces fastlayers' dropout + residual add + LayerNorm:
    ``'inductor'`` or ``'fused'``. Compiled functions recompile on their next call."""
    _set("compile_residual_layer_norm", mode)


def compile_residual_layer_norm_as(mode: str) -> AbstractContextManager[None]:
    """``set_compile_residual_layer_norm(mode)`` for the duration of a ``with`` block."""
    return _setting_as("compile_residual_layer_norm", mode)


# How torch.compile sees fastlayers' RMSNorm (fastlayers.RMSNorm and the models' RMSNorms the
# patcher swaps), "inductor" (default) or "fused" as for LayerNorm: "inductor" traces the
# model's own composite (its very rounding order), which Inductor fuses with its neighbours.
# Chosen by LayerNorm's measurement (above); RMSNorm's own compiled-model comparison is
# recorded in benchmarks/RESULTS.md once run.
compile_rms_norm: str = _from_env("compile_rms_norm")


def set_compile_rms_norm(mode: str) -> None:
    """Sets how torch.compile traces fastlayers' RMSNorm: ``'inductor'`` or ``'fused'``.
    Compiled functions recompile on their next call."""
    _set("compile_rms_norm", mode)


def compile_rms_norm_as(mode: str) -> AbstractContextManager[None]:
    """``set_compile_rms_norm(mode)`` for the duration of a ``with`` block."""
    return _setting_as("compile_rms_norm", mode)


# How torch.compile sees fastlayers' rotary embedding (fastlayers.functional.rotary_embedding and
# the attention forwards the rotary rule routes): "inductor" (default) traces the model's own
# apply_rotary_pos_emb (its composite), which Inductor fuses into one kernel with its neighbours
# (the projections' views, the cast); "fused": fastlayers' op, opaque to Inductor.
compile_rotary: str = _from_env("compile_rotary")


def set_compile_rotary(mode: str) -> None:
    """Sets how torch.compile traces fastlayers' rotary embedding: ``'inductor'`` or
    ``'fused'``. Compiled functions recompile on their next call."""
    _set("compile_rotary", mode)


def compile_rotary_as(mode: str) -> AbstractContextManager[None]:
    """``set_compile_rotary(mode)`` for the duration of a ``with`` block."""
    return _setting_as("compile_rotary", mode)


# Which GEMM a patched gated MLP's up projection runs in eval mode in a call that records no
# gradient (the gated_mlp rule's whole-MLP rewrite, read per call; a CUDA graph replays what its
# capture ran):
# - "fused" (default): on an sm_90 GPU, where the GEMM's size rule takes the call, CUTLASS's
#   GEMM with act(gate) * up in its epilogue (fastlayers.ops.gated_act.gated_act_linear_forward;
#   SiLU and tanh GELU): up is never written or read back. Each factor is rounded to the dtype
#   before the product as native rounds them, but the GEMM's own sums are CUTLASS's, not
#   cuBLAS's (and SiLU uses the hardware exp and division): the result is within the fused GEMMs'
#   bound, not native's bits. Elsewhere (other GPUs, CPU, other sizes) the same as "cublas".
# - "cublas": F.linear's GEMM (cuBLAS's, native's bits) and fastlayers' gated_act pass (native's
#   rounding; on CUDA within two units in the last place of native's product), the path every
#   training call takes.
gated_mlp_epilogue: str = _from_env("gated_mlp_epilogue", "fused")


def set_gated_mlp_epilogue(mode: str) -> None:
    """Sets which GEMM a patched gated MLP's inference calls (eval mode, no gradient recorded)
    run: ``'fused'`` or ``'cublas'`` (see fastlayers.config.gated_mlp_epilogue)."""
    _set("gated_mlp_epilogue", mode)


def gated_mlp_epilogue_as(mode: str) -> AbstractContextManager[None]:
    """``set_gated_mlp_epilogue(mode)`` for the duration of a ``with`` block."""
    return _setting_as("gated_mlp_epilogue", mode)
