"""The MLP Linear -> GELU -> Linear, forward + backward: fastlayers' linear_act_linear (the GELU
derivative and the first bias's gradient in the epilogue of the backward GEMM dy . W2) against
the same layers as the pair rule makes them (FusedLinearGELU, then nn.Linear: the derivative
in a separate pass), eager PyTorch and torch.compile, in one run on one GPU.

Floor (GEMM-bound): the six plain GEMMs of the MLP's forward and backward (x W1^T, h W2^T,
dy W2, dy^T h, dz W1, dz^T x) at the same shapes and layouts, timed in the same run; the issue's
target is <= 1.10x of it. Wall time (CUDA events, L2 flushed) and GPU busy time (the
kernels' summed durations from the profiler, L2 warm) are both given: the first moved by up to
20% between runs on a power-limited H100. Also the backward GEMM alone: linear_act_dgrad (dz
and db) against the bare GEMM dy . W2 and against what it replaces (cuBLAS, then the
elementwise pass).
Shapes: BERT-base (8192x768->3072->768, nn.Linear layout) and GPT-2 medium (8192x1024->4096->1024,
Conv1D layout: weights stored [in, out]), bf16 (and fp16 unless --quick).

--dgrad-sweep also times the sm90 backward GEMM alone per tile config and epilogue (identity:
the GEMM with the saved tensor read and dz written; relu; erf; tanh) and the op with and
without the bias gradient's column sum: where the backward GEMM's time goes.

    python benchmarks/bench_mlp.py [--out DIR] [--quick] [--dgrad-sweep] [--sweep-only]
        [--few-rows]

--wgrad-bgrad: only the weight-gradient GEMMs with the bias gradient, cuBLAS + a column sum
against cuBLASLt's BGRAD epilogues (benchmarks/cublaslt_peer.py).

--paired N: only the MLP op's forward + backward busy time and its six plain GEMMs' (bf16),
measured alternately N times (common.paired_kernel_ms): the ratio per round, its median and
range. The single measurements above compare the op with a floor timed minutes apart, and the
floor alone read 536-639 us at GPT-2 medium across runs.

--breakdown: only where the op's fwd+bwd busy time goes, per kernel (profiler, L2 warm), for
each form, beside the six plain GEMMs' total (bf16).

--few-rows: only the backward GEMM at 32..2048 rows (or --rows; BERT-base's FC2, or --kn KxN:
dy [m, K] . W2 [K, N]): the op's own path against eager, the fallback and the fused kernel
forced, the numbers behind its size rule.
"""

from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace

import cublaslt_peer
import torch
import torch.nn.functional as F
from bench_linear_gelu import timed_or_none
from common import (
    gpu_name,
    kernel_ms,
    kernel_times_us,
    paired_kernel_ms,
    warm_up_gpu,
    write_results,
)

import fastlayers
from fastlayers._extension import _C
from fastlayers.functional import linear_act_linear, linear_gelu
from fastlayers.ops.linear_act import linear_act_dgrad, linear_act_dgrad_path

