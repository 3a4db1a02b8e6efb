"""Linear + bias + activation (GELU erf / tanh, ReLU): fastlayers against eager (F.linear then
F.gelu / F.relu), cuBLASLt's epilogues (torch._addmm_activation: tanh-GELU, ReLU) and
torch.compile, forward and forward+backward, in one run on one GPU.

GELU rows at every shape of SHAPES; ReLU rows at RELU_SHAPES (8192x768->3072, 8192x4096->16384);
bf16 and fp16 forward and forward+backward, fp32 forward only; torch.compile for bf16.
--activations narrows the run (gelu, relu or both; default both).

Floor (GEMM-bound): forward, the plain GEMM torch.mm(x, w.t()) of the same shape and dtype;
forward+backward, the three plain GEMMs (x w^T, dz w, dz^T x), timed in the same run. Ratios
below 1.10 / 1.05 are the issue's targets. Max error: the forward against float64 (ERR_ROWS
rows). The path column is linear_act_path's for the row's activation. --sweep also times every
compiled sm90 tile config with the erf, tanh, ReLU and identity epilogues (the identity
isolates the GEMM from the activation).

    python benchmarks/bench_linear_gelu.py [--out DIR] [--activations gelu,relu] [--sweep]
        [--sweep-only] [--few-rows [--rows 576,640] [--kn 768x3072,3072x768]] [--quick]

--few-rows runs only the sweep's few-rows part (32..2048 rows at 768 -> 3072 and 1024 -> 4096,
or --rows at --kn: in_features x out_features), GELU both forms and ReLU: the fastlayers call's
own path, each sm90 config forced, eager, cuBLASLt's tanh GELU and ReLU epilogues), the numbers
behind the fused kernels' size rule. The sweep's cuBLASLt rows come from
benchmarks/cublaslt_peer.py (GELU_AUX_BIAS: the tanh epilogue that also keeps the
pre-activation).
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings

import cublaslt_peer
import torch
import torch.nn.functional as F
from common import gpu_name, median_ms, warm_up_gpu, write_results

import fastlayers
from fastlayers._extension import _C
from fastlayers.functional import linear_act_path, linear_gelu, linear_relu
from fastlayers.ops.linear_act import sm90_available

SHAPES = [(8192, 768, 3072), (8192, 4096, 16384), (4096, 1024, 4096), (32, 768, 3072)]
RELU_SHAPES = SHAPES[:2]
ACTIVATIONS = ("gelu", "relu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = _C._testing.sm90_tile_configs()  # the raw entry's config argument -> its name
EPILOGUES = {0: "erf", 1: "tanh", 2: "relu", 3: "identity"}  # _C._testing.linear_act_sm90_raw's
ERR_ROWS = 256  # rows of the output checked against float64


def timed(fn, budget_s: float = 0.4) -> float:
    """Median ms of fn, with as many repetitions as fit the budget (10 to 100)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = int(max(10, min(100, budget_s / max(once, 1e-6))))
    return median_ms(fn, warmup=3, reps=reps)


def make_inputs(m: int, k: int, n: int, dtype: torch.dtype):
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    return x, w, b


def reference(x, w, b, activation: str) -> torch.Tensor:
    """The float64 forward of the first ERR_ROWS rows; activation 'gelu', 'gelu_tanh', 'relu'."""
    z = F.linear(x[:ERR_ROWS].double(), w.double(), b.double())
    if activation == "relu":
        return F.relu(z)
    return F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def max_err(y: torch.Tensor, x, w, b, activation: str) -> float:
    return (y[:ERR_ROWS].double() - reference(x, w, b, activation)).abs().max().item()


def eager(activation: str):
    if activation == "relu":
        return lambda x, w, b: F.relu(F.linear(x, w, b))
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate)


