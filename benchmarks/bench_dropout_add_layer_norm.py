"""dropout + residual add + LayerNorm: fastlayers' fused op against eager (F.dropout, add,
F.layer_norm), torch.compile of those three, flash-attn's fused Triton op
(flash_attn.ops.triton.layer_norm.layer_norm_fn with dropout_p and residual) and Liger-Kernel's
LayerNorm after an eager dropout + add (Liger has no residual/dropout LayerNorm), each when
importable; forward and forward+backward (gradients of x, residual, weight and bias), in one
run on one GPU.

Cases: shapes (32768, 768), (16384, 1024), (8192, 4096); bf16 and fp32 (x, residual, weight,
bias and the output all in that dtype, as a patched model holds them); eval (p = 0, training
False) and training (p = 0.1); the prenorm variant (the sum returned too, and its gradient fed
back) at (16384, 1024) bf16. torch.compile compiles each function once per case and pass
(dynamic=False); its compile time is reported apart and is not in the timings.

Floors (memory-bound; N elements of E bytes; bandwidth = device copy rate measured in the same
run):
- forward: read x and residual, write y (and the sum when prenorm): 3N (4N) elements, plus the
  weight and bias.
- forward+backward, "x floor": the least any implementation moves. Forward as above; backward
  reads dy (and the sum's gradient when prenorm) and one saved row tensor (y, from which the
  normalised input is recomputed as Apex's memory-efficient LayerNorm does, or the prenorm sum,
  which the forward writes anyway) and writes dx, plus dresidual only with dropout (without it
  dresidual = dx: one tensor may serve both). Eval 6N, training 7N (prenorm 8N / 9N), plus
  the parameters, their gradients and one float per row (rstd).
- forward+backward, "x saved-sum min": the same for an implementation that saves the sum for
  its backward and writes dx and dresidual apart (what fastlayers' op does): 8N (prenorm 9N),
  plus mean and rstd.

Also: the max error of the eval forward against a float64 reference (y; the sum too when
prenorm), and, when training, the fraction of x that fastlayers' op dropped (expected p) and
the largest relative error of its kept values against x / (1 - p).

    python benchmarks/bench_dropout_add_layer_norm.py [--out DIR] [--quick] [--no-compile]

--quick: (16384, 1024) bf16 only, no prenorm case (~30 s on an H100 with compile). The default
run takes about 3 minutes on an H100, most of it torch.compile's 28 compilations.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import copy_bandwidth_gbs, gpu_name, median_ms, warm_up_gpu, write_results

import fastlayers

SHAPES = [(32768, 768), (16384, 1024), (8192, 4096)]
PRENORM_SHAPE = (16384, 1024)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = {"eval": (0.0, False), "train": (0.1, True)}  # mode -> (p, training)
EPS = 1e-5
ERR_ROWS = 1024  # rows checked against float64
DEVICE = "cuda"  # a CPU check of this script's logic sets "cpu" (and its own timer)


def eager_fn(cols: int, p: float, training: bool, prenorm: bool) -> Callable:
    def f(x, r, w, b):
        s = F.dropout(x, p, training) + r
        y = F.layer_norm(s, (cols,), w, b, EPS)
        return (y, s) if prenorm else y

    return f


def implementations(cols: int, p: float, training: bool, prenorm: bool) -> dict[str, Callable]:
    """name -> f(x, residual, weight, bias) returning y, or (y, sum) when prenorm. Peers that
    cannot be imported are left out with the reason printed."""
    eager = eager_fn(cols, p, training, prenorm)
    impls: dict[str, Callable] = {
        "fastlayers": lambda x, r, w, b: fastlayers.functional.dropout_add_layer_norm(
            x, r, cols, w, b, EPS, p=p, training=training, prenorm=prenorm
        ),
        "eager": eager,
        "torch.compile": torch.compile(eager, dynamic=False),
    }
    try:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        def flash(x, r, w, b):
            # A function, not a module: it drops whenever dropout_p > 0.
            return layer_norm_fn(
                x, w, b, residual=r, eps=EPS, dropout_p=p if training else 0.0, prenorm=prenorm
            )

        impls["flash-attn (triton)"] = flash
    except Exception as err:
        _note_once(f"flash-attn skipped: {type(err).__name__}: {err}")
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        def liger(x, r, w, b):
            s = F.dropout(x, p, training) + r
            y = LigerLayerNormFunction.apply(s, w, b, EPS)
            return (y, s) if prenorm else y

        impls["eager dropout+add, liger LN"] = liger
    except Exception as err:
        _note_once(f"liger-kernel skipped: {type(err).__name__}: {err}")
    return impls


_NOTED: set[str] = set()


def _note_once(msg: str) -> None:
    if msg not in _NOTED:
        _NOTED.add(msg)
        print(msg, flush=True)


def floors(rows: int, cols: int, esize: int, prenorm: bool, dropout: bool) -> dict[str, int]:
    """Bytes that must move (see the module docstring)."""
    n = rows * cols * esize
    params = 2 * cols * esize  # weight + bias
    fwd = (4 if prenorm else 3) * n + params
    grad_in = (2 if prenorm else 1) * n  # dy (+ the sum's gradient)
    grads_out = (2 if dropout else 1) * n  # dx (+ dresidual, which equals dx without dropout)
    # Backward: read the gradients, one saved tensor, weight and bias; write the input and
    # parameter gradients; rstd written by the forward and read back.
    least = fwd + grad_in + n + grads_out + 2 * params + 2 * rows * 4
    saved_sum = fwd + (0 if prenorm else n) + grad_in + n + 2 * n + 2 * params + 4 * rows * 4
    return {"fwd": fwd, "fwd+bwd": least, "fwd+bwd saved-sum": saved_sum}


def max_err(out, x, r, w, b, prenorm: bool) -> tuple[float, float | None]:
    """Max abs error of y (and of the sum when prenorm) over ERR_ROWS rows against float64."""
    xs, rs = x[:ERR_ROWS].double(), r[:ERR_ROWS].double()
    s_ref = xs + rs
    y_ref = F.layer_norm(s_ref, (x.shape[-1],), w.double(), b.double(), EPS)
    y, s = out if prenorm else (out, None)
    y_err = (y[:ERR_ROWS].double() - y_ref).abs().max().item()
    s_err = (s[:ERR_ROWS].double() - s_ref).abs().max().item() if s is not None else None
    return y_err, s_err


def dropped_fraction(x: torch.Tensor, cols: int, p: float) -> dict:
    """fastlayers' mask on x with a zero residual: the sum is then the dropped-out x itself."""
    zero = torch.zeros_like(x)
    w = torch.ones(cols, device=x.device, dtype=x.dtype)
    b = torch.zeros_like(w)
    _, s = fastlayers.functional.dropout_add_layer_norm(
        x, zero, cols, w, b, EPS, p=p, training=True, prenorm=True
    )
    dropped = s == 0
    kept = ~dropped & (x != 0)
    expect = (x.double() / (1 - p))[kept]
    rel = ((s.double()[kept] - expect).abs() / expect.abs()).max().item()
    return {"dropped": dropped.double().mean().item(), "kept_rel_err": rel}