# (name, rows, in, hidden, out, weights stored [in, out] (Conv1D))
SHAPES = [
    ("BERT-base", 8192, 768, 3072, 768, False),
    ("GPT-2 medium", 8192, 1024, 4096, 1024, True),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FORMS = {"erf": ("gelu", "none"), "tanh": ("gelu_tanh", "tanh")}
# --paired also times the ReLU MLP (T5's, OPT's): the op's activation per form
PAIRED_FORMS = {"erf": "gelu", "tanh": "gelu_tanh", "relu": "relu"}


def make(m, k, hidden, n, transposed, dtype):
    def weight(out_f, in_f):
        w = (torch.randn(out_f, in_f, device="cuda") / in_f**0.5).to(dtype)
        return (w.t().contiguous() if transposed else w).requires_grad_()

    x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
    w1, w2 = weight(hidden, k), weight(n, hidden)
    b1 = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    b2 = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    return x, w1, b1, w2, b2


def native_weight(w, transposed):
    return w.t() if transposed else w


def mlp_problem(m, k, hidden, n, transposed, dtype) -> SimpleNamespace:
    """The MLP's parameters (params: [x, w1, b1, w2, b2]), the output's gradient dy, detached
    operands for plain GEMMs (xd, w1d, w2d as nn.Linear's [out, in], h), and the floor
    six_gemms(): the six plain GEMMs of its forward and backward at the same shapes."""
    params = list(make(m, k, hidden, n, transposed, dtype))
    x, w1, _, w2, _ = params
    p = SimpleNamespace(params=params, dy=torch.randn(m, n, device="cuda", dtype=dtype))
    p.h, dz = (torch.randn(m, hidden, device="cuda", dtype=dtype) for _ in range(2))
    p.xd = x.detach()
    p.w1d = native_weight(w1, transposed).detach()
    p.w2d = native_weight(w2, transposed).detach()
    operands = (
        (p.xd, p.w1d.t()),
        (p.h, p.w2d.t()),
        (p.dy, p.w2d),
        (p.dy.t(), p.h),
        (dz, p.w1d),
        (dz.t(), p.xd),
    )

    def six_gemms():
        for a, b in operands:
            torch.mm(a, b)

    p.six_gemms = six_gemms
    return p


def bench(label, m, k, hidden, n, transposed, dname, dtype, rows):
    torch.compiler.reset()
    prob = mlp_problem(m, k, hidden, n, transposed, dtype)
    params, dy, six_gemms = prob.params, prob.dy, prob.six_gemms
    xd, w1d, w2d, h = prob.xd, prob.w1d, prob.w2d, prob.h
    w2 = params[3]

    floor_ms = timed_or_none(f"{label} six GEMMs", six_gemms)
    # GPU busy time (kernels summed, L2 warm): steadier than wall time across runs
    floor_gpu = kernel_ms(six_gemms)
    fwd_floor_ms = timed_or_none(
        f"{label} two GEMMs", lambda: (torch.mm(xd, w1d.t()), torch.mm(h, w2d.t()))
    )
    flops = 2 * m * hidden * (k + n)
    for form, (activation, approximate) in FORMS.items():

        def eager(x, w1, b1, w2, b2, approximate=approximate):
            hh = F.gelu(F.linear(x, native_weight(w1, transposed), b1), approximate=approximate)
            return F.linear(hh, native_weight(w2, transposed), b2)

        impls = {
            f"fastlayers mlp {form}": lambda x, w1, b1, w2, b2, a=activation: linear_act_linear(
                x, w1, b1, w2, b2, a, weight1_transposed=transposed, weight2_transposed=transposed
            ),
            f"fastlayers pair {form}": lambda x, w1, b1, w2, b2, ap=approximate: F.linear(
                linear_gelu(x, w1, b1, ap, weight_transposed=transposed),
                native_weight(w2, transposed),
                b2,
            ),
            f"eager {form}": eager,
        }
        if dtype == torch.bfloat16:
            impls[f"torch.compile {form}"] = torch.compile(eager, dynamic=False)
        for name, fn in impls.items():
            fwd = timed_or_none(f"{label} {dname} fwd {name}", lambda fn=fn: fn(*params))
            train = timed_or_none(
                f"{label} {dname} fwd+bwd {name}",
                lambda fn=fn: torch.autograd.grad(fn(*params), params, dy),
            )
            gpu = None
            if train is not None:
                gpu = kernel_ms(lambda fn=fn: torch.autograd.grad(fn(*params), params, dy))
            for pass_, ms, floor in (("fwd", fwd, fwd_floor_ms), ("fwd+bwd", train, floor_ms)):
                if ms is None or floor is None:
                    continue
                work = flops * (1 if pass_ == "fwd" else 3)
                row = {
                    "shape": f"{label} {m}x{k}->{hidden}->{n}",
                    "dtype": dname,
                    "pass": pass_,
                    "impl": name,
                    "ms": ms,
                    "x_floor": ms / floor,
                    "tflops": work / ms / 1e9,
                }
                if pass_ == "fwd+bwd":
                    row |= {"gpu_ms": gpu, "x_floor_gpu": gpu / floor_gpu}
                rows.append(row)
        # the backward GEMM alone: fused dz + db, the bare GEMM, and what the fusion replaces
        z = (2 * torch.randn(m, hidden, device="cuda")).to(dtype)
        gemm = timed_or_none("dy . W2", lambda: torch.mm(dy, w2d))

        def unfused(approximate=approximate, z=z):
            da = torch.mm(dy, w2d)
            dzz = torch.ops.aten.gelu_backward(da, z, approximate=approximate)
            return dzz, dzz.sum(0)

        for name, fn in {
            f"linear_act_dgrad {form}": lambda a=activation, z=z: linear_act_dgrad(
                dy, w2.detach(), z, a, transposed, True
            ),
            f"cuBLAS + gelu_backward + sum {form}": unfused,
        }.items():
            ms = timed_or_none(f"{label} {dname} {name}", fn)
            if ms is None or gemm is None:
                continue
            path = ""
            if name.startswith("linear_act_dgrad"):
                path = linear_act_dgrad_path(
                    dy, w2.detach(), z, activation=activation, weight_transposed=transposed
                )
            rows.append(
                {
                    "shape": f"{label} {m}x{n}->{hidden}",
                    "dtype": dname,
                    "pass": "dgrad GEMM",
                    "impl": name + (f" ({path})" if path else ""),
                    "ms": ms,
                    "x_floor": ms / gemm,
                    "tflops": 2 * m * n * hidden / ms / 1e9,
                }
            )


CONFIGS = _C._testing.sm90_tile_configs()  # the raw entry's config argument -> its name
EPILOGUES = {3: "identity", 2: "relu", 0: "erf", 1: "tanh"}  # Activation values


def train_step(prob: SimpleNamespace, activation: str, transposed: bool):
    """One forward + backward of the MLP op on prob's parameters (its gradients w.r.t. all)."""
    layout = {"weight1_transposed": transposed, "weight2_transposed": transposed}

    def train():
        y = linear_act_linear(*prob.params, activation, **layout)
        return torch.autograd.grad(y, prob.params, prob.dy)

    return train


def paired(label, m, k, hidden, n, transposed, rounds, rows) -> None:
    """The op's fwd+bwd busy time against its six plain GEMMs', alternated (bf16)."""
    prob = mlp_problem(m, k, hidden, n, transposed, torch.bfloat16)
    for form, activation in PAIRED_FORMS.items():
        train = train_step(prob, activation, transposed)
        pairs = paired_kernel_ms(train, prob.six_gemms, rounds)
        op_us = [op * 1e3 for op, _ in pairs]
        floor_us = [floor * 1e3 for _, floor in pairs]
        ratios = sorted(op / floor for op, floor in pairs)
        median = ratios[len(ratios) // 2]
        rows.append(
            {
                "shape": f"{label} {m}x{k}->{hidden}->{n}",
                "form": form,
                "op_us": op_us,
                "floor_us": floor_us,
                "median_ratio": median,
                "min_ratio": ratios[0],
                "max_ratio": ratios[-1],
            }
        )
        print(
            f"paired {label} {form}: op/floor median {median:.3f} (range {ratios[0]:.3f}-"
            f"{ratios[-1]:.3f}); op {min(op_us):.1f}-{max(op_us):.1f} us, floor "
            f"{min(floor_us):.1f}-{max(floor_us):.1f} us",
            flush=True,
        )


def kernel_label(name: str) -> str:
    """A readable name for a profiler kernel key: the fused sm90 GEMMs by their epilogue."""
    if name.startswith("_ZN7cutlass"):
        if "DAct" in name:
            return "sm90 GEMM dy . W2, act' and db partials in its epilogue"
        if "BiasActAux" in name:
            return "sm90 GEMM x . W1^T + b1, act (and what it keeps) in its epilogue"
        return "CUTLASS kernel"
    return name.replace("(anonymous namespace)::", "").split("(")[0][:90]


def breakdown(label, m, k, hidden, n, transposed, rows) -> None:
    """Where the op's fwd+bwd GPU busy time goes: each kernel's time per call (profiler, L2
    warm), per form, beside the six plain GEMMs' (bf16)."""
    prob = mlp_problem(m, k, hidden, n, transposed, torch.bfloat16)
    shape = f"{label} {m}x{k}->{hidden}->{n}"
    floor = kernel_times_us(prob.six_gemms)
    print(f"breakdown {shape}: six GEMMs {sum(floor.values()):.1f} us", flush=True)
    rows.append({"shape": shape, "form": "six GEMMs", "kernel": "", "us": sum(floor.values())})
    for form, activation in PAIRED_FORMS.items():
        times = kernel_times_us(train_step(prob, activation, transposed))
        print(f"breakdown {shape} {form}: op {sum(times.values()):.1f} us", flush=True)
        for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
            if us >= 0.05:
                print(f"  {us:7.1f}  {kernel_label(name)}", flush=True)
                rows.append({"shape": shape, "form": form, "kernel": name, "us": us})


def dgrad_row(shape: str, pass_: str, impl: str, ms: float, gemm_ms: float, flops: int) -> dict:
    """One row of the backward-GEMM tables, against the plain GEMM dy . W2."""
    return {
        "shape": shape,
        "dtype": "bf16",
        "pass": pass_,
        "impl": impl,
        "ms": ms,
        "x_floor": ms / gemm_ms,
        "tflops": flops / ms / 1e9,
    }


def print_dgrad_errors(label, dy, w2, z, results) -> None:
    """Max error of tanh-GELU dz and db against float64: absolute, and relative where
    |dz| >= 2^-6 (the small values are where a cheap tanh shows)."""
    ref = torch.ops.aten.gelu_backward(dy.double() @ w2.double(), z.double(), approximate="tanh")
    ref_db = ref.sum(0)
    big = ref.abs() >= 2**-6
    for name, (dz, db) in results.items():
        err = (dz.double() - ref).abs()
        rel = (err[big] / ref.abs()[big]).max().item()
        db_err = ((db.double() - ref_db).abs().max() / ref_db.abs().max()).item()
        print(
            f"{label} tanh dgrad {name}: dz max abs err {err.max().item():.3g}, max rel err "
            f"(|dz| >= 2^-6) {rel:.3g}; db max err / max|db| {db_err:.3g}",
            flush=True,
        )


def dgrad_sweep(label, m, hidden, n, transposed, rows):
    """The backward GEMM dz = act'(z) * (dy . W2) alone, bf16, per config and epilogue."""
    dtype = torch.bfloat16
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    w2 = (torch.randn(n, hidden, device="cuda") / hidden**0.5).to(dtype)
    stored = w2.t().contiguous() if transposed else w2
    z = (2 * torch.randn(m, hidden, device="cuda")).to(dtype)
    dz = torch.empty_like(z)
    gemm = timed_or_none("dy . W2", lambda: torch.mm(dy, w2))
    if gemm is None:
        return
    cases = {"bare GEMM dy . W2 (cuBLAS)": lambda: torch.mm(dy, w2)}
    for config, cname in CONFIGS.items():
        for epilogue, ename in EPILOGUES.items():
            cases[f"sm90 dgrad {cname} {ename}"] = lambda c=config, e=epilogue: (
                _C._testing.linear_act_dgrad_sm90_raw(dy, stored, z, dz, transposed, e, c)
            )
    for want_db in (False, True):
        cases[f"linear_act_dgrad erf (auto){' + db' if want_db else ''}"] = lambda d=want_db: (
            linear_act_dgrad(dy, stored, z, "gelu", transposed, d)
        )
    cases["linear_act_dgrad tanh (auto) + db"] = lambda: linear_act_dgrad(
        dy, stored, z, "gelu_tanh", transposed, True
    )
    cases["dz.sum(0) alone"] = lambda: dz.sum(0)
    why_not = cublaslt_peer.available()
    if why_not is None and not transposed:  # the peer takes FC2's weight as nn.Linear stores it
        db = torch.empty(hidden, device="cuda", dtype=dtype)
        lt_dz = torch.empty_like(z)
        cases["cuBLASLt DGELU_BGRAD tanh (dz + db)"] = lambda: cublaslt_peer.dgelu_bgrad(
            dy, w2, z, lt_dz, db
        )
        cublaslt_peer.dgelu_bgrad(dy, w2, z, lt_dz, db)
        ours_dz, ours_db, _ = linear_act_dgrad(dy, stored, z, "gelu_tanh", transposed, True)
        print_dgrad_errors(
            label, dy, w2, z, {"fastlayers": (ours_dz, ours_db), "cuBLASLt": (lt_dz, db)}
        )
    elif why_not is not None:
        print(f"cuBLASLt peer not built: {why_not}")
    for name, fn in cases.items():
        ms = timed_or_none(f"{label} {name}", fn)
        if ms is not None:
            shape = f"{label} {m}x{n}->{hidden}"
            rows.append(dgrad_row(shape, "dgrad sweep", name, ms, gemm, 2 * m * n * hidden))


def dgrad_few_rows(
    rows: list[dict], row_counts: list[int] | None = None, n: int = 768, hidden: int = 3072
) -> None:
    """The backward GEMM at few rows (by default BERT-base's FC2, dy [m, 768] . W2 [768, 3072];
    erf, bf16): linear_act_dgrad's own path (dz + db) against eager (cuBLAS, gelu_backward,
    sum), the fused kernel forced (dz only, with ATen's column sum, and each config with db from
    its epilogue as the op computes it) and the fallback forced (dz + db), the numbers behind
    the backward GEMM's size rule."""
    dtype = torch.bfloat16
    w2 = (torch.randn(n, hidden, device="cuda") / hidden**0.5).to(dtype)
    for m in row_counts or (32, 64, 128, 256, 512, 768, 1024, 1536, 2048):
        dgrad_few_rows_at(m, w2, rows)


def dgrad_few_rows_at(m: int, w2: torch.Tensor, rows: list[dict]) -> None:
    n, hidden = w2.shape
    dy = torch.randn(m, n, device="cuda", dtype=w2.dtype)
    z = (2 * torch.randn(m, hidden, device="cuda")).to(w2.dtype)
    dz = torch.empty_like(z)

    def fused(config: int = -1) -> None:
        _C._testing.linear_act_dgrad_sm90_raw(dy, w2, z, dz, False, 0, config)

    cases = {
        "eager (mm, gelu_backward, sum)": lambda: torch.ops.aten.gelu_backward(
            torch.mm(dy, w2), z
        ).sum(0),
        f"linear_act_dgrad + db ({linear_act_dgrad_path(dy, w2, z)})": lambda: linear_act_dgrad(
            dy, w2, z, "gelu", False, True
        ),
        "fused forced, dz only": fused,
        "fused forced + dz.sum(0)": lambda: (fused(), dz.sum(0)),
        "fallback forced (cuBLAS + backward pass), dz + db": lambda: (
            _C._testing.linear_act_dgrad_fallback_raw(dy, w2, z, False, 0, True)
        ),
    }
    for config, cname in CONFIGS.items():
        cases[f"fused {cname} forced, dz only"] = lambda c=config: fused(c)
        cases[f"fused {cname} forced, dz + db (epilogue)"] = lambda c=config: (
            _C._testing.linear_act_dgrad_sm90_raw(dy, w2, z, dz, False, 0, c, want_db=True)
        )
    gemm = timed_or_none("dy . W2", lambda: torch.mm(dy, w2))
    for name, fn in cases.items():
        ms = timed_or_none(name, fn)
        if ms is not None and gemm is not None:
            shape = f"dgrad {m}x{n}->{hidden}"
            rows.append(dgrad_row(shape, "dgrad few rows", name, ms, gemm, 2 * m * n * hidden))


def wgrad_bgrad(label, m, k, hidden, n, transposed, rows) -> None:
    """The weight-gradient GEMMs with the bias gradient, bf16: dW = g^T x (x^T g for Conv1D's
    layout) plus db = g.sum(0) as the MLP op computes them today (cuBLAS, then a column sum)
    against cuBLASLt's BGRADB/BGRADA epilogue (db from the same GEMM); errors against float64
    and run-to-run bit identity. FC1: g = dz [m, hidden], x [m, k]; FC2: g = dy [m, n], h."""
    why_not = cublaslt_peer.available()
    if why_not is not None:
        print(f"cuBLASLt peer not built: {why_not}")
        return
    wgrad_bgrad_layer(f"{label} FC1", m, k, hidden, transposed, rows)
    wgrad_bgrad_layer(f"{label} FC2", m, hidden, n, transposed, rows)


def wgrad_bgrad_layer(label, m, a_cols, g_cols, transposed, rows) -> None:
    dtype = torch.bfloat16
    a = torch.randn(m, a_cols, device="cuda", dtype=dtype)
    g = (torch.randn(m, g_cols, device="cuda") / 8).to(dtype)
    dw_shape = (a_cols, g_cols) if transposed else (g_cols, a_cols)
    dw = torch.empty(dw_shape, device="cuda", dtype=dtype)
    db = torch.empty(g_cols, device="cuda", dtype=dtype)

    def mm():
        return torch.mm(a.t(), g) if transposed else torch.mm(g.t(), a)

    def lt():
        cublaslt_peer.wgrad_bgrad(a, g, dw, db, transposed)

    lt()
    ref_dw = (a.double().t() @ g.double()) if transposed else (g.double().t() @ a.double())
    ref_db = g.double().sum(0)
    dw_err = ((dw.double() - ref_dw).abs().max() / ref_dw.abs().max()).item()
    db_err = ((db.double() - ref_db).abs().max() / ref_db.abs().max()).item()
    aten_db_err = ((g.sum(0).double() - ref_db).abs().max() / ref_db.abs().max()).item()
    first = (dw.clone(), db.clone())
    same = True
    for _ in range(5):
        lt()
        same = same and torch.equal(dw, first[0]) and torch.equal(db, first[1])
    print(
        f"{label} wgrad_bgrad: dw max err / max|dw| {dw_err:.3g}, db {db_err:.3g} "
        f"(ATen's g.sum(0): {aten_db_err:.3g}); bit-identical over 6 runs: {same}",
        flush=True,
    )
    gemm = timed_or_none("wgrad GEMM", mm)
    cases = {
        "wgrad GEMM (cuBLAS)": mm,
        "wgrad GEMM + g.sum(0)": lambda: (mm(), g.sum(0)),
        "cuBLASLt wgrad + BGRAD epilogue": lt,
        "g.sum(0) alone": lambda: g.sum(0),
    }
    for name, fn in cases.items():
        ms = timed_or_none(f"{label} {name}", fn)
        if ms is not None and gemm is not None:
            shape = f"{label} {m}x{g_cols}^T . {a_cols}"
            rows.append(dgrad_row(shape, "wgrad + db", name, ms, gemm, 2 * m * a_cols * g_cols))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for mlp.json and mlp.md")
    parser.add_argument("--quick", action="store_true", help="bf16 only")
    parser.add_argument("--dgrad-sweep", action="store_true", help="the backward GEMM alone")
    parser.add_argument("--sweep-only", action="store_true", help="only --dgrad-sweep")
    parser.add_argument(
        "--wgrad-bgrad", action="store_true", help="only the weight-gradient GEMMs with db"
    )
    parser.add_argument(
        "--few-rows", action="store_true", help="only the backward GEMM at few rows"
    )
    parser.add_argument("--rows", default=None, help="--few-rows at these row counts (576,640)")
    parser.add_argument(
        "--kn", default="768x3072", help="--few-rows GEMM dy [m, K] . W2 [K, N] at these KxN"
    )
    parser.add_argument(
        "--paired", type=int, default=0, help="only the op against its floor, N alternations"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="only the op's busy time per kernel (bf16)"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    rows: list[dict] = []
    if args.paired:
        for label, m, k, hidden, n, transposed in SHAPES:
            paired(label, m, k, hidden, n, transposed, args.paired, rows)
        write_results(args.out, "mlp_paired", "", {"gpu": gpu_name(), "rows": rows})
        return
    if args.breakdown:
        for label, m, k, hidden, n, transposed in SHAPES:
            breakdown(label, m, k, hidden, n, transposed, rows)
        write_results(args.out, "mlp_breakdown", "", {"gpu": gpu_name(), "rows": rows})
        return
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    if args.few_rows:
        row_counts = [int(r) for r in args.rows.split(",")] if args.rows else None
        for kn in args.kn.split(","):
            k, n = (int(v) for v in kn.split("x"))
            dgrad_few_rows(rows, row_counts, k, n)
    if args.wgrad_bgrad:
        for label, m, k, hidden, n, transposed in SHAPES:
            wgrad_bgrad(label, m, k, hidden, n, transposed, rows)
        args.few_rows = True  # nothing else
    for label, m, _, hidden, n, transposed in [] if args.few_rows else SHAPES:
        if args.dgrad_sweep or args.sweep_only:
            dgrad_sweep(label, m, hidden, n, transposed, rows)
    for label, m, k, hidden, n, transposed in [] if args.sweep_only or args.few_rows else SHAPES:
        for dname, dtype in dtypes.items():
            try:
                bench(label, m, k, hidden, n, transposed, dname, dtype, rows)
            except Exception as err:  # e.g. out of memory: the other shapes still run
                print(f"{label} {dname}: FAILED {type(err).__name__}: {err}", flush=True)
            print(f"done {label} {dname}", flush=True)
    lines = [
        f"GPU: {gpu_name()}, torch {torch.__version__}, fastlayers {fastlayers.__version__}",
        "",
        "| shape | dtype | pass | impl | time (us) | TFLOP/s | x floor (plain GEMMs) "
        "| GPU busy (us) | GPU x floor |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gpu = f"{r['gpu_ms'] * 1e3:.1f} | {r['x_floor_gpu']:.3f}" if "gpu_ms" in r else " | "
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['pass']} | {r['impl']} | {r['ms'] * 1e3:.1f} "
            f"| {r['tflops']:.0f} | {r['x_floor']:.3f} | {gpu} |"
        )
    write_results(args.out, "mlp", "\n".join(lines), {"rows": rows})


if __name__ == "__main__":
    main()
