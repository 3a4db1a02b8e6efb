"""CheckReport: what :func:`fastlayers.check` measured, end to end and per swapped layer."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..report import PatchReport, format_table, grouped, grouped_items


@dataclass(frozen=True)
class OutputCheck:
    """One output tensor of the model, patched vs native. ``max_rel_err`` is
    ``max|patched - native| / max|native|``; the output passes when ``max_abs_err <=
    tolerance = atol + rtol * max|native|`` and non-finite values sit where native's do."""

    name: str
    shape: tuple[int, ...]
    max_abs_err: float
    max_rel_err: float
    cosine: float
    worst_row_cosine: float | None  # the least similar sample (first dimension), if any
    # Logits (outputs named *logits*, or a bare output tensor): rows whose argmax is unchanged.
    top1_agreement: float | None
    tolerance: float
    problem: str | None = None

    @property
    def passed(self) -> bool:
        return self.problem is None and self.max_abs_err <= self.tolerance


@dataclass(frozen=True)
class LayerCheck:
    """One swapped layer: the fused module and its native twin (same Parameters) run on the
    same captured input; ``error`` / ``native_error`` are each one's max abs error against the
    native module computed in float64; it passes when ``error <= bound`` (2x native + floor).
    Numbers are from the worst of ``calls`` calls."""

    name: str
    fused: str
    calls: int
    max_abs_err: float
    max_rel_err: float
    cosine: float
    error: float
    native_error: float
    bound: float
    problem: str | None = None

    @property
    def passed(self) -> bool:
        return self.problem is None and self.error <= self.bound


# Below this share of a forward's wall time spent by kernels on the GPU, the forward is said to
# be host-bound: the GPU waits on Python and kernel launches.
HOST_BOUND_BUSY = 0.8


@dataclass(frozen=True)
class GreedyCheck:
    """A decoder's greedy continuation of the example inputs, native and patched: ``tokens``
    new tokens per sequence, identical or first different at step ``first_difference``. In
    float32 a difference fails the check; in half precision it is reported only (a near tie
    of two logits within the output tolerance may flip)."""

    tokens: int
    identical: bool
    first_difference: int | None
    decides: bool  # whether it counts toward the verdict (float32 models)

    @property
    def passed(self) -> bool:
        return self.identical or not self.decides

    def describe(self) -> str:
        if self.identical:
            return f"greedy decoding, {self.tokens} new tokens: identical to native"
        counted = "" if self.decides else " (half precision: reported, not failed)"
        return (
            f"greedy decoding, {self.tokens} new tokens: differs from native from step "
            f"{self.first_difference}{counted}"
        )


@dataclass(frozen=True)
class Timing:
    """Median forward time in milliseconds over ``runs`` runs (device synchronised), and on a
    GPU the time its kernels kept it busy per forward (the summed kernel durations)."""

    before_ms: float
    after_ms: float
    runs: int
    compiled: bool
    before_gpu_ms: float | None = None
    after_gpu_ms: float | None = None

    @property
    def speedup(self) -> float:
        return self.before_ms / self.after_ms if self.after_ms > 0 else math.inf

    @property
    def host_bound(self) -> bool:
        """Whether the patched forward keeps the GPU busy under HOST_BOUND_BUSY of its time."""
        return self.after_gpu_ms is not None and self.after_gpu_ms < HOST_BOUND_BUSY * self.after_ms

    def describe(self) -> list[str]:
        """The report's lines: both times (and GPU busy times), the speed-up, and what a
        host-bound forward means for it."""
        how = "torch.compile, one after the other" if self.compiled else "eager, in alternation"

        def part(wall: float, gpu: float | None) -> str:
            return f"{wall:.3f} ms" + (f" (GPU busy {gpu:.3f} ms)" if gpu is not None else "")

        lines = [
            f"time per forward ({how}; median of {self.runs}, synchronised): native "
            f"{part(self.before_ms, self.before_gpu_ms)}, patched "
            f"{part(self.after_ms, self.after_gpu_ms)}: {self.speedup:.2f}x"
        ]
        if self.after_gpu_ms is not None and self.before_gpu_ms is not None:
            gpu = self.before_gpu_ms / self.after_gpu_ms if self.after_gpu_ms > 0 else math.inf
            lines.append(f"GPU time per forward: {gpu:.2f}x less with the fused kernels")
        if self.host_bound:
            busy = self.after_gpu_ms / self.after_ms
            lines.append(
                f"host-bound: the GPU is busy {busy:.0%} of the patched forward's time, waiting "
                "on Python and kernel launches for the rest, so the GPU time saved shows only in "
                "part in the wall time; a larger batch (--batch, --seq) shows more of it"
            )
        return lines