def bench_case(shape, dname, dtype, mode, prenorm, with_compile, bw_gbs, rows_out, checks):
    rows, cols = shape
    p, training = MODES[mode]
    dropout = training and p > 0
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(rows, cols, device=DEVICE, dtype=dtype, generator=g)
    r = torch.randn(rows, cols, device=DEVICE, dtype=dtype, generator=g)
    w = (1 + 0.1 * torch.randn(cols, device=DEVICE, generator=g)).to(dtype)
    b = (0.1 * torch.randn(cols, device=DEVICE, generator=g)).to(dtype)
    dy = torch.randn_like(x)
    ds = torch.randn_like(x)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    fl = floors(rows, cols, x.element_size(), prenorm, dropout)
    case = {
        "shape": [rows, cols],
        "dtype": dname,
        "mode": f"{mode} (p={p})" if training else mode,
        "variant": "prenorm" if prenorm else "post",
    }
    torch.compiler.reset()  # a fresh cache per case: no recompile limit, no stale graph
    impls = implementations(cols, p, training, prenorm)
    if not with_compile:
        impls.pop("torch.compile")
    if dropout:
        try:
            checks.append({**case, **dropped_fraction(x, cols, p)})
        except Exception as err:
            print(f"{case}: dropped-fraction check FAILED {type(err).__name__}: {err}")
    for name, fn in impls.items():

        def fwd(fn=fn):
            return fn(x, r, w, b)

        def fwd_bwd(fn=fn):
            out = fn(*leaves)
            outs, grads = ((out[0], out[1]), (dy, ds)) if prenorm else ((out,), (dy,))
            return torch.autograd.grad(outs, leaves, grads)

        for pass_, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            row = {**case, "pass": pass_, "impl": name}
            try:
                t0 = time.perf_counter()
                out = f()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                if name == "torch.compile":
                    row["compile_s"] = first_s
                if pass_ == "fwd" and not dropout:
                    row["err"], row["sum_err"] = max_err(out, x, r, w, b, prenorm)
                del out
                ms = median_ms(f)
            except Exception as err:
                print(f"{case} {pass_} {name}: FAILED {type(err).__name__}: {err}", flush=True)
                traceback.print_exc(limit=3)
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                rows_out.append(row)
                continue
            floor_ms = fl[pass_] / (bw_gbs * 1e9) * 1e3
            row.update(
                ms=ms,
                gbs=fl[pass_] / (ms * 1e-3) / 1e9,
                x_floor=ms / floor_ms,
                x_saved_sum=(
                    ms / (fl["fwd+bwd saved-sum"] / (bw_gbs * 1e9) * 1e3)
                    if pass_ == "fwd+bwd"
                    else None
                ),
            )
            rows_out.append(row)


