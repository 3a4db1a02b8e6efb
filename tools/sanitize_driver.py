"""Calls every CUDA kernel of fastlayers, forward and backward, once per dtype and path, on small
but non-trivial shapes (partial blocks and tiles, odd widths, unaligned views): the program that
tools/device_sanitize.sh runs under compute-sanitizer. Starting torch under the sanitizer is
slow and every kernel runs instrumented, so this replaces the pytest suite there.

    python3 tools/sanitize_driver.py run [--only layer_norm,relu_scale,linear_gelu,...]
                                           [--dtypes fp16,bf16] [--start N] [--stop M]
    python3 tools/sanitize_driver.py coverage     # which kernels ran, per dtype (profiler)
    python3 tools/sanitize_driver.py summarize LOG   # a sanitizer log: findings per kernel
    python3 tools/sanitize_driver.py run --device cpu   # the same calls on CPU (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
Case = tuple[str, Callable[[], None]]


# ------------------------------------------------------------------------------------------
# The calls.


def randn(shape, dtype, device, offset: int = 0, requires_grad: bool = False) -> torch.Tensor:
    """Random tensor; offset > 0 views it `offset` elements into a larger buffer, so that its
    data pointer is not 16-byte aligned (the kernels' scalar paths)."""
    n = 1
    for s in shape:
        n *= s
    t = torch.randn(n + offset, device=device, dtype=dtype)[offset:].view(shape)
    return t.requires_grad_(requires_grad)


def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, wrt: list) -> None:
    """fn(x), then the gradients of <fn(x), dy> with respect to `wrt`."""
    y = fn(x)
    if wrt:
        torch.autograd.grad(y, wrt, torch.randn_like(y))


def layer_norm_cases(dtype, device) -> Iterator[Case]:
    import fastlayers

    half = dtype != torch.float32

    def ln(cols, rows, *, offset=0, frozen=False, autocast=False, params=None, **kw):
        def run() -> None:
            m = fastlayers.LayerNorm(cols, device=device, dtype=params or dtype, **kw)
            if m.weight is not None:
                torch.nn.init.normal_(m.weight)
            for p in m.parameters():
                p.requires_grad_(not frozen)
            x = randn((rows, cols), dtype, device, offset, requires_grad=True)
            amp = torch.autocast(device, dtype=dtype) if autocast else contextlib.nullcontext()
            with amp:
                fwd_bwd(m, x, [x, *(p for p in m.parameters() if p.requires_grad)])

        return run

    yield "layer_norm vec 37x512", ln(512, 37)
    yield "layer_norm vec 3x64", ln(64, 3)
    yield "layer_norm vec wide 5x20480 (max threads per row; backward generic)", ln(20480, 5)
    yield "layer_norm generic 9x771", ln(771, 9)
    yield "layer_norm unaligned 8x512", ln(512, 8, offset=1)
    yield "layer_norm no bias 16x512", ln(512, 16, bias=False)
    yield "layer_norm no affine 16x256", ln(256, 16, elementwise_affine=False)
    yield "layer_norm frozen params 16x512 (dx only)", ln(512, 16, frozen=True)
    yield "layer_norm generic frozen params 9x771 (dx only)", ln(771, 9, frozen=True)
    if half:
        yield "layer_norm float32 params 37x512", ln(512, 37, params=torch.float32)
        yield (
            "layer_norm autocast 37x512 (float32 out)",
            ln(512, 37, params=torch.float32, autocast=True),
        )
        yield "layer_norm autocast generic 9x771", ln(771, 9, params=torch.float32, autocast=True)


def relu_scale_cases(dtype, device) -> Iterator[Case]:
    from fastlayers.functional import relu_scale

    def out_of_place(shape, offset=0):
        def run() -> None:
            x = randn(shape, dtype, device, offset, requires_grad=True)
            fwd_bwd(lambda t: relu_scale(t, -0.5), x, [x])

        return run

    def in_place() -> None:
        with torch.no_grad():
            relu_scale(randn((1000, 257), dtype, device), 0.5, inplace=True)
            relu_scale(randn((257, 1000), dtype, device).t(), 0.5, inplace=True)  # strided
        x = randn((1000, 257), dtype, device, requires_grad=True)
        fwd_bwd(lambda t: relu_scale(t * 1.0, 2.0, inplace=True), x, [x])  # autograd: copy_

    yield "relu_scale 1000x257 (vector tail)", out_of_place((1000, 257))
    yield "relu_scale 8192x1024 (unrolled grid)", out_of_place((8192, 1024))
    yield "relu_scale unaligned 1000x257", out_of_place((1000, 257), offset=1)
    yield "relu_scale in place (contiguous, strided, under autograd)", in_place


