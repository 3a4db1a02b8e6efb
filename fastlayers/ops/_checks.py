"""Argument checks shared by the ops' Python side (fake kernels, trace-time choices) and the
patcher."""

from __future__ import annotations

import torch

# The dtypes every op takes (csrc/common/common.h is_supported_dtype); float64 computes in float64.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def stat_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of LayerNorm's mean/rstd outputs: float64 for float64 inputs, else float32
    (csrc/layer_norm/layer_norm.h layer_norm_stat_dtype)."""
    return torch.float64 if input_dtype == torch.float64 else torch.float32


def check_same_device(
    op: str, input: torch.Tensor, *, input_name: str = "input", **others: torch.Tensor | None
) -> None:
    """Refuses tensors on another device than ``input`` (called ``input_name`` in the message)
    with the message of the C++ checks (csrc/common/common.h). A fake kernel needs it: the
    dispatcher also sends it calls that mix a meta tensor with real ones (Meta ranks above CPU),
    which must fail as the real kernels do, not return uninitialised memory."""
    for name, t in others.items():
        if t is not None:
            torch._check(
                t.device == input.device,
                lambda name=name, t=t: (
                    f"fastlayers.{op}: {name} is on {t.device} but {input_name} is on "
                    f"{input.device}; move them to the same device"
                ),
            )
