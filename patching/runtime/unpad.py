"""Padding-free execution (opt-in: ``fastlayers.patch(model, unpad=True)``): a call of a
transformers base model (BertModel, LlamaModel, ...: ``model.base_model``) with a 2-D attention
mask runs on its real tokens only. The real tokens of all sequences are packed into one row,
with the positions native computes for them (the column index, a left padding's offset
included, or the family's own rule where its embeddings have one, RoBERTa's); every token-wise
part runs on them; attention runs per sequence (runtime/varlen.py, through the rule
``varlen_attention``'s routes); the outputs come back in the caller's shapes with zeros at the
padding positions, and a pooler runs on them as natively. Heads above the base model (an LM head,
a classifier, the loss) run as natively on those outputs.

A model's first padding-free call is checked: the same call padded, in eval mode under no grad,
must give the same outputs at the real positions (fastlayers.check's tolerance); where not (an
attention the rule could not route, outputs that depend on the padding), the model runs padded
from then on, with a warning naming why.

Refused per call, with the reason (the call runs padded; ``forward.stats`` counts them): no 2-D
attention mask, a mask without padding, a KV cache given or asked for (``use_cache=True``),
attention weights asked for, cross-attention inputs, other inputs not shaped [batch, seq, ...],
torch.compile tracing (the packed length is a host value). A call not naming ``use_cache``
runs without a cache: padding-free outputs carry no KV cache."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..fallback import warn_once
from ..fused import unpad_forward
from .call import CACHE_ARGS, CallView, WrappedForward
from .packed_replay import PackedReplay
from .replay import _CONSTANTS, ReplayOptions, model_test
from .varlen import (
    CAPTURING,
    PACKED_CALL,
    NotCapturable,
    Packing,
    PackingMismatch,
    sequence_bucket,
    token_bucket,
)

# inputs of another sequence than the call's (cross-attention)
_CROSS = ("encoder_hidden_states", "encoder_attention_mask")


class _Padded(Exception):
    """The packed call cannot stand for this call; the message says why (it runs padded)."""


class UnpadForward(WrappedForward):
    """The forward of a base model patched with ``unpad=True``, set on the instance
    (records.UnpadRecord puts it there and takes it away): the forward it replaced
    (``previous``, a rewritten block's, or None for the class's) run on the real tokens."""

    is_fastlayers_unpad = True  # what fused.rewritten_forward looks through

    def __init__(self, model: nn.Module, previous: Any, replay: ReplayOptions | None = None):
        self.model, self.previous = model, previous
        # replay of the packed calls from CUDA graphs keyed by packed size (None: eager)
        self.replay = replay
        self.replay_refused: str | None = None
        self._replay: PackedReplay | None = None
        self.stats: Counter[str] = Counter()
        self.refused: str | None = None  # why this model runs padded for good
        # kind of call ('left' padding or not) -> why it runs padded (None: checked, it holds)
        self.checked: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._replay_lock = threading.Lock()
        self._local = threading.local()  # .holding: this thread's call holds _replay_lock
        # the module tree as the first checks saw it (replay.model_test, structure alone)
        self._tree: Callable[[], bool] | None = None

    def __getstate__(self) -> dict:
        return {"model": self.model, "previous": self.previous, "replay": self.replay}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"], state["previous"], state.get("replay"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call_once(*args, **kwargs)
        finally:
            if getattr(self._local, "holding", False):
                self._local.holding = False
                self._replay_lock.release()

    def _call_once(self, *args: Any, **kwargs: Any) -> Any:
        view = CallView.bind(self.__signature__, args, kwargs)
        why = self.refused or _why_padded(view)
        if why is None and torch.compiler.is_compiling():
            why = "torch.compile is tracing (the packed length is a host value)"
        if why is None and view.tokens.is_cuda and torch.cuda.is_current_stream_capturing():
            why = "a CUDA graph capture is under way (the packing reads the lengths on the host)"
        if why is None and self._tree is not None and not self._tree():
            # a module replaced, or a forward set, since the first checks: which attentions
            # run per sequence may have changed; check again (before the packing's host
            # synchronisation, as every per-call check: the GPU is still busy then)
            warn_once(
                f"unpad: {type(self.model).__name__} changed since its first padding-free "
                "call: checked again",
                3,
            )
            self.checked.clear()
            self._tree = None
        if why is None:
            mask = view.mask.to(view.tokens.device)  # as transformers moves it
            try:
                packing, runner = self._packing(view, mask)
            except _Padded as err:
                packing, runner, why = None, None, str(err)
            if packing is None:
                pass
            elif packing.lengths and min(packing.lengths) == 0:
                # natively such a row's outputs come from padding alone (a pooler reads it):
                # nothing to compare with, nothing real to compute
                why = "a sequence without real tokens (a row of the mask all zeros)"
            elif packing.total == packing.batch * packing.seq and runner is None:
                # nothing to gain eagerly; replayed, a batch without padding still saves the
                # host its eager forward
                why = "no padding in the attention mask"
            else:
                kind = "left padding" if packing.left else "right padding"
                if kind not in self.checked:
                    self._first_check(kind, view, packing, runner, args, kwargs)
                why = self.refused or self.checked.get(kind)
            if why is None:
                try:
                    out = self._packed(view, packing, runner)
                    self.stats["padding-free"] += 1
                    return out
                except (_Padded, PackingMismatch) as err:
                    why = self.refused = str(err)
                    warn_once(f"unpad runs {type(self.model).__name__} padded: {why}", 3)
        self.stats[f"padded: {why}"] += 1
        return self.eager(*args, **kwargs)

    # ------------------------------------------------------------------ the packed call

    def _packing(self, view: CallView, mask: torch.Tensor) -> tuple[Packing, PackedReplay | None]:
        """The call's packing, its inputs gathered: into the replay's shared buffers where the
        call may replay (then also the runner), else into fresh tensors."""
        inputs = self._per_token(view, *mask.shape)
        runner = self._runner(view, mask)
        if runner is None:
            return Packing.of(mask, inputs), None
        out, cu = runner.destinations(inputs, mask.numel(), mask.shape[0])
        return Packing.of(mask, inputs, out, cu), runner

    def _runner(self, view: CallView, mask: torch.Tensor) -> PackedReplay | None:
        """The replay of packed calls where this call may replay (inference under no grad, on
        CUDA, ...), else None (counted in ``stats`` with the reason)."""
        if self.replay is None:
            return None
        why = self.replay_refused
        if why is None and not self._replay_lock.acquire(blocking=False):
            # the shared input buffers are one per model: one call at a time replays
            why = "another thread is replaying this model"
        elif why is None:
            self._local.holding = True  # released when the call returns (__call__)
            if self._replay is None:
                self._replay = PackedReplay(self.model, self.eager, self.replay)
            why = self._replay.refusal({**view.arguments, "attention_mask": mask})
        if why is None:
            return self._replay
        self.stats[f"packed eagerly: {why}"] += 1
        return None

    def _per_token(self, view: CallView, batch: int, seq: int) -> dict[str, torch.Tensor]:
        """The call's inputs to pack (every tensor but the mask and scalars; the native
        positions, and BERT's token types, where none are given), each ``[batch, seq, ...]``;
        raises _Padded for one that is not."""
        inputs = {}
        for name, value in view.arguments.items():
            if name == "attention_mask" or not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 0:  # a scalar (the Trainer's num_items_in_batch): passed as is
                continue
            if name == "position_ids" and value.dim() == 2 and value.shape[0] == 1:
                value = value.expand(batch, -1)
            if value.dim() < 2 or tuple(value.shape[:2]) != (batch, seq):
                raise _Padded(f"input {name!r} of shape {tuple(value.shape)} is not per token")
            inputs[name] = value
        if inputs.get("position_ids") is None:
            inputs["position_ids"] = _native_positions(self.model, view, batch, seq)
        if inputs.get("token_type_ids") is None and _buffered_token_types(self.model):
            # BERT's embeddings slice a buffer of zeros as long as the row when given none: the
            # packed row may be longer than the buffer
            inputs["token_type_ids"] = torch.zeros_like(inputs["position_ids"])
        return inputs

    def _constants(self, view: CallView, packing: Packing) -> dict[str, Any]:
        """The packed call's arguments other than its per-token inputs and packing (constants,
        scalar tensors)."""
        call = {
            name: value
            for name, value in view.arguments.items()
            if name not in packing.gathered
            and not (isinstance(value, torch.Tensor) and value.dim() > 0)
        }
        call["attention_mask"] = None
        if "use_cache" in self.__signature__.parameters and not call.get("use_cache"):
            call["use_cache"] = False
        if call.get("return_dict") is False:
            # the output's fields by name (a pooler's is recomputed on the re-padded output);
            # the caller's tuple is made from them after, as the model's own to_tuple() does
            call["return_dict"] = True
        return call

    def _packed(self, view: CallView, packing: Packing, runner: PackedReplay | None) -> Any:
        """The packed call, in the caller's shapes (a tuple where the caller asked
        ``return_dict=False``)."""
        out = self._packed_output(view, packing, runner)
        if view.arguments.get("return_dict") is False and hasattr(out, "to_tuple"):
            return out.to_tuple()
        return out

    def _packed_output(self, view: CallView, packing: Packing, runner: PackedReplay | None) -> Any:
        """The packed call's output re-padded: replayed from the graph of its bucket where
        ``runner`` is given, else eagerly."""
        constants = self._constants(view, packing)
        packed = PACKED_CALL.set(True)
        try:
            if runner is not None:
                token = CAPTURING.set(True)
                try:
                    out = runner.run(constants, packing)
                except NotCapturable as err:
                    self.replay_refused = str(err)
                    why = f"unpad + replay: {type(self.model).__name__} runs eagerly: {err}"
                    warn_once(why, 4)
                    out = None
                finally:
                    CAPTURING.reset(token)
                if out is not None:
                    return self._repad(out, packing)
            call = {**constants, **packing.kwargs()}
            for name in packing.gathered:
                call[name] = packing.packed(name)
            out = self.eager(**call)
        finally:
            PACKED_CALL.reset(packed)
        return self._repad(out, packing)

    def graph_count(self) -> int:
        """How many packed-size buckets are captured (as replay's graph_count)."""
        return 0 if self._replay is None else self._replay.graph_count()

    def graph_memory(self) -> int:
        """Bytes the packed calls' graphs and their shared input buffers hold on the device."""
        return 0 if self._replay is None else self._replay.memory()

    def _repad(self, out: Any, packing: Packing) -> Any:
        """The packed call's output in the caller's shapes: per-token tensors [1, total, ...] to
        [batch, seq, ...] with zeros at the padding; a pooler's output computed again on the
        re-padded last hidden state, as the model computes it."""

        def convert(value: Any, name: str) -> Any:
            if isinstance(value, torch.Tensor):
                if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == packing.total:
                    return packing.unpack(value)
                raise _Padded(f"output {name!r} of shape {tuple(value.shape)} is not per token")
            if isinstance(value, (tuple, list)):
                return type(value)(convert(v, f"{name}[{i}]") for i, v in enumerate(value))
            if isinstance(value, _CONSTANTS):
                return value
            raise _Padded(f"output {name!r} is a {type(value).__name__}")

        if isinstance(out, torch.Tensor):
            return convert(out, "output")
        if isinstance(out, (tuple, list)):
            return convert(out, "output")
        if not isinstance(out, dict):
            raise _Padded(f"its output is a {type(out).__name__}")
        pooler = getattr(self.model, "pooler", None)
        values = {}
        for key, value in out.items():
            if key == "pooler_output" and value is not None:
                continue
            values[key] = convert(value, key)
        if out.get("pooler_output") is not None:
            if not isinstance(pooler, nn.Module) or "last_hidden_state" not in values:
                raise _Padded("its pooler_output comes from no pooler child it can run again")
            values["pooler_output"] = pooler(values["last_hidden_state"])
        return type(out)(**values)

    # ------------------------------------------------------------------ the first call's check

    def _first_check(
        self,
        kind: str,
        view: CallView,
        packing: Packing,
        runner: PackedReplay | None,
        args: tuple,
        kwargs: dict,
    ) -> None:
        """The first padding-free call of a ``kind`` (left padding or not), against the same call
        padded (eval mode, no grad): at the real positions the outputs must agree within
        fastlayers.check's tolerance; where not, calls of that kind run padded."""
        from ..checking.numerics import default_tolerance

        with self._lock:
            if kind in self.checked:
                return
            flags = [(m, m.training) for m in self.model.modules()]
            try:
                for m, _ in flags:
                    m.training = False
                with torch.no_grad():
                    native = self.eager(*args, **kwargs)
                    try:
                        packed = self._packed(view, packing, runner)
                    except (_Padded, PackingMismatch) as err:
                        self.refused = str(err)
                        packed = None
            finally:
                for m, training in flags:
                    m.training = training
            self.checked[kind] = None
            self._tree = model_test(self.model, capture=False)
            if packed is None:
                warn_once(f"unpad runs {type(self.model).__name__} padded: {self.refused}", 4)
                return
            mask = view.mask.to(view.tokens.device) != 0
            for name, ours, theirs in _paired_tensors(packed, native):
                if ours is None or ours.shape != theirs.shape:
                    why = f"output {name!r} has another shape padding-free"
                elif not ours.is_floating_point():
                    continue
                else:
                    if ours.dim() >= 2 and tuple(ours.shape[:2]) == tuple(mask.shape):
                        ours, theirs = ours[mask], theirs[mask]
                    rtol, atol = default_tolerance(theirs.dtype)
                    err = (ours.double() - theirs.double()).abs().max().item()
                    scale = theirs.double().abs().max().item()
                    if err <= atol + rtol * scale:
                        continue
                    why = (
                        f"output {name!r} differs padding-free with {kind} (max abs err "
                        f"{err:.3g} against max |native| {scale:.3g}): an attention not routed "
                        "(rule varlen_attention), or outputs that depend on the padding (a "
                        "pooler reading a padded first token)"
                    )
                self.checked[kind] = why
                warn_once(f"unpad runs {type(self.model).__name__} padded: {why}", 4)
                return


def _why_padded(view: CallView | None) -> str | None:
    """Why a call runs padded (checked before any packing), or None."""
    if view is None:
        return "its arguments do not bind to the forward's signature"
    if view.mask is None:
        return "no 2-D attention_mask"
    tokens = view.tokens
    if tokens is None or tuple(tokens.shape[:2]) != tuple(view.mask.shape):
        return "no input_ids / inputs_embeds of the attention mask's shape"
    args = view.arguments
    if any(args.get(name) is not None for name in CACHE_ARGS):
        return "a KV cache was given"
    if args.get("use_cache"):
        return "a KV cache was asked for (use_cache=True)"
    if args.get("output_attentions"):
        return "attention weights were asked for"
    if any(args.get(name) is not None for name in _CROSS):
        return "cross-attention inputs"
    return None


def _buffered_token_types(model: nn.Module) -> bool:
    embeddings = getattr(model, "embeddings", None)
    return isinstance(embeddings, nn.Module) and "token_type_ids" in embeddings._buffers


def _native_positions(model: nn.Module, view: CallView, batch: int, seq: int) -> torch.Tensor:
    """The position ids the model computes for the padded call when given none: its embeddings'
    own rule where they have one (RoBERTa, XLM-R: from the padding token), else the column
    index (BERT, GPT-2, the LLaMA family: a left padding's offset included)."""
    embeddings = getattr(model, "embeddings", None)
    ids, embeds = view.arguments.get("input_ids"), view.arguments.get("inputs_embeds")
    pad = getattr(embeddings, "padding_idx", None)
    if (
        pad is not None
        and ids is not None
        and hasattr(embeddings, "create_position_ids_from_input_ids")
    ):
        return embeddings.create_position_ids_from_input_ids(ids, pad)
    if (
        pad is not None
        and embeds is not None
        and hasattr(embeddings, "create_position_ids_from_inputs_embeds")
    ):
        return embeddings.create_position_ids_from_inputs_embeds(embeds, pad)
    device = view.mask.device
    return torch.arange(seq, device=device).expand(batch, seq)


def _paired_tensors(ours: Any, theirs: Any, name: str = "output"):
    """(name, our tensor or None, their tensor) for every tensor in ``theirs`` (a ModelOutput,
    dict, tuple or tensor); a KV cache object in theirs is not compared (padding-free calls
    carry none)."""
    if isinstance(theirs, torch.Tensor):
        yield name, ours if isinstance(ours, torch.Tensor) else None, theirs
    elif isinstance(theirs, dict):
        for key, value in theirs.items():
            other = ours.get(key) if isinstance(ours, dict) else None
            yield from _paired_tensors(other, value, key)
    elif isinstance(theirs, (tuple, list)):
        for i, value in enumerate(theirs):
            other = ours[i] if isinstance(ours, (tuple, list)) and i < len(ours) else None
            yield from _paired_tensors(other, value, f"{name}[{i}]")


def warm_up(
    model: nn.Module,
    example: Mapping[str, Any],
    max_batch: int = 64,
    max_tokens: int = 4096,
) -> int:
    """Capture ahead the graphs that padding-free calls of up to ``max_batch`` sequences and
    ``max_tokens`` real tokens replay (a model patched with ``unpad=True, replay=True``), as
    vLLM captures its batch sizes at start-up: a stream of requests then pays no capture. The
    calls are modelled on ``example`` (a call's keyword arguments, e.g. a tokenizer's output on
    the model's device: which inputs, their dtypes, the other arguments); each token-count
    bucket is captured once per sequence-count bucket, sequences no longer than the model's
    ``config.max_position_embeddings``. Returns how many graphs the model holds then."""
    forwards = [f for m in model.modules() if (f := unpad_forward(m)) is not None]
    forwards = [f for f in forwards if f.replay is not None]
    if not forwards:
        raise ValueError(
            "warm_up: `model` has no padding-free replay: patch it with "
            "fastlayers.patch(model, unpad=True, replay=True) first"
        )
    mask = example.get("attention_mask") if isinstance(example, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.device.type != "cuda":
        raise ValueError("warm_up: `example` needs a 2-D CUDA tensor 'attention_mask'")
    for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"warm_up: `{name}` must be a positive int, got {value!r}")
    config = getattr(model, "config", None)
    longest = getattr(config, "max_position_embeddings", None) or max_tokens
    sequences = [64]
    while sequences[-1] < sequence_bucket(max_batch):
        sequences.append(2 * sequences[-1])
    tokens = [64]
    while tokens[-1] < token_bucket(max_tokens):
        tokens.append(token_bucket(tokens[-1] + 1))
    with torch.no_grad():
        for count in sequences:
            batch = min(count, max_batch)
            for total in tokens:
                rows = min(batch, total)  # no empty sequence
                seq = -(-total // rows) + 1  # one padding column at least
                if seq - 1 > longest:
                    continue
                model(**_synthetic(example, rows, seq, total))
    return sum(f.graph_count() for f in forwards)


def _synthetic(example: Mapping[str, Any], rows: int, seq: int, total: int) -> dict[str, Any]:
    """``example``'s call with ``rows`` x ``seq`` inputs (its per-token inputs tiled) and a
    right-padded mask of exactly ``total`` real tokens."""
    mask = example["attention_mask"]
    lengths = torch.full((rows,), total // rows, device=mask.device)
    lengths[: total % rows] += 1
    new_mask = (torch.arange(seq, device=mask.device)[None] < lengths[:, None]).to(mask.dtype)
    call: dict[str, Any] = {}
    for name, value in example.items():
        if name == "attention_mask":
            call[name] = new_mask
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == mask.shape:
            flat = value.reshape(-1, *value.shape[2:])
            index = torch.arange(rows * seq, device=value.device) % flat.shape[0]
            call[name] = flat[index].view(rows, seq, *value.shape[2:])
        else:
            call[name] = value
    return call