@dataclass
class CheckReport:
    """The result of :func:`fastlayers.check`; ``passed`` is the verdict, ``str(report)`` a
    table, ``to_dict()`` / ``to_json()`` the same numbers for machines."""

    model: str
    device: str
    dtype: str
    rtol: float
    atol: float
    patch: PatchReport | None  # None when the model came already patched
    outputs: list[OutputCheck] = field(default_factory=list)
    layers: list[LayerCheck] = field(default_factory=list)
    not_compared: dict[str, str] = field(default_factory=dict)  # layer -> why
    timing: Timing | None = None
    throughput: Any = None  # throughput.Throughput: real-length batches, whole passes
    stream: Any = None  # stream.Stream: a serving stream of random request sizes
    greedy: GreedyCheck | None = None  # decoders: greedy tokens, native and patched
    # what the patched model raised where the native one ran ("TypeError: ..."); then nothing
    # else was compared, and the patch check made was undone
    error: str | None = None

    @property
    def passed(self) -> bool:
        replay_ok = self.throughput is None or (
            self.throughput.replay_passed and self.throughput.unpad_passed
        )
        greedy_ok = self.greedy is None or self.greedy.passed
        return (
            self.error is None
            and all(o.passed for o in self.outputs)
            and all(c.passed for c in self.layers)
            and replay_ok
            and greedy_ok
        )

    def failures(self) -> list[str]:
        """One line per failed output or layer."""
        lines = [] if self.error is None else [f"the patched model raised {self.error}"]
        for o in self.outputs:
            if not o.passed:
                lines.append(
                    f"output {o.name}: "
                    + (o.problem or f"max abs err {o.max_abs_err:.3g} > {o.tolerance:.3g}")
                )
        for c in self.layers:
            if not c.passed:
                lines.append(
                    f"layer {c.name}: "
                    + (c.problem or f"error vs float64 {c.error:.3g} > bound {c.bound:.3g}")
                )
        if self.greedy is not None and not self.greedy.passed:
            lines.append(self.greedy.describe())
        t = self.throughput
        if t is not None and not t.unpad_passed:
            lines.append(
                f"padding-free: max abs err {t.unpad_error:.3g} > {t.unpad_tolerance:.3g} "
                "against the patched eager outputs"
            )
        if t is not None and not t.replay_passed:
            lines.append(
                f"replay: max abs err {t.replay_error:.3g} > {t.replay_tolerance:.3g} against "
                "the patched eager outputs"
            )
        return lines

    def verdict(self) -> str:
        """One line: PASS or FAIL, what was compared, the speed-up."""
        swapped = len(self.layers) + len(self.not_compared)
        speed = ""
        if self.throughput is not None:
            what, x = self.throughput.headline()
            speed = f"; {x:.2f}x on real-length batches ({what} against native eager)"
        elif self.timing is not None:
            t = self.timing
            speed = f"; {t.speedup:.2f}x ({t.before_ms:.3g} ms -> {t.after_ms:.3g} ms per forward)"
        if swapped == 0 and self.error is None:
            return "PASS: nothing was swapped (no layer fastlayers fuses), outputs unchanged"
        if self.passed:
            worst = max((o.max_rel_err for o in self.outputs), default=0.0)
            return (
                f"PASS: {swapped} fused layers; outputs within rtol {self.rtol:.2g} (max rel err "
                f"{worst:.2g}); every compared layer within 2x native error + floor{speed}"
            )
        failures = self.failures()
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return f"FAIL: {failures[0]}{more}{speed}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready; non-finite numbers become None)."""
        data = {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed,
            "verdict": self.verdict(),
            "patch": None
            if self.patch is None
            else {
                "swaps": [dataclasses.asdict(s) for s in self.patch.swaps],
                "skips": [dataclasses.asdict(s) for s in self.patch.skips],
            },
            "outputs": [{**dataclasses.asdict(o), "passed": o.passed} for o in self.outputs],
            "layers": [{**dataclasses.asdict(c), "passed": c.passed} for c in self.layers],
            "not_compared": dict(self.not_compared),
            "timing": None
            if self.timing is None
            else {
                **dataclasses.asdict(self.timing),
                "speedup": self.timing.speedup,
                "host_bound": self.timing.host_bound,
            },
            "greedy": None if self.greedy is None else dataclasses.asdict(self.greedy),
            "error": self.error,
            "throughput": None
            if self.throughput is None
            else {
                **dataclasses.asdict(self.throughput),
                "headline": self.throughput.headline(),
            },
            "stream": None if self.stream is None else dataclasses.asdict(self.stream),
        }
        return _finite_or_none(data)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return self.format()

    def format(self, details: bool = False) -> str:
        """The report as text: the patch, the outputs, the layers grouped by what was fused
        where (layer indices folded into ``*``; the worst layer of each group shown, and every
        failing layer by name), the times and the verdict. ``details``: one row per module."""
        lines = [
            f"fastlayers.check: {self.model} on {self.device}, {self.dtype} "
            f"(outputs: atol {self.atol:.2g} + rtol {self.rtol:.2g} x max|native|; "
            "layers: 2x native's error vs float64 + floor)"
        ]
        if self.patch is not None:
            lines += ["", self.patch.format(details)]
        else:
            lines += ["", "the model came already patched"]
        if self.outputs:
            lines += ["", "outputs, patched vs native:", _outputs_table(self.outputs)]
        if self.layers:
            lines += [
                "",
                "layers, fused vs native on the same input (errors vs float64):",
                _layers_table(self.layers) if details else _layer_groups_table(self.layers),
            ]
            failed = [c for c in self.layers if not c.passed]
            if failed and not details:
                lines += ["", "failed layers:", _layers_table(failed)]
        if details:
            lines += [
                f"layer {name} not compared: {why}" for name, why in self.not_compared.items()
            ]
        else:
            items = [_Named(name, why) for name, why in self.not_compared.items()]
            for (why,), n, where in grouped(items, lambda item: (item.what,)):
                lines.append(f"layer{'s' if n > 1 else ''} {where} not compared: {why}")
        if self.greedy is not None:
            lines += ["", self.greedy.describe()]
        if self.timing is not None:
            lines += ["", *self.timing.describe()]
        if self.throughput is not None:
            lines += ["", *self.throughput.describe()]
        if self.stream is not None:
            lines += ["", *self.stream.describe()]
        lines += ["", self.verdict()]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Named:
    name: str
    what: str


