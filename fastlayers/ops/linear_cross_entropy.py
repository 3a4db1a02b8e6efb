"""Linear + cross-entropy without the logits: the loss a causal LM head computes
(``F.cross_entropy(softcap(F.linear(hidden, weight, bias)).float(), target)``, transformers'
ForCausalLMLoss) run in chunks of tokens, so the [tokens, vocabulary] logits never exist whole.

Each chunk's logits are computed in the dtype native computes them in (autocast's, else the
inputs'), by one GEMM; one kernel (torch.ops.fastlayers.cross_entropy_rows_, csrc/cross_entropy)
then soft-caps them as Gemma does (divide, tanh, multiply, each rounded in that dtype), takes
them to float32 for the log-sum-exp, as ForCausalLMLoss upcasts, gives each row's loss and,
where a gradient is wanted, overwrites the chunk with its gradient (softmax minus the one-hot,
divided by the normaliser, rounded to the logits' dtype as the upcast's backward rounds it, then
the cap's backward in that dtype): no float32 copy of the logits exists. It is consumed at once: the
hidden states' gradient in the logits' dtype, the weight's and the bias's summed over chunks in
float32, rounded once to their dtype at the end (native rounds its one GEMM's result once) or,
for float32 parameters under autocast, handed back unrounded (native rounds them to bfloat16
first: ours is closer to exact, and no second float32 copy of the weight is made).
So a training step computes three GEMMs, as natively, and holds one chunk's logits at a time.

Only the rows whose target is not ``ignore_index`` are computed (their gradient is natively
exactly zero): padding and prompt tokens cost nothing. Finding them reads their count on the
host, in the one synchronisation that also checks the targets' range (natively a target out of
range is a device-side assert). Each chunk gathers its own rows (and, under autocast, casts
them), and its hidden-state gradient is written into the rows it came from: no whole copy of the
selected or cast hidden states, nor of their gradient, is made."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

# A chunk holds at most this many logits (rows x vocabulary), 128 MiB in bfloat16, but at least
# MIN_CHUNK_ROWS rows. Each chunk re-reads and re-writes the weight's float32 gradient (1 GiB at
# 128,256 x 2,048): on an H200 at 8,192 tokens and that vocabulary, 2,048 rows a chunk took 22.9
# ms forward + backward, 1,024 rows 24.6 ms (Liger 28.4), 256 rows 44.1 ms; so below 1,024 rows
# the chunks cost more time than their memory is worth. At a 32,000 vocabulary the bound gives
# 2,048 rows (the chunk's logits 128 MiB, where the whole 8,192 tokens' took 500 MiB of a llama-1b
# training step's peak).
CHUNK_LOGITS = 2**26
MIN_CHUNK_ROWS = 1024


def chunk_rows(vocab: int, rows: int) -> int:
    """Rows per chunk: as many as fit CHUNK_LOGITS, a multiple of 64, at least MIN_CHUNK_ROWS
    (and at most ``rows``, at least 1)."""
    fit = max(MIN_CHUNK_ROWS, (CHUNK_LOGITS // max(vocab, 1)) // 64 * 64)
    return max(1, min(fit, rows))


# Left out of torch.compile's graphs: the op reads the real-target count on the host and chunks by
# it, so a traced copy would be specialised on each batch's count (a recompile per new count, then
# dynamo's recompile limit); eager it is the same GEMMs and kernel, with one graph break.
@torch.compiler.disable
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    rows_per_chunk: int | None = None,
) -> torch.Tensor:
    """The cross-entropy of ``softcap(hidden @ weight.T + bias)`` against ``target`` (already
    shifted: one per row of ``hidden``), as ``F.cross_entropy`` on the float32 logits computes
    it: the mean over the targets other than ``ignore_index``, or, with ``num_items_in_batch``
    (what the HF Trainer passes for gradient accumulation), their sum divided by it. Under
    autocast the logits are computed in autocast's dtype, as F.linear would. ``hidden``:
    [..., H]; ``weight``: [V, H]; ``target``: integer, ``hidden``'s shape without H;
    ``softcap``: Gemma's final logit soft-capping (``cap * tanh(logits / cap)``)."""
    _check(hidden, weight, target, bias, ignore_index, softcap, rows_per_chunk)
    device = hidden.device.type
    compute = hidden.dtype  # the logits' dtype: autocast's, else the inputs'
    if torch.is_autocast_enabled(device):  # hidden and weight are cast inside, a chunk at a time
        compute = torch.get_autocast_dtype(device)
    elif weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(
            f"linear_cross_entropy: `weight` ({weight.dtype}) and `bias` must have `hidden`'s "
            f"dtype ({hidden.dtype}) outside autocast, as F.linear requires"
        )
    if compute not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"linear_cross_entropy: `hidden` must be float32, float16 or bfloat16 (or run under "
            f"autocast), got {hidden.dtype}"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])
    # widened first: in a narrow dtype (uint8, int16) the vocabulary bound and ignore_index wrap
    labels = target.reshape(-1).long()
    real = labels != ignore_index
    outside = real & ((labels < 0) | (labels >= weight.shape[0]))
    counts = torch.stack((real.sum(), outside.sum()))
    count, bad = counts.tolist()  # one host synchronisation
    if bad:
        raise ValueError(
            f"linear_cross_entropy: `target` holds a class outside [0, {weight.shape[0]}) "
            f"that is not ignore_index ({ignore_index})"
        )
    if count == labels.numel():  # every row real: chunks are slices, nothing gathered
        rows, picked = None, labels
    else:
        rows = torch.nonzero_static(real, size=count).squeeze(1)  # the count known: no 2nd sync
        picked = labels.index_select(0, rows)
    if num_items_in_batch is None:
        normaliser = counts[0].float()  # on the device already
    else:
        normaliser = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    chunk = rows_per_chunk or chunk_rows(weight.shape[0], max(count, 1))
    return _LinearCrossEntropy.apply(
        flat, weight, bias, rows, picked, normaliser, softcap, chunk, compute
    )


