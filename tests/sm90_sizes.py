"""The sm90 kernels' tile configs as the raw entries number them, read from the extension (their
names live in C++ beside sm90::Config)."""

from __future__ import annotations

from fastlayers._extension import _C

# the raw entries' config argument -> a test id
TILE_CONFIGS: dict[int, str] = _C._testing.sm90_tile_configs()
