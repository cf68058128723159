# The stage machinery of scripts/gpu_check.sh (sourced; tests/gpu/test_gpu_check.py runs
# it with fake stages). The caller sets T0 (start, epoch seconds), DEADLINE (seconds from
# T0), RESERVE (seconds kept for the summary) and STAGES (the stages' TSV file).
#
# A stage runs under `timeout -s INT`: pytest, interrupted, still writes its JUnit XML,
# and a launcher's KeyboardInterrupt ends its ranks; --kill-after ends what ignores it.
# Every process a stage starts carries JAXCOMM_GPU_CHECK_STAGE=<marker> in its
# environment, also ranks started in sessions of their own (which a timeout's signal to
# its process group never reaches), and after the stage `sweep` ends every process still
# carrying it, so none keeps the GPU busy for the next stage or a rerun.

KILL_AFTER=${GPU_CHECK_KILL_AFTER_S:-20}  # seconds between SIGINT and SIGKILL
MIN_STAGE_S=${GPU_CHECK_MIN_STAGE_S:-10}  # a stage with less time left is skipped
MARKER_PREFIX=jaxcomm-gpu-check

# pytest, answering SIGINT even where this script was started with SIGINT ignored (which
# children inherit, and Python then keeps): "${PYTEST[@]}" ARGS... (PY: the Python).
PYTEST=("${PY:-python3}" -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))')

left() { echo $(( DEADLINE - ($(date +%s) - T0) - RESERVE )); }

# record NAME RC SECONDS NOTE
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STAGES"; }

skip() {
  echo "=== $1: skipped, $2"
  record "$1" -1 0 "skipped: $2"
}

# marked_pids PATTERN: pids whose environment has an entry matching the extended regex
# PATTERN (anchored at the entry's start).
marked_pids() {
  local f
  for f in /proc/[0-9]*/environ; do
    grep -qszE -- "^$1" "$f" 2> /dev/null && { f=${f#/proc/}; echo "${f%/environ}"; }
  done
}

# sweep PATTERN: ends every process marked as PATTERN says, with its process group where
# that is not this shell's: SIGTERM, then SIGKILL for what is left after 5 s.
sweep() {
  local pattern="JAXCOMM_GPU_CHECK_STAGE=$1" pids pid pgid mine sig i
  pids=$(marked_pids "$pattern")
  [ -z "$pids" ] && return 0
  echo "=== sweep: ending leftover processes: $(echo $pids)"
  mine=$(ps -o pgid= -p $$ | tr -d ' ')
  for sig in TERM KILL; do
    for pid in $pids; do
      pgid=$(ps -o pgid= -p "$pid" 2> /dev/null | tr -d ' ')
      if [ -n "$pgid" ] && [ "$pgid" != "$mine" ]; then kill -s "$sig" -- "-$pgid" 2> /dev/null; fi
      kill -s "$sig" "$pid" 2> /dev/null
    done
    for i in $(seq 50); do
      pids=$(marked_pids "$pattern")
      [ -z "$pids" ] && return 0
      sleep 0.1
    done
  done
  echo "=== sweep: still present: $(echo $pids)"
}

# stage NAME CAP LOG CMD...: runs CMD with min(CAP, time left) seconds, output appended
# to LOG; sweeps the stage's processes; prints what it added to LOG; records rc and
# duration.
stage() {
  local name=$1 cap=$2 log=$3
  shift 3
  local budget t0 rc marker start note=""
  budget=$(( $(left) - KILL_AFTER ))
  [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$budget" -lt "$MIN_STAGE_S" ]; then
    echo "=== $name: skipped, the global deadline is near"
    record "$name" -1 0 "skipped: no time left"
    return 0
  fi
  echo "=== $name (limit ${budget}s, $(( $(date +%s) - T0 ))s into the check)"
  marker="$MARKER_PREFIX-$$-$name-$RANDOM"
  t0=$(date +%s)
  start=$(( $(stat -c %s "$log" 2> /dev/null || echo 0) + 1 ))
  # Straight into LOG, no pipe: a leftover rank holding a pipe's end would keep the stage
  # (and the sweep after it) waiting for it. Echoed to stdout (check.log) afterwards.
  JAXCOMM_GPU_CHECK_STAGE=$marker timeout -s INT --kill-after="$KILL_AFTER" "$budget" "$@" >> "$log" 2>&1
  rc=$?
  sweep "$marker"
  tail -c "+$start" "$log"
  [ "$rc" = 124 ] && note="timed out after ${budget}s (SIGINT)"
  [ "$rc" = 137 ] && note="timed out after ${budget}s, killed ${KILL_AFTER}s after SIGINT"
  record "$name" "$rc" $(( $(date +%s) - t0 )) "$note"
  echo "=== $name: rc=$rc"
}