def forward_impls(with_compile: bool, activations: set[str]) -> dict:
    """name -> (f(x, w, b), the activation it computes)."""
    impls = {}
    if "gelu" in activations:
        impls |= {
            "fastlayers erf": (lambda x, w, b: linear_gelu(x, w, b, "none"), "gelu"),
            "fastlayers tanh": (lambda x, w, b: linear_gelu(x, w, b, "tanh"), "gelu_tanh"),
            "eager erf": (eager("gelu"), "gelu"),
            "eager tanh": (eager("gelu_tanh"), "gelu_tanh"),
            "cuBLASLt tanh epilogue": (
                lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True),
                "gelu_tanh",
            ),
        }
        if with_compile:
            impls["torch.compile erf"] = (torch.compile(eager("gelu"), dynamic=False), "gelu")
            impls["torch.compile tanh"] = (
                torch.compile(eager("gelu_tanh"), dynamic=False),
                "gelu_tanh",
            )
    if "relu" in activations:
        impls |= {
            "fastlayers relu": (lambda x, w, b: linear_relu(x, w, b), "relu"),
            "eager relu": (eager("relu"), "relu"),
            "cuBLASLt relu epilogue": (
                lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=False),
                "relu",
            ),
        }
        if with_compile:
            impls["torch.compile relu"] = (torch.compile(eager("relu"), dynamic=False), "relu")
    return impls


def timed_or_none(label: str, fn) -> float | None:
    """timed(fn), or None with the error printed: one failing implementation does not stop
    the run."""
    try:
        return timed(fn)
    except Exception as err:
        print(f"{label}: FAILED {type(err).__name__}: {err}", flush=True)
        return None


def bench_shape(m, k, n, dname, dtype, with_compile, activations, rows):
    # Every shape compiles afresh: the impls share code objects, and dynamo's recompile limit
    # would otherwise silently fall back to eager on later shapes.
    torch.compiler.reset()
    x, w, b = make_inputs(m, k, n, dtype)
    gemm_ms = timed(lambda: torch.mm(x, w.t()))
    flops = 2 * m * n * k
    for name, (fn, activation) in forward_impls(with_compile, activations).items():
        label = f"{m}x{k}->{n} {dname} fwd {name}"
        ms = timed_or_none(label, lambda fn=fn: fn(x, w, b))
        if ms is None:
            continue
        path = ""
        if name.startswith("fastlayers"):
            try:
                path = linear_act_path(x, w, b, activation=activation)
            except Exception as err:
                path = f"? ({type(err).__name__}: {err})"
        rows.append(
            {
                "shape": f"{m}x{k}->{n}",
                "dtype": dname,
                "pass": "fwd",
                "impl": name,
                "ms": ms,
                "floor_ms": gemm_ms,
                "x_floor": ms / gemm_ms,
                "tflops": flops / ms / 1e9,
                "err": max_err(fn(x, w, b), x, w, b, activation),
                "path": path,
            }
        )
    if dtype == torch.float32:
        return  # the fp32 target is the forward
    # forward + backward against the three plain GEMMs
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    dz = torch.randn(m, n, device="cuda", dtype=dtype)

    def three_gemms():
        torch.mm(x, w.t())
        torch.mm(dz, w)
        torch.mm(dz.t(), x)

    floor_ms = timed(three_gemms)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    train = {}
    if "gelu" in activations:
        train |= {
            "fastlayers erf": lambda: linear_gelu(xg, wg, bg, "none"),
            "fastlayers tanh": lambda: linear_gelu(xg, wg, bg, "tanh"),
            "eager erf": lambda: eager("gelu")(xg, wg, bg),
        }
        if with_compile:
            compiled = torch.compile(eager("gelu"), dynamic=False)
            train["torch.compile erf"] = lambda: compiled(xg, wg, bg)
    if "relu" in activations:
        train |= {
            "fastlayers relu": lambda: linear_relu(xg, wg, bg),
            "eager relu": lambda: eager("relu")(xg, wg, bg),
        }
        if with_compile:
            compiled_relu = torch.compile(eager("relu"), dynamic=False)
            train["torch.compile relu"] = lambda: compiled_relu(xg, wg, bg)
    for name, fwd in train.items():
        label = f"{m}x{k}->{n} {dname} fwd+bwd {name}"
        ms = timed_or_none(label, lambda fwd=fwd: torch.autograd.grad(fwd(), [xg, wg, bg], dy))
        if ms is None:
            continue
        rows.append(
            {
                "shape": f"{m}x{k}->{n}",
                "dtype": dname,
                "pass": "fwd+bwd",
                "impl": name,
                "ms": ms,
                "floor_ms": floor_ms,
                "x_floor": ms / floor_ms,
                "tflops": 3 * flops / ms / 1e9,
                "err": float("nan"),
                "path": "",
            }
        )


