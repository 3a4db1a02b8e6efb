#!/usr/bin/env bash
# compute-sanitizer over every CUDA kernel of fastlayers, on the GPU machine, after
# tools/device_run.sh has built the extension there (same machine, still warm):
#   bash tools/device_sanitize.sh [tool ...]   (default: memcheck initcheck racecheck synccheck)
# Runs tools/sanitize_driver.py (every kernel once per dtype and path, small shapes) under each
# tool, not pytest: torch's start under the sanitizer is slow and every kernel runs instrumented.
# Writes to $OUT (default ./out): sanitize_<tool>.log (the sanitizer's report),
# sanitize_app.txt (the driver's output and the coverage check), sanitize_summary.txt; prints one
# line per tool: findings in our kernels (a report naming fastlayers code or a __global__
# function of csrc/), in others (ATen, cuBLAS), unattributed, the sanitizer's own failures;
# how many calls finished and in which the tool died; and the time it took.
# Exit status: 0 when every call finished and no tool found anything in our kernels (or
# unattributed); else 1.
#
# Choices:
# - PYTORCH_NO_CUDA_MEMORY_CACHING=1 for memcheck and initcheck: with torch's caching allocator
#   a tensor lives inside a larger cudaMalloc block, so an out-of-bounds access that lands in
#   the same block (another tensor, or cached free space) is not reported, and recycled memory
#   counts as initialised. Without caching every tensor is its own cudaMalloc.
# - No --leak-check: torch's caching allocator (and, even without it, cuBLAS workspaces and
#   handles that torch keeps until exit) leaves allocations alive at exit by design, so a leak
#   report would list torch's, not ours. Leaks of ours show as growth of
#   torch.cuda.memory_allocated(): tests/test_hardening.py and tools/memory_growth.py.
# - initcheck checks every kernel: it must see ATen's kernels write the memory that ours then
#   read, or it would report those reads as uninitialised. It often reports reads of
#   uninitialised bytes inside cuBLAS (workspace, padding): the summary sorts findings by
#   kernel, those land under "others".
# - memcheck, racecheck and synccheck check only our kernels (--kernel-name kns=fastlayers
#   matches them all: each is in namespace fastlayers, the CUTLASS GEMM through its fastlayers
#   epilogue type). memcheck checks a kernel's accesses against the allocations it intercepts,
#   whichever kernels are instrumented, so leaving ATen's out loses nothing of ours and saves
#   time under the per-tool limit; SANITIZE_ALL_KERNELS=1 instruments every kernel. racecheck's model of TMA /
#   mbarrier synchronisation (the sm90 CUTLASS kernel) may be incomplete: a hazard reported
#   in "cutlass_sm90 GEMM (fastlayers)" needs a look before it is believed.
# - --report-api-errors no: torch probes the driver with calls that fail by design; our launch
#   errors raise in the driver through C10_CUDA_KERNEL_LAUNCH_CHECK anyway.
# - A tool that dies inside a call (racecheck 2025.3 on cuBLAS's half-precision GEMMs) does
#   not end the run: a new process goes on from the next call (run_tool), and the summary
#   names the calls that never finished.
# - Each tool runs under `timeout` (SANITIZE_TIMEOUT_S, default per tool below, for all its
#   processes together). On one H100 racecheck took 164 s (79 calls, 11 processes); all four
#   tools can take up to about 10 minutes, so with the build in front of them they need two
#   device calls (e.g. racecheck in one, the others in the next). SANITIZE_DRIVER_ARGS narrows
#   the driver for a rerun, e.g. "--only linear_gelu --dtypes bf16".
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=LAZY
PY=python3
TOOLS=${*:-memcheck initcheck racecheck synccheck}
read -r -a DRIVER_ARGS <<< "${SANITIZE_DRIVER_ARGS:-}"
APP_LOG="$OUT/sanitize_app.txt"
SUMMARY="$OUT/sanitize_summary.txt"
: > "$APP_LOG"
: > "$SUMMARY"

# Packages that travel as wheels (see device_run.sh) were installed into /tmp/site there.
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

SAN=$(command -v compute-sanitizer || true)
for dir in "${CUDA_HOME:-}" /usr/local/cuda /opt/cuda; do
  [ -z "$SAN" ] && [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ] && SAN="$dir/bin/compute-sanitizer"
done
if [ -z "$SAN" ]; then
  echo "device_sanitize: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
  exit 3
fi
"$SAN" --version | tail -1
if ! $PY -c "import torch, fastlayers; assert torch.cuda.is_available(), 'no GPU'; \
assert fastlayers.build_info()['cuda'], 'extension built without CUDA kernels'" >> "$APP_LOG" 2>&1; then
  tail -5 "$APP_LOG"
  echo "device_sanitize: import fastlayers with CUDA failed; run tools/device_run.sh first"
  exit 3
