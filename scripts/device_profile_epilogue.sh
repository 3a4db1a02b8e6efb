#!/usr/bin/env bash
# The sm90 epilogue's cost on the GPU machine (extension already built or carried): clock and
# power per epilogue (scripts/profile_epilogue.py time), then Nsight Compute over one call of
# each epilogue at K = 768 (pipes, issue slots, stalls). Writes to $OUT.
#   bash scripts/device_profile_epilogue.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 scripts/profile_epilogue.py time > "$OUT/epilogue_time.txt" 2>&1
python3 scripts/profile_epilogue.py time --k 4096 --n 16384 --seconds 4 >> "$OUT/epilogue_time.txt" 2>&1
cat "$OUT/epilogue_time.txt"

# Metrics that this ncu knows (names differ between versions): pipe utilisation and clock.
ncu --query-metrics --chip gh100 > /tmp/ncu_metrics.txt 2>&1
metrics=""
for base in sm__cycles_elapsed sm__pipe_tensor_op_gmma_cycles_active sm__inst_executed_pipe_xu \
    sm__pipe_fma_cycles_active sm__inst_executed_pipe_fma sm__inst_executed_pipe_alu \
    smsp__issue_active sm__pipe_shared_cycles_active smsp__inst_executed; do
  grep -q "^$base " /tmp/ncu_metrics.txt || { echo "ncu lacks $base"; continue; }
  case $base in
    sm__cycles_elapsed) m="$base.avg.per_second,$base.max" ;;
    smsp__inst_executed) m="$base.sum" ;;
    *) m="$base.avg.pct_of_peak_sustained_active" ;;
  esac
  metrics=${metrics:+$metrics,}$m
done
echo "metrics: $metrics"
ncu --clock-control none -k regex:device_kernel --launch-skip 10 --launch-count 5 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --metrics "$metrics" \
  python3 scripts/profile_epilogue.py ncu --config 1 > "$OUT/ncu_pingpong_k768.txt" 2>&1
echo "ncu rc=$?"
grep -E "device_kernel|Duration|SM Frequency|Compute \(SM\)|Issue Slots Busy|Issued Ipc|gmma|pipe_xu|pipe_fma|issue_active|Stall|cycles_elapsed|inst_executed" \
  "$OUT/ncu_pingpong_k768.txt" | sed 's/cutlass::device_kernel.*/device_kernel/' | head -150
