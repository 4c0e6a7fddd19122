#!/usr/bin/env bash
# The published CPU benchmarks (docs/benchmarks.md): one thread, sizes that run in minutes.
# Usage (from the repository root): benchmarks/run_cpu.sh [OUT_DIR [MODEL...]]   MODEL: hetero hetero2 gpt resnet50
# Environment: PYTHON (default python), REPEATS (timed steps per method, default 7).
set -euo pipefail
OUT=${1:-benchmarks/results/cpu}
shift || true
MODELS=${*:-hetero hetero2 gpt resnet50}
PY=${PYTHON:-python}
REPEATS=${REPEATS:-7}
mkdir -p "$OUT"
run() { echo "+ lightning-rotor bench $*"; $PY -m lightning_rotor.cli bench "$@" --out "$OUT" --threads 1 --repeats "$REPEATS"; }
for model in $MODELS; do
  case $model in
    hetero) run --model hetero --batch-size 256 --budgets min,0.25,0.5,0.75,1.0 | tee "$OUT/hetero.md" ;;
    hetero2) run --model hetero2 --batch-size 64 --budgets min,0.25,0.5,0.75,1.0 | tee "$OUT/hetero2.md" ;;
    gpt) run --model gpt --batch-size 4 --set seq_len=128 --budgets min,0.25,0.5,0.75,1.0 --compile-budgets 0.5,1.0 \
      | tee "$OUT/gpt.md" ;;
    resnet50) run --model resnet50 --batch-size 8 --budgets min,0.25,0.5,0.75,1.0 --no-compile | tee "$OUT/resnet50.md" ;;
    *) echo "unknown model $model (hetero, hetero2, gpt, resnet50)" >&2; exit 2 ;;
  esac
done
