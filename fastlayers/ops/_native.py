"""The one decision "this call computes the native way" shared by every op's entry point.

A fused layer computes with torch's own composite ops (``F.layer_norm``, ``F.gelu(F.linear())``,
``torch.relu(x) * alpha``) instead of fastlayers' kernels when

- a ``torch.func`` transform is active (``jvp``, ``vmap``, ``grad``, ``jacrev``, ``jacfwd``,
  ``functional_call`` under them) or a forward-AD dual level is open: our ops have no
  forward-mode derivative or batching rule, and the native ops have both (and double backward);
- the model is being exported to ONNX (either exporter), so the graph holds standard ONNX ops;
- the input lives on a CUDA device this build has no kernels for (an architecture it was not
  compiled for, or a CPU-only build): the layer then warns once per process and keeps working.

The eager hot path pays one call of :func:`computes_natively` (a few cheap flag reads); dynamo
folds every flag it reads to a constant, so ``torch.compile`` traces no extra op and no break.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _fwad

from fastlayers._extension import _C

# CUDA devices (torch.device) where this build's kernels do not run; filled by kernels_run_on
# and by the first failing call on such a device. Empty (falsy) everywhere else.
_NO_KERNEL_DEVICES: set[torch.device] = set()
_warned = False


def computes_natively(input: torch.Tensor) -> bool:
    """Whether this call must compute the native way (see the module docstring)."""
    if _fwad._current_level >= 0 or torch._C._are_functorch_transforms_active():
        return True  # a dual level is open (inputs may carry tangents) or a torch.func transform
    if _NO_KERNEL_DEVICES and _lacks_kernels(input):
        return True
    # ONNX export traces plain tensors through the JIT tracer (TorchScript exporter) or fake
    # tensors under torch.export (dynamo exporter, is_compiling set); torch.onnx.
    # is_in_onnx_export imports on each call (microseconds), so it is asked only then.
    if torch._C._get_tracing_state() is not None or (
        type(input) is not torch.Tensor and torch.compiler.is_compiling()
    ):
        return torch.onnx.is_in_onnx_export()
    return False


def _lacks_kernels(input: torch.Tensor) -> bool:
    if input.device in _NO_KERNEL_DEVICES:
        _warn_once(input.device)
        return True
    return False


def _cuda_device(device: torch.device | str | int) -> torch.device:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def kernels_run_on(device: torch.device | str | int) -> bool:
    """Whether this build's kernels run on ``device``: always for CPU; for a CUDA device, whether
    the extension was built with CUDA kernels for its architecture (probed once per device).
    For the patcher: a layer on a device where this is False computes the native way."""
    device = _cuda_device(device)
    if device.type != "cuda":
        return True
    if device in _NO_KERNEL_DEVICES:
        return False
    runs = _probe(device.index)
    if not runs:
        _NO_KERNEL_DEVICES.add(device)
    return runs


def _probe(index: int) -> bool:
    """The C++ answer (cached per device there); a CPU-only build has no CUDA kernels at all."""
    if not _C.build_info()["cuda"]:
        return False
    return bool(_C.kernels_run_on(index))


def no_kernels_reason(device: torch.device | str | int) -> str | None:
    """Why this build's kernels do not run on ``device`` (naming the GPU and the rebuild
    command), or None when they do."""
    if kernels_run_on(device):
        return None
    index = _cuda_device(device).index
    props = torch.cuda.get_device_properties(index)
    return _C._arch_mismatch_message(props.major, props.minor, props.name)


def retry_natively(input: torch.Tensor) -> bool:
    """Called when a kernel raised: True (after a one-time warning) if the reason is that this
    build has no kernels for ``input``'s CUDA device, so the caller computes natively."""
    if kernels_run_on(input.device):
        return False
    _NO_KERNEL_DEVICES.add(input.device)  # later calls route before reaching the kernel
    _warn_once(input.device)
    return True


_Tensor = torch.Tensor
_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_tracing_state = torch._C._get_tracing_state


def fused_entry(
    name: str,
    fast: str,
    op: Callable[..., Any],
    native: Callable[..., Any],
    doc: str = "",
) -> Callable[..., Any]:
    """The one call path of every fused op's entry point (its first argument is the input):
    ``_C.<fast>(*args)``, the unboxed entry (the op through the dispatcher, without the boxed
    Python path), for plain tensors; ``op(*args)`` (torch.ops) for tensor subclasses, FX proxies
    and torch-function modes; ``native(*args)`` where fastlayers' kernels cannot run (see
    :func:`computes_natively`). ``_C.<fast>`` is looked up per call (a module attribute), so
    that what stands there is what runs.

    The common call (a plain tensor, no transform, mode or tracer, every device with kernels)
    costs a few flag reads before ``fast``, inlined here rather than asked of
    computes_natively: this runs on every call of every fused layer."""

    def entry(input: Any, *args: Any) -> Any:
        # The common case (a plain tensor, nothing transforming or tracing the call) is decided
        # by the first four cheap tests alone; computes_natively only runs when one fails.
        if (
            type(input) is _Tensor
            and not _torch_function_mode_enabled()
            and (
                (
                    _fwad._current_level < 0
                    and not _NO_KERNEL_DEVICES
                    and not _functorch_active()
                    and _tracing_state() is None
                )
                or not computes_natively(input)
            )
        ):
            try:
                return getattr(_C, fast)(input, *args)
            except RuntimeError:
                if not retry_natively(input):
                    raise
                return native(input, *args)
        if computes_natively(input):
            return native(input, *args)
        return op(input, *args)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = doc
    return entry


def _warn_once(device: torch.device) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"{no_kernels_reason(device)}. Until then fastlayers' layers on this GPU compute with "
        "torch's native ops (same results as the native modules, none of the fused speed).",
        RuntimeWarning,
        stacklevel=4,
    )