def _ok(passed: bool) -> str:
    return "ok" if passed else "FAIL"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _outputs_table(outputs: list[OutputCheck]) -> str:
    header = ["output", "shape", "max abs err", "max rel err", "cosine", "worst row cos"]
    header += ["top-1 agree", "tolerance", "result"]
    rows = [
        [
            o.name,
            "x".join(map(str, o.shape)),
            f"{o.max_abs_err:.3g}",
            f"{o.max_rel_err:.3g}",
            f"{o.cosine:.8f}",
            _opt(o.worst_row_cosine, ".8f"),
            _opt(None if o.top1_agreement is None else 100 * o.top1_agreement, ".2f"),
            f"{o.tolerance:.3g}",
            _ok(o.passed),
        ]
        for o in outputs
    ]
    return format_table(header, rows)


def _layers_table(layers: list[LayerCheck]) -> str:
    header = ["layer", "fused", "calls", "max abs err", "max rel err", "cosine"]
    header += ["err vs f64", "native err", "bound", "result"]
    rows = [
        [
            c.name,
            c.fused,
            str(c.calls),
            f"{c.max_abs_err:.3g}",
            f"{c.max_rel_err:.3g}",
            f"{c.cosine:.8f}",
            f"{c.error:.3g}",
            f"{c.native_error:.3g}",
            f"{c.bound:.3g}",
            _ok(c.passed),
        ]
        for c in layers
    ]
    return format_table(header, rows)


def _layer_groups_table(layers: list[LayerCheck]) -> str:
    """One row per kind of fused layer and place (layer indices folded): how many, their calls,
    and the numbers of the group's worst layer (its error against float64 over its bound)."""
    header = ["layers", "fused", "count", "calls", "max abs err", "max rel err", "cosine"]
    header += ["err vs f64", "native err", "bound", "result"]
    rows = []
    for (fused,), members, where in grouped_items(layers, lambda c: (c.fused,)):
        worst = max(members, key=lambda c: math.inf if c.problem else c.error / c.bound)
        failed = sum(not c.passed for c in members)
        rows.append(
            [
                where,
                fused,
                str(len(members)),
                str(sum(c.calls for c in members)),
                f"{max(c.max_abs_err for c in members):.3g}",
                f"{max(c.max_rel_err for c in members):.3g}",
                f"{min(c.cosine for c in members):.8f}",
                f"{worst.error:.3g}",
                f"{worst.native_error:.3g}",
                f"{worst.bound:.3g}",
                "ok" if not failed else f"FAIL ({failed})",
            ]
        )
    return format_table(header, rows)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value
