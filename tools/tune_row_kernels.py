"""Times fastlayers' row-norm kernels (LayerNorm, RMSNorm, add + RMSNorm, dropout + add +
LayerNorm; forward and backward) and the gated activation at the issue-57 sweep shapes, under
each threads-per-row the kernels' knobs accept, against the copy floor: the data the launch
choices are made from. Ops are called directly (no autograd, no module), with the L2 flushed
between calls (benchmarks/common.median_ms).

    python tools/tune_row_kernels.py [--ops ln,rms,add_rms,daln,gated] [--dtypes bf16,fp32]
                                     [--rows 2048,65536] [--widths 768,4096] [--passes fwd]
                                     [--auto-only] [--out DIR]

Floors (bytes that must move / measured copy bandwidth): LayerNorm and RMSNorm forward x in,
y out; backward x and dy in, dx out; add + RMSNorm forward x and residual in, sum and y out,
backward dy and sum in, dx out; dropout + add + LayerNorm (p = 0.1, training, sum kept) the
same as add + RMSNorm; daln_eval (p = 0, eval, sum not kept) x and residual in, y out; the
gated activation (ops gated = SiLU, gated_gelu, gated_gelu_tanh, gated_relu) forward gate and
up in, out out, backward dy, gate and up in, d gate and d up out (bwd_product, gated_act_down's
backward: the product out as well; run with the bwd pass). Statistics and parameter gradients
are not counted.

Each row also times a device copy of the same bytes (half read, half written) under the same
timer, x_copy being the kernel's time over it: at 8,192 rows of 768-2,048 columns the copy itself
takes 1.3-1.7x the floor (the launch, the first requests' latency and the dirty lines the L2
flush leaves), so there x_copy, not x_floor, says what is left to gain. (A copy splits its bytes
evenly between reads and writes; most of these kernels read more than they write.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import (
    SWEEP_ROWS,
    SWEEP_WIDTHS,
    copy_bandwidth_gbs,
    dtypes_named,
    gpu_name,
    median_ms,
    warm_up_gpu,
)

import fastlayers  # noqa: F401  (loads the ops)

OPS = torch.ops.fastlayers
TPRS = (32, 64, 128, 256, 512, 1024)
FWD_HELD_REGS = 32  # kFwdHeldRegs in csrc/layer_norm/layer_norm_kernels.cuh
LLAMA_FORM = 1  # RmsNormForm::kCastFirst


def accepted_tprs(cols: int, elem: int, backward: bool) -> list[int]:
    """The threads-per-row a knob can force at this width, as pick_config decides (the row
    fits the registers, and a kernel is compiled for it: has_vec_kernel's forward set, 1-2
    vectors a thread at up to 128 threads, 4 at any, 8 at 128-512); beyond one vector per
    thread a wider TPR only idles threads."""
    vec = 16 // elem
    if cols % vec:
        return []
    nvec = cols // vec
    per_thread = 2 if backward else min(8, FWD_HELD_REGS * 4 // elem // vec)
    out = []
    for t in TPRS:
        items = next(n for n in (1, 2, 4, 8, nvec) if -(-nvec // t) <= n)  # as items_for
        if nvec <= t * per_thread and (t == 32 or nvec > t // 2):
            compiled = items == 4 or (items <= 2 and t <= 128) or (items == 8 and 128 <= t <= 512)
            if backward or compiled:
                out.append(t)
    return out


# --ops names of the gated activation -> its activation
GATED_ACTIVATIONS = {
    "gated": "silu",
    "gated_gelu": "gelu",
    "gated_gelu_tanh": "gelu_tanh",
    "gated_relu": "relu",
}


# every --ops name the tool knows
OP_NAMES = ("ln", "rms", "add_rms", "daln", "daln_eval", *GATED_ACTIVATIONS)


def cases(op: str, rows: int, cols: int, dtype: torch.dtype, dev: str = "cuda"):
    """(pass, knob, bytes moved, fn) for one op at one shape (on ``dev``: "cpu" runs the same
    calls on the CPU kernels, tests/test_tune_row_kernels.py)."""
    x = torch.randn(rows, cols, device=dev, dtype=dtype)
    dy = torch.randn_like(x)
    w = torch.randn(cols, device=dev, dtype=dtype)
    b = torch.randn(cols, device=dev, dtype=dtype)
    nb = x.numel() * x.element_size()
    if op == "ln":
        _y, mean, rstd = OPS.layer_norm_fwd(x, [cols], w, b, 1e-5)
        yield (
            "fwd",
            "FASTLAYERS_LN_FWD_TPR",
            2 * nb,
            lambda: OPS.layer_norm_fwd(x, [cols], w, b, 1e-5),
        )
        yield (
            "bwd",
            "FASTLAYERS_LN_BWD_TPR",
            3 * nb,
            lambda: OPS.layer_norm_bwd(dy, x, mean, rstd, [cols], w, b, [True, True, True]),
        )
    elif op == "rms":
        _y, rstd = OPS.rms_norm_fwd(x, [cols], w, 1e-6, LLAMA_FORM)
        yield (
            "fwd",
            "FASTLAYERS_RMS_FWD_TPR",
            2 * nb,
            lambda: OPS.rms_norm_fwd(x, [cols], w, 1e-6, LLAMA_FORM),
        )
        yield (
            "bwd",
            "FASTLAYERS_RMS_BWD_TPR",
            3 * nb,
            lambda: OPS.rms_norm_bwd(dy, x, rstd, [cols], w, LLAMA_FORM, [True, True]),
        )
    elif op == "add_rms":
        res = torch.randn_like(x)
        _y, s, rstd = OPS.add_rms_norm_fwd(x, res, [cols], w, 1e-6, LLAMA_FORM)
        yield (
            "fwd",
            "FASTLAYERS_ADD_RMS_FWD_TPR",
            4 * nb,
            lambda: OPS.add_rms_norm_fwd(x, res, [cols], w, 1e-6, LLAMA_FORM),
        )
        yield (
            "bwd",
            "FASTLAYERS_ADD_RMS_BWD_TPR",
            3 * nb,
            lambda: OPS.add_rms_norm_bwd(
                dy, None, s, rstd, [cols], w, LLAMA_FORM, [True, True, True]
            ),
        )
    elif op == "daln":
        res = torch.randn_like(x)
        p = 0.1
        _y, s, mean, rstd, rng = OPS.dropout_add_layer_norm_fwd(
            x, res, [cols], w, b, 1e-5, p, True, True
        )
        yield (
            "fwd",
            "FASTLAYERS_DALN_FWD_TPR",
            4 * nb,
            lambda: OPS.dropout_add_layer_norm_fwd(x, res, [cols], w, b, 1e-5, p, True, True),
        )
        yield (
            "bwd",
            "FASTLAYERS_DALN_BWD_TPR",
            4 * nb,
            lambda: OPS.dropout_add_layer_norm_bwd(
                dy, None, s, mean, rstd, rng, [cols], w, b, p, True, dtype, [True, True, True, True]
            ),
        )
    elif op == "daln_eval":  # inference (BERT-style): p = 0 in eval, the sum not kept
        res = torch.randn_like(x)
        yield (
            "fwd",
            "FASTLAYERS_DALN_FWD_TPR",
            3 * nb,
            lambda: OPS.dropout_add_layer_norm_fwd(x, res, [cols], w, b, 1e-5, 0.0, False, False),
        )
    elif op in GATED_ACTIVATIONS:
        act = GATED_ACTIVATIONS[op]
        up = torch.randn_like(x)
        yield "fwd", None, 3 * nb, lambda: OPS.gated_act_fwd(x, up, act)
        yield (
            "bwd",
            None,
            5 * nb,
            lambda: OPS.gated_act_bwd(dy, x, up, act, [True, True, False]),
        )
        # gated_act_down's backward: the product recomputed beside the two gradients
        yield (
            "bwd_product",
            None,
            6 * nb,
            lambda: OPS.gated_act_bwd(dy, x, up, act, [True, True, True]),
        )
    else:
        raise SystemExit(f"--ops: unknown {op!r}")


def time_case(fn, knob: str | None, tpr: int | None) -> float:
    if knob is not None:
        os.environ.pop(knob, None)
        if tpr is not None:
            os.environ[knob] = str(tpr)
    try:
        return median_ms(fn, warmup=5, reps=25) * 1e3
    finally:
        if knob is not None:
            os.environ.pop(knob, None)


def copy_us(nbytes: int, cache: dict[int, float]) -> float:
    """Time of copying nbytes / 2 bytes into another buffer (nbytes moved), timed as a kernel."""
    if nbytes not in cache:
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 256)
        dst = torch.empty_like(src)
        cache[nbytes] = time_case(lambda: dst.copy_(src), None, None)
        del src, dst
    return cache[nbytes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="ln,rms,add_rms,daln,gated")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--rows", default=",".join(map(str, SWEEP_ROWS)))
    ap.add_argument("--widths", default=",".join(map(str, SWEEP_WIDTHS)))
    ap.add_argument("--passes", default="fwd,bwd")
    ap.add_argument(
        "--auto-only", action="store_true", help="the automatic configuration only (no knobs)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    print(f"# {gpu_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s")
    print(
        "op pass dtype rows cols | auto_us x_floor x_copy | best_tpr best_us x_floor | tpr:us ..."
    )
    records = []
    copies: dict[int, float] = {}
    for op in args.ops.split(","):
        for dname, dtype in dtypes_named(args.dtypes).items():
            for rows in map(int, args.rows.split(",")):
                for cols in map(int, args.widths.split(",")):
                    for pas, knob, nbytes, fn in cases(op, rows, cols, dtype):
                        if pas.split("_")[0] not in args.passes.split(","):
                            continue
                        floor_us = nbytes / (bw * 1e9) * 1e6
                        same_bytes_us = copy_us(nbytes, copies)
                        auto = time_case(fn, knob, None)
                        by_tpr = {}
                        if knob is not None and not args.auto_only:
                            elem = torch.empty((), dtype=dtype).element_size()
                            for t in accepted_tprs(cols, elem, pas == "bwd"):
                                by_tpr[t] = time_case(fn, knob, t)
                        best = min(by_tpr, key=by_tpr.get) if by_tpr else None
                        rec = dict(
                            op=op,
                            pass_=pas,
                            dtype=dname,
                            rows=rows,
                            cols=cols,
                            floor_us=floor_us,
                            copy_us=same_bytes_us,
                            auto_us=auto,
                            by_tpr=by_tpr,
                        )
                        records.append(rec)
                        tail = " ".join(f"{t}:{us:.1f}" for t, us in by_tpr.items())
                        best_s = (
                            f"{best} {by_tpr[best]:.1f} {by_tpr[best] / floor_us:.2f}"
                            if best
                            else "- - -"
                        )
                        print(
                            f"{op} {pas} {dname} {rows} {cols} | {auto:.1f} "
                            f"{auto / floor_us:.2f} {auto / same_bytes_us:.2f} | {best_s} | {tail}",
                            flush=True,
                        )
                    torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_row_kernels.json"), "w") as f:
            json.dump(
                {"gpu": gpu_name(), "torch": torch.__version__, "copy_gbs": bw, "records": records},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