def linear_gelu_cases(dtype, device) -> Iterator[Case]:
    from fastlayers._extension import _C
    from fastlayers.functional import linear_act_path
    from fastlayers.ops.linear_act import fallback_rows, linear_act_forward, sm90_available

    half = dtype != torch.float32

    def lg(m, k, n, *, act="gelu", bias=True, transposed=False, grads="all", path=None):

        def run() -> None:
            w = randn((k, n) if transposed else (n, k), dtype, device) / k**0.5
            b = randn((n,), dtype, device) if bias else None
            x = randn((m, k), dtype, device)
            if path and device == "cuda":
                got = linear_act_path(x, w, b, activation=act, weight_transposed=transposed)
                assert got.startswith(path), f"expected the {path} path, got {got!r}"
            wrt = [t for t in {"all": [x, w, b], "x": [x], "bias": [b]}[grads] if t is not None]
            for t in wrt:
                t.requires_grad_()

            def f(t):
                return linear_act_forward(t, w, b, act, transposed)

            fwd_bwd(f, x, wrt)
            with torch.no_grad():  # the inference path: GELU in place, no pre-activation
                f(x)

        return run

    def dact_bias(m, n, activation):
        def run() -> None:
            k = 8
            x, w = randn((m, k), dtype, device), randn((n, k), dtype, device)
            dy, z = randn((m, n), dtype, device), randn((m, n), dtype, device)
            torch.ops.fastlayers.linear_act_bwd(
                dy, z, x, w, True, activation, False, [False, False, True]
            )

        return run

    # The backward's elementwise pass and bias-gradient sums alone, no GEMM: racecheck
    # (2025.3) dies on cuBLAS's half-precision GEMMs that surround it in the cases below.
    yield "linear_act dgelu + bias grad alone 300x520 (vector)", dact_bias(300, 520, "gelu")
    yield "linear_act dgelu + bias grad alone 300x17 tanh (scalar)", dact_bias(300, 17, "gelu_tanh")
    yield "linear_act drelu + bias grad alone 300x520 (vector)", dact_bias(300, 520, "relu")
    # Sizes the fused kernels refuse on an sm90 GPU (every size falls back elsewhere).
    rows = fallback_rows(256, 512, dtype, device) if device == "cuda" else 64
    yield "linear_gelu fallback odd 7x33->17 (scalar backward)", lg(7, 33, 17, path="fallback")
    yield (
        f"linear_gelu fallback {rows}x256->512 tanh, [k, n] weight, no bias",
        lg(rows, 256, 512, act="gelu_tanh", bias=False, transposed=True, path="fallback"),
    )
    yield f"linear_gelu fallback {rows}x256->512, dx only", lg(rows, 256, 512, grads="x")
    yield (
        f"linear_relu fallback {rows}x256->512 (cuBLASLt epilogue)",
        lg(rows, 256, 512, act="relu"),
    )
    yield (
        "linear_relu fallback odd 7x33->17, no bias",
        lg(7, 33, 17, act="relu", bias=False),
    )
    yield f"linear_gelu fallback {rows}x256->512, bias grad only", lg(rows, 256, 512, grads="bias")
    if not half:
        return
    fused = "cutlass_sm90" if sm90_available(device) else None
    # 1024 x 4224 output: 8 x 33 = 264 tiles of 128 x 128, two full waves on 132 SMs (three on
    # 114): the fused path.
    yield "linear_gelu fused 1024x256->4224", lg(1024, 256, 4224, path=fused)
    # ReLU with a bias: three waves and more (16 x 33 = 528 tiles)
    yield "linear_relu fused 2048x256->4224", lg(2048, 256, 4224, act="relu", path=fused)
    yield "linear_gelu fused 64x256->512 (64x64 tiles)", lg(64, 256, 512, path=fused)
    yield (
        "linear_gelu fused 1024x256->4224 tanh, [k, n] weight, no bias",
        lg(1024, 256, 4224, act="gelu_tanh", bias=False, transposed=True, path=fused),
    )
    if not sm90_available(device):
        return

    def raw(config: int, epilogue: int, bias: bool, preact: bool, transposed: bool):
        def run() -> None:
            m, k, n = 300, 136, 264  # partial tiles in m, n and k
            x = randn((m, k), dtype, device)
            w = randn((k, n) if transposed else (n, k), dtype, device)
            b = randn((n,), dtype, device) if bias else None
            y = torch.empty(m, n, device=device, dtype=dtype)
            z = torch.empty(m, n, device=device, dtype=dtype) if preact else None
            _C._testing.linear_act_sm90_raw(x, w, b, y, z, transposed, epilogue, config)

        return run

    # Every tile configuration (0 cooperative 256x128, 1 ping-pong 128x128, 2 ping-pong 64x64,
    # 3 ping-pong 128x128 without a cluster), each epilogue (erf, tanh, relu, identity), with and
    # without bias and pre-activation output, both weight layouts.
    for config in (0, 1, 2, 3):
        for epilogue, bias, preact, transposed in (
            (0, 1, 1, 0),
            (1, 0, 1, 1),
            (2, 1, 0, 0),
            (3, 1, 0, 1),
        ):
            name = f"linear_gelu sm90 raw config {config} epilogue {epilogue}"
            yield name, raw(config, epilogue, bool(bias), bool(preact), bool(transposed))


