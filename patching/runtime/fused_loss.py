"""The fused head + loss per call (rule 'linear_cross_entropy'; what it proves: rules/
linear_cross_entropy.py). A call in training mode with labels runs the model's forward with
``labels=None`` and its head answering an empty [..., 0] tensor (the head's input kept), then the
loss from that input through fastlayers.functional.linear_cross_entropy with the loss
function's own arguments (``num_items_in_batch``, ``ignore_index``, ``shift_labels``); the
output is the forward's with ``loss`` set and ``logits`` None (the logits never exist).

Everything else runs the forward as it is, logits computed (``stats`` counts why): eval mode,
no labels, torch.compile tracing, a loss function other than transformers' ForCausalLMLoss (one
the user set), a head that is no longer a plain nn.Linear (or has hooks or its own forward),
a vocabulary other than the config's, ``logits_to_keep`` given, the class forward changed since
the patch."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from fastlayers.ops.linear_cross_entropy import linear_cross_entropy

from .call import CallView, WrappedForward


def _causal_lm_loss() -> Any:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # transformers absent: no model has its loss
        return None
    return ForCausalLMLoss


class FusedLossForward(WrappedForward):
    """A causal LM's forward with its head and loss fused in training (records.FusedLossRecord
    puts it on the instance): ``previous`` is the forward it wraps (a rewritten block's) or
    None for the class's."""

    is_fastlayers_loss = True  # what fused.py looks through

    _STATE = ("model", "previous", "head", "softcap", "cls_forward")

    def __init__(self, model: nn.Module, previous: Any, head: str, softcap: bool):
        self.model, self.previous, self.head, self.softcap = model, previous, head, softcap
        self.cls_forward = type(model).forward
        self.stats: Counter[str] = Counter()

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def __setstate__(self, state: dict) -> None:  # the model may be half-built: no lookups
        self.__dict__.update(state)
        self.stats = Counter()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("labels") is None and len(args) < 2:
            return self.eager(*args, **kwargs)  # the common inference call, decided cheaply
        view = CallView.bind(self.__signature__, args, kwargs)
        why = self.refusal(view)
        if why is not None:
            self.stats[f"logits: {why}"] += 1
            return self.eager(*args, **kwargs)
        self.stats["fused"] += 1
        return self._fused(view.arguments)  # type: ignore[union-attr]

    def refusal(self, view: CallView | None) -> str | None:
        """Why this call computes its logits (None: it may run fused)."""
        if view is None:
            return "its arguments do not bind to the forward"
        arguments = view.arguments
        if arguments.get("labels") is None:
            return "no labels"
        if not self.model.training:
            return "eval mode"
        if torch.compiler.is_compiling():
            return "torch.compile is tracing"
        if arguments.get("logits_to_keep") not in (None, 0):
            return "logits_to_keep given"
        if type(self.model).forward is not self.cls_forward:
            return "the class forward changed since the patch"
        head = self.model._modules.get(self.head)
        # the source proof is about `self.<head>(...)`, whatever module is there: a head
        # replaced by another plain nn.Linear (resize_token_embeddings) still fuses
        if type(head) is not nn.Linear:
            return f"the head {self.head!r} is not an nn.Linear now"
        if "forward" in head.__dict__ or head._forward_hooks or head._forward_pre_hooks:
            return f"the head {self.head!r} has hooks or its own forward"
        loss = _causal_lm_loss()
        if loss is None or self.model.loss_function is not loss:
            return "a loss function other than transformers' ForCausalLMLoss"
        config = getattr(self.model, "config", None)
        if head.out_features != getattr(config, "vocab_size", None):
            return "the head's outputs are not the config's vocabulary"
        return None

    def _fused(self, arguments: dict[str, Any]) -> Any:
        head = self.model._modules[self.head]
        labels = arguments["labels"]
        call = dict(arguments, labels=None)
        if "return_dict" in call or self._takes_kwargs():
            call["return_dict"] = True  # the caller's tuple is made from it below
        inputs: list[torch.Tensor] = []

        def keep_input(hidden: torch.Tensor) -> torch.Tensor:
            inputs.append(hidden)
            return hidden.new_empty((*hidden.shape[:-1], 0))

        head.__dict__["forward"] = keep_input
        try:
            out = self.eager(**call)
        finally:
            head.__dict__.pop("forward", None)
        if len(inputs) != 1 or not hasattr(out, "to_tuple"):
            raise RuntimeError(
                "fastlayers linear_cross_entropy: the forward did not call its head once and "
                "return a ModelOutput as its source says; patch with "
                "layers excluding 'linear_cross_entropy' and report this model"
            )
        hidden = inputs[0]
        extra = {k: v for k, v in arguments.items() if k not in self._parameters()}
        ignore_index = extra.get("ignore_index", -100)
        shifted = extra.get("shift_labels")
        if shifted is None:
            shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shifted = shifted.to(hidden.device)
        if shifted.numel() != hidden[..., 0].numel():
            raise ValueError(
                f"labels of {tuple(labels.shape)} do not match the head's input "
                f"{tuple(hidden.shape)} (as natively: the loss needs one label per token)"
            )
        softcap = None
        if self.softcap:
            softcap = getattr(self.model.config, "final_logit_softcapping", None)
        loss = linear_cross_entropy(
            hidden,
            head.weight,
            shifted.reshape(hidden.shape[:-1]),
            head.bias,
            ignore_index=ignore_index,
            num_items_in_batch=extra.get("num_items_in_batch"),
            softcap=softcap,
        )
        fields = {k: v for k, v in out.items() if k != "logits"}
        result = type(out)(**{**fields, "loss": loss})
        if arguments.get("return_dict") is False or (
            "return_dict" not in arguments
            and getattr(getattr(self.model, "config", None), "return_dict", True) is False
        ):
            return result.to_tuple()
        return result

    def _parameters(self) -> Any:
        signature = self.__signature__
        return signature.parameters if signature is not None else {}

    def _takes_kwargs(self) -> bool:
        return any(p.kind is p.VAR_KEYWORD for p in self._parameters().values())
