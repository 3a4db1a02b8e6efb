"""The accuracy rules that the tests and :func:`fastlayers.check` share.

Per layer (DESIGN.md): a fused result in dtype d passes when its max abs error against the
native module computed in float64 is at most ``FACTOR`` x the native module's own error in d,
plus ``FLOOR[d]``.

End to end (a whole model, where no float64 run is at hand): the patched output passes when
``max|patched - native| <= atol + rtol * max|native|``, with defaults per dtype from
:func:`default_tolerance`.
"""

from __future__ import annotations

import torch

FACTOR = 2.0
FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# rtol: 4 units in the last place at 1.0 for the half types (two correct models differ by a
# rounding at every layer); 1e-4 for float32, whose differences come from summation order in
# reductions over thousands of terms, grown through the layers. atol only matters for outputs
# that are all near zero.
_END_TO_END = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (4 * torch.finfo(torch.float16).eps, 1e-3),
    torch.bfloat16: (4 * torch.finfo(torch.bfloat16).eps, 1e-3),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a patched model's outputs with the native model's when the
    model computes in ``dtype`` (float64 and other dtypes get float32's)."""
    return _END_TO_END.get(dtype, _END_TO_END[torch.float32])


def end_to_end_error(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """``(max|got - expected|, atol + rtol * max|expected|)`` with the defaults of
    ``expected``'s dtype (0 for empty tensors): the end-to-end rule, outside fastlayers.check."""
    rtol, atol = default_tolerance(expected.dtype)
    if not expected.numel():
        return 0.0, atol
    error = (got.float() - expected.float()).abs().max().item()
    return error, atol + rtol * expected.float().abs().max().item()


def layer_bound(native_error: float, dtype: torch.dtype) -> float:
    """Largest error against float64 that a fused layer in ``dtype`` may have (DESIGN rule)."""
    return FACTOR * native_error + FLOOR.get(dtype, FLOOR[torch.float32])
