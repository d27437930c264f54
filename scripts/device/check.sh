#!/usr/bin/env bash
# Device check of the whole engine, one call of at most ~8 minutes on one
# GPU (H200), or `--smoke` on a CPU (tiny shapes, a few minutes), in parts:
#   attention   scripts/bench/attention_gpu.py: GPU kernel against the reference,
#               decode / prefill attention bandwidth (bench_attention.*)
#   e2e         greedy tokens, Pallas backend vs reference vs HF transformers
#   throughput  256 mixed requests on a Llama-3.2-1B shape, jaxkv vs HF generate
#   profile     batch-64 decode: host gap and device idle per step, HBM fraction,
#               then one call per step synchronous vs overlapped scheduling
# (the last three: scripts/device/engine.py and device_check_profile.py;
# see their docstrings for exactly what is measured). Each part runs in its own process under a hard
# timeout and stops starting new work after its budget; a failed part is
# reported and the others still run. Results land in $OUT (default
# ./device_out): env.txt, bench_attention.{json,md,log}, device_check.json
# (one entry per part: status ok / failed / skipped, error text, figures),
# device_check.md, device_check_engine.log, profile_trace*/ (the raw traces).
# Exit status: 0 all checks passed, 2 a correctness check failed, 1 another
# failure. Uses the python3 and packages already installed; installs nothing.
# Usage: bash scripts/device/check.sh [--smoke] [--model GGUF] [--parts a,b]
#        [bench_attention.py args]   (--parts: run only these; the rest are "skipped")
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/device_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore::DeprecationWarning"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # the HF peer's torch process shares the GPU

SMOKE=(); MODEL=(); ATT=(); PARTS="attention,e2e,throughput,profile"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=(--smoke) ;;
    --parts) PARTS="$2"; shift ;;
    --parts=*) PARTS="${1#--parts=}" ;;
    --model) MODEL=(--model "$2"); shift ;;
    --model=*) MODEL=(--model "${1#--model=}") ;;
    *) ATT+=("$1") ;;
  esac
  shift
done
# Per part: hard timeout (s) and the budget after which it starts nothing new.
# Full: 120 + 110 + 150 + 75 = 455 s of parts (plus ~15 s of set-up), inside 8 minutes.
if [ ${#SMOKE[@]} -gt 0 ]; then
  T_ATT=200; B_ATT=20; T_E2E=240; B_E2E=150; T_THR=200; B_THR=120; T_PRO=150; B_PRO=90
else
  T_ATT=120; B_ATT=75; T_E2E=110; B_E2E=75; T_THR=150; B_THR=100; T_PRO=75; B_PRO=50
fi
rm -rf "$OUT/device_check.json" "$OUT/device_check.md" "$OUT/device_check_engine.log" \
  "$OUT"/profile_trace*
start=$SECONDS

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) mode: ${SMOKE[*]:-full}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi unavailable"
  "$PY" -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())' 2>&1
} | tee "$OUT/env.txt"

selected() { [[ ",$PARTS," == *",$1,"* ]]; }

# 1. kernel correctness and attention bandwidth (its own --smoke: interpret mode).
rc_attention=skip
if selected attention; then
  timeout -k 10 "$T_ATT" "$PY" scripts/bench/attention_gpu.py --out "$OUT" --budget-s "$B_ATT" \
    "${SMOKE[@]}" "${ATT[@]}" 2>&1 | tee "$OUT/bench_attention.log"
  rc_attention=${PIPESTATUS[0]}
  echo "bench_attention.py exit status: $rc_attention (0 ok, 2 correctness failure, 124 timeout)" \
    | tee -a "$OUT/env.txt"
fi

# 2-4. the engine parts.
run_part() {  # name timeout budget [args]; a part not selected returns "skip"
  local name=$1 t=$2 b=$3; shift 3
  selected "$name" || return 200
  timeout -k 10 "$t" "$PY" scripts/device/engine.py --part "$name" --out "$OUT" \
    --budget-s "$b" "${SMOKE[@]}" "$@" 2>&1 | tee -a "$OUT/device_check_engine.log"
  return "${PIPESTATUS[0]}"
}
rc_of() { [ "$1" -eq 200 ] && echo skip || echo "$1"; }
run_part e2e "$T_E2E" "$B_E2E" "${MODEL[@]}"; rc_e2e=$(rc_of $?)
run_part throughput "$T_THR" "$B_THR"; rc_throughput=$(rc_of $?)
run_part profile "$T_PRO" "$B_PRO"; rc_profile=$(rc_of $?)

"$PY" scripts/device/engine.py --summarize "${SMOKE[@]}" --out "$OUT" --rc attention=$rc_attention \
  e2e=$rc_e2e throughput=$rc_throughput profile=$rc_profile
rc=$?
echo "device_check.sh: exit status $rc (0 ok, 2 correctness failure, 1 other failure)" \
  "after $((SECONDS - start)) s; parts' exit statuses: attention $rc_attention, e2e $rc_e2e," \
  "throughput $rc_throughput, profile $rc_profile" | tee -a "$OUT/env.txt"
exit "$rc"
