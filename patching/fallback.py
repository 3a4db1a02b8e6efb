"""The one warning of every call-time fallback of a rewrite (a guard found the model changed since
the patch, or a call the fused op does not take): once per process and message, never while
dynamo traces (it would warn at compile time, not at the call)."""

from __future__ import annotations

import warnings

import torch

WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """Warn ``fastlayers: <message>`` (RuntimeWarning) unless this message was warned before;
    ``stacklevel`` as the caller would pass it to warnings.warn."""
    if message in WARNED or torch.compiler.is_compiling():
        return
    WARNED.add(message)
    warnings.warn(f"fastlayers: {message}", RuntimeWarning, stacklevel=stacklevel + 1)
