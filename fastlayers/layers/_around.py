"""Modules built around Parameters they do not own: the fused layers' from_native / to_native."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def module_around(
    cls: type[M], training: bool, parameters: dict[str, nn.Parameter | None], **attributes
) -> M:
    """An instance of ``cls`` made without its ``__init__`` (no allocation, no initialisation):
    nn.Module's own state, ``attributes`` set, ``parameters`` registered as the very objects
    given (None registers an absent one, as nn.Linear's bias=False), in ``training`` mode."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in attributes.items():
        setattr(module, name, value)
    for name, param in parameters.items():
        module.register_parameter(name, param)
    module.train(training)
    return module


def linear_around(cls: type[M], source: nn.Module) -> M:
    """An instance of ``cls`` (``nn.Linear`` or a subclass) holding ``source``'s own weight and
    bias Parameter objects, its features and its training flag."""
    return module_around(
        cls,
        source.training,
        {"weight": source.weight, "bias": source.bias},
        in_features=source.in_features,
        out_features=source.out_features,
    )