def _check(
    hidden: Any,
    weight: Any,
    target: Any,
    bias: Any,
    ignore_index: Any,
    softcap: Any,
    rows_per_chunk: Any,
) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: `{name}` must be a tensor, got {type(t)}")
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise TypeError("linear_cross_entropy: `hidden` must be a floating tensor [..., H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy: `weight` must be [vocabulary, {hidden.shape[-1]}] for "
            f"`hidden` {tuple(hidden.shape)}, got {tuple(weight.shape)}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: `target` must be integer, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: `target` {tuple(target.shape)} must have `hidden`'s shape "
            f"without its last dimension {tuple(hidden.shape[:-1])}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        raise ValueError(f"linear_cross_entropy: `bias` must be None or [{weight.shape[0]}]")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(
                f"linear_cross_entropy: `{name}` is on {t.device} but `hidden` is on "
                f"{hidden.device}; move them to the same device"
            )
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(
            f"linear_cross_entropy: `ignore_index` must be an int, got {ignore_index!r}"
        )
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"linear_cross_entropy: `softcap` must be None or > 0, got {softcap!r}")
    if rows_per_chunk is not None and (
        not isinstance(rows_per_chunk, int)
        or isinstance(rows_per_chunk, bool)
        or rows_per_chunk < 1
    ):
        raise ValueError(
            f"linear_cross_entropy: `rows_per_chunk` must be a positive int, got {rows_per_chunk!r}"
        )


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` in float32 from ``a``, ``b`` in a lower dtype: on CUDA one GEMM with a
    float32 output (no rounding of the chunk's part); elsewhere through float32 copies."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
        return
    if a.is_cuda:
        try:
            torch.ops.aten.addmm.dtype_out(total, a, b, total.dtype, out=total)
            return
        except (RuntimeError, NotImplementedError) as err:  # an older torch
            warnings.warn(
                f"linear_cross_entropy: float32 accumulation through copies ({err})", stacklevel=3
            )
    total.addmm_(a.float(), b.float())


def _chunk(
    hidden: torch.Tensor,
    start: int,
    stop: int,
    rows: torch.Tensor | None,
    compute: torch.dtype,
    t: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    normaliser: torch.Tensor,
    softcap: float | None,
    grads: bool,
    d_hidden: torch.Tensor | None,
    d_weight: torch.Tensor | None,
    d_bias: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk, the rows ``start:stop`` of ``rows`` (of ``hidden`` itself where None): its
    summed loss; with ``grads``, its part of each gradient written (the hidden states' into the
    rows it came from) or added. One call per chunk: its rows and logits die on return, before
    the next chunk's exist (loop variables would hold two chunks' at once)."""
    index = rows[start:stop] if rows is not None else None
    h = hidden[start:stop] if index is None else hidden.index_select(0, index)
    h = h.to(compute)  # autocast's cast, a chunk at a time
    logits = F.linear(h, w, b)
    # each row's loss; with grads, the logits overwritten by their gradient
    loss = torch.ops.fastlayers.cross_entropy_rows_(logits, t, normaliser, softcap or 0.0, grads)
    if not grads:
        return loss.sum()
    if d_hidden is not None:
        if index is None:
            torch.mm(logits, w, out=d_hidden[start:stop])
        else:
            d_hidden.index_copy_(0, index, torch.mm(logits, w))
    if d_weight is not None:
        _accumulate(d_weight, logits.t(), h)
    if d_bias is not None:
        d_bias += logits.float().sum(0)
    return loss.sum()


class _LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss over the rows ``rows`` of ``hidden`` (all of them where None); the
    gradients made in the forward pass. Each chunk's rows and the weight (and bias) are cast to
    the compute dtype inside (autocast's copy of the weight lives only for the forward). The
    hidden states' gradient is computed in that dtype, as natively (the engine widens it to a
    float32 ``hidden``'s dtype, as autocast's cast would), zero in the rows not selected; the
    weight's is summed in float32 and, for a float32 weight, handed back as it is (native rounds
    its one GEMM's sum to the logits' dtype first: ours is closer to exact), else rounded once to
    the weight's dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: torch.Tensor | None,
        target: torch.Tensor,
        normaliser: torch.Tensor,
        softcap: float | None,
        chunk: int,
        compute: torch.dtype,
    ) -> torch.Tensor:
        wants = ctx.needs_input_grad
        d_hidden = None
        if wants[0]:
            fill = torch.empty if rows is None else torch.zeros  # unselected rows: exactly zero
            d_hidden = fill(hidden.shape, dtype=compute, device=hidden.device)
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        d_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] else None
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        grads = any(wants[:3])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.to(compute)
        b = bias.to(compute) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, target.shape[0], chunk):
                stop = min(start + chunk, target.shape[0])
                total += _chunk(
                    hidden, start, stop, rows, compute, target[start:stop], w, b, normaliser,
                    softcap, grads, d_hidden, d_weight, d_bias,
                )  # fmt: skip
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        ctx.spent = False
        return total / normaliser

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        if ctx.spent:  # the sums are scaled in place (no second float32 copy of the weight)
            raise RuntimeError(
                "linear_cross_entropy: a second backward through the same loss "
                "(retain_graph=True) is not supported; compute the loss again"
            )
        ctx.spent = True
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        if d_hidden is not None:
            d_hidden = d_hidden.mul_(grad.to(d_hidden.dtype))
        if d_weight is not None:
            d_weight = d_weight.mul_(grad).to(w_dtype)
        if d_bias is not None:
            d_bias = d_bias.mul_(grad).to(b_dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None
