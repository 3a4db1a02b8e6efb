"""fastlayers.check: patch a model in place and prove, in numbers, that its outputs did not
change, layer by layer and end to end, and how much faster it became.

No second copy of the model is made. End to end, the native model's outputs are kept and
compared with the patched model's. Per layer, each fused module and its native twin (a shallow
copy of the native module bound to the same Parameters) run on the input the fused module
received, and both are compared with the native module computed in float64 (one layer's
float64 copy at a time).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..eligibility import OWN_HOOKS
from ..plan import applied_rewrites, natives_restored, patch, unpatch
from ..records import CheckTarget
from ..rules import DEFAULT_LAYERS
from .numerics import default_tolerance, layer_bound
from .report import CheckReport, GreedyCheck, LayerCheck, OutputCheck, Timing

Inputs = torch.Tensor | tuple | list | Mapping


def check(
    model: nn.Module,
    example_inputs: Inputs,
    *,
    layers: str | Iterable[str] = DEFAULT_LAYERS,
    rtol: float | None = None,
    atol: float | None = None,
    runs: int = 10,
    warmup: int = 3,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
) -> CheckReport:
    """Run ``model`` on ``example_inputs`` (a tensor, a tuple of positional arguments or a dict
    of keyword arguments, e.g. a tokenizer's output), patch it in place (a model that is already
    patched is used as it is, its native modules swapped back in for the "before" run), run it
    again and compare.

    End to end, each floating output passes when ``max|patched - native| <= atol + rtol *
    max|native|`` (defaults per dtype of the model's parameters:
    :func:`fastlayers.patching.checking.numerics.default_tolerance`). Per swapped layer, the
    DESIGN rule: error against float64 at most 2x the native module's own plus a floor per
    dtype. Forward times
    before and after are medians of ``runs`` device-synchronised runs after ``warmup``;
    ``compile=True`` times (and compares) ``torch.compile``-d models. The model runs in eval
    mode under ``torch.no_grad``; its training flags are restored afterwards and it stays
    patched, unless the patched model fails to run where the native one ran: then the patch
    check made is undone and the report says FAIL with what the patched model raised
    (``report.error``). What the native model raises propagates. ``progress`` receives one line
    per step that takes a while."""
    _check_arguments(model, example_inputs, rtol, atol, runs, warmup)
    say = progress or (lambda _msg: None)
    dtype, device = _compute_dtype(model), _device(model)
    default_rtol, default_atol = default_tolerance(dtype)
    rtol = default_rtol if rtol is None else float(rtol)
    atol = default_atol if atol is None else float(atol)
    already_patched = bool(applied_rewrites(model))
    patch_report = None

    def report(**results: Any) -> CheckReport:
        return CheckReport(
            model=type(model).__name__,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            rtol=rtol,
            atol=atol,
            patch=patch_report,
            **results,
        )

    training = {name: m.training for name, m in model.named_modules()}
    model.eval()
    try:
        with torch.no_grad():
            with natives_restored(model) if already_patched else nullcontext():
                say("running the native model" + (" (torch.compile)" if compile else ""))
                forward = _forward(model, example_inputs, compile)
                before = forward()
                if compile:
                    before_ms = _median_ms(forward, device, warmup, runs, say, "native")
                    before_gpu = _gpu_busy_ms(forward, device)
            if not already_patched:
                say("patching")
                patch_report = patch(model, layers=layers)
            try:
                say("comparing each fused layer with its native twin and float64")
                with _LayerProbes(model) as probes:
                    after = _call(model, example_inputs)
                if compile:
                    say("running the patched model (torch.compile)")
                    forward = _forward(model, example_inputs, compile)
                    after = forward()
                    after_ms = _median_ms(forward, device, warmup, runs, say, "patched")
                    after_gpu = _gpu_busy_ms(forward, device)
                else:
                    before_ms, after_ms = _alternating_ms(
                        model, example_inputs, device, warmup, runs, say
                    )
                    forward = lambda: _call(model, example_inputs)  # noqa: E731
                    if device.type == "cuda":
                        say("measuring the GPU's busy time per forward (profiler)")
                    with natives_restored(model):
                        before_gpu = _gpu_busy_ms(forward, device)
                    after_gpu = _gpu_busy_ms(forward, device)
                greedy = None
                if _decodes(model, example_inputs):
                    say("greedy decoding, native and patched")
                    with natives_restored(model):
                        native_tokens = _greedy(model, example_inputs)
                    greedy = _greedy_check(native_tokens, _greedy(model, example_inputs), dtype)
            except Exception as err:  # the patched model failed: hand back the native one
                if patch_report is not None:
                    unpatch(model)
                undone = " (the patch was undone)" if patch_report is not None else ""
                return report(error=f"{type(err).__name__}: {err}{undone}")
            except BaseException:
                if patch_report is not None:
                    unpatch(model)
                raise
    finally:
        for name, module in model.named_modules():
            module.train(training.get(name, module.training))
    return report(
        outputs=_outputs(before, after, rtol, atol),
        layers=probes.results(),
        not_compared=probes.not_compared,
        timing=Timing(before_ms, after_ms, runs, compile, before_gpu, after_gpu),
        greedy=greedy,
    )


GREEDY_TOKENS = 8


def _decodes(model: nn.Module, inputs: Inputs) -> bool:
    """A decoder-only generative model called with input_ids: check compares its greedy
    tokens too."""
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    return (
        isinstance(inputs, dict)
        and isinstance(inputs.get("input_ids"), torch.Tensor)
        and callable(can)
        and bool(can())
        and config is not None
        and not getattr(config, "is_encoder_decoder", False)
    )


def _greedy(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The ``GREEDY_TOKENS`` new tokens greedy decoding appends to each sequence."""
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    out = model.generate(
        **inputs,
        max_new_tokens=GREEDY_TOKENS,
        min_new_tokens=GREEDY_TOKENS,
        do_sample=False,
        pad_token_id=0 if pad is None else pad,
    )
    return out[:, inputs["input_ids"].shape[1] :]


