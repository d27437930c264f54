#!/usr/bin/env bash
# GPU device check, one call of at most ~8 minutes: environment, then
# scripts/bench_attention.py (GPU kernel correctness vs the reference, decode
# and prefill benchmarks). Results land in $OUT (default ./device_out):
# env.txt, bench_attention.json, bench_attention.md, bench_attention.log.
# Uses the python3 and jax already installed on the machine; installs nothing.
# Usage: bash scripts/device_check.sh [extra bench_attention.py args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore::DeprecationWarning"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi unavailable"
  python3 -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())' 2>&1
} | tee "$OUT/env.txt"

# Benchmarks stop starting new configurations after --budget-s; the timeout
# is the hard stop. Partial results are written after every measurement.
timeout 450 python3 scripts/bench_attention.py --out "$OUT" --budget-s 330 "$@" 2>&1 \
  | tee "$OUT/bench_attention.log"
rc=${PIPESTATUS[0]}
echo "bench_attention.py exit status: $rc (0 ok, 2 correctness failure, 124 timeout)" | tee -a "$OUT/env.txt"
exit "$rc"
