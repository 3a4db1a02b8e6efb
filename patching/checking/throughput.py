"""What users run, timed: real texts of varied length, sorted by length and cut into batches
padded to their longest text, as sentence-transformers' ``encode`` batches them; whole passes
over all of them with the native model, the patched model (eager), the patched model with
replay (CUDA graphs per shape bucket, patching/runtime/replay.py) and padding-free (a copy of
the patched model with ``unpad=True``: real tokens only; replayed per packed size on CUDA). The
texts are the paragraphs of Python's own documentation topics (``pydoc_data``, in every Python
install): real English prose of every length, nothing downloaded."""

from __future__ import annotations

import copy
import re
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..fused import replay_forward
from ..plan import natives_restored, patch
from ..records import ReplayRecord
from .numerics import end_to_end_error


def real_texts() -> list[str]:
    """The paragraphs of Python's documentation topics that are prose (mostly letters), in a
    fixed order."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split())
            if len(text) >= 20 and sum(c.isalpha() for c in text) > 0.7 * len(text):
                out.append(text)
    return out


@dataclass(frozen=True)
class Batches:
    """Tokenized batches and what they hold."""

    batches: list[dict[str, torch.Tensor]]
    texts: int
    batch_size: int
    tokens: int  # real tokens
    padded_tokens: int  # tokens the batches hold, padding included

    @property
    def padding_share(self) -> float:
        return 1 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


def real_batches(
    tokenizer: Any,
    texts: list[str],
    batch_size: int,
    max_length: int,
    device: torch.device,
    extra: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda b: b,
) -> Batches:
    """``texts`` sorted by length (longest first, as sentence-transformers sorts), cut into
    batches of ``batch_size``, each tokenized and padded to its longest text (at most
    ``max_length`` tokens), on ``device``; ``extra`` adds inputs (decoder ids)."""
    ordered = sorted(texts, key=lambda t: -len(t))
    batches, tokens, padded = [], 0, 0
    for start in range(0, len(ordered), batch_size):
        encoded = tokenizer(
            ordered[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        tokens += int(encoded["attention_mask"].sum())
        padded += encoded["attention_mask"].numel()
        batches.append(extra({k: v.to(device) for k, v in encoded.items()}))
    return Batches(batches, len(texts), batch_size, tokens, padded)


@dataclass(frozen=True)
class Throughput:
    """Seconds per pass over all batches (median of ``passes``) for the native model, the
    patched model and, on CUDA, the patched model with replay; the replay's setup (its first
    pass, capturing each bucket), how many buckets it captured, the tokens its buckets added,
    and its largest error against the patched eager outputs at the real positions."""

    texts: int
    batch_size: int
    batches: int
    padding_share: float
    passes: int
    native_s: float
    patched_s: float
    replay_s: float | None = None
    replay_setup_s: float | None = None
    replay_graphs: int = 0
    replay_extra_tokens: float = 0.0  # bucket padding over the batches' own tokens
    replay_error: float | None = None
    replay_tolerance: float | None = None
    replay_note: str = ""
    # the padding-free way (patch(unpad=True) on a copy of the patched model): seconds per pass,
    # max abs error against patched eager at the real positions and its tolerance
    unpad_s: float | None = None
    unpad_error: float | None = None
    unpad_tolerance: float | None = None
    unpad_note: str = ""

    @property
    def unpad_passed(self) -> bool:
        return self.unpad_error is None or self.unpad_error <= (self.unpad_tolerance or 0.0)

    @property
    def replay_passed(self) -> bool:
        return self.replay_error is None or self.replay_error <= (self.replay_tolerance or 0.0)

    def per_s(self, seconds: float) -> float:
        return self.texts / seconds if seconds > 0 else float("inf")

    def headline(self) -> tuple[str, float]:
        """The speed-up a user gets (replay where it ran) and what it is."""
        if self.replay_s is not None:
            return "patched + replay", self.native_s / self.replay_s
        return "patched", self.native_s / self.patched_s

    def describe(self) -> list[str]:
        lines = [
            f"real-length encode: {self.texts} texts (paragraphs of Python's documentation), "
            f"sorted by length, {self.batches} batches of {self.batch_size} padded to their "
            f"longest ({self.padding_share:.0%} of the tokens are padding); median of "
            f"{self.passes} passes:",
            f"  native eager      {self.per_s(self.native_s):10.1f} texts/s  "
            f"({1e3 * self.native_s:.1f} ms per pass)",
            f"  patched eager     {self.per_s(self.patched_s):10.1f} texts/s  "
            f"({1e3 * self.patched_s:.1f} ms, {self.native_s / self.patched_s:.2f}x)",
        ]
        if self.replay_s is not None:
            lines.append(
                f"  patched + replay  {self.per_s(self.replay_s):10.1f} texts/s  "
                f"({1e3 * self.replay_s:.1f} ms, {self.native_s / self.replay_s:.2f}x; setup "
                f"{self.replay_setup_s:.2f} s for {self.replay_graphs} buckets, which add "
                f"{self.replay_extra_tokens:.0%} tokens; max abs err vs patched eager "
                f"{self.replay_error:.3g}, tolerance {self.replay_tolerance:.3g}: "
                f"{'ok' if self.replay_passed else 'FAIL'})"
            )
        elif self.replay_note:
            lines.append(f"  patched + replay  {self.replay_note}")
        if self.unpad_s is not None:
            lines.append(
                f"  padding-free      {self.per_s(self.unpad_s):10.1f} texts/s  "
                f"({1e3 * self.unpad_s:.1f} ms, {self.native_s / self.unpad_s:.2f}x; computes "
                f"{1 - self.padding_share:.0%} of the padded tokens; max abs err vs patched "
                f"eager {self.unpad_error:.3g}, tolerance {self.unpad_tolerance:.3g}: "
                f"{'ok' if self.unpad_passed else 'FAIL'})"
            )
        elif self.unpad_note:
            lines.append(f"  padding-free      {self.unpad_note}")
        return lines


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass(model: nn.Module, batches: list[dict], device: torch.device) -> tuple[float, list]:
    """One pass over ``batches`` (outputs kept on the device, as ``encode(...,
    convert_to_tensor=True)`` keeps them); seconds, outputs."""
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        outs = [model(**b) for b in batches]
    _sync(device)
    return time.perf_counter() - start, outs


@contextmanager
def replayed(model: nn.Module, device: torch.device) -> Iterator[str]:
    """On CUDA, ``model`` with replay for the block (added where it has none, taken away
    after); yields "" or why replay was refused ("refused: ..."), and "" on CPU."""
    added, refused = False, ""
    if device.type == "cuda" and replay_forward(model) is None:
        report = patch(model, layers=(), replay=True)
        added = replay_forward(model) is not None
        if not added:  # refused (an accelerate hook, a forward set on the instance)
            refused = f"refused: {report.skips[-1].reason}"
    try:
        yield refused
    finally:
        if added:
            ReplayRecord(model, replay_forward(model)).undo()


@contextmanager
def _replay_off(model: nn.Module) -> Iterator[None]:
    forward = replay_forward(model)
    if forward is None:
        yield
        return
    record = ReplayRecord(model, forward)
    record.undo()
    try:
        yield
    finally:
        record.apply()


def _real_error(got: Any, expected: Any, mask: torch.Tensor | None) -> tuple[float, float]:
    """Max abs error of the first output, at the real positions, and its tolerance."""
    a, b = pytree.tree_leaves(got)[0], pytree.tree_leaves(expected)[0]
    if mask is not None and b.dim() == 3 and b.shape[:2] == mask.shape:
        a, b = a * mask[..., None].to(a.dtype), b * mask[..., None].to(b.dtype)
    return end_to_end_error(a, b)


def encode_throughput(
    model: nn.Module,
    data: Batches,
    device: torch.device,
    passes: int = 5,
    progress: Callable[[str], None] = lambda _m: None,
) -> Throughput:
    """Time whole passes of a patched ``model`` over ``data``: native (its native modules
    swapped back), patched eager, patched with replay (CUDA; the replay record is added for the
    measurement and taken away again), in rounds; median seconds per pass."""
    batches = data.batches
    native_s, patched_s, replay_s = [], [], []
    setup = None
    with replayed(model, device) as refused:
        replay = device.type == "cuda" and not refused
        with _replay_off(model):
            progress("real-length batches: warming up native and patched")
            with natives_restored(model):
                _pass(model, batches, device)
            _, eager_outs = _pass(model, batches, device)
        if replay:
            progress("real-length batches: capturing the replay's buckets (first pass)")
            setup, replay_outs = _pass(model, batches, device)
            _, replay_outs = _pass(model, batches, device)
        for i in range(passes):
            progress(f"real-length batches: pass {i + 1} of {passes}")
            with _replay_off(model):
                with natives_restored(model):
                    native_s.append(_pass(model, batches, device)[0])
                patched_s.append(_pass(model, batches, device)[0])
            if replay:
                replay_s.append(_pass(model, batches, device)[0])
        result: dict[str, Any] = {"replay_note": refused or "CUDA only"}
        if replay:
            forward = replay_forward(model)
            errors = [
                _real_error(r, e, b.get("attention_mask"))
                for r, e, b in zip(replay_outs, eager_outs, batches, strict=True)
            ]
            worst = max(errors, key=lambda et: et[0] / et[1] if et[1] else et[0])
            eager_calls = sum(n for k, n in forward.stats.items() if k.startswith("eager"))
            result = {
                "replay_s": statistics.median(replay_s),
                "replay_setup_s": setup,
                "replay_graphs": forward.stats["captured"],
                "replay_extra_tokens": _bucket_padding(batches, forward),
                "replay_error": worst[0],
                "replay_tolerance": worst[1],
                "replay_note": f"{eager_calls} calls ran eagerly" if eager_calls else "",
            }
        result.update(_unpad_way(model, batches, device, passes, eager_outs, progress))
    return Throughput(
        data.texts,
        data.batch_size,
        len(batches),
        data.padding_share,
        passes,
        statistics.median(native_s),
        statistics.median(patched_s),
        **result,
    )


# the padding-free way times a copy of the model: up to this size (a copy doubles its memory)
UNPAD_COPY_LIMIT = 1 << 30


def _unpad_way(
    model: nn.Module,
    batches: list[dict],
    device: torch.device,
    passes: int,
    eager_outs: list,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The padding-free way, on a copy of the patched model (patch(unpad=True); with replay on
    CUDA): median seconds per pass and its error against the patched eager outputs."""
    twin, note = padding_free_twin(model, device)
    if twin is None:
        return {"unpad_note": note}
    progress("real-length batches: padding-free (first pass: its checks and captures)")
    _pass(twin, batches, device)
    times = []
    for i in range(passes):
        progress(f"real-length batches: padding-free pass {i + 1} of {passes}")
        seconds, outs = _pass(twin, batches, device)
        times.append(seconds)
    errors = [
        _real_error(o, e, b.get("attention_mask"))
        for o, e, b in zip(outs, eager_outs, batches, strict=True)
    ]
    worst = max(errors, key=lambda et: et[0] / et[1] if et[1] else et[0])
    return {
        "unpad_s": statistics.median(times),
        "unpad_error": worst[0],
        "unpad_tolerance": worst[1],
    }


