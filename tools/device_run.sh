#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the `cuda`-marked tests, run the
# benchmarks; logs and results under $OUT (default: ./out).
#   bash tools/device_run.sh [pytest -k expression] [benchmark[=args] ...]
#   e.g. bash tools/device_run.sh "" layer_norm linear_gelu=--sweep   ("none": no benchmark)
# The first argument "none" skips the cuda tests ("" runs them all). Each benchmark spec is one
# argument, benchmarks/bench_NAME.py run with ARGS split at spaces; '+' in ARGS also stands for a
# space (so ARGS cannot hold a literal '+'), and commas pass through:
#   bash tools/device_run.sh none dropout_add_layer_norm=--quick \
#     "models=--models bert-base,opt-350m --modes infer" models=--models+t5-base+--modes+train
# Time limits: each benchmark runs under `timeout` (BENCH_TIMEOUT, default 540 s), cut to what
# is left of CALL_LIMIT (default 585 s, counted from the start of this script: the device
# call's own limit is 600 s) less 15 s for printing its log; a benchmark with under 30 s left is
# skipped. The cuda tests run under TEST_TIMEOUT (default 420 s; interrupted there, they still
# write their summary and $OUT/cuda_tests.xml). A benchmark killed by the
# timeout prints rc=124 and its log so far; bench_models and bench_dropout_add_layer_norm write
# their results as they go.
# Packages missing there travel as wheels in .whl/ and are installed first: the build needs
# nvidia-cutlass (its CUTLASS headers), the benchmarks may use peers such as liger-kernel.
# NO_CUTLASS=1 leaves the nvidia-cutlass wheel out: the build then has no CUTLASS GEMMs (the
# Linear + activation ops run their cuBLAS paths) and takes about 145 s instead of 245 s on the
# H200 machine, for calls about the other kernels. Commands run after this script in the same
# call need PYTHONPATH=/tmp/site to import the carried wheels.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
CALL_LIMIT=${CALL_LIMIT:-585}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
SECONDS=0
KEXPR=${1:-}
shift || true
if [ $# -eq 0 ]; then
  set -- layer_norm
fi

wheels=()
for whl in .whl/*.whl; do
  [ -e "$whl" ] || continue
  [ "${NO_CUTLASS:-0}" = 1 ] && [[ "$(basename "$whl")" == nvidia_cutlass* ]] && continue
  wheels+=("$whl")
done
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" && export PYTHONPATH=/tmp/site
fi

start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m fastlayers env | tee "$OUT/env.txt"

if [ "$KEXPR" = none ]; then
  echo "cuda tests: skipped"
else
  # SIGINT at the limit: pytest stops as on Ctrl-C, still printing its summary and writing the
  # junit file (which tests ran, passed, failed); a SIGTERM would lose both
  timeout -s INT -k 30 "$TEST_TIMEOUT" python3 -m pytest -q -m cuda -n 4 -rf --tb=short \
    --junitxml="$OUT/cuda_tests.xml" ${KEXPR:+-k "$KEXPR"} tests > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests rc=$? ($SECONDS s into the call)"
  grep -E "passed|failed|error" "$OUT/cuda_tests.log" | tail -5
  grep -E "^(FAILED|ERROR|E  )" "$OUT/cuda_tests.log" | head -40
fi

for spec in "$@"; do
  [ "$spec" = none ] && continue
  b=${spec%%=*}
  bargs=""
  [ "$spec" != "$b" ] && bargs=${spec#*=}
  bargs=${bargs//+/ }
  left=$(( CALL_LIMIT - SECONDS - 15 ))
  limit=$(( left < BENCH_TIMEOUT ? left : BENCH_TIMEOUT ))
  if [ "$limit" -lt 30 ]; then
    echo "bench_${b}: skipped, ${left} s left of the call"
    continue
  fi
  echo "bench_${b} ${bargs} (limit ${limit} s, ${SECONDS} s into the call)"
  log="$OUT/bench_${b}.log"
  n=1
  while [ -e "$log" ]; do  # the same benchmark twice: keep each log
    n=$((n + 1))
    log="$OUT/bench_${b}_${n}.log"
  done
  set -f  # the arguments are split at spaces but never globbed
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" python3 "benchmarks/bench_${b}.py" --out "$OUT" $bargs > "$log" 2>&1
  rc=$?
  set +f
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "bench_${b}: timed out after ${limit} s"
  fi
  echo "bench_${b} rc=$rc"
  cat "$log"
done