def dropout_add_layer_norm_cases(dtype, device) -> Iterator[Case]:
    from fastlayers.functional import dropout_add_layer_norm

    half = dtype != torch.float32

    def daln(rows, cols, *, p=0.1, residual=True, prenorm=False, offset=0, res_dtype=None):
        def run() -> None:
            x = randn((rows, cols), dtype, device, offset, requires_grad=True)
            r = randn((rows, cols), res_dtype or dtype, device, requires_grad=True)
            w = randn((cols,), res_dtype or dtype, device, requires_grad=True)
            b = randn((cols,), res_dtype or dtype, device, requires_grad=True)
            wrt = [x, w, b] + ([r] if residual else [])

            def f(t):
                out = dropout_add_layer_norm(
                    t,
                    r if residual else None,
                    (cols,),
                    w,
                    b,
                    1e-5,
                    p=p,
                    training=p > 0,
                    prenorm=prenorm,
                )
                return out[0] + out[1] if prenorm else out

            fwd_bwd(f, x, wrt)

        return run

    yield "dropout_add_layer_norm vec 37x768 p=0.1", daln(37, 768)
    yield "dropout_add_layer_norm vec 33x1024 eval (p=0)", daln(33, 1024, p=0.0)
    yield "dropout_add_layer_norm vec 17x512 prenorm", daln(17, 512, prenorm=True)
    yield "dropout_add_layer_norm generic 9x771 p=0.1", daln(9, 771)
    yield "dropout_add_layer_norm unaligned 8x512", daln(8, 512, offset=1)
    yield "dropout_add_layer_norm no residual 16x256", daln(16, 256, residual=False)
    yield "dropout_add_layer_norm wide 5x20480", daln(5, 20480)
    if half:
        yield (
            "dropout_add_layer_norm half x + float32 residual 37x768",
            daln(37, 768, res_dtype=torch.float32),
        )


FAMILIES = {
    "layer_norm": layer_norm_cases,
    "relu_scale": relu_scale_cases,
    "linear_gelu": linear_gelu_cases,
    "dropout_add_layer_norm": dropout_add_layer_norm_cases,
}


def all_cases(device: str, only: set[str], dtypes: list[str]) -> Iterator[Case]:
    for family, cases in FAMILIES.items():
        if only and family not in only:
            continue
        for tag in dtypes:
            for name, fn in cases(DTYPES[tag], device):
                yield f"[{tag}] {name}", fn


def run(
    device: str,
    only: set[str],
    dtypes: list[str],
    quiet: bool = False,
    start: int = 0,
    stop: int | None = None,
) -> int:
    """Runs cases start..stop-1 (numbered over all the selected cases, so that
    device_sanitize.sh can go on after a case during which the sanitizer itself died)."""
    import fastlayers  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    count = 0
    for index, (name, fn) in enumerate(all_cases(device, only, dtypes)):
        if index < start or (stop is not None and index >= stop):
            continue
        if not quiet:
            # Under the sanitizer: which call a report follows, and where a crash happened.
            print(f"case {index}: {name}", flush=True)
        fn()
        if device == "cuda":
            torch.cuda.synchronize()  # a fault surfaces in the case that caused it
        count += 1
    print(f"sanitize_driver: {count} calls done on {device}", flush=True)
    return count


# ------------------------------------------------------------------------------------------
# Which kernels the calls launch (profiler), against the __global__ functions in csrc/.


def kernel_functions() -> list[str]:
    """Names of the __global__ functions in csrc/*.cu and *.cuh."""
    pattern = re.compile(
        # __launch_bounds__ arguments nest calls two deep, e.g. min_blocks(block_threads(TPR)).
        r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)\s*)?"
        r"(\w+)\s*\("
    )
    names = set()
    for path in sorted((ROOT / "csrc").rglob("*.cu*")):
        names.update(pattern.findall(path.read_text()))
    return sorted(names)