def _greedy_check(native: torch.Tensor, patched: torch.Tensor, dtype: torch.dtype) -> GreedyCheck:
    same = native.shape == patched.shape and torch.equal(native, patched)
    first = None
    if not same:
        n = min(native.shape[1], patched.shape[1])
        differs = (native[:, :n] != patched[:, :n]).any(dim=0).nonzero()
        first = int(differs[0]) if differs.numel() else n
    return GreedyCheck(native.shape[1], same, first, dtype in (torch.float32, torch.float64))


def _check_arguments(model, example_inputs, rtol, atol, runs, warmup) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastlayers.check: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (torch.Tensor, tuple, list, Mapping)):
        raise TypeError(
            "fastlayers.check: example_inputs must be a tensor, a tuple of positional arguments "
            f"or a dict of keyword arguments, got {type(example_inputs).__name__}"
        )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not value >= 0:
            raise ValueError(f"fastlayers.check: {name} must be >= 0, got {value}")
    if runs < 1:
        raise ValueError(f"fastlayers.check: runs must be >= 1, got {runs}")
    if warmup < 0:
        raise ValueError(f"fastlayers.check: warmup must be >= 0, got {warmup}")


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype holding most of the model's parameters (float32 if none)."""
    sizes: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] += p.numel()
    return sizes.most_common(1)[0][0] if sizes else torch.float32


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _call(model: Callable, inputs: Inputs) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


