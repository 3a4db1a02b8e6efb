"""fastlayers.RMSNorm: a drop-in torch.nn.RMSNorm whose forward and backward run fused kernels,
and the fused form of the models' own RMSNorms (LLaMA, T5, Gemma, OLMo2 and their copies), each
computed in its model's rounding order."""

from __future__ import annotations

import torch
from torch import nn

from fastlayers.layers._around import module_around
from fastlayers.layers._script import refuse_script
from fastlayers.layers.recognise import recognise_rms_norm
from fastlayers.ops.rms_norm import FORM_NAMES, FORMS, native_rms_norm, rms_norm_forward


class RMSNorm(nn.RMSNorm):
    """Same constructor, defaults, parameters, initialisation and ``state_dict`` as
    :class:`torch.nn.RMSNorm` (a subclass: ``isinstance(m, nn.RMSNorm)`` holds).

    Built by :meth:`from_native` around a model's own RMSNorm (HuggingFace ``LlamaRMSNorm``,
    ``T5LayerNorm``, ``GemmaRMSNorm``, ...), it computes that module's function in its rounding
    order (``form``: see :func:`fastlayers.functional.rms_norm`) and keeps its epsilon under the
    module's own attribute name (``variance_epsilon`` for LLaMA and T5), so code that reads or
    sets it keeps working."""

    __prepare_scriptable__ = refuse_script

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._form = FORMS["torch"]
        self._eps_attr = "eps"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Parameters straight from _parameters (self.weight is a Module.__getattr__ call);
        # where a parametrization or pruning took the weight out of it, as nn.Module reads it
        p = self._parameters
        weight = p["weight"] if "weight" in p else self.weight
        eps = self.__dict__[self._eps_attr]
        if input.dtype is torch.float64:
            # native's own autograd: the forms that compute in float32 (all but 'torch') take
            # float32 derivatives through their statistics, which our float64 backward would not
            return native_rms_norm(input, self.normalized_shape, weight, eps, self._form)
        return rms_norm_forward(input, self.normalized_shape, weight, eps, self._form)

    @property
    def form(self) -> str:
        """Whose rounding order this layer keeps: 'torch', 'cast_first', 't5', 'gemma' or
        'float32'."""
        return FORM_NAMES[self._form]

    @classmethod
    def from_native(cls, native: nn.Module, recognised: tuple[str, str] | None = None) -> RMSNorm:
        """Wraps ``native``'s own weight Parameter (no copy). ``native`` is a
        ``torch.nn.RMSNorm`` or a module whose forward provably computes one of the RMSNorm
        forms (probed on its class forward: see :func:`fastlayers.layers.recognise_rms_norm`);
        anything else raises TypeError with the reason. ``recognised``: the ``(form,
        eps_attribute)`` that recognise_rms_norm just returned for ``native`` (the patcher's
        rule asks it first), so that the probe does not run twice."""
        form, eps_attr, why = (*recognised, None) if recognised else recognise_rms_norm(native)
        if form is None:
            raise TypeError(f"RMSNorm.from_native: {why}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        weight = native._parameters.get("weight")
        if isinstance(native, nn.RMSNorm):
            layer.normalized_shape = tuple(native.normalized_shape)
            layer.elementwise_affine = native.elementwise_affine
        else:
            layer.normalized_shape = tuple(weight.shape)
            layer.elementwise_affine = True
        layer.__dict__[eps_attr] = native.__dict__[eps_attr]
        layer._eps_attr = eps_attr
        layer._form = FORMS[form]
        layer.register_parameter("weight", weight)
        layer.train(native.training)
        return layer

    def to_native(self) -> nn.RMSNorm:
        """An ``nn.RMSNorm`` sharing this layer's weight (form 'torch' only: the other forms
        are the models' own modules, which the patcher keeps and puts back)."""
        if self._form != FORMS["torch"]:
            raise TypeError(
                f"RMSNorm.to_native: this layer computes the {self.form!r} form, which "
                "torch.nn.RMSNorm does not; fastlayers.unpatch puts the model's own module back"
            )
        return module_around(
            nn.RMSNorm,
            self.training,
            {"weight": self.weight},
            normalized_shape=tuple(self.normalized_shape),
            eps=self.eps,
            elementwise_affine=self.elementwise_affine,
        )

    def extra_repr(self) -> str:
        eps = self.__dict__[self._eps_attr]
        return (
            f"{self.normalized_shape}, {self._eps_attr}={eps}, "
            f"elementwise_affine={self.elementwise_affine}, form={self.form}, "
            "fused=fastlayers.rms_norm"
        )
