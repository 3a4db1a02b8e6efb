#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the `cuda`-marked tests, run the
# benchmarks; logs and results under $OUT (default: ./out).
#   bash scripts/device_run.sh [pytest -k expression] [benchmark[=args] ...]
#   e.g. bash scripts/device_run.sh "" layer_norm linear_gelu=--sweep   ("none": no benchmark)
# Packages missing there travel as wheels in .whl/ and are installed first: the build needs
# nvidia-cutlass (its CUTLASS headers), the benchmarks may use peers such as liger-kernel.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
KEXPR=${1:-}
shift || true
BENCHES=${*:-layer_norm}

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m fastlayers env | tee "$OUT/env.txt"

python3 -m pytest -q -m cuda -n 4 -rf --tb=short ${KEXPR:+-k "$KEXPR"} tests > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc=$?"
grep -E "passed|failed|error" "$OUT/cuda_tests.log" | tail -5
grep -E "^(FAILED|ERROR|E  )" "$OUT/cuda_tests.log" | head -40

for spec in $BENCHES; do
  [ "$spec" = none ] && continue
  b=${spec%%=*}
  bargs=""
  [ "$spec" != "$b" ] && bargs=${spec#*=}
  # shellcheck disable=SC2086
  python3 "benchmarks/bench_${b}.py" --out "$OUT" $bargs > "$OUT/bench_${b}.log" 2>&1
  echo "bench_${b} rc=$?"
  cat "$OUT/bench_${b}.log"
done