_DTYPE_TAGS = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64"}


def dtype_tag(template_args: str) -> str:
    """The dtype tag of a kernel instance: the first dtype among its template arguments (the
    LayerNorm kernels lead with an int, e.g. ln_fwd_vec_kernel<4, ...Src<c10::Half>...>)."""
    found = re.findall(r"c10::BFloat16|c10::Half|\bdouble\b|\bfloat\b", template_args)
    return _DTYPE_TAGS[found[0]] if found else template_args.split(",")[0].strip()


def kernel_label(name: str, ours: list[str]) -> tuple[str, str] | None:
    """(kernel label, dtype tag) of a profiler kernel name if it is one of ours, else None."""
    if "fastlayers" not in name:  # all ours are in namespace fastlayers (ATen has an
        return None  # elementwise_kernel too)
    if "cutlass" in name and "device_kernel" in name:  # demangled or not (long names)
        schedule = "pingpong" if "Pingpong" in name else "cooperative"
        dtype = "bf16" if "bfloat16_t" in name else ("fp16" if "half_t" in name else "?")
        return f"cutlass_sm90 {schedule}", dtype
    for fn in ours:
        match = re.search(rf"\b{fn}<(.*)", name)
        if match:
            label = fn
            functor = re.search(r"::(\w+)>\(", name)
            if fn == "elementwise_kernel" and functor:
                label = f"{fn} {functor.group(1)}"
            return label, dtype_tag(match.group(1))
        if re.search(rf"\b{fn}\(", name):
            return fn, "-"
    return None