def sweep_row(m: int, k: int, n: int, config: str, epilogue: str, ms: float, gemm_ms: float):
    """One row of the sweep tables: an implementation at one shape, against the plain GEMM."""
    return {
        "shape": f"{m}x{k}->{n}",
        "config": config,
        "epilogue": epilogue,
        "ms": ms,
        "x_gemm": ms / gemm_ms,
    }


def sweep_shape(m: int, k: int, n: int, rows: list[dict]) -> None:
    """Every compiled sm90 tile config x epilogue for one bf16 shape, through the raw entry,
    and cuBLASLt's tanh epilogues (without and with the pre-activation kept)."""
    x, w, b = make_inputs(m, k, n, torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    pre = torch.empty_like(y)
    gemm_ms = timed(lambda: torch.mm(x, w.t()))
    variants = [(ep, ename, None) for ep, ename in EPILOGUES.items()]
    variants += [(0, "erf +preact", pre), (1, "tanh +preact", pre)]
    peer = {"cuBLASLt": ("tanh", lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))}
    if cublaslt_peer.available() is None:  # the training forward: GELU_AUX_BIAS keeps z
        peer["cuBLASLt GELU_AUX_BIAS"] = (
            "tanh +preact",
            lambda: cublaslt_peer.gelu_aux_bias(x, w, b, y, pre),
        )
    for cname, (ename, fn) in peer.items():
        rows.append(sweep_row(m, k, n, cname, ename, timed(fn), gemm_ms))
    for cfg, cname in CONFIGS.items():
        for ep, ename, aux in variants:
            fn = functools.partial(_C._testing.linear_act_sm90_raw, x, w, b, y, aux, False, ep, cfg)
            try:
                ms = timed(fn)
            except RuntimeError as err:
                print(f"sweep {m}x{k}->{n} {cname} {ename}: {err}")
                continue
            rows.append(sweep_row(m, k, n, cname, ename, ms, gemm_ms))


