#!/usr/bin/env bash
# The published CPU benchmarks (docs/benchmarks.md): one thread, sizes that run in minutes.
# Usage: benchmarks/run_cpu.sh [OUT_DIR]   (from the repository root)
set -euo pipefail
OUT=${1:-benchmarks/results/cpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
run() { echo "+ lightning-rotor bench $*"; $PY -m lightning_rotor.cli bench "$@" --out "$OUT" --threads 1 --repeats 5; }
run --model hetero --batch-size 256 --budgets min,0.25,0.5,0.75,1.0 | tee "$OUT/hetero.md"
run --model gpt --batch-size 4 --set seq_len=128 --budgets min,0.25,0.5,0.75,1.0 --compile-budgets 0.5,1.0 \
  | tee "$OUT/gpt.md"
run --model resnet50 --batch-size 8 --budgets min,0.25,0.5,0.75,1.0 --no-compile | tee "$OUT/resnet50.md"