def coverage(only: set[str], dtypes: list[str]) -> int:
    """Runs the calls under the profiler; prints each kernel of ours with the dtypes it ran in;
    exit 1 when a __global__ function of csrc/ (other than the arch probe, never launched) did
    not run in every dtype, or the sm90 kernels not in both configurations."""
    from torch.profiler import ProfilerActivity, profile

    from fastlayers.ops.linear_act import sm90_available

    if not torch.cuda.is_available():
        print("coverage: needs a GPU")
        return 2
    ours = [f for f in kernel_functions() if f != "arch_probe_kernel"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run("cuda", only, dtypes, quiet=True)
    seen: dict[str, set[str]] = {}
    for event in prof.events():
        label = kernel_label(event.name, ours)
        if label:
            seen.setdefault(label[0], set()).add(label[1])
    want_dtypes = set(dtypes)
    missing = []
    # float64 kernels run only for float64 tensors, which the driver does not make (the cuda
    # tests cover them).
    expected = {f: want_dtypes for f in ours if f != "sum_partials_kernel" and "_f64_" not in f}
    expected["sum_partials_kernel"] = {"-"}
    if sm90_available("cuda"):
        for schedule in ("pingpong", "cooperative"):
            expected[f"cutlass_sm90 {schedule}"] = want_dtypes - {"fp32"}
    for fn, dts in sorted(expected.items()):
        got = set().union(*(v for k, v in seen.items() if k == fn or k.startswith(fn + " ")))
        lacking = dts - got
        print(f"{fn:32s} ran in: {', '.join(sorted(got)) or 'nothing'}")
        if lacking:
            missing.append(f"{fn} ({', '.join(sorted(lacking))})")
    for label in sorted(k for k in seen if " " in k and not k.startswith("cutlass")):
        print(f"  {label:30s} {', '.join(sorted(seen[label]))}")
    print("coverage: " + ("complete" if not missing else "MISSING " + "; ".join(missing)))
    return 1 if missing else 0


# ------------------------------------------------------------------------------------------
# A compute-sanitizer log, findings grouped by kernel, ours (fastlayers) apart from the rest.

_SKIP = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target")
# Records that are the sanitizer failing, not a kernel: racecheck 2025.3 on some cuBLAS kernels.
_TOOL_FAILURES = ("Internal Sanitizer Error", "Error: process didn't terminate successfully")


def findings(log: str) -> list[tuple[str, str, bool]]:
    """(what, where, ours) for each report of the log. A record starts at a line '========= X'
    and continues with more-indented '=========     ...' lines (locations, device backtrace).
    `where` is its first code location ('at <function>', in the header or a continuation line;
    '' if none), or its first location in fastlayers code when it has one (an error inside a
    CUTLASS/cute helper inlined into our GEMM); `ours` whether any line names fastlayers code."""
    records: list[list[str]] = []
    for line in log.splitlines():
        m = re.match(r"^========= (\S.*)$", line)
        if m:
            records.append([m.group(1)])
        elif records and re.match(r"^=========\s{2,}\S", line):
            records[-1].append(line[9:].strip())
    unique = [f for f in kernel_functions() if f != "elementwise_kernel"]  # ATen has one too
    out = []
    for rec in records:
        if rec[0].startswith(_SKIP):
            continue
        text = "\n".join(rec)
        ours = "fastlayers" in text or any(re.search(rf"\b{f}\b", text) for f in unique)
        places = [loc for loc in map(_location, rec) if loc]
        mine = [loc for loc in places if "fastlayers" in loc] or [
            line.split("Device Frame:", 1)[1]
            for line in rec
            if "Device Frame:" in line and "fastlayers" in line
        ]
        out.append((rec[0], (mine or places or [""])[0], ours))
    return out


def _location(line: str) -> str:
    """The code location in 'at [0x.. in ]<function>' ('' for addresses: 'at 0x7f..',
    'at __shared__ 0x10', and for host backtrace headers)."""
    m = re.search(r"\bat (?:0x[0-9a-f]+ in )?(.+)$", line)
    if not m or line.startswith("Saved host backtrace"):
        return ""
    if re.match(r"(0x|__shared__|__global__|__local__)", m.group(1)):
        return ""
    return m.group(1)


def short_name(where: str) -> str:
    """A kernel's name without return type, template arguments, parameters, source position
    and offset; fastlayers' CUTLASS GEMM by its role."""
    if "cutlass" in where and "device_kernel" in where and "fastlayers" in where:
        return "cutlass_sm90 GEMM (fastlayers)"
    name = where.strip().replace("(anonymous namespace)::", "")
    name = re.sub(r"\+0x[0-9a-f]+(\s*\[.*\])?$", "", name)
    name = re.sub(r"^void\s+", "", name)
    name = re.sub(r"^\S+:\d+:", "", name)  # file.cu:12:kernel(...)
    depth, out = 0, []
    for ch in name:  # drop <...> and (...) groups
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or where[:80]


def summarize(path: str, tool_name: str) -> int:
    """Prints one line: findings in our kernels, in others (ATen, cuBLAS, ...), unattributed,
    and the sanitizer's own failures (a log may hold several runs: device_sanitize.sh goes on
    after one). Exit 1: any finding in ours or unattributed, or no summary line; 2: findings
    only in others; 0: clean (tool failures are reported by the caller, which knows which
    calls never finished)."""
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    ours, others, unknown, tool = Counter(), Counter(), Counter(), Counter()
    for what, where, mine in findings(text):
        if what.startswith(_TOOL_FAILURES) and not mine:
            tool[what[:80]] += 1  # the sanitizer's own failure, not a finding in a kernel
        elif not where:
            unknown[what[:80]] += 1
        else:
            (ours if mine else others)[short_name(where)] += 1
    totals = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: .*", text)

    def fmt(c: Counter) -> str:
        return ", ".join(f"{n} x{k}" for n, k in c.most_common(6)) or "none"

    said = "; ".join(f"{n} x {k}" if n > 1 else k for k, n in Counter(totals).items())
    line = (
        f"{tool_name}: ours {sum(ours.values())} [{fmt(ours)}]; others {sum(others.values())} "
        f"[{fmt(others)}]; unattributed {sum(unknown.values())} [{fmt(unknown)}]; "
        f"tool failures {sum(tool.values())} [{fmt(tool)}]; "
        f"sanitizer says: {said or 'no summary line (did it finish?)'}"
    )
    print(line)
    if ours or unknown or not totals:
        return 1
    return 2 if others else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("run", "coverage"):
        p = sub.add_parser(cmd)
        p.add_argument("--only", default="", help=f"comma-separated of {', '.join(FAMILIES)}")
        p.add_argument("--dtypes", default="fp32,fp16,bf16")
        if cmd == "run":
            p.add_argument("--device", default="cuda")
            p.add_argument("--start", type=int, default=0, help="first case number to run")
            p.add_argument("--stop", type=int, default=None, help="case number to stop before")
    p = sub.add_parser("summarize")
    p.add_argument("log")
    p.add_argument("--tool", default="sanitizer")
    args = ap.parse_args()
    if args.cmd == "summarize":
        return summarize(args.log, args.tool)
    only = set(filter(None, args.only.split(",")))
    dtypes = [d for d in args.dtypes.split(",") if d]
    if args.cmd == "coverage":
        return coverage(only, dtypes)
    run(args.device, only, dtypes, start=args.start, stop=args.stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