def padding_free_twin(model: nn.Module, device: torch.device) -> tuple[nn.Module | None, str]:
    """A copy of the patched ``model`` patched again with ``unpad=True`` (replayed per packed
    size on CUDA), or None and why not (too large to copy, refused)."""
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if size > UNPAD_COPY_LIMIT:
        return None, "not timed (a copy of a model over 1 GiB would double its memory)"
    twin = copy.deepcopy(model)
    forward = replay_forward(twin)
    if forward is not None:  # the copy's root replay goes: the padding-free one replays itself
        ReplayRecord(twin, forward).undo()
    report = patch(twin, unpad=True, replay=device.type == "cuda")
    if not any(s.rule == "unpad" for s in report.swaps):
        why = next((s.reason for s in report.skips if s.rule == "unpad"), "refused")
        return None, f"refused: {why}"
    return twin, ""


def _bucket_padding(batches: list[dict], forward: Any) -> float:
    """The tokens the replay's buckets add, over the batches' padded tokens."""
    from ..runtime.replay import batch_bucket, seq_bucket

    own = added = 0
    for b in batches:
        rows, cols = b["attention_mask"].shape
        own += rows * cols
        bucket_rows = batch_bucket(rows, forward.options.batch_buckets) or rows
        added += bucket_rows * seq_bucket(cols, forward.options.seq_multiple) - rows * cols
    return added / own if own else 0.0
