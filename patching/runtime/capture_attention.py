"""Attention captured as eager runs it. While a CUDA graph is captured, transformers (5.x) cannot
look at a padding mask (a host sync), so it builds the full boolean attention mask where eager
passes none; that mask comes out of a broadcast with stride 0 in its last dim, which every fused
attention kernel refuses, and ``scaled_dot_product_attention`` falls back to its math kernel in
float32: measured on an H100, a ViT-B/16 step (128 images, bf16) replayed in 38.9 ms against
12.8 ms eager, the same with a plain ``torch.cuda.graph`` and no fastlayers code.

:class:`AttentionUnderCapture` is active for one bucket's warm-up and capture, on the capturing
thread only. The last warm-up run records each attention call's mask decision (no mask, and
``is_causal``). During the capture:

- when the call has no mask input of its own (``mask_free``: no tensor argument named like a
  mask), eager's decision depends on shapes alone, so each attention call gets eager's own (no
  mask, its ``is_causal``) where eager passed none: the fused kernels, as eager runs;
- otherwise a mask with a stride-0 last dim is made contiguous (one small copy in the graph) so
  that the memory-efficient kernel takes it.

The replayed outputs are compared with eager's at capture, whatever this changed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


class AttentionUnderCapture:
    """See the module docstring. ``mask_free``: the call structure has no mask input."""

    def __init__(self, mask_free: bool) -> None:
        self.mask_free = mask_free
        self.eager: list[tuple[tuple[int, ...], bool, bool]] = []  # (q shape, no mask, causal)
        self._recording = False
        self._index = 0
        self._thread = 0
        self._next: Any = F.scaled_dot_product_attention

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """One warm-up run: its attention calls' decisions are recorded."""
        self.eager, self._recording = [], True
        with self._active():
            yield
        self._recording = False

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """The capture: attention calls given eager's decisions (see the module docstring)."""
        self._index = 0
        with self._active():
            yield

    @contextmanager
    def _active(self) -> Iterator[None]:
        self._thread = threading.get_ident()
        previous = torch.nn.functional.scaled_dot_product_attention  # maybe another library's
        self._next = previous
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        try:
            yield
        finally:
            if torch.nn.functional.scaled_dot_product_attention == self._sdpa:
                torch.nn.functional.scaled_dot_product_attention = previous
            self._thread = 0

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if threading.get_ident() == self._thread:
            if self._recording:
                self.eager.append((tuple(query.shape), attn_mask is None, bool(is_causal)))
            else:
                i, self._index = self._index, self._index + 1
                if attn_mask is not None:
                    attn_mask, is_causal = self._as_eager(i, query, attn_mask, is_causal)
        return self._next(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

    def _as_eager(
        self, i: int, query: torch.Tensor, attn_mask: torch.Tensor, is_causal: bool
    ) -> tuple[torch.Tensor | None, bool]:
        """The mask and causal flag the capture's ``i``-th attention call runs with."""
        if self.mask_free and i < len(self.eager):
            shape, no_mask, causal = self.eager[i]
            if no_mask and shape == tuple(query.shape):
                return None, causal
        if attn_mask.dim() and attn_mask.stride(-1) == 0:
            return attn_mask.contiguous(), is_causal
        return attn_mask, is_causal
