"""fastlayers.FusedLinearGELU: ``nn.Linear`` followed by ``nn.GELU`` in one op, the GELU computed in
the GEMM's epilogue on Hopper GPUs."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastlayers.layers._script import refuse_script
from fastlayers.ops.linear_gelu import APPROXIMATIONS, _check_approximate, linear_gelu_forward

# Points where an activation module is compared with both GELU forms: dense over the range
# where they differ (up to ~5e-4 apart), plus far points that unmask clipping.
_PROBE = torch.cat(
    [
        torch.linspace(-8.0, 8.0, 161, dtype=torch.float64),
        torch.tensor([-1e4, -100.0, -20.0, 20.0, 100.0, 1e4], dtype=torch.float64),
    ]
)
# The probe is repeated so that rare train-mode randomness shows: a dropout of p = 1e-3 leaves
# all of 2 x 10,688 points untouched with probability ~5e-10.
_PROBE_REPEATS = 64


def _gelu_reference(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))
        return 0.5 * x * (1.0 + torch.tanh(inner))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_approximation(activation: nn.Module) -> str | None:
    """``'none'`` if ``activation`` computes exact (erf) GELU, ``'tanh'`` if it computes the tanh
    approximation, ``None`` otherwise (:func:`recognise_gelu` says why)."""
    return recognise_gelu(activation)[0]


def recognise_gelu(activation: nn.Module) -> tuple[str | None, str | None]:
    """``(approximate, None)`` when ``activation`` provably computes GELU, else ``(None, why)``.

    ``nn.GELU`` (or a subclass that keeps its forward) is read from its ``approximate``. Any
    other parameter-free module (HuggingFace's ``GELUActivation``, ``NewGELUActivation``,
    ``GELUTanh``, a subclass with its own forward, ...) is recognised by what it computes, in
    float64 on probe points, in eval mode and twice in train mode (so dropout or other
    train-only randomness shows); clipped or sigmoid-based variants (``ClippedGELUActivation``,
    ``QuickGELUActivation``) are not mistaken for GELU. The probe leaves the training flags and
    the CPU random generator as they were."""
    name = type(activation).__name__
    if isinstance(activation, nn.GELU) and type(activation).forward is nn.GELU.forward:
        if activation.approximate in APPROXIMATIONS:
            return activation.approximate, None
        return None, f"{name} has approximate={activation.approximate!r}"
    if not isinstance(activation, nn.Module):
        return None, f"{name} is not an nn.Module"
    if any(True for _ in activation.parameters()) or any(True for _ in activation.buffers()):
        return None, f"{name} has parameters or buffers, so it is not GELU alone"
    not_gelu = f"{name} is not GELU (erf or tanh form)"
    modes = [(m, m.training) for m in activation.modules()]
    forms = []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for training in (False, True, True):
                for m, _ in modes:  # the flag itself: an overridden train() may do more
                    m.training = training
                forms.append(_probe_form(activation))
    finally:
        for m, training in modes:
            m.training = training
    if forms[0] is None:
        return None, not_gelu
    if forms[1] != forms[0] or forms[2] != forms[0]:
        return None, (
            f"{name} computes GELU in eval mode but not in train mode (its own forward; "
            "probed in float64)"
        )
    return forms[0], None


def _probe_form(activation: nn.Module) -> str | None:
    """Which GELU form ``activation``'s class forward computes on the probe, or None."""
    probe = _PROBE.repeat(_PROBE_REPEATS)
    try:
        # the class's forward: no hooks (user or accelerate) run on the probe
        out = type(activation).forward(activation, probe.clone())
    except Exception:  # not an elementwise activation we can run on a float64 CPU tensor
        return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return None
    for approximate in APPROXIMATIONS:
        ref = _gelu_reference(probe, approximate)
        if bool(((out.double() - ref).abs() <= 1e-7 * (1.0 + ref.abs())).all()):
            return approximate
    return None


