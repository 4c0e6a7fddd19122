#!/usr/bin/env bash
# One device session on a lent GPU machine, as one prepared script (docs/gpu_check_h200.md):
# build the planner, run the CUDA unit tests, benchmarks/gpu_check.py, and offloading on CUDA.
# Usage (from the repository root): benchmarks/gpu_session.sh OUT_DIR      (OUT_DIR: where the reports go)
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_session.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
step() { echo "== $(date -u +%H:%M:%S) $*"; }
step build
python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
step "CUDA unit tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_offload*.py tests/test_memory.py \
  tests/test_checkpointable.py tests/test_lightning.py tests/test_bench.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
step gpu_check
(cd benchmarks && PYTHONPATH=..:. timeout 200 python3 gpu_check.py --out "$OUT/gpu_check.md" >"$OUT/gpu_check.log" 2>&1)
grep -E "^\| [0-9]\.|PASS:|FAIL" "$OUT/gpu_check.md" | grep -E "^\||FAIL" | head -20
step "offloading on CUDA"
PYTHONPATH=. timeout 100 python3 benchmarks/offload_gpu.py 2>&1 | tee "$OUT/offload_gpu.txt" | tail -30
step done
