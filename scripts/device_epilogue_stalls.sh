#!/usr/bin/env bash
# Why the sm90 epilogue is exposed: Nsight Compute warp-stall reasons and per-instruction
# (SASS) stall samples of one call of the raw fused GEMM per epilogue, on the GPU machine
# (extension built or carried). Writes $OUT/stalls_<epilogue>.txt (the stall breakdown) and
# $OUT/source_<epilogue>.csv.gz (the SASS with its samples: python scripts/sass_stalls.py $OUT).
#   bash scripts/device_epilogue_stalls.sh [profile_epilogue.py args, e.g. --k 768 --config 1]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
# scripts/profile_epilogue.py ncu launches 2 warm-up calls per epilogue, then one call each in
# the order identity, relu, tanh, erf, erf+preact: launch 10 + index.
for pair in identity:10 tanh:12 erf:13; do
  name=${pair%%:*}
  skip=${pair#*:}
  rep=/tmp/stalls_$name
  ncu --clock-control none -k regex:device_kernel --launch-skip "$skip" --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SchedulerStats \
    --import-source no -f -o "$rep" \
    python3 scripts/profile_epilogue.py ncu "$@" > "$OUT/ncu_$name.log" 2>&1
  echo "$name: ncu rc=$?"
  ncu -i "$rep.ncu-rep" --page raw 2>&1 | grep -E "issue_stalled|cycles_elapsed|inst_executed" \
    > "$OUT/stalls_$name.txt"
  ncu -i "$rep.ncu-rep" --page details --print-details all >> "$OUT/stalls_$name.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2> "$OUT/source_$name.err" |
    gzip -c > "$OUT/source_$name.csv.gz"
  head -c 600 "$OUT/source_$name.err"
done
for name in identity tanh erf; do
  echo "== $name"
  grep -E "Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Active Warps Per|Duration|Cycles" \
    "$OUT/stalls_$name.txt" | head -12
done
