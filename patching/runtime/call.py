"""One view of a call of a model's forward, shared by the call-time paths: its arguments bound to
the forward's signature by name (positional ones included), its tensors, and its 2-D attention
mask with the batch and sequence sizes that mask gives."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fused import wrapped_signature

# the names transformers' forwards give a KV cache (``past_key_values`` renamed ``cache``)
CACHE_ARGS = ("cache", "past_key_values")


@dataclass
class CallView:
    """``arguments``: every argument of the call by parameter name (``**kwargs`` spread out);
    ``mask``: the 2-D attention mask, or None."""

    arguments: dict[str, Any]
    mask: torch.Tensor | None

    @staticmethod
    def bind(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> CallView | None:
        """The view of ``forward(*args, **kwargs)``, or None where the arguments do not bind to
        ``signature`` (the forward then raises what it raises)."""
        if signature is None:
            if args:
                return None
            arguments = dict(kwargs)
        elif not args and _named(signature, kwargs):
            arguments = dict(kwargs)  # what bind gives, without its cost on every call
        else:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return None
            arguments = {}
            for name, value in bound.arguments.items():
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    arguments.update(value)
                elif kind is inspect.Parameter.VAR_POSITIONAL:
                    if value:
                        return None
                else:
                    arguments[name] = value
        mask = arguments.get("attention_mask")
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            mask = None
        return CallView(arguments, mask)

    @property
    def tokens(self) -> torch.Tensor | None:
        """The call's token input: ``input_ids``, else ``inputs_embeds``."""
        for name in ("input_ids", "inputs_embeds"):
            value = self.arguments.get(name)
            if isinstance(value, torch.Tensor):
                return value
        return None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.arguments.items() if isinstance(v, torch.Tensor)}


_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _named(signature: inspect.Signature, kwargs: dict) -> bool:
    """Whether every keyword names a parameter that takes it by name and every parameter
    without a default is among them: then binding the keywords gives them unchanged."""
    params = signature.parameters
    for name in kwargs:
        param = params.get(name)
        if param is None or param.kind not in _BY_NAME:
            return False
    return all(
        p.name in kwargs or p.default is not inspect.Parameter.empty or p.kind in _VARIADIC
        for p in params.values()
    )


class WrappedForward:
    """The base of the call-time paths a patch sets on a model's instance forward (replay's,
    padding-free's, the fused loss's): ``model`` and the forward it wraps, ``previous`` (a
    rewritten block's or another path's; None for the class's)."""

    model: nn.Module
    previous: Any

    @property
    def __signature__(self) -> inspect.Signature | None:
        # what tools that read a forward's arguments by signature see: the model's own. Read
        # on every call by the paths that bind arguments: cached while the wrapped forward (or
        # the class forward) stays the same object
        source = self.previous if self.previous is not None else type(self.model).forward
        cached = self.__dict__.get("_signature")
        if cached is not None and cached[0] is source:
            return cached[1]
        signature = wrapped_signature(self.previous, self.model)
        self.__dict__["_signature"] = (source, signature)
        return signature

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped forward, as the model runs without this path."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)
