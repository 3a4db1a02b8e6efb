"""A serving stream, timed as a server runs it: requests of 1 to ``max_batch`` real texts picked
at random (unsorted), each tokenized and padded to its longest, one forward per request, each
timed from its start to its output on the host (the device synchronised). Ways: native eager;
on CUDA native with cuDNN's attention off, the patched model with replay, and the patched model
padding-free with replay; on CPU the patched model and the patched model padding-free. One
process runs them all, cuDNN's attention last: its execution plans (one per new shape) would
otherwise be found built by the later ways."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..plan import natives_restored
from .throughput import _replay_off, _sync, padding_free_twin, replayed


@dataclass(frozen=True)
class StreamWay:
    """One way through the stream: total seconds, the median and 99th-percentile request in
    milliseconds, and the graphs it holds at the end (None: no replay)."""

    name: str
    total_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    graphs: int | None = None


@dataclass(frozen=True)
class Stream:
    requests: int
    max_batch: int
    padding_share: float
    ways: tuple[StreamWay, ...]
    note: str = ""

    def describe(self) -> list[str]:
        lines = [
            f"serving stream: {self.requests} requests of 1 to {self.max_batch} random texts, "
            f"unsorted, each padded to its longest ({self.padding_share:.0%} padding), one "
            "forward per request:",
        ]
        native = next((w.total_s for w in self.ways if w.name == "native eager"), None)
        for w in self.ways:
            ratio = f"{native / w.total_s:5.2f}x" if native else ""
            graphs = f", {w.graphs} graphs" if w.graphs is not None else ""
            lines.append(
                f"  {w.name:<34} {w.total_s:7.2f} s {ratio}  p50 {w.p50_ms:7.2f} ms  "
                f"p99 {w.p99_ms:7.2f} ms  max {w.max_ms:7.1f} ms{graphs}"
            )
        if self.note:
            lines.append(f"  {self.note}")
        return lines


def stream_requests(
    tokenizer: Any,
    texts: list[str],
    count: int,
    max_batch: int,
    max_length: int,
    device: torch.device,
    extra: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda b: b,
    seed: int = 0,
) -> tuple[list[dict[str, torch.Tensor]], float]:
    """``count`` requests of 1 to ``max_batch`` texts picked at random (seeded), each padded
    to its longest text, on ``device``; and the share of padded tokens."""
    rng = random.Random(seed)
    requests, real, padded = [], 0, 0
    for _ in range(count):
        picked = rng.sample(texts, rng.randint(1, min(max_batch, len(texts))))
        enc = tokenizer(
            picked, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        real += int(enc["attention_mask"].sum())
        padded += enc["attention_mask"].numel()
        requests.append(extra({k: v.to(device) for k, v in enc.items()}))
    return requests, (1 - real / padded if padded else 0.0)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def request_seconds(model: nn.Module, requests: list[dict], device: torch.device) -> list[float]:
    """Seconds of each request in order, one forward each under no grad, from its start to its
    output (the device synchronised before and after)."""
    seconds = []
    with torch.no_grad():
        for request in requests:
            _sync(device)
            start = time.perf_counter()
            out = model(**request)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            del out
    return seconds


def runtime_forward(model: nn.Module) -> Any:
    """The call-time forward (replay's or padding-free's) a patch set on ``model`` or one of its
    modules, or None."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if hasattr(forward, "graph_count"):
            return forward
    return None


def _timed(model: nn.Module, requests: list[dict], device: torch.device, name: str) -> StreamWay:
    seconds = request_seconds(model, requests, device)
    ms = [1e3 * s for s in seconds]
    forward = runtime_forward(model) if device.type == "cuda" else None
    graphs = forward.graph_count() if forward is not None else None
    return StreamWay(
        name, sum(seconds), statistics.median(ms), percentile(ms, 0.99), max(ms), graphs
    )


@contextmanager
def cudnn_attention_off() -> Iterator[None]:
    """cuDNN's scaled-dot-product attention switched off for the block (set back after)."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


def serving_stream(
    model: nn.Module,
    requests: list[dict[str, torch.Tensor]],
    padding_share: float,
    max_batch: int,
    device: torch.device,
    progress: Callable[[str], None] = lambda _m: None,
) -> Stream:
    """Time the ``requests`` through a patched ``model`` every way (module docstring)."""
    ways: list[StreamWay] = []
    notes = []
    twin, why = padding_free_twin(model, device)
    cuda = device.type == "cuda"
    if cuda:
        progress("serving stream: native, cuDNN attention off")
        with _replay_off(model), natives_restored(model), cudnn_attention_off():
            ways.append(_timed(model, requests, device, "native, cuDNN attention off"))
    if twin is not None:
        name = "patched + replay + padding-free" if cuda else "patched, padding-free"
        progress(f"serving stream: {name}")
        ways.append(_timed(twin, requests, device, name))
        del twin
    else:
        notes.append(f"padding-free: {why}")
    if cuda:
        with replayed(model, device) as refused:
            if refused:
                notes.append(f"replay {refused}")
            else:
                progress("serving stream: patched + replay")
                ways.append(_timed(model, requests, device, "patched + replay"))
    else:
        progress("serving stream: patched")
        with _replay_off(model):
            ways.append(_timed(model, requests, device, "patched"))
    progress("serving stream: native eager")
    with _replay_off(model), natives_restored(model):
        ways.insert(0, _timed(model, requests, device, "native eager"))
    return Stream(len(requests), max_batch, padding_share, tuple(ways), "; ".join(notes))