def _is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2 and kin): a linear layer whose weight is [in, out]."""
    return (
        type(module).__name__ == "Conv1D"
        and type(module).__module__.startswith("transformers")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    )


def _is_plain_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or a subclass computing what it computes (not a quantized or LoRA layer
    with its own forward)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class FusedLinearGELU(nn.Module):
    """``gelu(linear(input))`` in one op. Same constructor, defaults, parameters, initialisation
    and ``state_dict`` as :class:`torch.nn.Linear` (plus ``approximate`` as for
    :class:`torch.nn.GELU`), so a ``Linear`` checkpoint loads as is.

    It can also wrap a weight stored ``[in_features, out_features]`` (HuggingFace ``Conv1D``,
    via :meth:`from_native`) without copying or transposing it. It is not an ``nn.Linear``
    subclass on purpose: code that finds and rewrites Linears must not drop its GELU.
    """

    __constants__ = ("in_features", "out_features", "approximate", "weight_transposed")

    __prepare_scriptable__ = refuse_script

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        approximate: str = "none",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_approximate(approximate)
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.approximate = approximate
        self.weight_transposed = False
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: weight and bias uniform in +-1/sqrt(in_features)."""
        if not self.weight_transposed:
            nn.Linear.reset_parameters(self)  # the same random draws as nn.Linear
            return
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_gelu_forward(
            input, self.weight, self.bias, self.approximate, self.weight_transposed
        )

    @classmethod
    def from_native(cls, linear: nn.Module, gelu: nn.Module | str = "none") -> FusedLinearGELU:
        """The fused layer for ``linear`` followed by ``gelu``, around ``linear``'s own Parameter
        objects (no copy): optimizer state, tied weights, ``requires_grad`` and device placement
        stay valid.

        ``linear`` is an ``nn.Linear`` or HuggingFace ``Conv1D`` (weight [in, out], read in
        place). ``gelu`` is an ``nn.GELU``, a HuggingFace GELU activation module, or the form
        itself, ``'none'`` (erf) or ``'tanh'``.
        """
        if isinstance(gelu, str):
            _check_approximate(gelu)
            approximate = gelu
        else:
            approximate = gelu_approximation(gelu)
            if approximate is None:
                raise TypeError(
                    f"FusedLinearGELU.from_native: gelu must be an nn.GELU, a module computing "
                    f"GELU (erf or tanh form), or 'none'/'tanh'; {type(gelu).__name__} computes "
                    "something else"
                )
        if _is_plain_linear(linear):
            transposed = False
            in_features, out_features = linear.in_features, linear.out_features
        elif _is_hf_conv1d(linear):
            transposed = True
            in_features, out_features = linear.weight.shape
        else:
            raise TypeError(
                f"FusedLinearGELU.from_native: linear must be a torch.nn.Linear (without its own "
                f"forward) or a HuggingFace Conv1D, got {type(linear).__name__}"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features = int(in_features)
        layer.out_features = int(out_features)
        layer.approximate = approximate
        layer.weight_transposed = transposed
        layer.register_parameter("weight", linear.weight)
        layer.register_parameter("bias", linear.bias)
        layer.train(linear.training)
        return layer

    def to_native(self) -> tuple[nn.Module, nn.GELU]:
        """``(linear, nn.GELU(approximate))`` sharing this layer's Parameter objects; ``linear``
        is an ``nn.Linear``, or a HuggingFace ``Conv1D`` when the weight is stored transposed."""
        if self.weight_transposed:
            from transformers.pytorch_utils import Conv1D

            linear = Conv1D.__new__(Conv1D)
            nn.Module.__init__(linear)
            linear.nf, linear.nx = self.out_features, self.in_features
        else:
            linear = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(linear)
            linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.register_parameter("weight", self.weight)
        linear.register_parameter("bias", self.bias)
        linear.train(self.training)
        gelu = nn.GELU(approximate=self.approximate)
        gelu.train(self.training)
        return linear, gelu

    def extra_repr(self) -> str:
        layout = ", weight_transposed=True" if self.weight_transposed else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, approximate={self.approximate!r}{layout}, "
            "fused=fastlayers.linear_gelu"
        )