def sweep_rows(m: int, k: int, n: int, rows: list[dict]) -> None:
    """A few-row problem, bf16: the fastlayers call (whichever path it takes), each sm90 config
    forced, eager and cuBLASLt's epilogue, for GELU (both forms) and ReLU: the numbers behind
    the size rule."""
    x, w, b = make_inputs(m, k, n, torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = timed(lambda: torch.mm(x, w.t()))
    timings = {("bare GEMM", "-"): gemm_ms}
    fastlayers_call = {
        "gelu": lambda bias: linear_gelu(x, w, bias, "none"),
        "gelu_tanh": lambda bias: linear_gelu(x, w, bias, "tanh"),
        "relu": lambda bias: linear_relu(x, w, bias),
    }
    forms = (
        ("erf", "gelu", 0, b),
        ("tanh", "gelu_tanh", 1, b),
        ("relu", "relu", 2, b),
        ("relu, no bias", "relu", 2, None),  # its fallback is cuBLAS + a ReLU pass
    )
    for form, act, epilogue, bias in forms:
        path = linear_act_path(x, w, bias, activation=act)
        timings[("eager", form)] = timed(lambda a=act, c=bias: eager(a)(x, w, c))
        call = functools.partial(fastlayers_call[act], bias)
        timings[(f"fastlayers ({path})", form)] = timed(call)
        for cfg, cname in CONFIGS.items():
            timings[(f"sm90 {cname}", form)] = timed(
                functools.partial(
                    _C._testing.linear_act_sm90_raw, x, w, bias, y, None, False, epilogue, cfg
                )
            )
        if form in ("tanh", "relu"):  # cuBLASLt's tanh GELU and bias + ReLU epilogues
            timings[("cuBLASLt epilogue", form)] = timed(
                lambda g=form == "tanh": torch._addmm_activation(b, x, w.t(), use_gelu=g)
            )
    for (cname, form), ms in timings.items():
        rows.append(sweep_row(m, k, n, cname, form, ms, gemm_ms))


FEW_ROWS_KN = ((768, 3072), (1024, 4096))
FEW_ROWS = (32, 64, 128, 256, 384, 512, 640, 768, 1024, 2048)


def sweep(
    rows: list[dict],
    few_rows_only: bool = False,
    few_rows_kn: tuple = FEW_ROWS_KN,
    few_rows: tuple = FEW_ROWS,
) -> None:
    if not sm90_available("cuda"):
        return
    for m, k, n in [] if few_rows_only else [*SHAPES[:3], (8192, 2048, 8192)]:
        sweep_shape(m, k, n, rows)
    for k, n in few_rows_kn:
        for m in few_rows:
            sweep_rows(m, k, n, rows)


def parse_kn(text: str) -> tuple:
    """'768x3072,1024x4096' -> ((768, 3072), (1024, 4096))."""
    return tuple(tuple(int(v) for v in kn.split("x")) for kn in text.split(",") if kn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for linear_gelu.json and .md")
    parser.add_argument("--sweep", action="store_true", help="time every sm90 tile config")
    parser.add_argument("--quick", action="store_true", help="bf16 only, no torch.compile")
    parser.add_argument("--sweep-only", action="store_true", help="only the config sweep")
    parser.add_argument(
        "--few-rows", action="store_true", help="only the few-rows part of the config sweep"
    )
    parser.add_argument(
        "--kn",
        default=None,
        help="--few-rows at these in_features x out_features (e.g. 3072x768,768x3072)",
    )
    parser.add_argument("--rows", default=None, help="--few-rows at these row counts (576,640)")
    parser.add_argument(
        "--activations",
        default=",".join(ACTIVATIONS),
        help="rows for these activations: gelu (erf and tanh), relu; default both",
    )
    args = parser.parse_args()
    activations = {a for a in args.activations.split(",") if a}
    if not activations or not activations <= set(ACTIVATIONS):
        parser.error(f"--activations: choose from {', '.join(ACTIVATIONS)}")
    warnings.filterwarnings("ignore")
    warm_up_gpu()
    rows: list[dict] = []
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    for m, k, n in [] if args.sweep_only or args.few_rows else SHAPES:
        acts = activations if (m, k, n) in RELU_SHAPES else activations - {"relu"}
        if not acts:
            continue
        for dname, dtype in dtypes.items():
            with_compile = dtype == torch.bfloat16 and not args.quick
            try:
                bench_shape(m, k, n, dname, dtype, with_compile, acts, rows)
            except Exception as err:  # e.g. out of memory: the other shapes still run
                print(f"{m}x{k}->{n} {dname}: FAILED {type(err).__name__}: {err}", flush=True)
            print(f"done {m}x{k}->{n} {dname} {sorted(acts)}", flush=True)
    sweep_rows: list[dict] = []
    if args.sweep or args.sweep_only or args.few_rows:
        sweep(
            sweep_rows,
            few_rows_only=args.few_rows,
            few_rows_kn=parse_kn(args.kn) if args.kn else FEW_ROWS_KN,
            few_rows=tuple(int(r) for r in args.rows.split(",")) if args.rows else FEW_ROWS,
        )
    lines = [
        f"GPU: {gpu_name()}, torch {torch.__version__}, fastlayers {fastlayers.__version__}",
        "",
        "| shape (M x K -> N) | dtype | pass | impl | time (us) | TFLOP/s "
        "| x floor (plain GEMMs) | max err vs fp64 | fastlayers path |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['pass']} | {r['impl']} | {r['ms'] * 1e3:.1f} | "
            f"{r['tflops']:.0f} | {r['x_floor']:.3f} | {r['err']:.2g} | {r['path']} |"
        )
    if sweep_rows:
        lines += [
            "",
            "sm90 tile configs, bf16, forward (x plain GEMM)",
            "",
            "| shape | config | epilogue | time (us) | x GEMM |",
            "|---|---|---|---:|---:|",
        ]
        for r in sweep_rows:
            lines.append(
                f"| {r['shape']} | {r['config']} | {r['epilogue']} | {r['ms'] * 1e3:.1f} "
                f"| {r['x_gemm']:.3f} |"
            )
    write_results(args.out, "linear_gelu", "\n".join(lines), {"rows": rows, "sweep": sweep_rows})


if __name__ == "__main__":
    main()
