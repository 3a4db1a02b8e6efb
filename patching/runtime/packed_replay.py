"""Replay of padding-free calls (``patch(model, unpad=True, replay=True)``): a packed call of the
base model replayed from the CUDA graph of its bucket, with the host out of the loop.

A packed call's size is known on the host only after one synchronisation (the number of real
tokens is a shape). So the call is split around it:

- before it (kernels queued behind the previous call's graph, while the GPU still runs it): the
  model's guard, the packing's sort, every per-token input gathered straight into one shared
  buffer per input, the cumulative lengths into a shared buffer;
- after it: the bucket's key from the host lengths, one graph launch; then the cut, re-padding
  and pooler (queued behind the graph).

Every graph reads the same buffers (a bucket of ``tokens`` rows reads their first ``tokens``),
so no input is copied per call; buffers that grow (a call past their size) drop the graphs.
Buckets: the token count rounded up (varlen.token_bucket), the sequence count (a power of two),
and the longest sequence coarsely (``packed_length``): the flash kernel's grid is sized by it.
Rows past the real tokens belong to no sequence: their outputs are never read (each layer is
per token but for attention, which reads only the sequences' own rows) and are cut away.

Each bucket's first call captures (replay.record: warm-up, capture) and compares the replayed
outputs at the real tokens with the eager packed call on the same inputs (fastlayers.check's
end-to-end tolerance); where they differ that bucket runs eagerly. Past ``max_graphs`` the
least used graph is dropped (``stats['evicted']``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..fallback import warn_once
from .replay import (
    _BROKEN,
    ReplayOptions,
    _capture_problem,
    _differs,
    _Refused,
    _why_eager,
    model_test,
    record,
)
from .varlen import Packing, packing_kwargs, sequence_bucket, token_bucket


def packed_length(length: int) -> int:
    """A bucket's longest sequence: 512, then 4x steps. Coarse on purpose: an empty block of
    the flash grid costs next to nothing, a graph per length class costs a capture."""
    size = 512
    while size < length:
        size *= 4
    return size


@dataclass
class _PackedGraph:
    graph: torch.cuda.CUDAGraph
    outputs: list[Any]
    spec: pytree.TreeSpec
    uses: int = 0


class PackedReplay:
    """The graphs of one base model's packed calls. ``eager(**call)`` is the model's forward
    without unpad; ``stats`` counts replays, captures, evictions and eager packed calls."""

    def __init__(self, model: nn.Module, eager: Callable[..., Any], options: ReplayOptions):
        self.model, self.eager, self.options = model, eager, options
        self.stats: Counter[str] = Counter()
        self._holds: Callable[[], bool] | None = None
        self._wanted = 0  # rows a call's bucket needed that the buffers did not have
        self._drop()

    def _drop(self) -> None:
        self._graphs: dict[tuple, _PackedGraph | str] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._size = 0  # rows of every buffer
        self._cu: torch.Tensor | None = None
        self._pool: Any = None
        self._stream: Any = None

    def graph_count(self) -> int:
        return sum(isinstance(g, _PackedGraph) for g in self._graphs.values())

    def memory(self) -> int:
        """Bytes the graphs' pool and the shared buffers hold on the device (the pool as the
        caching allocator reports it; 0 before the first capture)."""
        held = sum(b.numel() * b.element_size() for b in self._buffers.values())
        if self._cu is not None:
            held += self._cu.numel() * self._cu.element_size()
        if self._pool is None:
            return held
        device = next(iter(self._buffers.values())).device
        for segment in torch.cuda.memory_snapshot():
            if segment.get("segment_pool_id") == self._pool and segment["device"] == (
                device.index or 0
            ):
                held += segment["total_size"]
        return held

    # ------------------------------------------------------------------ before the sync

    def refusal(self, arguments: dict[str, Any]) -> str | None:
        """Why this call cannot replay (None: it may): replay's refusals (training, autograd,
        devices, arguments other than tensors and constants), another stream; and the model's
        guard, checked per call (a change drops the graphs)."""
        why = _why_eager(self.model, (), arguments)
        if why is not None:
            return why
        if self._holds is not None and not self._holds():
            warn_once(f"{type(self.model).__name__} changed since its capture: captured again", 5)
            self._holds = None
            self._drop()
        device = next(v for v in arguments.values() if isinstance(v, torch.Tensor)).device
        if self._stream is not None and torch.cuda.current_stream(device) != self._stream:
            return "the call is on another CUDA stream than the captures' own"
        return None

    def destinations(
        self, inputs: dict[str, torch.Tensor], rows: int, batch: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Where a call of ``rows`` padded tokens and ``batch`` sequences gathers its inputs
        (views of the shared buffers: its first rows, as many as fit) and its cumulative
        lengths (the whole buffer: past the call's sequences Packing.of fills in the total).
        The buffers grow (doubling) when a call's bucket did not fit them (``run``), which
        drops the graphs: their size follows the real tokens, not the padded ones."""
        stale = self._cu is None or self._cu.numel() < sequence_bucket(batch) + 1
        for name, x in inputs.items():
            buf = self._buffers.get(name)
            if buf is not None and (buf.dtype, buf.shape[1:]) != (x.dtype, x.shape[2:]):
                stale = True
        if stale or self._size < self._wanted:
            if self._graphs:
                self.stats["dropped: buffers grown"] += len(self._graphs)
            size = max(4096, self._size)  # stale ones are remade at their size
            if self._wanted > size:
                size = max(self._wanted, 2 * size)
            sequences = max(256, 2 * sequence_bucket(batch))
            self._drop()
            self._size = size
            device = next(iter(inputs.values())).device
            with torch.inference_mode(False):  # written later under no_grad too
                self._cu = torch.zeros(sequences + 1, dtype=torch.int32, device=device)
        for name, x in inputs.items():
            if name not in self._buffers:  # a new input: graphs that do not read it stay
                with torch.inference_mode(False):
                    self._buffers[name] = torch.zeros(
                        self._size, *x.shape[2:], dtype=x.dtype, device=x.device
                    )
        views = {name: self._buffers[name][: min(rows, self._size)] for name in inputs}
        return views, self._cu  # type: ignore[return-value]

    # ------------------------------------------------------------------ after the sync

    def run(self, constants: dict[str, Any], packing: Packing) -> Any | None:
        """The packed call's output (per-token tensors ``[1, total, ...]``), replayed; None
        where this bucket runs eagerly (the caller runs the packed call)."""
        tokens = token_bucket(packing.total)
        sequences = sequence_bucket(packing.batch)
        length = min(tokens, packed_length(packing.max_length))
        if tokens > self._size:  # this call runs eagerly; the next ones find room
            self._wanted = max(self._wanted, tokens)
            self.stats["eager: past the buffers (grown for the next calls)"] += 1
            return None
        inputs = {name: self._buffers[name] for name in packing.gathered}
        structure = _structure(constants, inputs)
        key = (structure, tokens, sequences, length)
        entry = self._graphs.get(key)
        if isinstance(entry, str):
            self.stats[f"eager: {entry}"] += 1
            return None
        if entry is None:
            graphs = {k: g for k, g in self._graphs.items() if isinstance(g, _PackedGraph)}
            if len(graphs) >= self.options.max_graphs:  # no cliff: the least used one goes
                del self._graphs[min(graphs, key=lambda k: graphs[k].uses)]
                self.stats["evicted"] += 1
            call = self._call(constants, inputs, tokens, sequences, length)
            try:
                entry = self._capture(call, tokens, packing.total)
            except _Refused as err:
                self._graphs[key] = str(err)
                warn_once(f"unpad + replay: a packed call runs eagerly: {err}", 5)
                return None
            if isinstance(entry, str):
                self._graphs[key] = entry
                warn_once(f"unpad + replay: a packed call runs eagerly: {entry}", 5)
                return None
            self._graphs[key] = entry
            self.stats["captured"] += 1
        else:
            entry.graph.replay()
            self.stats["replayed"] += 1
        entry.uses += 1
        return _cut(pytree.tree_unflatten(entry.outputs, entry.spec), tokens, packing.total)

    def _call(
        self, constants: dict[str, Any], inputs: dict, tokens: int, sequences: int, length: int
    ) -> dict[str, Any]:
        call = dict(constants)
        for name, buf in inputs.items():
            call[name] = buf[:tokens][None]
        call.update(packing_kwargs(self._cu[: sequences + 1], length))  # type: ignore[index]
        return call

    def _capture(self, call: dict[str, Any], rows: int, total: int) -> _PackedGraph | str:
        """Capture ``call`` and compare its replay with the eager call at the real tokens;
        the graph, or why not."""
        with torch.inference_mode(False), torch.no_grad():
            if self._holds is None:
                self._holds = model_test(self.model)
            problem = _BROKEN[0] or _capture_problem(self.model)
            if problem is not None:
                raise _Refused(problem)
            device = self._cu.device  # type: ignore[union-attr]
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._stream = torch.cuda.current_stream(device)
            graph, out = record(lambda: self.eager(**call), device, self._pool, self.options, True)
            outputs, spec = pytree.tree_flatten(out)
            graph.replay()
            expected = self.eager(**call)
        why = _differs(_cut(out, rows, total), _cut(expected, rows, total))
        if why is not None:
            return f"the replayed packed call differs from eager ({why})"
        return _PackedGraph(graph, outputs, spec)


def _structure(constants: dict[str, Any], buffers: dict[str, torch.Tensor]) -> tuple:
    """What a graph is specific to besides its bucket: the constant arguments (by type too),
    which inputs it reads and their dtypes and per-token shapes, the autocast state."""
    values = tuple((k, type(v), v) for k, v in sorted(constants.items()))
    inputs = tuple((k, b.dtype, tuple(b.shape[1:])) for k, b in sorted(buffers.items()))
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return values, inputs, autocast


def _cut(out: Any, rows: int, total: int) -> Any:
    """An output's per-token tensors ``[1, rows, ...]`` cut back to the ``total`` real ones
    (others, such as a pooler's ``[1, hidden]``, as they are)."""

    def cut(t: Any) -> Any:
        packed = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == 1
        return t[:, :total] if packed and t.shape[1] == rows else t

    return pytree.tree_map(cut, out)