fi

# Without the sanitizer, under the profiler: do the calls reach every kernel of csrc/ in every
# dtype (both sm90 tile configurations on an H100)? Informational: the tools run either way.
start=$(date +%s)
echo "===== coverage" >> "$APP_LOG"
$PY tools/sanitize_driver.py coverage >> "$APP_LOG" 2>&1
echo "$(tail -1 "$APP_LOG") ($(( $(date +%s) - start )) s)" | tee -a "$SUMMARY"

timeout_for() {
  case $1 in
    memcheck) echo "${SANITIZE_TIMEOUT_S:-120}" ;;
    initcheck) echo "${SANITIZE_TIMEOUT_S:-100}" ;;
    racecheck) echo "${SANITIZE_TIMEOUT_S:-300}" ;;  # restarts after the tool's own failures
    *) echo "${SANITIZE_TIMEOUT_S:-60}" ;;
  esac
}

# One tool over the driver's cases, in as many processes as it takes: when the process dies
# in the middle (compute-sanitizer's own "Internal Sanitizer Error" leaves the CUDA context
# broken, and so every later call), a new process goes on from the next case. Sets: calls
# (cases that finished), died (cases that never finished, "case N: name"), timed_out (1 when
# the tool's time ran out first). All sanitizer output is appended to $log.
run_tool() {
  local tool=$1 log=$2 limit=$3
  shift 3
  local deadline=$(( $(date +%s) + limit )) from=0 seg last rc left n
  local sargs=("$@")
  calls=0 died=() timed_out=0
  rm -f "$log"
  segment() {  # segment START: rc of the sanitizer; driver output in $seg
    seg="$OUT/.segment_app.txt"
    left=$(( deadline - $(date +%s) ))
    [ "$left" -le 0 ] && { timed_out=1; return 124; }
    env "${envs[@]}" timeout --kill-after=15 "$left" "$SAN" "${sargs[@]}" --log-file "$log.part" \
      $PY tools/sanitize_driver.py run "${DRIVER_ARGS[@]}" --start "$1" \
      > "$seg" 2>&1
    rc=$?
    cat "$seg" >> "$APP_LOG"
    [ -f "$log.part" ] && cat "$log.part" >> "$log" && rm -f "$log.part"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && timed_out=1
    return $rc
  }
  while :; do
    segment "$from"
    n=$(grep -o "sanitize_driver: [0-9]* calls done" "$seg" | grep -o "[0-9]*")
    if [ -n "$n" ]; then calls=$((calls + n)); return; fi
    [ "$timed_out" = 1 ] && return
    last=$(grep -E "^case [0-9]+: " "$seg" | tail -1)
    if [ -z "$last" ]; then died+=("before case $from"); return; fi
    n=${last#case }
    n=${n%%:*}
    calls=$((calls + $(grep -cE "^case [0-9]+: " "$seg") - 1))
    died+=("$last")
    echo "device_sanitize: $tool died in $last; going on from the next case" >> "$APP_LOG"
    from=$((n + 1))
  done
}

status=0
for tool in $TOOLS; do
  log="$OUT/sanitize_$tool.log"
  args=(--tool "$tool" --target-processes all --error-exitcode 86 --report-api-errors no
    --show-backtrace device --print-limit 100 --launch-timeout 0)
  envs=()
  ours_only=(--kernel-name kns=fastlayers)
  [ "${SANITIZE_ALL_KERNELS:-0}" = 1 ] && ours_only=()
  case $tool in
    memcheck) envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) && args+=("${ours_only[@]}") ;;
    initcheck) envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;;
    racecheck | synccheck) args+=("${ours_only[@]}") ;;
    *) echo "device_sanitize: unknown tool $tool"; status=1; continue ;;
  esac
  limit=$(timeout_for "$tool")
  echo "===== $tool: $SAN ${args[*]} $PY tools/sanitize_driver.py run ${DRIVER_ARGS[*]}" >> "$APP_LOG"
  start=$(date +%s)
  run_tool "$tool" "$log" "$limit" "${args[@]}"
  secs=$(( $(date +%s) - start ))
  line=$($PY tools/sanitize_driver.py summarize "$log" --tool "$tool")
  src=$?
  ran="$calls calls finished"
  if [ "${#died[@]}" -gt 0 ]; then
    ran="$ran; the sanitizer died in: $(printf '%s; ' "${died[@]}")"
    ran=${ran%; }
  fi
  [ "$timed_out" = 1 ] && ran="$ran; TIMED OUT after ${limit} s (partial)"
  echo "$line | $ran | ${secs} s" | tee -a "$SUMMARY"
  { [ "$src" = 1 ] || [ "${#died[@]}" -gt 0 ] || [ "$timed_out" = 1 ]; } && status=1
done
rm -f "$OUT/.segment_app.txt"
exit $status
