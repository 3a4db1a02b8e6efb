"""The sm90 kernels' tile configs as the raw entries number them, and sizes that put a Linear +
activation call on the fallback path of a CUDA GPU, found by asking the package
(linear_act_path) rather than restating its size rule."""

from __future__ import annotations

import torch

from fastlayers.functional import linear_act_path
from fastlayers.ops.linear_act import sm90_available

# sm90::Config: the raw entries' config argument -> a test id
TILE_CONFIGS = {
    0: "coop256x128",
    1: "pingpong128x128",
    2: "pingpong64x64",
    3: "pingpong128x128solo",
}


def fallback_rows(k: int, n: int, dtype: torch.dtype, device: str = "cuda") -> int:
    """Rows for which a [rows, k] input times an [n, k] weight in dtype takes the fallback. With
    the sm90 kernels: the fewest multiple of 128 refused for its size alone (more rows than fit
    one wave of the small tiles, too few to fill the large tiles' waves); otherwise (no sm90
    kernels, float32 or float64) every call falls back, and 64 rows do."""
    if not sm90_available(device) or dtype not in (torch.float16, torch.bfloat16):
        return 64
    w = torch.empty(n, k, device=device, dtype=dtype)
    for tiles in range(1, 1025):
        x = torch.empty(128 * tiles, k, device=device, dtype=dtype)
        if "output tiles" in linear_act_path(x, w, None, activation="gelu"):
            return 128 * tiles
    raise AssertionError(f"no row count sends {k} -> {n} to the fallback for its size")
