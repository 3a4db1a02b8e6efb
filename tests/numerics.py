"""Test helpers around the DESIGN.md accuracy rule (fastlayers.patching.checking.numerics,
fastlayers.check): a fused result in dtype d passes when its max abs error against the float64
reference is at most FACTOR x the native module's own error in dtype d, plus a floor per dtype.
"""

from __future__ import annotations

import pytest
import torch
from fastlayers.patching.checking.numerics import FLOOR, layer_bound

__all__ = ["DEVICES", "DTYPES", "FLOOR", "assert_close_to_reference", "max_err", "poison_allocator"]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def max_err(t: torch.Tensor, ref: torch.Tensor) -> float:
    return (t.double() - ref.double()).abs().max().item() if t.numel() else 0.0


def assert_close_to_reference(
    fused: torch.Tensor, native: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    assert fused.shape == ref.shape, f"{what}: shape {fused.shape} != {ref.shape}"
    assert torch.isfinite(fused).all(), f"{what}: non-finite values"
    err, native_err = max_err(fused, ref), max_err(native, ref)
    bound = layer_bound(native_err, dtype)
    assert err <= bound, f"{what}: error {err:.3g} > {bound:.3g} (native error {native_err:.3g})"


def poison_allocator(device: str | torch.device, nbytes: int) -> None:
    """On CUDA, fills and frees a block of all-ones bytes (NaN in every float dtype): the caching
    allocator hands that memory to the next outputs, so an element a kernel forgot to write
    shows up as NaN."""
    if torch.device(device).type == "cuda":
        block = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)
        del block