def _forward(model: nn.Module, inputs: Inputs, compile: bool) -> Callable[[], Any]:
    if compile:
        torch._dynamo.reset()  # the patched model must not reuse the native model's graphs
        compiled = torch.compile(model)
        return lambda: _call(compiled, inputs)
    return lambda: _call(model, inputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(forward: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    forward()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _median_ms(
    forward: Callable[[], Any],
    device: torch.device,
    warmup: int,
    runs: int,
    say: Callable[[str], None],
    what: str,
) -> float:
    say(f"timing the {what} model: {warmup} warm-up + {runs} runs")
    for _ in range(warmup):
        forward()
    return statistics.median(_time_ms(forward, device) for _ in range(runs))


def _gpu_busy_ms(forward: Callable[[], Any], device: torch.device, runs: int = 3) -> float | None:
    """The time one forward keeps the GPU busy, in milliseconds: the summed durations of the
    kernels it runs (the profiler's device time), over ``runs`` forwards; None on CPU, or where
    the profiler cannot see the GPU's kernels."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    forward()  # the profiler's own start-up stays out of the numbers
    _sync(device)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                forward()
            _sync(device)
        total_us = sum(e.self_device_time_total for e in prof.key_averages())
    except Exception:  # no CUPTI, or a profiler already running
        return None
    return total_us / runs / 1e3 if total_us > 0 else None


def _alternating_ms(
    model: nn.Module,
    inputs: Inputs,
    device: torch.device,
    warmup: int,
    runs: int,
    say: Callable[[str], None],
) -> tuple[float, float]:
    """Median times of the native and the patched model, run in alternation (the native modules
    swapped in and out between runs), so that clock or load drift during the check weighs on
    both alike."""
    say(f"timing the native and patched models in turn: {warmup} warm-up + {runs} runs each")
    forward = lambda: _call(model, inputs)  # noqa: E731
    native, patched = [], []
    for i in range(warmup + runs):
        with natives_restored(model):
            t_native = _time_ms(forward, device)
        t_patched = _time_ms(forward, device)
        if i >= warmup:
            native.append(t_native)
            patched.append(t_patched)
    return statistics.median(native), statistics.median(patched)


# ---------------------------------------------------------------- comparing tensors


@dataclass(frozen=True)
class _Diff:
    max_abs: float
    scale: float  # max |reference| over finite values
    cosine: float
    nonfinite_mismatch: int

    @property
    def max_rel(self) -> float:
        if self.scale > 0:
            return self.max_abs / self.scale
        return 0.0 if self.max_abs == 0 else float("inf")


def _diff(value: torch.Tensor, reference: torch.Tensor) -> _Diff:
    """Errors of ``value`` against ``reference`` in float64 over the positions where both are
    finite; non-finite values must match exactly (NaN where NaN, the same infinity)."""
    a, b = value.detach().double().flatten(), reference.detach().double().flatten()
    finite = torch.isfinite(a) & torch.isfinite(b)
    mismatch = int(
        ((torch.isnan(a) != torch.isnan(b)) | (~finite & (a != b) & ~torch.isnan(b))).sum()
    )
    a, b = a[finite], b[finite]
    if a.numel() == 0:
        return _Diff(0.0, 0.0, 1.0, mismatch)
    max_abs = (a - b).abs().max().item()
    norms = a.norm() * b.norm()
    cosine = (a @ b / norms).item() if norms > 0 else float(max_abs == 0)
    return _Diff(max_abs, b.abs().max().item(), cosine, mismatch)


def _named_tensors(out: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a model output (tensor, tuple, dict or HuggingFace ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [(name, out)]
    if isinstance(out, Mapping):
        items = [(k if name == "output" else f"{name}.{k}", v) for k, v in out.items()]
    elif isinstance(out, (tuple, list)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(out)]
    else:
        return []
    return [pair for key, v in items for pair in _named_tensors(v, key)]


def _is_logits(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t.shape[-1] > 1 and ("logits" in name or name == "output")


def _outputs(before: Any, after: Any, rtol: float, atol: float) -> list[OutputCheck]:
    native, patched = dict(_named_tensors(before)), dict(_named_tensors(after))
    checks = []
    for name, ref in native.items():
        got = patched.get(name)
        shape = tuple(ref.shape)
        if got is None or got.shape != ref.shape:
            problem = "missing after the patch" if got is None else f"shape {tuple(got.shape)}"
            checks.append(OutputCheck(name, shape, 0.0, 0.0, 0.0, None, None, 0.0, problem))
            continue
        if not ref.is_floating_point():
            same = torch.equal(got, ref)
            checks.append(
                OutputCheck(
                    name, shape, 0.0, 0.0, 1.0, None, None, 0.0, None if same else "values differ"
                )
            )
            continue
        d = _diff(got, ref)
        worst_row = None
        if ref.dim() >= 2 and ref.shape[0] > 1 and ref.numel():
            rows_a, rows_b = got.double().flatten(1), ref.double().flatten(1)
            worst_row = nn.functional.cosine_similarity(rows_a, rows_b, dim=1).min().item()
        top1 = None
        if _is_logits(name, ref) and ref.numel():
            top1 = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
        problem = (
            f"{d.nonfinite_mismatch} non-finite values differ" if d.nonfinite_mismatch else None
        )
        checks.append(
            OutputCheck(
                name,
                shape,
                d.max_abs,
                d.max_rel,
                d.cosine,
                worst_row,
                top1,
                atol + rtol * d.scale,
                problem,
            )
        )
    return checks


# ---------------------------------------------------------------- per-layer probes


def _main_tensor(out: Any) -> torch.Tensor | None:
    """The first floating tensor of a layer's output (a tensor, or a block's tuple/dict)."""
    for _, t in _named_tensors(out):
        if t.is_floating_point():
            return t
    return None


def _to64(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().double()
    return value


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


@dataclass
class _Worst:
    calls: int = 0
    check: LayerCheck | None = None


@dataclass
class _LayerProbes:
    """Forward pre-hooks capture each fused module's input (cloned: a fused in-place ReLU
    overwrites it); forward hooks run the native twin and the float64 reference on it."""

    model: nn.Module
    not_compared: dict[str, str] = field(default_factory=dict)
    _worst: dict[str, _Worst] = field(default_factory=dict)
    _pending: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    _handles: list = field(default_factory=list)
    # Set while a native twin or reference runs: a rewritten block's twin calls the block's
    # (possibly fused) children, whose probes must not fire for it.
    _busy: bool = False

    def __enter__(self) -> _LayerProbes:
        for record in applied_rewrites(self.model):
            targets = record.check_targets()
            if isinstance(targets, str):
                self.not_compared[getattr(record, "name", "")] = targets
                continue
            for target in targets:
                name = target.name
                self._worst[name] = _Worst()
                self._handles += [
                    target.module.register_forward_pre_hook(self._capture(name), with_kwargs=True),
                    target.module.register_forward_hook(
                        self._compare(name, target), with_kwargs=True
                    ),
                ]
        # the probes watch the fused layers; the rewrites' guards must not take them for the
        # user's hooks (a fused Linear + activation would compute apart)
        OWN_HOOKS.update(h.id for h in self._handles)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
            OWN_HOOKS.discard(handle.id)
        self._pending.clear()

    def _capture(self, name: str):
        def hook(module, args, kwargs):
            if self._busy:
                return
            self._pending[name] = (
                tuple(map(_clone, args)),
                {k: _clone(v) for k, v in kwargs.items()},
            )

        return hook

    def _compare(self, name: str, target: CheckTarget):
        def hook(module, args, kwargs, output):
            if self._busy:
                return
            args, kwargs = self._pending.pop(name)
            worst = self._worst[name]
            worst.calls += 1
            if any(p.device.type == "meta" for p in module.parameters()):
                self.not_compared[name] = "parameters offloaded (accelerate); compared end to end"
                return
            if any(_is_cache(v) for v in (*args, *kwargs.values())):
                # each run of the layer appends to the cache: the twin and the reference would
                # see another state than the call did
                self.not_compared[name] = "its call carries a KV cache; compared end to end"
                return
            self._busy = True
            try:
                native = target.native(*args, **kwargs)
                ref = target.reference()(
                    *map(_to64, args), **{k: _to64(v) for k, v in kwargs.items()}
                )
            except Exception as err:  # e.g. a block given a cache object of float32 tensors
                self.not_compared[name] = (
                    f"no float64 run on its inputs ({type(err).__name__}); compared end to end"
                )
                return
            finally:
                self._busy = False
            output, native, ref = _main_tensor(output), _main_tensor(native), _main_tensor(ref)
            if output is None or native is None or ref is None:
                self.not_compared[name] = "no floating output to compare"
                return
            self._record(name, target.fused, output, native, ref, worst)

        return hook

    def _record(self, name, fused: str, output, native, ref, worst: _Worst) -> None:
        vs_native, vs_ref, native_vs_ref = (
            _diff(output, native),
            _diff(output, ref),
            _diff(native, ref),
        )
        bound = layer_bound(native_vs_ref.max_abs, output.dtype)
        mismatch = vs_native.nonfinite_mismatch
        problem = f"{mismatch} non-finite values differ from native" if mismatch else None
        candidate = LayerCheck(
            name=name,
            fused=fused,
            calls=0,  # set in results()
            max_abs_err=vs_native.max_abs,
            max_rel_err=vs_native.max_rel,
            cosine=vs_native.cosine,
            error=vs_ref.max_abs,
            native_error=native_vs_ref.max_abs,
            bound=bound,
            problem=problem,
        )
        if worst.check is None or _badness(candidate) > _badness(worst.check):
            worst.check = candidate

    def results(self) -> list[LayerCheck]:
        return [
            dataclasses.replace(w.check, calls=w.calls)
            for name, w in self._worst.items()
            if w.check is not None and name not in self.not_compared
        ]


def _is_cache(value: Any) -> bool:
    """A transformers KV cache (state that a layer's call changes)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(value, Cache)


def _badness(c: LayerCheck) -> float:
    return float("inf") if c.problem is not None else c.error / c.bound