def cases(quick: bool) -> list[tuple]:
    """(shape, dtype name, mode, prenorm) in run order."""
    if quick:
        return [(PRENORM_SHAPE, "bf16", mode, False) for mode in MODES]
    out = [(s, d, m, False) for s in SHAPES for d in DTYPES for m in MODES]
    return out + [(PRENORM_SHAPE, "bf16", m, True) for m in MODES]


def render(bw: float, rows: list[dict], checks: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| shape | dtype | mode | variant | pass | impl | time (us) | GB/s | x floor "
        "| x saved-sum min | max err vs fp64 (y; sum) | compile (s) |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        head = (
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['mode']} | {r['variant']} "
            f"| {r['pass']} | {r['impl']} |"
        )
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | | |")
            continue
        err = f"{r['err']:.2g}" if r.get("err") is not None else ""
        if r.get("sum_err") is not None:
            err += f"; {r['sum_err']:.2g}"
        saved = f"{r['x_saved_sum']:.2f}" if r["x_saved_sum"] is not None else ""
        comp = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
        lines.append(
            f"{head} {r['ms'] * 1e3:.1f} | {r['gbs']:.0f} | {r['x_floor']:.2f} | {saved} | "
            f"{err} | {comp} |"
        )
    if checks:
        lines += [
            "",
            "fastlayers dropout (training, zero residual): fraction of x dropped, and the largest "
            "relative error of the kept values against x / (1 - p)",
            "",
            "| shape | dtype | mode | variant | dropped | kept rel err |",
            "|---|---|---|---|---:|---:|",
        ]
        for c in checks:
            lines.append(
                f"| {c['shape'][0]}x{c['shape'][1]} | {c['dtype']} | {c['mode']} | "
                f"{c['variant']} | {c['dropped']:.5f} | {c['kept_rel_err']:.2g} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for dropout_add_layer_norm.json/.md")
    parser.add_argument("--quick", action="store_true", help="(16384, 1024) bf16 only")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    warm_up_gpu()
    bw = copy_bandwidth_gbs()
    header = (
        f"GPU: {gpu_name()}, torch {torch.__version__}, fastlayers {fastlayers.__version__}, "
        f"copy bandwidth {bw:.0f} GB/s, eps {EPS}"
    )
    print(header, flush=True)
    rows: list[dict] = []
    checks: list[dict] = []
    for shape, dname, mode, prenorm in cases(args.quick):
        bench_case(shape, dname, DTYPES[dname], mode, prenorm, args.compile, bw, rows, checks)
        print(
            f"done {shape[0]}x{shape[1]} {dname} {mode}{' prenorm' if prenorm else ''} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        if args.out:  # a run cut short keeps what it measured
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "dropout_add_layer_norm.md"), "w") as f:
                f.write(render(bw, rows, checks, header) + "\n")
        torch.cuda.empty_cache()
    write_results(
        args.out,
        "dropout_add_layer_norm",
        render(bw, rows, checks, header),
        {"copy_gbs": bw, "eps": EPS, "rows": rows, "dropout_checks": checks},
    )
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
